"""Deterministic mode on GPUs (UBNEXT_DETERMINISTIC=1): every ubnext algorithm gives the
same bits for the same inputs, those of one reference (rank order, -0.0 written as
+0.0, one rounding), so results do not change when `auto` crosses a size threshold.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_deterministic.py``
(ranks may share one GPU); skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import device, host, make_other_input, rank_inputs, require_gpu_and_torch

from ubnext._tools import reference

pytestmark = pytest.mark.gpu

KERNELS = ("lamport", "lamport_twoshot", "twoshot")


@pytest.fixture(scope="module")
def comm():
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator(deterministic=True)
    yield c
    c.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("count", [7, 4096, (1 << 16) + 3, 1 << 19])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_every_algorithm_gives_the_same_bits(comm, dtype, count, op):
    import torch

    inputs = rank_inputs(count, dtype, comm.size, seed=count + len(op), specials=True)
    want = reference.lamport_twoshot(inputs, op)  # inputs and result cleared of -0.0, rank order
    for algo in KERNELS:
        if not comm.selector.fits(algo, count * inputs[0].itemsize):
            continue  # the Lamport one-shot past its buffers
        out = torch.full((count,), float("nan"), device="cuda", dtype=getattr(torch, dtype))
        comm.all_reduce(device(inputs[comm.rank]), out=out, op=op, algorithm=algo)
        torch.cuda.synchronize()
        reference.assert_same_bits(host(out), want, f"{algo} {dtype} {count} {op}")


def test_auto_takes_no_nccl_where_the_kernels_run(comm):
    for nbytes in (1 << 10, 1 << 20, 64 << 20, 1 << 30):
        assert comm.select(nbytes, "bfloat16") in KERNELS, nbytes
        assert comm.select(nbytes, "float64") == "twoshot", nbytes
    assert not any(name.startswith("nvls") for name in comm.algorithms())


@pytest.mark.parametrize("count", [7, 4099, (1 << 18) + 3])
def test_float64_reduces_in_rank_order_on_the_two_shot(comm, count):
    """float64 (only the barrier two-shot among ubnext's kernels) in deterministic mode: rank
    order, -0.0 written as +0.0 in inputs and results, whatever slice a rank owns."""
    import cupy

    inputs = [make_other_input(count, "float64", r, seed=count) for r in range(comm.size)]
    for op in ("sum", "avg", "max", "min"):
        out = cupy.full(count, np.nan)
        comm.all_reduce(cupy.asarray(inputs[comm.rank]), out=out, op=op)
        cupy.cuda.get_current_stream().synchronize()
        reference.assert_same_bits(out.get(), reference.lamport_twoshot(inputs, op), f"float64 {count} {op}")


@pytest.mark.parametrize("algo", KERNELS)
def test_fused_residual_sums_are_the_same_bits(comm, algo):
    """The fused call's residual sums are the same on every algorithm (its normed output
    also follows the row sums' launch shape, which the mode does not fix)."""
    import torch

    tokens, hidden = 8, 1024
    inputs = [x.reshape(tokens, hidden) for x in rank_inputs(tokens * hidden, "bfloat16", comm.size, seed=3)]
    residual = inputs[0].copy()
    weight = np.ones(hidden, reference.DTYPES["bfloat16"])
    ar = reference.lamport_twoshot(inputs, "sum")
    want = reference.clear_negative_zero(reference.narrow(reference.widen(ar) + reference.widen(residual),
                                                          ar.dtype))
    res_out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    comm.all_reduce_add_rmsnorm(device(inputs[comm.rank]), device(residual), device(weight),
                                residual_out=res_out, algorithm=algo)
    torch.cuda.synchronize()
    reference.assert_same_bits(host(res_out), want, f"{algo} residual sums")
