"""The separate residual add + RMSNorm kernel: the unfused path of
``Communicator.all_reduce_add_rmsnorm`` (any hidden size and alignment, after an
all-reduce by any engine, NCCL included). Local to this rank: no pool, no peers."""

from __future__ import annotations

import math

from ubnext._engine.kernels import compile_module
from ubnext._engine.launch import F32, SM_THREADS, U64, Launcher
from ubnext._protocol.algorithms import DTYPES, NORM_ENTRY, NORM_SOURCE, ROW_KEEP, norm_defines, row_threads
from ubnext._protocol.constants import NORM_THREADS, VEC_BYTES
from ubnext._protocol.errors import UbnextError

_PARAMS = (U64,) * 8 + (F32,)  # x, rows, hidden, residual, bias, weight, normed, res_out, eps


class AddRmsNorm:
    """Launches ``ub_add_rmsnorm`` (kernels/rmsnorm.cu); one compiled kernel per dtype.

    Args:
        device: the GPU it launches on.
        sms: the device's multiprocessors. A launch has one row per block (grid-stride
            beyond) and as many blocks as the SMs hold at once.
        dependent: launch with programmatic dependent launch (``_launch.programmatic``).
    """

    def __init__(self, device: int, sms: int, dependent: bool = False):
        self._device, self._sms, self._dependent = device, sms, dependent
        self._launchers: dict[str, Launcher] = {}

    def __call__(self, dtype: str, x: int, rows: int, hidden: int, norm: tuple, eps: float,
                 stream: int) -> None:
        """``normed, res_out = rmsnorm(x + bias + residual) * weight, x + bias + residual``.

        ``norm``: local addresses (residual or 0, bias or 0, weight, normed, res_out);
        ``x`` is the all-reduced input and may equal ``normed``.
        """
        launcher = self._launchers.get(dtype)
        if launcher is None:
            module = compile_module(NORM_SOURCE, norm_defines(dtype), self._device)
            launcher = self._launchers[dtype] = Launcher(module.get_function(NORM_ENTRY), _PARAMS,
                                                          dependent=self._dependent)
        blocks, threads = row_launch(rows, -(-hidden * DTYPES[dtype][1] // VEC_BYTES), self._sms, ROW_KEEP)
        launcher(blocks, threads, stream, x, rows, hidden, *norm, eps)


def row_launch(rows: int, vectors: int, sms: int, keep: int) -> tuple[int, int]:
    """``(blocks, threads)`` of a launch of ``add_rmsnorm_rows`` (kernels/rmsnorm.cuh: one
    row per block, no clusters) over ``rows`` rows of ``vectors`` 16-byte vectors on a
    device of ``sms`` multiprocessors, for a kernel that keeps ``keep`` vectors per thread
    in registers (UB_ROW_KEEP). A thread per vector of a row while a full block on every
    SM covers the array (a row's passes on the most threads); larger arrays: ``keep``
    vectors per thread, so that more, smaller blocks share an SM (bench/NOTES.md); at most
    as many blocks as the SMs hold at once. The threads are the row group's, on which a
    row's sum of squares, and so its normed bits, depend (``_tools.reference.add_rmsnorm``)."""
    per_thread = 1 if rows * vectors <= sms * NORM_THREADS else keep
    threads = row_threads(-(-vectors // per_thread))
    return max(1, min(rows, sms * (SM_THREADS // threads))), threads


def check_eps(name: str, eps) -> float:
    """``eps`` of an add + RMSNorm as a float, finite and >= 0 (``name``: the call, for the
    message)."""
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise UbnextError(f"{name}: eps must be a number, got {type(eps).__name__}") from None
    if not math.isfinite(eps) or eps < 0:
        raise UbnextError(f"{name}: eps must be finite and >= 0, got {eps}")
    return eps
