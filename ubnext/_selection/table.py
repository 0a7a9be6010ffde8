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
collective). ``collectives`` may also hold the data movers' rows (``"broadcast"``,
``"all_to_all"``, ``"send_recv"``: ``MOVER_TABLES``), in the same form, a size being
the bytes moved (an all-to-all's whole input of one rank) and each algorithm one of
the mover's (``MOVER_SERVES``); a mover without rows in any table keeps ``auto``'s rule
of today (NCCL where it runs, the copy form where it cannot: ``pool_copy``), and the
default table has none until they are measured. Like the quantized thresholds below,
**the movers' rows serve only the machine they were measured on**: an entry chosen for
another machine lends its other rows, never those (``auto`` keeps its rule there). Optional keys of an entry: ``note`` (text), ``measured`` (what tune
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
of this mode for another GPU. Every rank reads the same document (``table_format.agreed_table``
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

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ubnext._protocol.algorithms import DTYPES, KERNEL_DTYPES, MOVER_TABLES

FORMAT = 2
#: The format of earlier tune files, still read (as one entry for any machine).
FORMAT_1 = 1
#: The ``tables`` key of the world sizes without an entry of their own; as a machine
#: key's value: any.
ANY_WORLD = ANY = "*"
#: The link a communicator asks for: ubnext cannot tell the link yet (module docstring).
DEFAULT_LINK = "nvlink"

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
        # thresholds and the movers' rows only for the machine measured (or an entry's "*", which says any)
        measured = gpu in (0, 2) and max(link, placement, mode) < 2
        dropped = []
        if not measured and (chosen.quantized or chosen.quantized_by_collective):
            chosen = replace(chosen, quantized={}, quantized_by_collective={})
            dropped.append("quantized thresholds")
        if not measured and set(chosen.by_collective) & set(MOVER_TABLES):
            chosen = replace(chosen, by_collective={c: rows for c, rows in chosen.by_collective.items()
                                                    if c not in MOVER_TABLES})
            dropped.append("data movers' rows")
        unmeasured = f"; its {' and '.join(dropped)} not taken (measured on {chosen.label} only)" if dropped else ""
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
