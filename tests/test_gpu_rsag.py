"""Reduce-scatter and all-gather correctness on GPUs: every algorithm x kernel dtype x size
(1 element per rank, 7, 4 KiB, about 1M+3 in all; 64 MiB for bfloat16 only), in and out of
place, plain, unaligned and symmetric buffers. Every output element is compared bit for
bit with the host reference in the order of the kernels that ran (ubnext/_tools/reference.py:
reduce_scatter, all_gather; NCCL on exactly representable inputs), outputs are poisoned
and bordered by canary bytes, the all-gather's bits are the same on every rank; CUDA-graph
replay; back-to-back calls interleaved with all_reduce; the fused sequence-parallel step
(reduce_scatter_add_rmsnorm) against the reduce-scatter's reference followed by the
add + RMSNorm reference of the separate kernel that runs it.

Run at 1, 2 and 4 ranks (one GPU may be shared):
``mpirun --oversubscribe -n 4 python -m pytest -q tests/test_gpu_rsag.py``; the cases that
NCCL runs are skipped where ranks share a GPU; skipped without a GPU.
"""

from __future__ import annotations

import pytest
from gpu_support import (
    WIDTH,
    Bordered,
    as_framework,
    assert_same_bits_everywhere,
    collected,
    communicator,
    device,
    host,
    norm_operands,
    rank_inputs,
    recorded_launches,
    seed_of,
    skip_where_nccl_cannot_run,
    to_torch,
)

from ubnext._protocol.algorithms import KERNEL_DTYPES
from ubnext._tools import reference

pytestmark = pytest.mark.gpu

MIB = 1 << 20
#: elements per rank: 1, 7 (odd: slices not 16-byte aligned), 4 KiB of them, about 1M+3
#: in all (an odd count per rank); and a whole message of 64 MiB (bfloat16 only)
SIZES = ("1", "7", "4KiB", "1M+3", "64MiB")
KERNELS = ("lamport_twoshot", "twoshot")


