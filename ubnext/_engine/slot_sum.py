"""The slot sum kernel (kernels/slot_sum.cu): ``out`` = slots 0..N-1 added in that order in
the accumulator of their dtype (fp32, or double for float64), rounded once. The reduction
of ``ubnext.torch``'s overlapped matmul + reduce-scatter, in one pass over the slots (a
kernel per added slot read and wrote an fp32 accumulator each time); its second entry
point finishes each row of the sum with the residual add + RMSNorm in the same pass (the
overlapped matmul + reduce-scatter + add + RMSNorm). Local to this rank: no pool, no peers."""

from __future__ import annotations

import threading

from ubnext._engine.epilogue import row_launch
from ubnext._engine.kernels import compile_module
from ubnext._engine.launch import F32, SM_THREADS, U64, Launcher, programmatic
from ubnext._protocol.algorithms import (
    DTYPES,
    SLOT_NORM_DTYPES,
    SLOT_NORM_ENTRY,
    SLOT_NORM_ROW_KEEP,
    SLOT_SUM_DTYPES,
    SLOT_SUM_ENTRY,
    SLOT_SUM_SOURCE,
    slot_sum_defines,
)
from ubnext._protocol.constants import SLOT_SUM_THREADS, VEC_BYTES

_PARAMS = (U64,) * 4  # slots, stride, n, out
#: slots, stride, rows, hidden, residual, bias, weight, normed, res_out, eps
_NORM_PARAMS = (U64,) * 9 + (F32,)
#: blocks per SM: the grid-stride loop's grid fills each SM
_BLOCKS_PER_SM = SM_THREADS // SLOT_SUM_THREADS


class SlotSum:
    """Launches ``ub_slot_sum`` and ``ub_slot_sum_add_rmsnorm`` of ``count`` slots, compiled
    for every dtype they take (SLOT_SUM_DTYPES, SLOT_NORM_DTYPES: one module per dtype
    holds both) at construction: nothing compiles or loads at a later call, which a CUDA
    graph may be capturing.

    Args:
        device: the GPU it launches on (its context current at construction and at every
            call: ``ubnext.torch``'s overlapped calls make both in the communicator's launch
            section).
        sms: the device's multiprocessors.
        count: the slots of every sum.
        pdl: ``Config.pdl``: launch with programmatic dependent launch where the device
            has it (``launch.programmatic``); both entry points wait for the grid
            dependency before they read anything (kernels/slot_sum.cu).

    Thread-safe: each launcher has one argument pack (``launch.Launcher``), so its calls
    take a lock of their own around the packing and the launch (the overlapped calls of
    one communicator also come one at a time, in its section).
    """

    def __init__(self, device: int, sms: int, count: int, pdl: bool = True):
        self._sms = sms
        self._most = sms * _BLOCKS_PER_SM
        self._lock = threading.Lock()
        dependent = programmatic(pdl, device)
        modules = {dtype: compile_module(SLOT_SUM_SOURCE, slot_sum_defines(dtype, count), device)
                   for dtype in SLOT_SUM_DTYPES}
        self._launchers = {dtype: Launcher(module.get_function(SLOT_SUM_ENTRY), _PARAMS, dependent=dependent)
                           for dtype, module in modules.items()}
        self._norms = {dtype: Launcher(modules[dtype].get_function(SLOT_NORM_ENTRY), _NORM_PARAMS,
                                       dependent=dependent)
                       for dtype in SLOT_NORM_DTYPES}

    def __call__(self, dtype: str, slots: int, stride: int, n: int, out: int, stream: int) -> None:
        """``out[i] = round(slot[0][i] + ... + slot[count-1][i])``, added in slot order.

        ``slots``: address of slot 0, aligned to the element; slot s at ``slots + s *
        stride``, ``stride`` a whole number of elements (by 16-byte vectors where it, the
        slots and ``out`` are 16-byte aligned); ``n`` elements of ``dtype``
        (SLOT_SUM_DTYPES) each, and ``out`` too (not overlapping the slots).
        """
        vectors = -(-n * DTYPES[dtype][1] // VEC_BYTES)
        blocks = max(1, min(self._most, -(-vectors // SLOT_SUM_THREADS)))
        with self._lock:
            self._launchers[dtype](blocks, SLOT_SUM_THREADS, stream, slots, stride, n, out)

    def add_rmsnorm(self, dtype: str, slots: int, stride: int, rows: int, hidden: int, norm: tuple, eps: float,
                    stream: int) -> None:
        """The slots' sum as ``__call__`` computes it, of ``rows`` x ``hidden`` elements of
        ``dtype`` (SLOT_NORM_DTYPES; ``rows`` > 0), rounded to dtype, then ``res_out =
        round(sum + bias + residual)`` and ``normed = round(res_out * rsqrt(mean(res_out **
        2) + eps) * weight)`` row by row, with the separate add + RMSNorm kernel's
        arithmetic (kernels/rmsnorm.cuh; the row group of ``epilogue.row_launch``).

        ``norm``: local addresses (residual or 0, bias or 0, weight, normed, res_out), none
        overlapping the slots; by 16-byte vectors where hidden is a multiple of the vector
        width and every address and the stride are 16-byte aligned, else element by element.
        """
        blocks, threads = row_launch(rows, -(-hidden * DTYPES[dtype][1] // VEC_BYTES), self._sms,
                                     SLOT_NORM_ROW_KEEP)
        with self._lock:
            self._norms[dtype](blocks, threads, stream, slots, stride, rows, hidden, *norm, eps)
