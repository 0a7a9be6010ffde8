"""Selector tables: which algorithm takes a message, by machine, world size, dtype and size.

One JSON format (format 2) serves the table shipped in the package
(``ubnext/tables/default.json``) and the files ``python -m ubnext.tune`` writes
(``UBNEXT_TUNE_FILE``). A document is a list of entries, each measured on one kind
of machine::

    {"format": 2,
     "note": "...",
     "entries": [
      {"gpu": "NVIDIA H200", "link": "nvlink", "placement": "plain", "mode": "graph",
       "note": "...",
       "tables": {"4": {"bfloat16": [[524288, "lamport"], [33554432, "lamport_twoshot"], [null, "nccl"]]},
                  "*": {"bfloat16": [[262144, "lamport"], [33554432, "twoshot"], [null, "nccl"]]}},
       "collectives": {"reduce_scatter": {"note": "...", "tables": {...}}, "all_gather": {...}},
       "measured": {...}}]}

**The machine key** of an entry (all four required; ``"*"`` in any of them: any value):

- ``gpu``: the CUDA device name as ``cupy.cuda.runtime.getDeviceProperties(d)["name"]``
  gives it (``"NVIDIA H200"``, ``"NVIDIA H100 80GB HBM3"``).
- ``link``: how the GPUs reach each other, ``"nvlink"`` or ``"pcie"``. ubnext has no
  reliable source for it today (peer access says whether a GPU can map another's memory,
  not over what; ``devices.py`` matches GPUs by UUID only), and it runs on NVLink nodes,
  so a communicator asks for ``"nvlink"`` (:data:`DEFAULT_LINK`); a tune file measured
  on a PCIe node says ``"pcie"`` by hand until ubnext detects the link.
- ``placement``: the arrays of the calls measured: ``"plain"`` (the caller's arrays,
  through the staging copy) or ``"pool"`` (buffers from ``comm.empty()``, in place).
  The selector does not know the placement of a call when it chooses (the choice is made
  once per communicator), so a communicator takes the ``"plain"`` entries; choosing per
  call (pool buffers skip the staging copy, which moves the crossovers) is a follow-up.
- ``mode``: how the calls were issued: ``"graph"`` (back to back in a CUDA graph, what
  ``python -m ubnext.tune`` measures by default), ``"dependent"`` (a kernel between calls:
  ``python -m ubnext.tune --mode dependent`` puts a GEMM that writes each call's input
  before it) or ``"eager"``. A communicator asks for the mode ``UBNEXT_TABLE_MODE`` names
  (``Config.table_mode``: ``"graph"``, the default, or ``"dependent"``); where a table has
  no entry of that mode for the machine, the choice below falls back to one of another
  mode (the shipped table has a ``"dependent"`` entry for H100 only).

There is no GPU-count key: the world sizes that key ``tables`` (the ranks of the node
that took part in the measurement) are the GPU counts the rows were measured at, and
one entry holds every count measured on that machine (``"*"``: the others). A GPU
count beside them could only say how many GPUs the node had besides those that took
part, which the rows do not depend on where every GPU has its own links (NVSwitch); a
node whose GPUs are wired differently (PCIe pairs) differs by ``link``.

**The rows** (``tables``, and ``collectives``, as in format 1): ``tables`` maps a world
size (``"*"``: world sizes without an entry of their own) to ``{dtype: rows}``. Rows
ascend by ``max_bytes``; a message takes the first row it does not exceed whose
algorithm the communicator can run; ``null`` (last row only) means no upper limit. A
dtype without rows uses the rows of another dtype of that world size (same element
size first). ``collectives`` holds the rows of the other collectives,
``{"reduce_scatter": {"note": "...", "tables": {...}}, "all_gather": {...}}`` in the
same form as ``tables`` (whose rows are the all-reduce's); a table without rows for a
collective leaves it to the next table (the default one has rows for every
collective). Optional keys of an entry: ``note`` (text), ``measured`` (what tune
measured, kept for the record), ``collectives``; of the document: ``note``. Two entries
may not have the same key.

**Choosing the entry** (:meth:`TableFile.choose`, once per communicator, for the GPU
name of the node's local rank 0, so every rank chooses alike): among the entries whose
``link`` is the machine's or ``"*"`` (all entries where none is), the same ``gpu``; then
the same family (the letters of the model number: ``H`` for H100/H200/H800, ``A`` for
A100, ``B`` for B200); then ``gpu: "*"``; then any other measured GPU (the nearest
measured being the first such entry of the file). Among those: the same ``link`` before
``"*"``, then the same ``placement`` (then ``"*"``), then the same ``mode`` (then
``"*"``); ties go to the entry listed first. The choice and why are shown by ``describe()`` and
``python -m ubnext info``: ``"default table: NVIDIA H200 nvlink plain graph (no entry for
NVIDIA H800: NVIDIA H200, nearest measured of the same family (H); its quantized thresholds
not taken (...))"``; asked for the dependent mode, ``"default table: NVIDIA H200 nvlink
plain graph (no dependent mode entry for NVIDIA H200 nvlink plain: graph's; ...)"``. The
GPU comes before the mode: an entry for this GPU in another mode is taken before an entry
of this mode for another GPU. Every rank reads the same document (:func:`agreed_table`
checks the digests) and chooses for the same machine key, so every rank takes the same entry.

**Format 1** (``{"format": 1, "machine": "<text>", "tables": ..., "collectives": ...,
"note": ..., "measured": ...}``, written by earlier ``python -m ubnext.tune``) still loads:
as one entry whose key is ``"*"`` throughout (it applies to any machine), its
``machine`` text kept in the entry's note. ``python -m ubnext.tune`` merging into such
a file writes it back as format 2, the old rows kept as that ``"*"`` entry; the entry it
adds for the machine it ran on starts from those rows (a communicator takes one entry of
a file, so what the run did not measure keeps serving that machine).

**Quantized thresholds** (optional key ``quantized`` of an entry): the size from which
``precision="auto"`` runs each quantized format on a communicator that opted in to it
(``UBNEXT_QUANTIZED``), as ``python -m ubnext.tune`` measured it on that machine::

    "quantized": {"note": "...",
                  "tables": {"2": {"bfloat16": {"int8": 67108864, "fp8": 67108864, "int4": "never"}}},
                  "collectives": {"reduce_scatter": {"tables": {"2": {"bfloat16": {"int8": 33554432}}}}}}

``tables`` (the all-reduce's) maps a world size (``"*"``: the others) to ``{dtype:
{format: threshold}}`` (dtypes the quantized two-shot takes, ``_quant.DTYPES``; formats of
``_quant.FORMATS``): a threshold is the smallest message, in bytes, from which the format
is used, or ``"never"`` where it was measured not to pay at any size. ``collectives``
(optional) holds the reduce-scatter's thresholds, ``{"reduce_scatter": {"note": ...,
"tables": ...}}`` in the same form, its sizes those of the whole input (size x k
elements, as ``select`` takes them); the all-gather has none (it stays exact). Either
``tables`` or ``collectives`` may be left out, not both. A threshold is found as the rows
are: the chosen entry of the first table that has it for the collective and world size
(its own, then ``"*"``), a dtype without thresholds taking another's of the same element
size. **Thresholds serve only the machine they were measured on**: an entry chosen for
another machine (another GPU of its family, the first entry, another link, placement or
mode: the fallbacks above) lends its rows, never its thresholds; a ``"*"`` in an entry's
key (written by hand: ``python -m ubnext.tune`` writes the machine it ran on) says any.
**What is not there was not measured, and auto then keeps full precision**: an entry
without the key (files written before it existed; the shipped table's H100 dependent
entry), a world size without thresholds in any table, a format missing from a dtype's, a
collective without thresholds. Full
precision, not a guessed size, because the quantized path is lossy and measurements
(docs/quantized.md) show it slower than full precision at some sizes on some machines:
quantizing where nobody measured that it pays could cost both accuracy and time.
``describe()`` says which applies. At one rank nothing crosses a link and auto never
quantizes, whatever a table says.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, DTYPES, KERNEL_DTYPES
from ubnext._protocol.errors import UbnextError

FORMAT = 2
#: The format of earlier tune files, still read (as one entry for any machine).
FORMAT_1 = 1
#: The ``tables`` key of the world sizes without an entry of their own; as a machine
#: key's value: any.
ANY_WORLD = ANY = "*"
#: The shipped table, in ``ubnext/tables/``.
DEFAULT_FILE = "default.json"
#: The machine key of an entry and the values each may take (besides ``"*"``).
KEYS = {"gpu": None, "link": ("nvlink", "pcie"), "placement": ("plain", "pool"),
        "mode": ("graph", "dependent", "eager")}
#: The link a communicator asks for: ubnext cannot tell the link yet (module docstring).
DEFAULT_LINK = "nvlink"
_REQUIRED = ("format", "entries")
_OPTIONAL = ("note",)
_ENTRY_REQUIRED = (*KEYS, "tables")
_ENTRY_OPTIONAL = ("note", "measured", "collectives", "quantized")
_V1_REQUIRED = ("format", "machine", "tables")
_V1_OPTIONAL = ("note", "measured", "collectives")

#: A quantized threshold that says the format never pays (``quantized`` of an entry).
NEVER = "never"

#: ``(max_bytes or None for no limit, algorithm)``
Row = tuple[int | None, str]
#: quantized format -> the smallest message it takes, or None: never (``quantized`` of an entry)
Thresholds = dict[str, int | None]


@dataclass(frozen=True)
class Machine:
    """What a communicator chooses a table entry for.

    Attributes:
        gpu: the CUDA device name (``"NVIDIA H200"``), or None where it is not known.
        link, placement, mode: as the entries' keys (module docstring).
    """

    gpu: str | None = None
    link: str = DEFAULT_LINK
    placement: str = "plain"
    mode: str = "graph"

    def label(self) -> str:
        return " ".join([self.gpu or "unknown GPU", self.link, self.placement, self.mode])


def family(gpu: str | None) -> str | None:
    """The letters of a GPU name's model number: ``"NVIDIA H100 80GB HBM3"`` -> ``"H"``,
    ``"NVIDIA GB200"`` -> ``"GB"``; None where the name has no such model number. Pure."""
    found = re.search(r"\b([A-Z]{1,3})\d{2,4}[A-Z]*\b", gpu or "")
    return found.group(1) if found else None


@dataclass(frozen=True)
class Table:
    """One validated entry of a selector table document: one machine's rows.

    Attributes:
        source: where the document came from: ``"default table"`` or ``"tune file /abs/path.json"``.
        gpu, link, placement, mode: the entry's machine key (``"*"``: any).
        rows: world key (``"4"``, ``"*"``) -> dtype -> ascending rows (of the all-reduce).
        entry: the entry's JSON object.
        by_collective: collective other than the all-reduce -> its rows, as ``rows``.
        quantized: world key -> dtype -> the quantized thresholds of the all-reduce (the
            entry's ``quantized.tables``; empty where it has none, and where
            :meth:`TableFile.choose` took the entry for another machine: not measured).
        quantized_by_collective: collective other than the all-reduce (the reduce-scatter)
            -> its quantized thresholds, as ``quantized`` (``quantized.collectives``).
        why: why :meth:`TableFile.choose` chose it (``"exact match"``, or the fallback); "" before.
    """

    source: str
    gpu: str
    link: str
    placement: str
    mode: str
    rows: dict[str, dict[str, tuple[Row, ...]]]
    entry: dict[str, Any] = field(repr=False, compare=False)
    by_collective: dict[str, dict[str, dict[str, tuple[Row, ...]]]] = field(default_factory=dict)
    quantized: dict[str, dict[str, Thresholds]] = field(default_factory=dict)
    quantized_by_collective: dict[str, dict[str, dict[str, Thresholds]]] = field(default_factory=dict)
    why: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.gpu, self.link, self.placement, self.mode

    @property
    def label(self) -> str:
        """``"NVIDIA H200 nvlink plain graph"`` (``"*"`` shown as ``*``, a GPU ``"*"`` as ``any GPU``;
        ``"any machine"`` where every key is ``"*"``)."""
        if self.key == (ANY,) * 4:
            return "any machine"
        return " ".join(["any GPU" if self.gpu == ANY else self.gpu, self.link, self.placement, self.mode])

    @property
    def where(self) -> str:
        """``"default table: NVIDIA H200 nvlink plain graph"``: the source and the entry."""
        return f"{self.source}: {self.label}"

    @property
    def note(self) -> str:
        return self.entry.get("note", "")

    def lookup(self, nranks: int, dtype: str, collective: str = "all_reduce") -> tuple[tuple[Row, ...], str] | None:
        """The rows for ``nranks`` ranks, ``dtype`` and ``collective``, and a description of
        where they come from.

        Returns:
            ``(rows, "4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph)")`` (the
            collective named before the source when it is not the all-reduce); the
            description says when the rows are another world size's (``"*"``) or another
            dtype's. None when the entry has neither ``nranks`` nor ``"*"`` for the collective.
        """
        tables = self.rows if collective == "all_reduce" else self.by_collective.get(collective, {})
        source = self.where if collective == "all_reduce" else f"{collective}, {self.where}"
        return _find(tables, nranks, dtype, source)

    def quantized_lookup(self, nranks: int, dtype: str,
                         collective: str = "all_reduce") -> tuple[Thresholds, str] | None:
        """The quantized thresholds of ``collective`` (one of ``_quant.COLLECTIVES``) for
        ``nranks`` ranks and ``dtype`` (one of ``_quant.DTYPES``) and where they come from,
        as :meth:`lookup` gives rows (``"2 ranks bfloat16 (quantized, default table: ...)"``,
        ``"... (quantized reduce_scatter, ...)"``); None where the entry has none for
        ``nranks``."""
        if collective == "all_reduce":
            return _find(self.quantized, nranks, dtype, f"quantized, {self.where}")
        return _find(self.quantized_by_collective.get(collective, {}), nranks, dtype,
                     f"quantized {collective}, {self.where}")

    def digest(self) -> str:
        """A hash of the key and the rows: equal on every rank that chose the same entry."""
        rows = {"key": self.key, "all_reduce": self.rows, **self.by_collective, "quantized": self.quantized,
                **{f"quantized {c}": t for c, t in self.quantized_by_collective.items()}}
        return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class TableFile:
    """A validated selector table document: its entries, one per machine key.

    Attributes:
        source: ``"default table"`` or ``"tune file /abs/path.json"``.
        entries: the entries, in the document's order.
        document: the document in format 2 (a format-1 document converted: one ``"*"`` entry);
            ``python -m ubnext.tune`` merges into it.
        format: the format the document was written in (1 or 2).
    """

    source: str
    entries: tuple[Table, ...]
    document: dict[str, Any] = field(repr=False, compare=False)
    format: int = FORMAT

    def entry(self, key: tuple[str, str, str, str]) -> Table | None:
        """The entry whose machine key is ``key`` (``(gpu, link, placement, mode)``), or None."""
        return next((t for t in self.entries if t.key == tuple(key)), None)

    def choose(self, machine: Machine) -> Table:
        """The entry for ``machine`` (the rule in the module docstring), with ``why`` set. Pure."""
        fam = family(machine.gpu)

        def gpu_rank(t: Table) -> int:
            if machine.gpu is not None and t.gpu == machine.gpu:
                return 0
            if t.gpu != ANY and fam is not None and family(t.gpu) == fam:
                return 1
            return 2 if t.gpu == ANY else 3

        def rank(value: str, wanted: str) -> int:
            return 0 if value == wanted else 1 if value == ANY else 2

        # another link only where no entry has this one or "*"; then the GPU, the link's "*",
        # placement, mode, the file's order
        ranked = [((rank(t.link, machine.link) == 2, gpu_rank(t), rank(t.link, machine.link),
                    rank(t.placement, machine.placement), rank(t.mode, machine.mode)), i, t)
                  for i, t in enumerate(self.entries)]
        (_, gpu, link, placement, mode), _, chosen = min(ranked, key=lambda r: (r[0], r[1]))
        reasons = []
        # thresholds only for the machine measured (or an entry's "*", which says any)
        measured = gpu in (0, 2) and max(link, placement, mode) < 2
        if not measured and (chosen.quantized or chosen.quantized_by_collective):
            chosen = replace(chosen, quantized={}, quantized_by_collective={})
            unmeasured = f"; its quantized thresholds not taken (measured on {chosen.label} only)"
        else:
            unmeasured = ""
        if link == 2:
            reasons.append(f"no {machine.link} entry: {chosen.link}'s")
        if gpu and self.format == FORMAT_1:
            reasons.append("format-1 file: one entry for any machine")
        elif gpu:
            lacking = f"no entry for {machine.gpu}" if machine.gpu else "GPU not known"
            reasons.append(f"{lacking}: " + {
                1: f"{chosen.gpu}, nearest measured of the same family ({fam})",
                2: "the entry for any GPU",
                3: f"{chosen.gpu}, nearest measured (first such entry)"}[gpu])
        # a placement or mode not there: no entry of the chosen one's key before it has it (that
        # entry would have been chosen), which the reason names
        before = ["any GPU" if chosen.gpu == ANY else chosen.gpu, chosen.link, chosen.placement]
        for n, (what, got, value) in enumerate((("placement", placement, machine.placement),
                                                ("mode", mode, machine.mode)), 2):
            if got == 2:
                reasons.append(f"no {value} {what} entry for {' '.join(before[:n])}: {getattr(chosen, what)}'s")
        return replace(chosen, why=("; ".join(reasons) or "exact match") + unmeasured)

    def digest(self) -> str:
        """A hash of every entry's key and rows: equal on every rank that read the same table."""
        return hashlib.sha256(json.dumps([t.digest() for t in self.entries]).encode()).hexdigest()


