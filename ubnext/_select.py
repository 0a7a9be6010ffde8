"""Algorithm selection for ``algorithm="auto"``.

The choice is a pure function of (message bytes, dtype, world size, what the node
can run), identical on every rank, so every rank launches the same kernel. The
size thresholds come from a table (per world size: ascending ``[max_bytes, name]``
rows); the shipped defaults are first measurements on 4xH200, and a table for the
machine at hand can be given in ``UBNEXT_TUNE_FILE``.
"""

from __future__ import annotations

import json

from ._algorithms import ALGORITHMS, DTYPES
from ._errors import UbnextError

_OPEN = 1 << 62
#: world size -> ascending (largest message in bytes, algorithm); the last row is open-ended.
#: Measured on 2x and 4xH200 (NVLink, bf16, CUDA graphs; bench/results/compare_h200x*_bf16.json):
#: at 4 ranks NCCL wins from 64 MiB on (1-7 %), so "auto" hands those sizes to NCCL.
#: World sizes without a row (3, 5-8) use the 4-rank row until measured.
DEFAULT_TABLE: dict[int, list[tuple[int, str]]] = {
    2: [(1 << 20, "lamport"), (_OPEN, "twoshot")],
    4: [(512 << 10, "lamport"), (32 << 20, "twoshot"), (_OPEN, "nccl")],
    0: [(256 << 10, "lamport"), (32 << 20, "twoshot"), (_OPEN, "nccl")],
}


def load_table(path: str) -> dict[int, list[tuple[int, str]]]:
    """Reads a ``{"<world size>": [[max_bytes, algorithm], ...]}`` JSON table.

    Raises:
        UbnextError: unreadable file, unknown algorithm, rows not ascending.
    """
    try:
        with open(path) as f:
            raw = json.load(f)
        table = {int(k): [(int(limit), str(name)) for limit, name in rows] for k, rows in raw.items()}
    except (OSError, ValueError, TypeError) as e:
        raise UbnextError(f"selector: cannot read UBNEXT_TUNE_FILE {path}: {e}") from e
    for world, rows in table.items():
        if [r[0] for r in rows] != sorted(r[0] for r in rows) or not rows:
            raise UbnextError(f"selector: {path}: rows of world size {world} must ascend")
        unknown = {name for _, name in rows} - set(ALGORITHMS)
        if unknown:
            raise UbnextError(f"selector: {path}: unknown algorithm(s) {sorted(unknown)}")
    table.setdefault(0, DEFAULT_TABLE[0])
    return table


class Selector:
    """Picks the algorithm for one message.

    Args:
        nranks: ranks of the node.
        lamport_max: largest message the Lamport buffers hold (bytes).
        usable: algorithm names this communicator can run (e.g. only "nccl").
        table: thresholds (``DEFAULT_TABLE`` format); the default when None.
    """

    def __init__(self, nranks: int, lamport_max: int, usable: list[str], table=None):
        table = table or DEFAULT_TABLE
        self._rows = table.get(nranks, table[0])
        self._lamport_max = lamport_max
        self._usable = set(usable)

    def fits(self, name: str, nbytes: int) -> bool:
        """Whether ``name`` can take a message of ``nbytes`` on this communicator."""
        if name not in self._usable:
            return False
        return not ALGORITHMS[name].one_shot or nbytes <= self._lamport_max

    def capped(self) -> list[tuple[str, int]]:
        """``(algorithm, table limit)`` of the usable one-shot rows whose limit exceeds the
        largest one-shot message: sizes in between go to the next row that fits."""
        return [(name, limit) for limit, name in self._rows
                if name in self._usable and ALGORITHMS[name].one_shot and limit > self._lamport_max]

    def select(self, nbytes: int, dtype: str) -> str:
        """The algorithm for a message of ``nbytes`` bytes of ``dtype``."""
        assert dtype in DTYPES
        for limit, name in self._rows:
            if nbytes <= limit and self.fits(name, nbytes):
                return name
        for name in ("twoshot", "nccl"):  # preference order past the table
            if self.fits(name, nbytes):
                return name
        raise AssertionError("selector: no usable algorithm")  # "nccl" is always usable
