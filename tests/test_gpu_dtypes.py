"""The dtypes outside the fp32 kernels (float64 and the 8-, 32- and 64-bit integers) on GPUs.

ubnext's barrier two-shot (``algorithm="twoshot"``) reduces them, float64 in float64 and
integers in their own type, wrapping around: every output element matches the host
reference in the kernel's order bit for bit (ubnext/_tools/reference.py: ``twoshot``), with canary
bytes around the output, the input unchanged, the same bits on every rank, through the
kernel's copy-in/copy-out, in place on symmetric memory, through the staging slot for
unaligned arrays, and replayed from a CUDA graph. ``auto`` hands these dtypes to NCCL
(checked bit for bit on inputs that every order sums alike), except where NCCL cannot run
(ranks sharing a GPU): then to the two-shot. Integer ``avg`` and the fused call on these
dtypes raise on every rank.

Run at 1 rank (``python -m pytest -q tests/test_gpu_dtypes.py``) and at N ranks, also
sharing one GPU (``mpirun --oversubscribe -n 4 python -m pytest -q tests/test_gpu_dtypes.py``):
the NCCL tests skip where ranks share a GPU (NCCL refuses them), the two-shot tests run
everywhere; everything skips without a GPU.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gpu_support import (
    collected,
    communicator,
    expected_all_reduce,
    make_other_input,
    ran,
    recorded_launches,
    skip_where_nccl_cannot_run,
)

from ubnext._tools import reference

pytestmark = pytest.mark.gpu

DTYPES = tuple(reference.TWOSHOT_ONLY)
GUARD = 64  # canary bytes on each side of the output


comm = pytest.fixture(scope="module", name="comm")(communicator)


def rank_input(count: int, dtype: str, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input for NCCL, whose order is its own. Integers: make_other_input's
    (any order sums them alike). float64: nonzero multiples of 0.5 below 2**20 in magnitude,
    whose sums in any order are exact."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        rng = np.random.default_rng(seed * 1009 + rank)
        a = rng.integers(1, 1 << 21, count) * rng.choice([-0.5, 0.5], count)
        return a.astype(dt)
    return make_other_input(count, dtype, rank, seed)


def want(inputs, dtype: str, op: str) -> np.ndarray:
    return reference.exact(inputs, op) if dtype == "float64" else reference.integer(inputs, op)


def bordered(cupy, count: int, dtype: str, seed: int, offset: int = 0, comm=None):
    """``(buffer, view, canaries)``: ``count`` elements of ``dtype`` between GUARD random bytes
    on each side (``offset`` more elements before: a view not 16-byte aligned), poisoned
    with 0xA5 bytes; the buffer from ``comm.empty()`` (symmetric memory) when given."""
    width = np.dtype(dtype).itemsize
    start = GUARD + offset * width
    size = start + count * width + GUARD
    base = cupy.empty(size, cupy.uint8) if comm is None else comm.empty(size, "uint8")
    canaries = np.random.default_rng(seed).integers(0, 256, base.size, dtype=np.uint8)
    canaries[start:start + count * width] = 0xA5
    base.set(canaries)
    return base, base[start:start + count * width].view(dtype), canaries


def outside(base, canaries, view_start: int, view_bytes: int) -> int:
    """Bytes of ``base`` outside the view that differ from ``canaries``."""
    got = base.get()
    changed = got != canaries
    changed[view_start:view_start + view_bytes] = False
    return int(changed.sum())


def digest(a) -> bytes:
    return hashlib.sha256(a.get().tobytes()).digest()


def ops_of(dtype: str, nranks: int, exact: bool = True):
    ops = ["sum", "max", "min"]
    if dtype == "float64" and (not exact or nranks & (nranks - 1) == 0):  # exact averages: 2**k ranks
        ops.append("avg")
    return ops


# ---- ubnext's barrier two-shot --------------------------------------------------------------
def check_twoshot(comm, count: int, dtype: str, op: str, seed: int, *, place: str = "out", offset: int = 0,
                  symmetric: bool = False) -> list[str]:
    """One ``all_reduce(algorithm="twoshot")`` of make_other_input data checked element by
    element; returns the failures. ``place``: ``"out"`` (a poisoned bordered output) or
    ``"in"``; ``offset``: elements past 16-byte alignment; ``symmetric``: both arrays from
    ``comm.empty()``."""
    import cupy

    width = np.dtype(dtype).itemsize
    inputs = [make_other_input(count, dtype, r, seed) for r in range(comm.size)]
    memory = comm if symmetric else None
    xbase, x, xcan = bordered(cupy, count, dtype, seed + 1, offset, memory)
    x.set(inputs[comm.rank])
    out = x
    if place == "out":
        obase, out, ocan = bordered(cupy, count, dtype, seed + 2, offset, memory)
    with recorded_launches(comm) as launches:
        result = comm.all_reduce(x, out=out, op=op, algorithm="twoshot")
    cupy.cuda.get_current_stream().synchronize()
    what = f"twoshot {dtype} {op} count={count} place={place} offset={offset} symmetric={symmetric}"
    failures = []
    digests = comm.bootstrap.allgather(digest(out))  # collective: before any check one rank alone may fail
    with collected(failures):
        assert result is out, what
        assert all(d == digests[0] for d in digests), f"{what}: ranks got different bits"
        assert ran(launches) == "twoshot", f"{what}: ran {ran(launches)}"
        reference.assert_same_bits(out.get(), expected_all_reduce(launches, inputs, op), what)
        start = GUARD + offset * width
        if place == "out":
            assert outside(obase, ocan, start, count * width) == 0, f"{what}: wrote outside the output"
            reference.assert_same_bits(x.get(), inputs[comm.rank], f"{what}: modified its input")
        assert outside(xbase, xcan, start, count * width) == 0, f"{what}: wrote outside the input"
    return failures


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 7, 4099, (1 << 20) + 3])
def test_twoshot_reduces_every_other_dtype_bit_for_bit(comm, dtype, count):
    failures = []
    for op in ops_of(dtype, comm.size, exact=False):
        failures += check_twoshot(comm, count, dtype, op, seed=count * 31 + len(dtype) + len(op))
    assert not failures, failures


@pytest.mark.parametrize("dtype", DTYPES)
def test_twoshot_in_place_on_symmetric_memory_and_through_staging_when_unaligned(comm, dtype):
    failures = check_twoshot(comm, 4099, dtype, "sum", seed=5, place="in", symmetric=True)  # zero copy
    failures += check_twoshot(comm, 4099, dtype, "max", seed=6, offset=1)  # copies through the staging slot
    failures += check_twoshot(comm, 4099, dtype, "min", seed=7, offset=1, place="in")
    assert not failures, failures


@pytest.mark.parametrize("dtype", DTYPES)
def test_twoshot_replays_from_a_cuda_graph(comm, dtype):
    """An eager call compiles the kernel; the captured call, replayed once with new inputs
    in x and a poisoned output, gives the new inputs' reduction."""
    import cupy

    count = 10_007
    x = cupy.empty(count, dtype)
    _, out, _ = bordered(cupy, count, dtype, seed=8)
    s = cupy.cuda.Stream(non_blocking=True)
    x.set(make_other_input(count, dtype, comm.rank, 9))
    comm.all_reduce(x, out=out, algorithm="twoshot", stream=s)  # eager: compiles
    s.synchronize()
    s.begin_capture()
    with recorded_launches(comm) as launches:
        comm.all_reduce(x, out=out, algorithm="twoshot", stream=s)
    graph = s.end_capture()
    inputs = [make_other_input(count, dtype, r, 10) for r in range(comm.size)]
    x.set(inputs[comm.rank])
    out.fill(0)
    cupy.cuda.Device().synchronize()
    graph.launch(s)
    s.synchronize()
    failures = []
    digests = comm.bootstrap.allgather(digest(out))
    with collected(failures):
        assert all(d == digests[0] for d in digests), "replay: ranks got different bits"
        reference.assert_same_bits(out.get(), expected_all_reduce(launches, inputs, "sum"), f"replay {dtype}")
    assert not failures, failures