def _find(tables: dict[str, dict[str, Any]], nranks: int, dtype: str, source: str) -> tuple[Any, str] | None:
    """``tables[world][dtype]`` for ``nranks`` (its own key, then ``"*"``) and the closest dtype
    present, and a description of where it comes from; None where neither world key is there."""
    for key in (str(nranks), ANY_WORLD):
        by_dtype = tables.get(key)
        if by_dtype is None:
            continue
        world = f"{nranks} ranks" if key != ANY_WORLD else f"{nranks} ranks (via '*')"
        used = _closest_dtype(dtype, by_dtype)
        what = used if used == dtype else f"{used} (no {dtype} rows)"
        return by_dtype[used], f"{world} {what} ({source})"
    return None


def _closest_dtype(dtype: str, by_dtype: dict[str, Any]) -> str:
    """``dtype`` if present, else a present dtype of the same element size, else the first present."""
    if dtype in by_dtype:
        return dtype
    same_width = [d for d in KERNEL_DTYPES if d in by_dtype and DTYPES[d][1] == DTYPES[dtype][1]]
    return (same_width or [d for d in KERNEL_DTYPES if d in by_dtype])[0]


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
    others = [c for c in COLLECTIVES if c != "all_reduce"]
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


def agreed_machine(local, gpu: str | None | Callable[[], str], mode: str = Machine.mode) -> tuple[Machine, str]:
    """The machine key every rank of ``local`` (a node's bootstrap) chooses its entries for:
    the GPU name of local rank 0, so that ranks of a node with mixed GPUs still choose
    alike. Collective (one allgather).

    Args:
        local: the node's bootstrap.
        gpu: this rank's GPU name, or a function that reads it. A read that fails counts
            as a GPU not known (None) and this rank still joins the allgather, so no rank
            is left waiting in it (as ``nvls_gate.decide`` treats an attribute it cannot read).
        mode: the mode asked for (``Config.table_mode``, which the ranks agree on).

    Returns:
        ``(machine, note)``: ``note`` names the GPUs when the ranks' differ, else "".
    """
    if callable(gpu):
        try:
            gpu = gpu()
        except Exception:  # a device it cannot describe: the fallback entry, alike on every rank
            gpu = None
    names = local.allgather_obj(gpu)
    note = ""
    if len(set(names)) > 1:
        shown = [name or "a GPU whose name could not be read" for name in names]
        note = (f"the local ranks have different GPUs ({', '.join(dict.fromkeys(shown))}); every rank "
                f"chooses the selector table entry of local rank 0's, {shown[0]}")
    return Machine(gpu=names[0], mode=mode), note


def human_bytes(nbytes: int) -> str:
    """A byte count as people read it: ``2048`` -> ``"2 KiB"``, ``268435456`` -> ``"256 MiB"``
    (the size labels of tables, reports and plots)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
