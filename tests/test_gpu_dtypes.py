"""The dtypes only NCCL reduces (float64 and the 8-, 32- and 64-bit integers) on GPUs:
``auto`` hands them to NCCL, and every output element matches the host reference bit for
bit (integers in their own type, wrapping around, which every order gives alike; float64
on inputs exact in any order), with canary bytes around the output and the input
unchanged. Integer ``avg`` and the fused call on these dtypes raise on every rank.

Run at N ranks, one GPU each, with ``mpirun -n N python -m pytest -q tests/test_gpu_dtypes.py``;
skipped where ranks share a GPU (NCCL refuses them) and without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_support import collected, require_gpu_and_torch, skip_where_nccl_cannot_run
from ubnext import _reference as reference

pytestmark = pytest.mark.gpu

DTYPES = tuple(reference.TWOSHOT_ONLY)
GUARD = 64  # canary bytes on each side of the output


@pytest.fixture(scope="module")
def comm():
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator()
    skip_where_nccl_cannot_run(c)
    yield c
    c.close()


def rank_input(count: int, dtype: str, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input. Integers: uniform over the whole type, the type's extremes at
    elements 0 and 1 (so sums wrap around). float64: nonzero multiples of 0.5 below 2**20
    in magnitude, whose sums in any order are exact."""
    rng = np.random.default_rng(seed * 1009 + rank)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        a = rng.integers(1, 1 << 21, count) * rng.choice([-0.5, 0.5], count)
        return a.astype(dt)
    info = np.iinfo(dt)
    a = rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    a[:2] = (info.max, info.min)[:count] if rank % 2 == 0 else (info.max - 1, info.min + 1)[:count]
    return a


def want(inputs, dtype: str, op: str) -> np.ndarray:
    return reference.exact(inputs, op) if dtype == "float64" else reference.integer(inputs, op)


def bordered(cupy, count: int, dtype: str, seed: int):
    """``(buffer, view, canaries)``: ``count`` elements of ``dtype`` between GUARD random bytes
    on each side, poisoned with 0xA5 bytes."""
    width = np.dtype(dtype).itemsize
    base = cupy.empty(2 * GUARD + count * width, cupy.uint8)
    canaries = np.random.default_rng(seed).integers(0, 256, base.size, dtype=np.uint8)
    canaries[GUARD:GUARD + count * width] = 0xA5
    base.set(canaries)
    return base, base[GUARD:GUARD + count * width].view(dtype), canaries


def ops_of(dtype: str, nranks: int):
    ops = ["sum", "max", "min"]
    if dtype == "float64" and nranks & (nranks - 1) == 0:  # exact averages: a power-of-two rank count
        ops.append("avg")
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 7, 4099, (1 << 20) + 3])
def test_auto_reduces_every_dtype_on_nccl_bit_for_bit(comm, dtype, count):
    import cupy

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
            got = base.get()
            outside = np.flatnonzero(np.r_[got[:GUARD] != canaries[:GUARD], got[-GUARD:] != canaries[-GUARD:]])
            assert outside.size == 0, f"all_reduce {dtype} {op} wrote {outside.size} canary bytes"
            reference.assert_same_bits(x.get(), inputs[comm.rank], "all_reduce modified its input")
    assert not failures, failures


@pytest.mark.parametrize("dtype", ["int32", "uint8", "float64"])
def test_torch_tensors_and_symmetric_memory_in_place(comm, dtype):
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

    with pytest.raises(ubnext.UbnextError, match="op 'avg' takes floating-point dtypes"):
        comm.all_reduce(cupy.ones(8, cupy.int32), op="avg")
    x = cupy.ones((2, 8), cupy.float64)
    with pytest.raises(ubnext.UbnextError, match="fused add \\+ RMSNorm takes"):
        comm.all_reduce_add_rmsnorm(x, x, cupy.ones(8, cupy.float64))
    y = comm.all_reduce(cupy.full(8, 3, cupy.int64))  # the communicator still works
    assert (y.get() == 3 * comm.size).all()
