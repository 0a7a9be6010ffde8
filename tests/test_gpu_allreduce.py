"""All-reduce correctness on GPUs: every algorithm x dtype x size, in and out of place,
CuPy and torch, plain and symmetric buffers, against an fp64 reference.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_allreduce.py``;
skipped without a GPU.
"""

from __future__ import annotations

import zlib

import pytest

from gpu_support import (TOL, TOL_NCCL, as_framework, assert_same_bits_everywhere, check_close, make_input,
                         reference, require_gpu_and_torch, to_torch)

pytestmark = pytest.mark.gpu

MIB = 1 << 20
DTYPES = ("bfloat16", "float16", "float32")
WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}
# element counts: 1, 7, 4096, 1M+3, and 64 MiB / 256 MiB of data
SIZES = ("1", "7", "4096", "1M+3", "64MiB", "256MiB")
#: largest message of the algorithms bounded by their buffers (the default Config); the
#: Lamport two-shot takes larger ones in launches of its buffers' size (16 MiB)
LIMIT = {"lamport": MIB}
TWOSHOT_LAUNCH = 16 * MIB
KERNELS = ("lamport", "lamport_twoshot", "twoshot")


def too_big(algo: str, nbytes: int) -> bool:
    return nbytes > LIMIT.get(algo, nbytes)


def count_of(size: str, dtype: str) -> int:
    fixed = {"1": 1, "7": 7, "4096": 4096, "1M+3": (1 << 20) + 3}
    return fixed[size] if size in fixed else int(size[:-3]) * MIB // WIDTH[dtype]


@pytest.fixture(scope="session")
def comm():
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator()
    yield c
    c.close()


def cases():
    for algo in (*KERNELS, "nccl", "auto"):
        for dtype in DTYPES:
            for size in SIZES:
                nbytes = count_of(size, dtype) * WIDTH[dtype]
                if too_big(algo, nbytes):
                    continue
                if algo == "auto" and size == "256MiB":
                    continue  # auto takes twoshot there, tested above
                for place in ("out", "in"):
                    for fw in ("torch", "cupy"):
                        yield pytest.param(algo, dtype, size, place, fw, id=f"{algo}-{dtype}-{size}-{place}-{fw}")


@pytest.mark.parametrize("algo,dtype,size,place,fw", list(cases()))
def test_all_reduce_sum(comm, algo, dtype, size, place, fw):
    import torch

    count = count_of(size, dtype)
    seed = zlib.crc32(f"{algo}{dtype}{size}{place}{fw}".encode()) % 100000  # same on every rank
    x = make_input(count, dtype, comm.rank, seed, specials=True)
    arg = as_framework(x, fw)
    if place == "in":
        result = comm.all_reduce(arg, out=arg, algorithm=algo)
        assert result is arg
    else:
        out = torch.full_like(x, float("nan"))  # poisoned
        result = comm.all_reduce(arg, out=as_framework(out, fw), algorithm=algo)
        assert type(result) is type(arg)
        assert torch.equal(to_torch(x).view(torch.int8), make_input(count, dtype, comm.rank, seed, True).view(torch.int8)), \
            "out-of-place all_reduce modified its input"
    got = to_torch(result)
    torch.cuda.synchronize()
    tol = TOL_NCCL if algo == "nccl" else TOL
    check_close(got, reference(count, dtype, comm.size, seed, specials=True), dtype, tol)
    assert_same_bits_everywhere(comm, got)


