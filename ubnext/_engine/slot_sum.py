"""The slot sum kernel (kernels/slot_sum.cu): ``out`` = slots 0..N-1 added in that order in
the accumulator of their dtype (fp32, or double for float64), rounded once. The reduction
of ``ubnext.torch``'s overlapped matmul + reduce-scatter, in one pass over the slots (a
kernel per added slot read and wrote an fp32 accumulator each time). Local to this rank:
no pool, no peers."""

from __future__ import annotations

from ubnext._engine.kernels import compile_module
from ubnext._engine.launch import SM_THREADS, U64, Launcher
from ubnext._protocol.algorithms import DTYPES, SLOT_SUM_DTYPES, SLOT_SUM_ENTRY, SLOT_SUM_SOURCE, slot_sum_defines
from ubnext._protocol.constants import SLOT_SUM_THREADS, VEC_BYTES

_PARAMS = (U64,) * 4  # slots, stride, n, out
#: blocks per SM: the grid-stride loop's grid fills each SM
_BLOCKS_PER_SM = SM_THREADS // SLOT_SUM_THREADS


class SlotSum:
    """Launches ``ub_slot_sum`` of ``count`` slots, compiled for every dtype it takes
    (SLOT_SUM_DTYPES) at construction: nothing compiles or loads at a later call, which a
    CUDA graph may be capturing.

    Args:
        device: the GPU it launches on (its context current at construction and at every
            call).
        sms: the device's multiprocessors.
        count: the slots of every sum.

    Its calls must not overlap (one argument pack per launcher, ``launch.Launcher``):
    ``ubnext.torch``'s overlapped calls on one communicator, whose side state holds it,
    come one after the other, as their barriers' order requires.
    """

    def __init__(self, device: int, sms: int, count: int):
        self._most = sms * _BLOCKS_PER_SM
        self._launchers = {dtype: Launcher(compile_module(SLOT_SUM_SOURCE, slot_sum_defines(dtype, count), device)
                                           .get_function(SLOT_SUM_ENTRY), _PARAMS)
                           for dtype in SLOT_SUM_DTYPES}

    def __call__(self, dtype: str, slots: int, stride: int, n: int, out: int, stream: int) -> None:
        """``out[i] = round(slot[0][i] + ... + slot[count-1][i])``, added in slot order.

        ``slots``: address of slot 0, aligned to the element; slot s at ``slots + s *
        stride``, ``stride`` a whole number of elements (by 16-byte vectors where it, the
        slots and ``out`` are 16-byte aligned); ``n`` elements of ``dtype``
        (SLOT_SUM_DTYPES) each, and ``out`` too (not overlapping the slots).
        """
        vectors = -(-n * DTYPES[dtype][1] // VEC_BYTES)
        blocks = max(1, min(self._most, -(-vectors // SLOT_SUM_THREADS)))
        self._launchers[dtype](blocks, SLOT_SUM_THREADS, stream, slots, stride, n, out)