def per_rank(size: str, dtype: str, nranks: int) -> int:
    fixed = {"1": 1, "7": 7, "4KiB": 4096 // WIDTH[dtype], "1M+3": -(-(MIB + 3) // nranks) | 1}
    return fixed[size] if size in fixed else 64 * MIB // WIDTH[dtype] // nranks


comm = pytest.fixture(scope="module", name="comm")(communicator)


def cases():
    for algo in (*KERNELS, "nccl", "auto"):
        for dtype in KERNEL_DTYPES:
            for size in SIZES:
                if size == "64MiB" and dtype != "bfloat16":
                    continue
                for place in ("out", "in") if size != "64MiB" else ("out",):  # 64 MiB: one case, to stay fast
                    yield pytest.param(algo, dtype, size, place, id=f"{algo}-{dtype}-{size}-{place}")


def resolved(comm, algorithm: str, collective: str, nbytes: int, dtype: str) -> str:
    """The algorithm a call runs; skips where it is NCCL and ranks share a GPU (collective)."""
    algo = algorithm if algorithm != "auto" else comm.select(nbytes, dtype, collective=collective)
    if algo == "nccl":
        skip_where_nccl_cannot_run(comm)
    return algo


def ran(launches, collective: str) -> str:
    names = {(launch.kernel, launch.collective) for launch in launches}
    assert len(names) <= 1, f"one call launched several kernels: {names}"
    if not names:
        return "nccl"
    kernel, what = names.pop()
    assert what == collective, f"a {collective} launched a {what} kernel"
    return kernel


def check_reduce_scatter(comm, k: int, dtype: str, seed: int, algorithm: str = "auto", op: str = "sum",
                         place: str = "out", x_memory: str = "plain", offset: int = 0, framework: str = "torch"):
    """One ``reduce_scatter`` checked element by element (the reference of the kernel that
    ran), canaries around x and out, x unchanged out of place."""
    import torch

    n = comm.size
    algo = resolved(comm, algorithm, "reduce_scatter", n * k * WIDTH[dtype], dtype)
    exact = algo == "nccl"
    inputs = rank_inputs(n * k, dtype, n, seed, exact=exact)
    x = Bordered(n * k, dtype, seed + 1, offset, comm if x_memory == "symmetric" else None)
    x.view.copy_(device(inputs[comm.rank]))
    if place == "in":
        out_view, out = x.view[comm.rank * k:(comm.rank + 1) * k], None
    else:
        out = Bordered(k, dtype, seed + 2, offset)
        out.view.fill_(float("nan"))
        out_view = out.view
    with recorded_launches(comm) as launches:
        result = comm.reduce_scatter(as_framework(x.view, framework), as_framework(out_view, framework),
                                     op=op, algorithm=algorithm)
    torch.cuda.synchronize()
    got = host(to_torch(result)).reshape(-1)
    failures = []
    with collected(failures):
        assert ran(launches, "reduce_scatter") == algo
        want = (reference.exact(inputs, op)[comm.rank * k:(comm.rank + 1) * k] if exact
                else reference.reduce_scatter(algo, inputs, op)[comm.rank])
        reference.assert_same_bits(got, want, f"reduce_scatter {algo} {op}")
        x.assert_intact("reduce_scatter (input)")
        if out is not None:
            out.assert_intact("reduce_scatter (output)")
            reference.assert_same_bits(host(x.view), inputs[comm.rank], "reduce_scatter modified its input")
    assert not failures, failures


def check_all_gather(comm, k: int, dtype: str, seed: int, algorithm: str = "auto", place: str = "out",
                     out_memory: str = "plain", offset: int = 0, framework: str = "torch"):
    """One ``all_gather`` checked element by element, canaries around x and out, the same
    bits on every rank, x unchanged out of place."""
    import torch

    n = comm.size
    algo = resolved(comm, algorithm, "all_gather", n * k * WIDTH[dtype], dtype)
    inputs = rank_inputs(k, dtype, n, seed, exact=algo == "nccl")
    out = Bordered(n * k, dtype, seed + 2, offset, comm if out_memory == "symmetric" else None)
    out.view.fill_(float("nan"))
    x = None
    if place == "in":
        x_view = out.view[comm.rank * k:(comm.rank + 1) * k]
    else:
        x = Bordered(k, dtype, seed + 1, offset)
        x_view = x.view
    x_view.copy_(device(inputs[comm.rank]))
    with recorded_launches(comm) as launches:
        result = comm.all_gather(as_framework(x_view, framework), as_framework(out.view, framework),
                                 algorithm=algorithm)
    torch.cuda.synchronize()
    got = to_torch(result)
    assert_same_bits_everywhere(comm, got)
    failures = []
    with collected(failures):
        assert ran(launches, "all_gather") == algo
        reference.assert_same_bits(host(got).reshape(-1), reference.all_gather(algo, inputs), f"all_gather {algo}")
        out.assert_intact("all_gather (output)")
        if x is not None:
            x.assert_intact("all_gather (input)")
            reference.assert_same_bits(host(x.view), inputs[comm.rank], "all_gather modified its input")
    assert not failures, failures


@pytest.mark.parametrize("algo,dtype,size,place", list(cases()))
def test_reduce_scatter_bit_for_bit(comm, algo, dtype, size, place):
    check_reduce_scatter(comm, per_rank(size, dtype, comm.size), dtype, seed_of("rs", algo, dtype, size, place),
                         algo, place=place)


@pytest.mark.parametrize("algo,dtype,size,place", list(cases()))
def test_all_gather_bit_for_bit(comm, algo, dtype, size, place):
    check_all_gather(comm, per_rank(size, dtype, comm.size), dtype, seed_of("ag", algo, dtype, size, place),
                     algo, place=place)


@pytest.mark.parametrize("algo", KERNELS)
@pytest.mark.parametrize("op", ["avg", "max", "min"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_reduce_scatter_every_op(comm, algo, op, dtype):
    check_reduce_scatter(comm, 4099, dtype, seed_of("ops", algo, op, dtype), algo, op=op)


@pytest.mark.parametrize("algo", KERNELS)
@pytest.mark.parametrize("memory", ["symmetric", "unaligned", "cupy"])
@pytest.mark.parametrize("place", ["out", "in"])
def test_buffers(comm, algo, memory, place):
    """Symmetric arrays (the barrier two-shot in place on them), views that start past
    16-byte alignment, CuPy arrays."""
    kwargs = {"symmetric": {}, "unaligned": {"offset": 1}, "cupy": {"framework": "cupy"}}[memory]
    sym = "symmetric" if memory == "symmetric" else "plain"
    for k in (8, 4096, 5000):
        seed = seed_of("buffers", algo, memory, place, k)
        check_reduce_scatter(comm, k, "bfloat16", seed, algo, place=place, x_memory=sym, **kwargs)
        check_all_gather(comm, k, "bfloat16", seed, algo, place=place, out_memory=sym, **kwargs)


def test_default_outputs_have_the_torch_layouts(comm):
    import torch

    n = comm.size
    x = torch.ones(2 * n, 3, dtype=torch.bfloat16, device="cuda")
    assert tuple(comm.reduce_scatter(x).shape) == (2, 3)
    assert tuple(comm.all_gather(x).shape) == (2 * n * n, 3)
    assert tuple(comm.reduce_scatter(torch.ones(n * 5, dtype=torch.float32, device="cuda")).shape) == (5,)


@pytest.mark.parametrize("algo", KERNELS)
def test_graph_replay(comm, algo):
    """Captured after an eager call, replayed on new inputs: the results of each replay."""
    import torch

    n, k, dtype = comm.size, 3000, "bfloat16"
    x = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
    rs_out = torch.empty(k, dtype=torch.bfloat16, device="cuda")
    ag_out = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm.reduce_scatter(x, rs_out, algorithm=algo)
        comm.all_gather(rs_out, ag_out, algorithm=algo)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            comm.reduce_scatter(x, rs_out, algorithm=algo)
            comm.all_gather(rs_out, ag_out, algorithm=algo)
    failures = []
    for replay in range(3):
        inputs = rank_inputs(n * k, dtype, n, seed_of("graph", algo, replay))
        x.copy_(device(inputs[comm.rank]))
        rs_out.fill_(float("nan"))
        ag_out.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        shards = reference.reduce_scatter(algo, inputs)
        with collected(failures):
            reference.assert_same_bits(host(rs_out), shards[comm.rank], f"replay {replay}: reduce_scatter")
            reference.assert_same_bits(host(ag_out), reference.all_gather(algo, shards), f"replay {replay}: all_gather")
    assert not failures, failures


def test_back_to_back_with_all_reduce(comm):
    """Reduce-scatters, all-gathers and all-reduces of every kernel family issued without a
    synchronization in between; every result checked afterwards."""
    import torch

    n, dtype = comm.size, "bfloat16"
    calls = []
    for i, algo in enumerate(("lamport_twoshot", "twoshot", "lamport_twoshot", "twoshot") * 2):
        k = (1000, 4096, 7, 70000)[i % 4]
        inputs = rank_inputs(n * k, dtype, n, seed_of("b2b", i))
        x = device(inputs[comm.rank])
        rs = comm.reduce_scatter(x, algorithm=algo)
        ar = comm.all_reduce(x, algorithm=("lamport", "lamport_twoshot", "twoshot")[i % 3])
        ag = comm.all_gather(rs, algorithm=KERNELS[i % 2])
        calls.append((algo, KERNELS[i % 2], inputs, rs, ar, ag))
    torch.cuda.synchronize()
    failures = []
    for algo, ag_algo, inputs, rs, _ar, ag in calls:
        shards = reference.reduce_scatter(algo, inputs)
        with collected(failures):
            reference.assert_same_bits(host(rs), shards[comm.rank], f"back to back: reduce_scatter {algo}")
            reference.assert_same_bits(host(ag), reference.all_gather(ag_algo, shards),
                                       f"back to back: all_gather {ag_algo}")
    assert not failures, failures


@pytest.mark.parametrize("algo", KERNELS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("hidden,bias", [(1024, True), (4000, False), (12, True)])
def test_reduce_scatter_add_rmsnorm(comm, algo, dtype, hidden, bias):
    """The fused sequence-parallel step: the reduce-scatter's reference rows, then the
    separate add + RMSNorm kernel's arithmetic (kernels/rmsnorm.cu) on this rank's rows."""
    import torch

    n = comm.size
    rows = 3 * n
    seed = seed_of("rs_norm", algo, dtype, hidden, bias)
    inputs, _, weight, b = norm_operands(comm, rows, hidden, dtype, seed, residual=False, bias=bias)
    residual = host(torch.randn(rows // n, hidden, device="cuda").to(getattr(torch, dtype)))
    with recorded_launches(comm) as launches:
        normed, res_out = comm.reduce_scatter_add_rmsnorm(
            device(inputs[comm.rank]), device(residual), device(weight), eps=1e-5,
            bias=None if b is None else device(b), algorithm=algo)
    torch.cuda.synchronize()
    shard = reference.reduce_scatter(algo, [x.reshape(-1) for x in inputs])[comm.rank].reshape(rows // n, hidden)
    separate = [launch for launch in launches if launch.kernel == "add_rmsnorm"]
    assert len(separate) == 1
    by_vectors = hidden * WIDTH[dtype] % 16 == 0
    want_normed, want_res = reference.add_rmsnorm(shard, residual, b, weight, 1e-5, separate[0].threads,
                                                  by_vectors=by_vectors)
    failures = []
    with collected(failures):
        reference.assert_same_bits(host(res_out), want_res, "reduce_scatter_add_rmsnorm residual_out")
        reference.assert_same_bits(host(normed), want_normed, "reduce_scatter_add_rmsnorm normed")
    assert not failures, failures


def test_count_the_world_does_not_divide_raises(comm):
    import torch

    import ubnext

    if comm.size == 1:
        pytest.skip("every count divides by one rank")
    with pytest.raises(ubnext.UbnextError, match="do not divide"):
        comm.reduce_scatter(torch.ones(comm.size + 1, device="cuda"))
