"""Selector tables: which algorithm takes a message, by world size, dtype and size.

One JSON format serves the table shipped in the package (``tables/h200.json``,
measured on 2x and 4xH200) and the files ``python -m ubnext.tune`` writes
(``UBNEXT_TUNE_FILE``)::

    {"format": 1,
     "machine": "NVIDIA H200",
     "tables": {"4": {"bfloat16": [[524288, "lamport"], [33554432, "twoshot"], [null, "nccl"]],
                      "float32":  [[524288, "lamport"], [null, "twoshot"]]},
                "*": {"bfloat16": [[262144, "lamport"], [null, "twoshot"]]}}}

``tables`` maps a world size (ranks of the node; ``"*"``: world sizes without
an entry of their own) to ``{dtype: rows}``. Rows ascend by ``max_bytes``; a
message takes the first row it does not exceed whose algorithm the
communicator can run; ``null`` (last row only) means no upper limit. A dtype
without rows uses the rows of another dtype of that world size (same element
size first). Optional keys: ``note`` (text), ``measured`` (what tune
measured, kept for the record) and ``collectives``: rows of the other collectives,
``{"reduce_scatter": {"note": "...", "tables": {...}}, "all_gather": {...}}`` in the
same form as ``tables`` (whose rows are the all-reduce's); a table without rows for a
collective leaves it to the next table (the default one has rows for every collective).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, DTYPES, KERNEL_DTYPES
from ubnext._protocol.errors import UbnextError

FORMAT = 1
#: The ``tables`` key of the world sizes without an entry of their own.
ANY_WORLD = "*"
_REQUIRED = ("format", "machine", "tables")
_OPTIONAL = ("note", "measured", "collectives")

#: ``(max_bytes or None for no limit, algorithm)``
Row = tuple[int | None, str]


@dataclass(frozen=True)
class Table:
    """A validated selector table.

    Attributes:
        source: where it came from, for messages: ``"default table h200"`` or
            ``"tune file /abs/path.json"``.
        machine: the file's ``machine`` text.
        rows: world key (``"4"``, ``"*"``) -> dtype -> ascending rows (of the all-reduce).
        document: the JSON document itself (``python -m ubnext.tune`` merges into it).
        by_collective: collective other than the all-reduce -> its rows, as ``rows``.
    """

    source: str
    machine: str
    rows: dict[str, dict[str, tuple[Row, ...]]]
    document: dict[str, Any] = field(repr=False, compare=False)
    by_collective: dict[str, dict[str, dict[str, tuple[Row, ...]]]] = field(default_factory=dict)

    def lookup(self, nranks: int, dtype: str, collective: str = "all_reduce") -> tuple[tuple[Row, ...], str] | None:
        """The rows for ``nranks`` ranks, ``dtype`` and ``collective``, and a description of
        where they come from.

        Returns:
            ``(rows, "4 ranks bfloat16 (default table h200)")`` (the collective named
            before the source when it is not the all-reduce); the description says when
            the rows are another world size's (``"*"``) or another dtype's. None when the
            table has neither ``nranks`` nor ``"*"`` for the collective.
        """
        tables = self.rows if collective == "all_reduce" else self.by_collective.get(collective, {})
        source = self.source if collective == "all_reduce" else f"{collective}, {self.source}"
        for key in (str(nranks), ANY_WORLD):
            by_dtype = tables.get(key)
            if by_dtype is None:
                continue
            world = f"{nranks} ranks" if key != ANY_WORLD else f"{nranks} ranks (via '*')"
            used = _closest_dtype(dtype, by_dtype)
            what = used if used == dtype else f"{used} (no {dtype} rows)"
            return by_dtype[used], f"{world} {what} ({source})"
        return None

    def digest(self) -> str:
        """A hash of the rows: equal on every rank that read the same table."""
        rows = {"all_reduce": self.rows, **self.by_collective}
        return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def _closest_dtype(dtype: str, by_dtype: dict[str, Any]) -> str:
    """``dtype`` if present, else a present dtype of the same element size, else the first present."""
    if dtype in by_dtype:
        return dtype
    same_width = [d for d in KERNEL_DTYPES if d in by_dtype and DTYPES[d][1] == DTYPES[dtype][1]]
    return (same_width or [d for d in KERNEL_DTYPES if d in by_dtype])[0]


def parse_table(document: Any, source: str) -> Table:
    """Validate a table document (the parsed JSON).

    Raises:
        UbnextError: ``"selector: <source>: <what is wrong, and where>"``.
    """
    def fail(problem: str) -> UbnextError:
        return UbnextError(f"selector: {source}: {problem}")

    if not isinstance(document, dict):
        raise fail(f"expected a JSON object {{\"format\": {FORMAT}, \"machine\": ..., \"tables\": ...}}, "
                   f"got {type(document).__name__}")
    missing = [k for k in _REQUIRED if k not in document]
    if missing:
        raise fail(f"missing key(s) {', '.join(missing)} (a format-{FORMAT} table has "
                   f"{', '.join(_REQUIRED)}; python -m ubnext.tune writes one)")
    unknown = sorted(set(document) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise fail(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(_REQUIRED + _OPTIONAL)}")
    if document["format"] != FORMAT:
        raise fail(f"format {document['format']!r} is not supported; this ubnext reads format {FORMAT}")
    if not isinstance(document["machine"], str):
        raise fail("machine must be a string")
    rows = _parse_tables(document["tables"], "tables", "all_reduce", fail)
    collectives = document.get("collectives", {})
    others = [c for c in COLLECTIVES if c != "all_reduce"]
    if not isinstance(collectives, dict) or any(c not in others for c in collectives):
        raise fail(f"collectives must be an object whose keys are among {', '.join(others)}")
    by_collective = {}
    for name, entry in collectives.items():
        if not isinstance(entry, dict) or "tables" not in entry or set(entry) - {"tables", "note"}:
            raise fail(f"collectives[{name!r}] must be an object {{\"note\": ..., \"tables\": ...}}")
        by_collective[name] = _parse_tables(entry["tables"], f"collectives[{name!r}].tables", name, fail)
    return Table(source, document["machine"], rows, document, by_collective)


def _parse_tables(tables: Any, where: str, collective: str, fail) -> dict[str, dict[str, tuple[Row, ...]]]:
    """``{"<world size>": {"<dtype>": rows}}`` of ``collective`` at ``where`` -> rows."""
    if not isinstance(tables, dict) or not tables:
        raise fail(f"{where} must be a non-empty object {{\"<world size>\": {{\"<dtype>\": rows}}}}")
    rows: dict[str, dict[str, tuple[Row, ...]]] = {}
    for world, by_dtype in tables.items():
        if world != ANY_WORLD and not (world.isdigit() and int(world) > 0):
            raise fail(f"{where} key {world!r} is not a world size (a positive integer, or \"*\")")
        if not isinstance(by_dtype, dict) or not by_dtype:
            raise fail(f"{where}[{world!r}] must be a non-empty object {{\"<dtype>\": rows}}")
        rows[world] = {}
        for dtype, raw_rows in by_dtype.items():
            if dtype not in KERNEL_DTYPES:  # NCCL reduces the others: no rows
                raise fail(f"{where}[{world!r}]: unknown dtype {dtype!r}; use {', '.join(KERNEL_DTYPES)}")
            rows[world][dtype] = _parse_rows(
                raw_rows, lambda p, w=world, d=dtype: fail(f"{where}[{w!r}][{d!r}]: {p}"), collective)
    return rows


def _parse_rows(raw: Any, fail, collective: str = "all_reduce") -> tuple[Row, ...]:
    """``[[max_bytes, name], ...]`` of ``collective`` -> rows; ``fail(problem)`` makes the exception."""
    if not isinstance(raw, list) or not raw:
        raise fail("rows must be a non-empty list of [max_bytes, algorithm]")
    rows: list[Row] = []
    for i, row in enumerate(raw, 1):
        if not (isinstance(row, list) and len(row) == 2):
            raise fail(f"row {i} is {row!r}, not [max_bytes, algorithm]")
        limit, name = row
        if name not in ALGORITHMS:
            raise fail(f"row {i}: unknown algorithm {name!r}; use {', '.join(ALGORITHMS)}")
        if not ALGORITHMS[name].serves(collective):
            raise fail(f"row {i}: {name} has no {collective} kernel; use "
                       f"{', '.join(n for n, a in ALGORITHMS.items() if a.serves(collective))}")
        if limit is None:
            if i != len(raw):
                raise fail(f"row {i}: null (no limit) is allowed on the last row only")
        elif isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise fail(f"row {i}: max_bytes {limit!r} is not a positive integer (or null)")
        elif rows and limit <= rows[-1][0]:
            raise fail(f"row {i}: max_bytes {limit} is not above the previous row's {rows[-1][0]} "
                       "(rows must ascend)")
        rows.append((limit, name))
    return tuple(rows)


def load_table(path: str) -> Table:
    """Read and validate a tune file.

    Raises:
        UbnextError: unreadable file, not JSON, or an invalid table (the
            message names the file and the problem).
    """
    path = os.path.abspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError) as e:
        raise UbnextError(f"selector: cannot read tune file {path}: {e}") from e
    return parse_table(document, f"tune file {path}")


@functools.lru_cache(maxsize=None)
def default_table() -> Table:
    """The table shipped in the package (``ubnext/tables/h200.json``)."""
    text = resources.files("ubnext").joinpath("tables").joinpath("h200.json").read_text(encoding="utf-8")
    return parse_table(json.loads(text), "default table h200")


def agreed_table(path: str, bootstrap) -> Table:
    """:func:`load_table` on every rank of ``bootstrap``, checked to agree. Collective.

    Raises:
        UbnextError: on every rank alike, when some rank cannot load the file
            or ranks read different tables (e.g. a file rewritten meanwhile).
    """
    table, error = None, None
    try:
        table = load_table(path)
    except UbnextError as e:
        error = str(e)
    outcomes = bootstrap.allgather_obj((error, None if table is None else table.digest()))
    for rank, (err, _) in enumerate(outcomes):
        if err:
            raise UbnextError(f"Communicator: UBNEXT_TUNE_FILE (rank {rank}): {err}")
    if len({digest for _, digest in outcomes}) > 1:
        raise UbnextError(f"Communicator: UBNEXT_TUNE_FILE {path}: the ranks read different tables")
    return table


def human_bytes(nbytes: int) -> str:
    """A byte count as people read it: ``2048`` -> ``"2 KiB"``, ``268435456`` -> ``"256 MiB"``
    (the size labels of tables, reports and plots)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