@pytest.mark.parametrize("algo", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", ["7", "4096", "1M+3", "64MiB"])
@pytest.mark.parametrize("place", ["in", "out"])
def test_symmetric_buffers(comm, algo, dtype, size, place):
    """Arrays from comm.empty(): in place is zero-copy; out= a symmetric array too."""
    import torch

    count = count_of(size, dtype)
    if too_big(algo, count * WIDTH[dtype]):
        pytest.skip(f"larger than the {algo} buffers")
    seed = 7 + count
    x = comm.empty((count,), dtype, framework="torch")
    x.copy_(make_input(count, dtype, comm.rank, seed, specials=True))
    out = x if place == "in" else comm.empty((count,), dtype, framework="torch").fill_(float("nan"))
    result = comm.all_reduce(x, out=out, algorithm=algo)
    assert result is out
    torch.cuda.synchronize()
    check_close(result, reference(count, dtype, comm.size, seed, specials=True), dtype)
    assert_same_bits_everywhere(comm, result)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("algo", [*KERNELS, "nccl"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops(comm, op, algo, dtype):
    import torch

    count = 12345
    x = make_input(count, dtype, comm.rank, 3, specials=False)
    got = comm.all_reduce(x, op=op, algorithm=algo)
    torch.cuda.synchronize()
    tol = TOL_NCCL if algo == "nccl" else TOL
    check_close(got, reference(count, dtype, comm.size, 3, specials=False, op=op), dtype, tol)


@pytest.mark.parametrize("algo", KERNELS)
def test_misaligned_arrays_take_the_staging_copy(comm, algo):
    """A view starting 2 bytes into an allocation cannot use 16-byte vectors directly."""
    import torch

    count = 5001
    base = make_input(count + 1, "bfloat16", comm.rank, 11, specials=False)
    x = base[1:]
    out = torch.full((count + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")[1:]
    comm.all_reduce(x, out=out, algorithm=algo)
    torch.cuda.synchronize()
    check_close(out, reference(count + 1, "bfloat16", comm.size, 11, specials=False)[1:], "bfloat16")


@pytest.mark.parametrize("offset", [0, 1])
def test_lamport_twoshot_in_launches_from_any_address(comm, offset):
    """Past its buffers, aligned arrays go launch by launch and misaligned ones through
    the staging slot launch by launch; out of place, with a poisoned guard after out."""
    import torch

    count = TWOSHOT_LAUNCH // 2 + 12345  # bf16: a full launch, then a part
    base = make_input(count + offset, "bfloat16", comm.rank, 13, specials=False)
    x = base[offset:]
    out = torch.full((count + offset + 8,), float("nan"), dtype=torch.bfloat16, device="cuda")
    comm.all_reduce(x, out=out[offset:offset + count], algorithm="lamport_twoshot")
    torch.cuda.synchronize()
    check_close(out[offset:offset + count], reference(count + offset, "bfloat16", comm.size, 13,
                                                      specials=False)[offset:], "bfloat16")
    assert torch.isnan(out[offset + count:].float()).all(), "wrote past the end of out"


def test_2d_input_keeps_its_shape(comm):
    import torch

    x = make_input(64 * 96, "float32", comm.rank, 5, specials=False).view(64, 96)
    got = comm.all_reduce(x)
    assert got.shape == (64, 96)
    torch.cuda.synchronize()
    check_close(got, reference(64 * 96, "float32", comm.size, 5, specials=False), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [0, -1, -8])
def test_lamport_twoshot_at_and_past_its_limit(comm, dtype, extra):
    """The largest messages its buffers take, with slices that do not divide evenly;
    two launches of full buffers and a tiny third one; then a small message, so the next
    launch re-poisons a full previous buffer."""
    per_launch = TWOSHOT_LAUNCH // WIDTH[dtype]
    for count in (per_launch + extra, 2 * per_launch - extra, 1000):
        check_lamport_twoshot(comm, count, dtype, 21 + count)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_thread", [2, 3])
def test_lamport_twoshot_on_narrow_blocks(comm, dtype, per_thread):
    """Messages whose launches run on the narrow blocks (ubnext._engine.lamport_twoshot_threads):
    each thread pushes, reduces and gathers 2 or 3 vectors in turn; also with a partial
    last vector."""
    from ubnext import _engine
    from ubnext._algorithms import ALGORITHMS

    blocks, alg = comm._node.engine._blocks, ALGORITHMS["lamport_twoshot"]
    per_vec = 16 // WIDTH[dtype]
    # the widest launch whose blocks each get per_thread vectors per narrow thread (at 1
    # rank, where a launch has a block per 512 vectors, that is a one-block launch)
    launch = next(b for b in range(blocks, 0, -1)
                  if _engine.lamport_shape(alg, b * per_thread * _engine.NARROW_THREADS * comm.size, comm.size,
                                           blocks) == (b, _engine.NARROW_THREADS))
    for extra in (0, -3):
        count = launch * per_thread * _engine.NARROW_THREADS * comm.size * per_vec + extra
        nvec = -(-count // per_vec)
        assert _engine.lamport_shape(alg, nvec, comm.size, blocks) == (launch, _engine.NARROW_THREADS)
        check_lamport_twoshot(comm, count, dtype, 31 + per_thread + extra)


def check_lamport_twoshot(comm, count: int, dtype: str, seed: int) -> None:
    """The Lamport two-shot's all-reduce of ``count`` elements (with specials) into a
    poisoned ``out``: close to fp64, the same bits on every rank."""
    import torch

    x = make_input(count, dtype, comm.rank, seed, specials=True)
    out = torch.full_like(x, float("nan"))
    comm.all_reduce(x, out=out, algorithm="lamport_twoshot")
    torch.cuda.synchronize()
    check_close(out, reference(count, dtype, comm.size, seed, specials=True), dtype)
    assert_same_bits_everywhere(comm, out)
