"""Reading selector tables: the JSON format (``ubnext._selection.table``'s docstring) parsed
and validated into a ``TableFile`` (:func:`parse_table`; a format-1 document upgraded:
:func:`upgrade`), and the documents it comes in: a tune file (:func:`load_table`), agreed
on by every rank (:func:`agreed_table`), and the table shipped in the package
(:func:`default_table`)."""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterator
from importlib import resources
from typing import Any

from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, KERNEL_DTYPES, MOVER_SERVES, MOVER_TABLES
from ubnext._protocol.errors import UbnextError
from ubnext._selection.table import ANY, ANY_WORLD, FORMAT, FORMAT_1, Row, Table, TableFile, Thresholds

#: The shipped table, in ``ubnext/tables/``.
DEFAULT_FILE = "default.json"
#: The machine key of an entry and the values each may take (besides ``"*"``).
KEYS = {"gpu": None, "link": ("nvlink", "pcie"), "placement": ("plain", "pool"),
        "mode": ("graph", "dependent", "eager")}
_REQUIRED = ("format", "entries")
_OPTIONAL = ("note",)
_ENTRY_REQUIRED = (*KEYS, "tables")
_ENTRY_OPTIONAL = ("note", "measured", "collectives", "quantized")
_V1_REQUIRED = ("format", "machine", "tables")
_V1_OPTIONAL = ("note", "measured", "collectives")

#: A quantized threshold that says the format never pays (``quantized`` of an entry).
NEVER = "never"


def upgrade(document: dict[str, Any]) -> dict[str, Any]:
    """A format-1 document (checked by :func:`parse_table`) as format 2: one entry whose
    machine key is ``"*"`` throughout, its ``machine`` text kept in the entry's note. Pure."""
    entry = {k: ANY for k in KEYS}
    note = f"format-1 table (machine: {document['machine']}), read as one entry for any machine"
    entry["note"] = f"{note}. {document['note']}" if document.get("note") else note
    entry["tables"] = copy.deepcopy(document["tables"])
    for key in ("collectives", "measured"):
        if key in document:
            entry[key] = copy.deepcopy(document[key])
    return {"format": FORMAT, "entries": [entry]}


def parse_table(document: Any, source: str) -> TableFile:
    """Validate a table document (the parsed JSON), format 2 or format 1.

    Raises:
        UbnextError: ``"selector: <source>: <what is wrong, and where>"``; in an entry,
            where names it: ``"entries[0] (NVIDIA H200 nvlink plain graph): tables['4']: ..."``.
    """
    def fail(problem: str) -> UbnextError:
        return UbnextError(f"selector: {source}: {problem}")

    if not isinstance(document, dict):
        raise fail(f"expected a JSON object {{\"format\": {FORMAT}, \"entries\": [...]}}, "
                   f"got {type(document).__name__}")
    if "format" in document and document["format"] not in (FORMAT, FORMAT_1):
        raise fail(f"format {document['format']!r} is not supported; this ubnext reads formats "
                   f"{FORMAT} and {FORMAT_1}")
    if document.get("format") == FORMAT_1:
        _check_keys(document, _V1_REQUIRED, _V1_OPTIONAL, f"a format-{FORMAT_1} table", fail)
        if not isinstance(document["machine"], str):
            raise fail("machine must be a string")
        converted = upgrade(document)
        return TableFile(source, (_parse_entry(converted["entries"][0], source, fail),), converted, FORMAT_1)
    _check_keys(document, _REQUIRED, _OPTIONAL, f"a format-{FORMAT} table", fail)
    if not isinstance(document.get("note", ""), str):
        raise fail("note must be a string")
    raw = document["entries"]
    if not isinstance(raw, list) or not raw:
        raise fail("entries must be a non-empty list of objects {\"gpu\": ..., \"link\": ..., "
                   "\"placement\": ..., \"mode\": ..., \"tables\": ...}")
    entries: list[Table] = []
    for i, entry in enumerate(raw):
        name = f"entries[{i}]"
        if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in KEYS):
            name += f" ({' '.join(entry[k] for k in KEYS)})"
        table = _parse_entry(entry, source, lambda p, n=name: fail(f"{n}: {p}"))
        twin = next((j for j, t in enumerate(entries) if t.key == table.key), None)
        if twin is not None:
            raise fail(f"{name}: the same machine key as entries[{twin}]; merge their rows into one entry")
        entries.append(table)
    return TableFile(source, tuple(entries), document, FORMAT)


