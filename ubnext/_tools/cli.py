"""What ubnext's command-line tools share with the benchmarks: byte sizes written
and listed as nccl-tests does (``1K``, ``256M``; ``-b/-e/-f``), and a main that
ends the whole MPI job when one rank fails.

Used by ``python -m ubnext``, ``python -m ubnext.tune`` and ``bench/``. Needs only
the standard library.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable

_SIZE = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Parse a byte count as nccl-tests does: a number and an optional K, M or G (powers of 1024).

    ``"8"`` -> 8, ``"1K"`` -> 1024, ``"256M"`` -> 268435456, ``"1.5k"`` -> 1536.
    A trailing ``B``/``iB`` is accepted too (``"2KiB"``). Fractions of a byte
    are dropped, as nccl-tests' ``(size_t)`` cast does.

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"invalid size {text!r}; expected a number with an optional K, M or G suffix")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def size_arg(text: str) -> int:
    """:func:`parse_size` for ``argparse`` (``type=size_arg``)."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_list(minbytes: int, maxbytes: int, stepbytes: int, stepfactor: int) -> list[int]:
    """The message sizes nccl-tests visits: multiply by ``stepfactor`` when it is > 1, else add ``stepbytes``.

    Raises:
        ValueError: ``minbytes > maxbytes``, or a step that never grows the size.
    """
    if minbytes < 0 or minbytes > maxbytes:
        raise ValueError(f"invalid sizes: minbytes {minbytes} must be in [0, maxbytes {maxbytes}]")
    if stepfactor > 1 and minbytes == 0 and maxbytes > 0:
        raise ValueError("minbytes 0 never grows with a step factor; use -b 1 or larger")
    if stepfactor <= 1 and stepbytes <= 0 and maxbytes > minbytes:
        raise ValueError(f"stepbytes must be > 0 without a step factor, got {stepbytes}")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        if size == maxbytes:
            break
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return sizes


def run_or_abort(main: Callable[[], int]) -> int:
    """Run ``main``; on an exception, print it and abort the whole MPI job so no rank hangs.

    A benchmark rank that fails while the others wait in a collective would
    otherwise hang the job; ``MPI_Abort`` ends every rank.
    """
    try:
        return main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        return abort_mpi_job(1)


def abort_mpi_job(code: int) -> int:
    """Ends every rank of the MPI job with ``code`` (``MPI_Abort``) where this process runs
    MPI with other ranks, which would otherwise wait for it in a collective; else returns
    ``code``. Flushes stdout and stderr first."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(code)
    return code
