"""The dependent-kernel mode of the measurements: what a tensor-parallel model runs.

A GEMM writes the collective's input, on the same stream, right before it. A ubnext
kernel launched with programmatic dependent launch overlaps its prologue with the
GEMM's tail only when there is such a producer; back-to-back calls never show it. A
sample times a CUDA graph of (GEMM, collective) pairs, and right after it (same clocks,
same neighbours) a graph of the same GEMMs alone; their difference is the collective's
time as a model sees it.

Shared by ``python -m ubnext.tune --mode dependent`` and ``bench/`` (``compare.py``,
``fused_perf.py``, ``tp_block.py``, through ``bench/_common.py``): the GEMM's shape
(``--gemm M,K,N``), the subtraction and the GEMM's launch on cupy arrays (torch's GEMM:
:func:`matmul_into`). torch is imported when a GEMM is launched, so importing this module
needs neither a GPU nor torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ubnext._protocol.errors import UbnextError

#: ``--gemm`` default ``M,K,N``: 64 tokens through a 4096 x 4096 projection (bf16: 512 KiB out).
GEMM_SHAPE = (64, 4096, 4096)


def parse_gemm(text: str) -> tuple[int, int, int]:
    """``--gemm`` value ``M,K,N`` -> three positive ints.

    Raises:
        ValueError: not three positive integers.
    """
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--gemm takes M,K,N (three positive integers), got {text!r}")
    return shape  # type: ignore[return-value]


def gemm_arg(text: str) -> tuple[int, int, int]:
    """:func:`parse_gemm` as an argparse ``type``."""
    try:
        return parse_gemm(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dependent_samples(pair: Callable[[], float], gemm: Callable[[], float], repeats: int) -> dict[str, list[float]]:
    """The dependent mode's numbers, ``repeats`` of each, µs per call.

    ``pair()`` times one sample of the graph of (GEMM, collective) calls, ``gemm()`` one
    sample of the graph of the same GEMMs alone; each GEMM sample is taken right after its
    pair sample (same clocks, same neighbours), and their difference is the collective's
    time with a real producer before it.

    Returns:
        ``times_us`` (pair - GEMM, per repeat), ``raw_us`` (pair) and ``gemm_us`` (GEMM).
    """
    raw, alone = [], []
    for _ in range(repeats):
        raw.append(pair())
        alone.append(gemm())
    return {"times_us": [r - g for r, g in zip(raw, alone)], "raw_us": raw, "gemm_us": alone}


def matmul_into(a: Any, b: Any, out: Any, stream: Any) -> Callable[[], None]:
    """A launch of ``C = a @ b`` (cupy arrays, M x K and K x N) into the first M * N
    elements of the flat cupy array ``out`` (viewed M x N), on the cupy ``stream``. Runs
    the GEMM once eagerly, so cuBLAS picks its kernel and workspace before any capture.

    The GEMM is torch's (``torch.matmul(out=)`` on the same memory and stream): cupy's
    cuBLAS binding refuses to run while a stream is being captured, which is where the
    dependent mode launches it.

    Raises:
        UbnextError: torch is not installed.
    """
    try:
        import torch
    except ImportError:
        raise UbnextError("the dependent mode's GEMM needs torch (cupy cannot call cuBLAS while a CUDA graph is "
                          "being captured); install torch, or measure in the graph mode") from None
    device = torch.device("cuda", out.device.id)

    def tensor(x: Any) -> Any:
        """``x``'s memory as a torch tensor of its dtype (through same-width integers, which
        cupy and torch exchange for every dtype, bfloat16 included)."""
        bits = torch.as_tensor(x.view(f"int{8 * x.itemsize}"), device=device)
        return bits.view(getattr(torch, x.dtype.name))

    ta, tb = tensor(a), tensor(b)
    c = tensor(out[:a.shape[0] * b.shape[1]]).view(a.shape[0], b.shape[1])
    on = torch.cuda.ExternalStream(stream.ptr, device=device)

    def launch() -> None:
        with torch.cuda.stream(on):
            torch.matmul(ta, tb, out=c)

    launch()
    return launch
