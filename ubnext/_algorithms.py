"""The algorithm table: one record per all-reduce algorithm.

This table is the single place that says what exists. It drives selection
(`Selector`), compilation (`compile_defines`), validation, and the benchmarks'
list of candidates. Adding an algorithm means adding a row here and a kernel in
``kernels/``; nothing else lists algorithms by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Ranks of one node the kernels serve (kernels/common.cuh: UB_MAX_RANKS).
MAX_RANKS = 8
#: Blocks per launch that own barrier flags (kernels/common.cuh: UB_MAX_BLOCKS).
MAX_BLOCKS = 256

#: dtype name -> (element type in the kernels, bytes per element)
DTYPES = {"bfloat16": ("bf16", 2), "float16": ("f16", 2), "float32": ("float", 4)}
#: op name -> reduction functor in the kernels
OPS = {"sum": "OpSum", "avg": "OpAvg", "max": "OpMax", "min": "OpMin"}


@dataclass(frozen=True)
class Algorithm:
    """One all-reduce algorithm.

    Attributes:
        name: public name (``algorithm=`` argument, ``UBNEXT_ALGO``).
        source: kernel file in ``kernels/``, or None for the NCCL engine.
        entry: ``extern "C"`` entry point in ``source``.
        threads: threads per block the entry point is built for.
        one_shot: every rank reads every rank's whole message (latency-bound
            sizes); its largest message is ``Config.lamport_max_kb``.
        summary: one line for ``python -m ubnext info``.
    """

    name: str
    source: str | None
    entry: str | None
    threads: int
    one_shot: bool
    summary: str

    @property
    def is_kernel(self) -> bool:
        return self.source is not None


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "lamport", "lamport.cu", "ub_lamport", 256, True,
            "one-shot push into every rank, sentinel-polled, no barrier (small messages)",
        ),
        Algorithm(
            "twoshot", "twoshot.cu", "ub_twoshot", 512, False,
            "reduce-scatter by loads + all-gather by stores, in place on the pool (large messages)",
        ),
        Algorithm(
            "nccl", None, None, 0, False,
            "the NCCL library (fallback engine: several nodes, no P2P, other cases)",
        ),
    )
}


def compile_defines(dtype: str, op: str, nranks: int) -> dict[str, str]:
    """Preprocessor definitions that instantiate a kernel entry point.

    Args:
        dtype: a key of ``DTYPES``.
        op: a key of ``OPS``.
        nranks: ranks of the node, 1..MAX_RANKS.

    Returns:
        ``{"UB_T": ..., "UB_OP": ..., "UB_NRANKS": ...}``.
    """
    return {"UB_T": DTYPES[dtype][0], "UB_OP": OPS[op], "UB_NRANKS": str(nranks)}