# ---- auto: NCCL where it runs, else the two-shot ---------------------------------------------
def test_auto_takes_the_two_shot_exactly_where_nccl_cannot_run(comm):
    from ubnext._environment import devices as _devices
    from ubnext._environment import install as _install

    shared = _devices.shared(comm.bootstrap.allgather_obj(_devices.device_uuid(comm.device)))
    cannot = bool(shared) or any(comm.bootstrap.allgather_obj(_install.nccl_problem()))
    assert bool(comm.selector.nccl_problem) == cannot, comm.selector.nccl_problem
    for dtype in DTYPES:
        name, why = comm.selector.explain(4096, dtype)
        assert comm.select(4096, dtype) == name == ("twoshot" if cannot else "nccl"), why
        if shared:
            assert "share one GPU, which NCCL refuses" in why
    if cannot:
        import cupy

        with recorded_launches(comm) as launches:
            y = comm.all_reduce(cupy.full(4099, 3, cupy.int64))
        assert ran(launches) == "twoshot" and (y.get() == 3 * comm.size).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 7, 4099, (1 << 20) + 3])
def test_auto_reduces_every_dtype_on_nccl_bit_for_bit(comm, dtype, count):
    import cupy

    skip_where_nccl_cannot_run(comm)
    failures = []
    assert comm.select(count * np.dtype(dtype).itemsize, dtype) == "nccl"
    for op in ops_of(dtype, comm.size):
        seed = count * 31 + len(dtype) + len(op)
        inputs = [rank_input(count, dtype, r, seed) for r in range(comm.size)]
        x = cupy.asarray(inputs[comm.rank])
        base, out, canaries = bordered(cupy, count, dtype, seed)
        result = comm.all_reduce(x, out=out, op=op)
        assert result is out
        cupy.cuda.get_current_stream().synchronize()
        with collected(failures):
            reference.assert_same_bits(out.get(), want(inputs, dtype, op), f"all_reduce {dtype} {op}")
            assert outside(base, canaries, GUARD, out.nbytes) == 0, f"all_reduce {dtype} {op} wrote canary bytes"
            reference.assert_same_bits(x.get(), inputs[comm.rank], "all_reduce modified its input")
    assert not failures, failures


