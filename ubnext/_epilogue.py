"""The separate residual add + RMSNorm kernel: the unfused path of
``Communicator.all_reduce_add_rmsnorm`` (any hidden size and alignment, after an
all-reduce by any engine, NCCL included). Local to this rank: no pool, no peers."""

from __future__ import annotations

from ._algorithms import DTYPES, NORM_ENTRY, NORM_SOURCE, compile_defines, row_threads
from ._kernels import compile_module
from ._launch import F32, U64, Launcher

_PARAMS = (U64,) * 8 + (F32,)  # x, rows, hidden, residual, bias, weight, normed, res_out, eps


class AddRmsNorm:
    """Launches ``ub_add_rmsnorm`` (kernels/rmsnorm.cu); one compiled kernel per dtype.

    Args:
        blocks: most blocks per launch (one row per block, grid-stride beyond).
    """

    def __init__(self, blocks: int):
        self._blocks = blocks
        self._launchers: dict[str, Launcher] = {}

    def __call__(self, dtype: str, x: int, rows: int, hidden: int, norm: tuple, eps: float,
                 stream: int) -> None:
        """``normed, res_out = rmsnorm(x + bias + residual) * weight, x + bias + residual``.

        ``norm``: local addresses (residual or 0, bias or 0, weight, normed, res_out);
        ``x`` is the all-reduced input and may equal ``normed``.
        """
        launcher = self._launchers.get(dtype)
        if launcher is None:
            module = compile_module(NORM_SOURCE, compile_defines(dtype, "sum", 1))
            launcher = self._launchers[dtype] = Launcher(module.get_function(NORM_ENTRY), _PARAMS)
        vectors = -(-hidden * DTYPES[dtype][1] // 16)  # a thread per 16 bytes of a row
        launcher(max(1, min(self._blocks, rows)), row_threads(vectors), stream, x, rows, hidden, *norm, eps)
