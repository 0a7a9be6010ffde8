"""The kernels' launch protocol on GPUs: the Lamport buffer rotation across the wrap of
the 32-bit launch epoch.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_protocol.py``
(ranks may share one GPU); skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import communicator, torch_dtype

pytestmark = pytest.mark.gpu

WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}
WRAP = 1 << 32


comm = pytest.fixture(scope="module", name="comm")(communicator)


def _u32(ptr: int, value: int | None = None) -> int:
    """Reads (or writes, then reads) the 32-bit word at device address ``ptr``."""
    import cupy

    word = np.zeros(1, np.uint32)
    if value is not None:
        word[0] = value
        cupy.cuda.runtime.memcpy(ptr, word.ctypes.data, 4, cupy.cuda.runtime.memcpyHostToDevice)
    cupy.cuda.runtime.memcpy(word.ctypes.data, ptr, 4, cupy.cuda.runtime.memcpyDeviceToHost)
    return int(word[0])


def plant_epoch_below_wrap(comm, family: str, width: int, before_wrap: int) -> int:
    """Sets the launch epoch of a Lamport family's state ``before_wrap`` launches short of
    2^32, keeping ``epoch % 3`` (the buffer a rotation by epoch would take next), so that
    only the wrap itself can break the rotation. Collective; returns the planted epoch."""
    import torch

    from ubnext._protocol.constants import LAUNCH_STATE

    torch.cuda.synchronize()
    comm.bootstrap.barrier()  # no rank still runs a launch of the family
    state = comm._node.engine._sets[family, width][1]
    epoch_at = [field for _, field, _ in LAUNCH_STATE].index("epoch") * 4
    epoch = _u32(state + epoch_at)
    assert len(set(comm.bootstrap.allgather(epoch.to_bytes(4, "little")))) == 1, "ranks made different calls"
    planted = WRAP - before_wrap - ((WRAP - before_wrap - epoch) % 3)
    assert planted % 3 == epoch % 3 and WRAP - planted >= before_wrap
    assert _u32(state + epoch_at, planted) == planted
    comm.bootstrap.barrier()
    return planted


def rank_values(comm, count: int, call: int, rank: int, dtype: str):
    """Small integers (sums of up to 8 ranks stay below 256: exact in every dtype),
    different per rank and per call (so that a stale buffer gives another sum)."""
    import torch

    i = torch.arange(count, device="cuda", dtype=torch.float32)
    return ((i % 3) + 1 + 2 * (rank % 4) + 8 * (call % 3)).to(torch_dtype(dtype))


def expected(comm, count: int, call: int, dtype: str):
    return sum(rank_values(comm, count, call, r, dtype).float() for r in range(comm.size)).to(torch_dtype(dtype))


@pytest.mark.parametrize("algo", ["lamport", "lamport_twoshot"])
@pytest.mark.parametrize("dtype", list(WIDTH))
@pytest.mark.parametrize("fused", [False, True])
def test_lamport_rotation_across_the_epoch_wrap(comm, algo, dtype, fused):
    """Calls running across the 2^32 wrap of the launch epoch each receive into a buffer of
    their own: exact sums on every call (with the rotation taken as epoch % 3, two
    consecutive launches around the wrap received into the same buffer and a rank read
    the previous call's data)."""
    import torch

    rows, hidden = 3, 256  # 1536 elements: a few vectors per rank in either family
    count = rows * hidden
    plant_epoch_below_wrap(comm, algo, WIDTH[dtype], before_wrap=3)
    weight = torch.ones(hidden, device="cuda", dtype=torch_dtype(dtype))
    for call in range(8):  # 3 before the wrap, 5 after it
        x = rank_values(comm, count, call, comm.rank, dtype)
        want = expected(comm, count, call, dtype)
        if fused:
            residual = rank_values(comm, count, call + 1, 0, dtype).view(rows, hidden)  # the same on every rank
            out = torch.full_like(residual, float("nan"))
            res_out = torch.full_like(residual, float("nan"))
            comm.all_reduce_add_rmsnorm(x.view(rows, hidden), residual, weight, out=out, residual_out=res_out,
                                        algorithm=algo)
            got, want = res_out.flatten(), (want.float() + residual.flatten().float()).to(torch_dtype(dtype))
        else:
            got = torch.full_like(x, float("nan"))
            comm.all_reduce(x, out=got, algorithm=algo)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int8), want.view(torch.int8)), \
            f"call {call} after planting: {(got != want).sum().item()} of {count} elements wrong"