@pytest.mark.parametrize("dtype", ["int32", "uint8", "float64"])
def test_torch_tensors_and_symmetric_memory_in_place(comm, dtype):
    """``auto`` (NCCL, or the two-shot where ranks share a GPU) on inputs every order sums alike."""
    import torch

    count = 4099
    inputs = [rank_input(count, dtype, r, 7) for r in range(comm.size)]
    t = torch.from_numpy(inputs[comm.rank]).to("cuda")
    assert comm.all_reduce(t, out=t) is t
    sym = comm.empty(count, dtype)
    sym.set(inputs[comm.rank])
    comm.all_reduce(sym, out=sym, op="max")
    torch.cuda.synchronize()
    failures = []
    with collected(failures):
        reference.assert_same_bits(t.cpu().numpy(), want(inputs, dtype, "sum"), "torch in place")
        reference.assert_same_bits(sym.get(), want(inputs, dtype, "max"), "symmetric in place")
    assert not failures, failures


def test_integer_avg_and_fused_float64_raise_before_any_launch(comm):
    import cupy

    import ubnext

    for algorithm in ("auto", "twoshot"):
        with pytest.raises(ubnext.UbnextError, match="op 'avg' takes floating-point dtypes"):
            comm.all_reduce(cupy.ones(8, cupy.int32), op="avg", algorithm=algorithm)
    with pytest.raises(ubnext.UbnextError, match="algorithm 'lamport' does not reduce int8"):
        comm.all_reduce(cupy.ones(8, cupy.int8), algorithm="lamport")
    x = cupy.ones((2, 8), cupy.float64)
    with pytest.raises(ubnext.UbnextError, match="fused add \\+ RMSNorm takes"):
        comm.all_reduce_add_rmsnorm(x, x, cupy.ones(8, cupy.float64))
    y = comm.all_reduce(cupy.full(8, 3, cupy.int64))  # the communicator still works
    assert (y.get() == 3 * comm.size).all()