def _check_keys(obj: dict, required: tuple, optional: tuple, what: str, fail) -> None:
    missing = [k for k in required if k not in obj]
    if missing:
        raise fail(f"missing key(s) {', '.join(missing)} ({what} has {', '.join(required)}"
                   f"{'; python -m ubnext.tune writes one' if 'format' in required else ''})")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise fail(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(required + optional)}")


def _parse_entry(entry: Any, source: str, fail) -> Table:
    """One entry of a format-2 document -> its Table; ``fail(problem)`` names the entry."""
    if not isinstance(entry, dict):
        raise fail(f"must be an object with {', '.join(_ENTRY_REQUIRED)}, got {type(entry).__name__}")
    _check_keys(entry, _ENTRY_REQUIRED, _ENTRY_OPTIONAL, "an entry", fail)
    for key, allowed in KEYS.items():
        value = entry[key]
        if not isinstance(value, str) or not value.strip():
            raise fail(f"{key} must be a non-empty string")
        if allowed is not None and value not in (*allowed, ANY):
            raise fail(f"{key} {value!r} is not one of {', '.join(allowed)} (or \"*\")")
    if not isinstance(entry.get("note", ""), str):
        raise fail("note must be a string")
    rows = _parse_tables(entry["tables"], "tables", "all_reduce", fail)
    collectives = entry.get("collectives", {})
    others = [c for c in COLLECTIVES if c != "all_reduce"] + list(MOVER_TABLES)
    if not isinstance(collectives, dict) or any(c not in others for c in collectives):
        raise fail(f"collectives must be an object whose keys are among {', '.join(others)}")
    by_collective = {}
    for name, rows_of in collectives.items():
        if not isinstance(rows_of, dict) or "tables" not in rows_of or set(rows_of) - {"tables", "note"}:
            raise fail(f"collectives[{name!r}] must be an object {{\"note\": ..., \"tables\": ...}}")
        by_collective[name] = _parse_tables(rows_of["tables"], f"collectives[{name!r}].tables", name, fail)
    thresholds, by_collective_q = _parse_quantized(entry.get("quantized"), fail)
    return Table(source, entry["gpu"], entry["link"], entry["placement"], entry["mode"], rows, entry,
                 by_collective, thresholds, by_collective_q)


def _parse_quantized(quantized: Any, fail) -> tuple[dict[str, dict[str, Thresholds]],
                                                    dict[str, dict[str, dict[str, Thresholds]]]]:
    """An entry's ``quantized`` (or None) -> the all-reduce's thresholds and those of the
    other collectives (``collectives``), each world key -> dtype -> thresholds."""
    if quantized is None:
        return {}, {}
    if (not isinstance(quantized, dict) or not {"tables", "collectives"} & set(quantized)
            or set(quantized) - {"tables", "collectives", "note"}):
        raise fail("quantized must be an object {\"note\": ..., \"tables\": {\"<world size>\": "
                   "{\"<dtype>\": {\"<format>\": bytes or \"never\"}}}, \"collectives\": {\"reduce_scatter\": "
                   "{\"tables\": ...}}} (tables or collectives, or both)")
    thresholds = _parse_thresholds(quantized["tables"], "quantized.tables", fail) if "tables" in quantized else {}
    if "collectives" not in quantized:
        return thresholds, {}
    others = [c for c in _quant.COLLECTIVES if c != "all_reduce"]
    collectives = quantized["collectives"]
    if not isinstance(collectives, dict) or not collectives or any(c not in others for c in collectives):
        raise fail(f"quantized.collectives must be a non-empty object whose keys are among {', '.join(others)} "
                   "(the all-gather stays exact)")
    by_collective = {}
    for name, of in collectives.items():
        if not isinstance(of, dict) or "tables" not in of or set(of) - {"tables", "note"}:
            raise fail(f"quantized.collectives[{name!r}] must be an object {{\"note\": ..., \"tables\": ...}}")
        by_collective[name] = _parse_thresholds(of["tables"], f"quantized.collectives[{name!r}].tables", fail)
    return thresholds, by_collective


