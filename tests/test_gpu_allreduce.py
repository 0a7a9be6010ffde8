"""All-reduce correctness on GPUs: every algorithm x dtype x size, in and out of place,
CuPy and torch, plain and symmetric buffers. Every output element is compared bit for
bit with the host reference computed in the order of the kernels that ran
(ubnext/_tools/reference.py; NCCL on exactly representable inputs), outputs are poisoned and
bordered by canary bytes, and every rank must hold the same bits.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_allreduce.py``;
skipped without a GPU.
"""

from __future__ import annotations

import pytest
from gpu_support import DTYPES, WIDTH, check_all_reduce, require_gpu_and_torch, seed_of

pytestmark = pytest.mark.gpu

MIB = 1 << 20
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
    """Out of place into a poisoned, bordered ``out``, or in place."""
    check_all_reduce(comm, count_of(size, dtype), dtype, seed_of(algo, dtype, size, place, fw), algorithm=algo,
                     place=place, framework=fw)


@pytest.mark.parametrize("algo", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", ["7", "4096", "1M+3", "64MiB"])
@pytest.mark.parametrize("place", ["in", "out"])
def test_symmetric_buffers(comm, algo, dtype, size, place):
    """Arrays from comm.empty(): in place is zero-copy; out= a symmetric array too."""
    count = count_of(size, dtype)
    if too_big(algo, count * WIDTH[dtype]):
        pytest.skip(f"larger than the {algo} buffers")
    check_all_reduce(comm, count, dtype, 7 + count, algorithm=algo, place=place, x_memory="symmetric",
                     out_memory="symmetric")


@pytest.mark.parametrize("algo", [*KERNELS, "nccl"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 7, 4099])
@pytest.mark.parametrize("memory", ["plain", "symmetric"])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("place", ["out", "in"])
def test_no_write_outside_out(comm, algo, dtype, count, memory, offset, place):
    """Canary bytes on both sides of ``out`` stay as they were: ``out`` (or the in-place
    array) from torch's allocator or a view into a ``comm.empty()`` buffer next to other
    data, at a 16-byte boundary or one element past it (the staging copy), with ``x`` a
    separate plain array out of place. The barrier two-shot once stored whole 16-byte
    vectors there: ``all_reduce(ones(7), out=b[:7], algorithm="twoshot")`` changed b[7]."""
    check_all_reduce(comm, count, dtype, seed_of(algo, dtype, count, memory, offset, place), algorithm=algo,
                     place=place, x_memory=memory if place == "in" else "plain", out_memory=memory, offset=offset)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("algo", [*KERNELS, "nccl"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("place", ["new", "out", "in"])
def test_ops(comm, op, algo, dtype, place):
    """Every op, with -0.0, inf and NaN among the inputs (max and min skip a NaN operand)."""
    check_all_reduce(comm, 12345, dtype, seed_of(op, algo, dtype, place), algorithm=algo, op=op, place=place)


@pytest.mark.parametrize("algo", KERNELS)
def test_misaligned_arrays_take_the_staging_copy(comm, algo):
    """A view starting 2 bytes past 16-byte alignment cannot use 16-byte vectors directly:
    every launch reduces the staging slot in place."""
    engine = comm._node.engine
    _, launches = check_all_reduce(comm, 5001, "bfloat16", 11, algorithm=algo, offset=1)
    buffers = {launch.buffers for launch in launches}
    staged = (engine.staging_off, 0, 0) if algo == "twoshot" else (engine.staging_ptr, engine.staging_ptr)
    assert buffers == {staged}, f"launches on {buffers}, expected the staging slot {staged}"


@pytest.mark.parametrize("offset", [0, 1])
def test_lamport_twoshot_in_launches_from_any_address(comm, offset):
    """Past its buffers, aligned arrays go launch by launch and misaligned ones through
    the staging slot launch by launch; out of place, bordered by canaries."""
    count = TWOSHOT_LAUNCH // 2 + 12345  # bf16: a full launch, then a part
    _, launches = check_all_reduce(comm, count, "bfloat16", 13, algorithm="lamport_twoshot", offset=offset)
    assert [launch.count for launch in launches] == [TWOSHOT_LAUNCH // 2, 12345]


def test_2d_input_keeps_its_shape(comm):
    check_all_reduce(comm, 64 * 96, "float32", 5, place="new", shape=(64, 96))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [0, -1, -8])
def test_lamport_twoshot_at_and_past_its_limit(comm, dtype, extra):
    """The largest messages its buffers take, with slices that do not divide evenly;
    two launches of full buffers and a tiny third one; then a small message, so the next
    launch re-poisons a full previous buffer."""
    per_launch = TWOSHOT_LAUNCH // WIDTH[dtype]
    for count in (per_launch + extra, 2 * per_launch - extra, 1000):
        check_all_reduce(comm, count, dtype, 21 + count, algorithm="lamport_twoshot")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_thread", [2, 3])
def test_lamport_twoshot_on_narrow_blocks(comm, dtype, per_thread):
    """Messages whose launches run on the narrow blocks (ubnext._engine.engine.lamport_twoshot_threads):
    each thread pushes, reduces and gathers 2 or 3 vectors in turn; also with a partial
    last vector."""
    from ubnext._engine import engine as _engine
    from ubnext._protocol.algorithms import ALGORITHMS

    blocks, alg = comm._node.engine._blocks, ALGORITHMS["lamport_twoshot"]
    per_vec = 16 // WIDTH[dtype]
    # the widest launch whose blocks each get per_thread vectors per narrow thread (at 1
    # rank, where a launch has a block per 512 vectors, that is a one-block launch)
    widest = next(b for b in range(blocks, 0, -1)
                  if _engine.lamport_shape(alg, b * per_thread * _engine.NARROW_THREADS * comm.size, comm.size,
                                           blocks) == (b, _engine.NARROW_THREADS))
    for extra in (0, -3):
        count = widest * per_thread * _engine.NARROW_THREADS * comm.size * per_vec + extra
        nvec = -(-count // per_vec)
        assert _engine.lamport_shape(alg, nvec, comm.size, blocks) == (widest, _engine.NARROW_THREADS)
        _, launches = check_all_reduce(comm, count, dtype, 31 + per_thread + extra, algorithm="lamport_twoshot")
        assert [launch.threads for launch in launches] == [_engine.NARROW_THREADS]