def _by_world(tables: Any, where: str, inner: str, fail) -> Iterator[tuple[str, dict]]:
    """The ``(world key, {dtype: ...})`` pairs of ``{"<world size>": {"<dtype>": <inner>}}``
    at ``where``, checked: a non-empty object, each key a world size or ``"*"``, each value a
    non-empty object."""
    if not isinstance(tables, dict) or not tables:
        raise fail(f"{where} must be a non-empty object {{\"<world size>\": {{\"<dtype>\": {inner}}}}}")
    for world, by_dtype in tables.items():
        if world != ANY_WORLD and not (world.isdigit() and int(world) > 0):
            raise fail(f"{where} key {world!r} is not a world size (a positive integer, or \"*\")")
        if not isinstance(by_dtype, dict) or not by_dtype:
            raise fail(f"{where}[{world!r}] must be a non-empty object {{\"<dtype>\": {inner}}}")
        yield world, by_dtype


def _parse_thresholds(tables: Any, where: str, fail) -> dict[str, dict[str, Thresholds]]:
    """Quantized thresholds at ``where`` of an entry (``quantized.tables``, or a collective's)
    -> world key -> dtype -> format -> bytes or None (never)."""
    parsed: dict[str, dict[str, Thresholds]] = {}
    for world, by_dtype in _by_world(tables, where, "thresholds", fail):
        parsed[world] = {}
        for dtype, by_format in by_dtype.items():
            at = f"{where}[{world!r}][{dtype!r}]"
            if dtype not in _quant.DTYPES:
                raise fail(f"{where}[{world!r}]: dtype {dtype!r} is not quantized; use {', '.join(_quant.DTYPES)}")
            if not isinstance(by_format, dict) or not by_format:
                raise fail(f"{at} must be a non-empty object {{\"<format>\": bytes or \"never\"}}")
            parsed[world][dtype] = {}
            for fmt, threshold in by_format.items():
                if fmt not in _quant.FORMATS:
                    raise fail(f"{at}: unknown format {fmt!r}; use {', '.join(_quant.FORMATS)}")
                if threshold != NEVER and (isinstance(threshold, bool) or not isinstance(threshold, int)
                                           or threshold <= 0):
                    raise fail(f"{at}[{fmt!r}]: {threshold!r} is not a positive byte count or \"never\"")
                parsed[world][dtype][fmt] = None if threshold == NEVER else threshold
    return parsed


def _parse_tables(tables: Any, where: str, collective: str, fail) -> dict[str, dict[str, tuple[Row, ...]]]:
    """``{"<world size>": {"<dtype>": rows}}`` of ``collective`` at ``where`` -> rows."""
    rows: dict[str, dict[str, tuple[Row, ...]]] = {}
    for world, by_dtype in _by_world(tables, where, "rows", fail):
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
        if collective in MOVER_SERVES:  # a data mover: the algorithms of MOVERS it takes
            if name not in MOVER_SERVES[collective]:
                raise fail(f"row {i}: {name!r} is not an algorithm of {collective}; use "
                           f"{', '.join(MOVER_SERVES[collective])}")
        elif name not in ALGORITHMS:
            raise fail(f"row {i}: unknown algorithm {name!r}; use {', '.join(ALGORITHMS)}")
        elif not ALGORITHMS[name].serves(collective):
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


def load_table(path: str) -> TableFile:
    """Read and validate a tune file (format 2, or format 1 as one entry for any machine).

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
def default_table() -> TableFile:
    """The table shipped in the package (``ubnext/tables/default.json``)."""
    text = resources.files("ubnext").joinpath("tables").joinpath(DEFAULT_FILE).read_text(encoding="utf-8")
    return parse_table(json.loads(text), "default table")


def agreed_table(path: str, bootstrap) -> TableFile:
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
