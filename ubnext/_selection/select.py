"""Algorithm selection for ``algorithm="auto"``.

The choice is a pure function of (collective, message bytes, dtype, world size, what
the communicator can run), identical on every rank, so every rank launches the same
kernel. The size thresholds come from a selector table (``_table``): a tune
file (``UBNEXT_TUNE_FILE``, written by ``python -m ubnext.tune``) first, for the
world sizes it covers, then the table shipped in the package; of each, the entry
for this machine (``TableFile.choose``: the GPU of local rank 0, the ``"nvlink"``
link, ``"plain"`` arrays, the mode of ``UBNEXT_TABLE_MODE``: ``"graph"`` unless it says
``"dependent"``). The selector does not know whether a
call's arrays are pool buffers: the ``"plain"`` entries serve every call (choosing
the ``"pool"`` entries for pool buffers is a follow-up). The size from which
``precision="auto"`` quantizes on an opted-in communicator comes from the same entries
(their ``quantized`` thresholds, the all-reduce's and the reduce-scatter's:
:meth:`Selector.quantized`), and so do the data movers' rows (:meth:`Selector.mover`: by
the bytes a broadcast, all-to-all or send/recv moves; None where no table has them, and
the mover keeps its rule: ``pool_copy.PoolCopy._auto``).
"""

from __future__ import annotations

import dataclasses

from ubnext._environment.config import Config
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import (ALGORITHMS, COLLECTIVES, DTYPES, FLOAT_DTYPES, KERNEL_DTYPES, MOVER_TABLES,
                                         UNICAST_OF)
from ubnext._selection.table import Machine, Row, TableFile, Thresholds, human_bytes
from ubnext._selection.table_format import default_table

#: unicast algorithm -> the multicast kernel that replaces it: its own multicast
#: instantiation, and NVLS two-shot for the Lamport two-shot (the seed's order puts
#: multicast kernels first; tables are measured where multicast is off)
MULTICAST_OF = {**{unicast: mc for mc, unicast in UNICAST_OF.items()}, "lamport_twoshot": "nvls"}
#: Rows after a table's own, for messages that none of its rows takes (past its last
#: limit, or larger than the buffers of its kernels): the barrier two-shot up to 8 MiB,
#: NCCL above, where the barrier two-shot's staging copy leaves it behind NCCL
#: (bench/results/tune_h200x{2,4}.txt).
_PAST_TABLE: tuple[Row, ...] = ((8 << 20, "twoshot"), (None, "nccl"))
#: The kernel that a fused call past its buffers runs in launches of whole rows, where
#: the table would hand the message to NCCL because it is larger than those buffers. It
#: moves 2(n-1)/n of the data per rank like NCCL, so launches of its largest message cost
#: per byte about what NCCL does, and the fused kernel saves NCCL's separate add + RMSNorm
#: pass (bench/NOTES.md).
_FUSED_IN_LAUNCHES = "lamport_twoshot"
#: Config field -> its default (the buffer sizes the tables were measured with)
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}

#: algorithm -> (largest message in bytes, the setting that sizes its buffers, as text)
Limits = dict[str, tuple[int, str]]


def buffer_limits(config) -> Limits:
    """The message bound of every algorithm with bounded receive buffers, from ``config``."""
    env = {f.name: f.metadata["env"] for f in dataclasses.fields(config)}
    return {name: (getattr(config, alg.limit) << 10, f"{env[alg.limit]}={getattr(config, alg.limit)}")
            for name, alg in ALGORITHMS.items() if alg.limit is not None}


def bound(name: str, nbytes: int, limits: Limits) -> str | None:
    """The setting that keeps ``name`` from taking a message of ``nbytes`` (larger than its
    buffers, and not a kernel that runs in launches of their size), or None where it takes
    it. Pure."""
    if name in limits and nbytes > limits[name][0] and not ALGORITHMS[name].in_launches:
        return limits[name][1]
    return None


def launch_floor(name: str) -> int:
    """The least buffer bytes with which ``algorithm="auto"`` runs ``name`` (an
    ``in_launches`` kernel) past its buffers: its default buffers, with which the tables
    were measured. Smaller buffers mean more and smaller launches than measured, which
    cost more per byte (bench/NOTES.md)."""
    return _CONFIG_DEFAULTS[ALGORITHMS[name].limit] << 10


class Selector:
    """Picks the algorithm for one message.

    Args:
        nranks: ranks of the node.
        limits: the bound of every algorithm with bounded buffers (``buffer_limits``);
            kept as :attr:`limits`.
        usable: algorithm names this communicator can run (e.g. only "nccl").
        table: a tune file's table, consulted before the default table; None: the default only.
        nccl_reason: why only NCCL is usable, when it is (shown by :meth:`explain`).
        deterministic: ``Config.deterministic``: where a row gives NCCL, whose reduction
            order is its own, the barrier two-shot (which takes any size) runs instead, for
            the floating-point dtypes (an integer reduction's bits do not depend on the order).
        nccl_problem: why NCCL cannot run on this communicator (``_nccl.cannot_run``: ranks
            sharing a GPU, NCCL not loadable), or None: then the barrier two-shot, which
            takes every dtype and any size, runs wherever NCCL would.
        machine: what the entries of the tables are chosen for (``TableFile.choose``);
            None: a GPU not known here, nvlink, plain arrays, graph mode (the fallback
            entry). :attr:`tables` are the chosen entries, each with ``why``.

    The dtypes outside the tables (``TWOSHOT_ONLY_DTYPES``: float64, the integers) go to
    NCCL, the engine tuned for them, except where it cannot run or deterministic mode
    takes a float64 from it: then to the barrier two-shot, ubnext's one kernel for them.
    """

    def __init__(self, nranks: int, limits: Limits, usable: list[str], table: TableFile | None = None,
                 nccl_reason: str = "", deterministic: bool = False, nccl_problem: str | None = None,
                 machine: Machine | None = None):
        self.nranks = nranks
        self.deterministic = deterministic
        self.nccl_problem = nccl_problem
        self.machine = machine or Machine()
        self.tables = [t.choose(self.machine) for t in (table, default_table()) if t is not None]
        self.limits = limits
        self._usable = set(usable)
        self._nccl_reason = nccl_reason
        #: collective -> dtype -> (rows, where they come from); the default table has a "*"
        #: entry for every collective and dtype. Only the kernels' dtypes have rows: NCCL
        #: reduces the others.
        self._rows = {c: {dtype: next(found for t in self.tables if (found := t.lookup(nranks, dtype, c)))
                          for dtype in KERNEL_DTYPES} for c in COLLECTIVES}
        #: data mover (MOVER_TABLES) -> dtype -> (rows, where they come from), or None where no
        #: table has rows for it (the default one has none until measured): rows by the bytes moved
        self._mover_rows = {c: {dtype: next((found for t in self.tables if (found := t.lookup(nranks, dtype, c))),
                                            None) for dtype in DTYPES} for c in MOVER_TABLES}
        #: (collective, format, dtype) -> (the smallest message auto quantizes, or None: never; why)
        self._quantized = {(c, fmt, dtype): _threshold(fmt, nranks, c, self.machine, next(
            (found for t in self.tables if (found := t.quantized_lookup(nranks, dtype, c))), None))
            for c in _quant.COLLECTIVES for fmt in _quant.FORMATS for dtype in _quant.DTYPES}

    def quantized(self, fmt: str, dtype: str, collective: str = "all_reduce") -> tuple[int | None, str]:
        """The smallest message (bytes) of ``dtype`` that ``precision="auto"`` reduces in
        ``fmt`` on a communicator opted in to it, in an all-reduce or a ``collective`` of
        ``_quant.COLLECTIVES`` (the reduce-scatter: bytes of its whole input), or None where
        it never does, and why: ``"from 64 MiB (2 ranks bfloat16 (quantized, tune file ...:
        NVIDIA H100 ...))"``, ``"never (measured not to pay: ...)"``, ``"never: not measured
        ..."``. From the tables' ``quantized`` thresholds of the collective (``table`` module
        docstring: what is not measured keeps full precision); None at one rank. Any other
        format, dtype or collective: (None, "")."""
        return self._quantized.get((collective, fmt, dtype), (None, ""))

    def mover_algorithms(self, collective: str) -> set[str]:
        """The algorithms that the table rows of the data mover ``collective`` (one of
        ``MOVER_TABLES``) name, for any dtype; empty where no table has rows for it."""
        return {name for found in self._mover_rows[collective].values() if found for _, name in found[0]}

    def mover(self, collective: str, nbytes: int, dtype: str, takes) -> tuple[str, str] | None:
        """``(algorithm, why)`` for a data mover's call of ``nbytes`` bytes of ``dtype`` (any
        of DTYPES: a mover's rows are by bytes, a dtype without rows takes another's), from
        the first table row that covers ``nbytes`` and whose algorithm ``takes(name)`` says
        the call can run; None where no table has rows for ``collective`` (one of
        ``MOVER_TABLES``) or no such row takes it. Pure: the same on every rank."""
        found = self._mover_rows[collective][dtype]
        if found is None:
            return None
        rows, where = found
        for index, row in enumerate(rows):
            if _covers(row, nbytes) and takes(row[1]):
                return row[1], f"table row {_row_label(rows, index)} for {where}"
        return None

    def fits(self, name: str, nbytes: int) -> bool:
        """Whether ``name`` can take a message of ``nbytes`` on this communicator: in one
        launch, or in launches of its buffers' size (``in_launches`` kernels)."""
        return name in self._usable and bound(name, nbytes, self.limits) is None

    def _in_one_launch(self, name: str, nbytes: int) -> bool:
        return name not in self.limits or nbytes <= self.limits[name][0]

    def _takes(self, name: str, nbytes: int) -> bool:
        """Whether ``algorithm="auto"`` may give ``name`` a message of ``nbytes``: as
        :meth:`fits`, except that launches past the buffers need at least the
        buffers the tables were measured with (:func:`launch_floor`)."""
        return name in self._usable and (self._in_one_launch(name, nbytes) or self._launches_ok(name))

    def _launches_ok(self, name: str) -> bool:
        return ALGORITHMS[name].in_launches and self.limits[name][0] >= launch_floor(name)

    def capped(self) -> list[tuple[str, int, str]]:
        """``(algorithm, table limit, setting)`` of the usable rows (any dtype) whose limit
        exceeds what the algorithm takes with its buffers: sizes in between go to the next
        row that fits."""
        return sorted({(name, limit, self.limits[name][1]) for by_dtype in self._rows.values()
                       for rows, _ in by_dtype.values() for limit, name in rows
                       if name in self._usable and limit is not None and not self._takes(name, limit)})

    def select(self, nbytes: int, dtype: str, collective: str = "all_reduce") -> str:
        """The algorithm for a ``collective`` (a key of COLLECTIVES) of ``nbytes`` bytes of
        ``dtype`` (the reduce-scatter's input, the all-gather's output: size x k elements).

        Where NVLink multicast is usable, a table row's unicast kernel is replaced by its
        multicast instantiation (the seed's order: multicast -> Lamport -> two-shot -> NCCL).
        """
        return self._final(self._walk(nbytes, dtype, collective)[0], dtype, collective)

    def select_fused(self, nbytes: int, dtype: str) -> str:
        """The algorithm for a fused all-reduce + add + RMSNorm of ``nbytes`` bytes.

        As :meth:`select`, except past the Lamport two-shot's buffers: a fused call runs
        as launches of whole rows, so where the table gives the Lamport two-shot at the
        buffers' size and NCCL past it, the call takes the Lamport two-shot (or its
        multicast replacement) in launches of at most that size, if its buffers are
        those the tables were measured with (:func:`launch_floor`) or larger.
        """
        name = self._walk(nbytes, dtype)[0]
        bound = self.limits.get(_FUSED_IN_LAUNCHES, (None,))[0]
        if (not ALGORITHMS[name].is_kernel and bound is not None and nbytes > bound
                and self._walk(bound, dtype)[0] == _FUSED_IN_LAUNCHES and self._launches_ok(_FUSED_IN_LAUNCHES)):
            name = _FUSED_IN_LAUNCHES
        return self._final(name, dtype)

    def _final(self, name: str, dtype: str, collective: str = "all_reduce") -> str:
        """The row's algorithm as it runs (:meth:`_replaced`)."""
        return self._replaced(name, dtype, collective)[0]

    def _replaced(self, name: str, dtype: str, collective: str = "all_reduce") -> tuple[str, list[str]]:
        """The row's algorithm as it runs, and why it replaced the row's: the barrier
        two-shot in place of NCCL where NCCL cannot run or in deterministic mode, the
        multicast instantiation where NVLink multicast is usable and takes the dtype."""
        notes = []
        why = self._instead_of_nccl(dtype)
        twoshot = "twoshot" in self._usable and ALGORITHMS["twoshot"].supports(dtype, "sum", collective)
        if name == "nccl" and why and twoshot:
            name = "twoshot"
            notes.append(f"{why}: twoshot in place of nccl")
        mc = MULTICAST_OF.get(name)
        if mc in self._usable and ALGORITHMS[mc].supports(dtype, "sum", collective):
            notes.append(f"NVLink multicast: {mc} in place of {name}")
            name = mc
        return name, notes

    def _instead_of_nccl(self, dtype: str) -> str | None:
        """Why the barrier two-shot runs where a row gives NCCL, or None."""
        if self.nccl_problem:
            return f"NCCL cannot run here ({self.nccl_problem})"
        if self.deterministic and dtype in FLOAT_DTYPES:
            return "deterministic mode"
        return None

    def explain(self, nbytes: int, dtype: str, collective: str = "all_reduce") -> tuple[str, str]:
        """``(algorithm, why)`` for a ``collective`` of ``nbytes`` bytes of ``dtype``.

        ``why`` names the table row and its source, e.g. ``"table row ≤ 512 KiB for
        4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph)"``, and every row skipped on the way
        (``"lamport does not fit: > UBNEXT_LAMPORT_MAX_KB=256"``).
        """
        unicast, index = self._walk(nbytes, dtype, collective)
        name, notes = self._replaced(unicast, dtype, collective)
        if self._usable == {"nccl"}:
            return name, f"only NCCL usable: {self._nccl_reason or 'no kernels on this communicator'}"
        if dtype not in KERNEL_DTYPES:
            if name == "nccl":
                return name, (f"NCCL reduces {dtype} (the tables cover {', '.join(KERNEL_DTYPES)}; "
                              f"ubnext's barrier two-shot takes {dtype} in an all_reduce with algorithm='twoshot')")
            return name, f"ubnext's barrier two-shot reduces {dtype}: {notes[0]}"
        rows, where = self._rows[collective][dtype]
        skipped = [self._why_not(rows[i][1], nbytes) for i in range(len(rows) if index is None else index)
                   if _covers(rows[i], nbytes)]
        if index is None:
            last = rows[-1][0]
            past = "no table row fits" if last is None else f"past the last table row (≤ {human_bytes(last)})"
            reason = f"{past} for {where}: first usable of {_past_rows()}"
        else:
            reason = f"table row {_row_label(rows, index)} for {where}"
        if name == unicast and not self._in_one_launch(name, nbytes):
            reason += f"; in launches of {human_bytes(self.limits[name][0])} ({self.limits[name][1]})"
        for note in notes:
            reason += f"; {note}"
        return name, "; ".join([reason, *dict.fromkeys(skipped)])

    def _walk(self, nbytes: int, dtype: str, collective: str = "all_reduce") -> tuple[str, int | None]:
        """The algorithm and the index of the table row that gave it (None: past the table);
        every row's algorithm serves its collective (``_table``), and so do those past it."""
        if dtype not in KERNEL_DTYPES:
            return "nccl", None
        rows = self._rows[collective][dtype][0]
        for i, row in enumerate(rows):
            if _covers(row, nbytes) and self._takes(row[1], nbytes):
                return row[1], i
        for row in _PAST_TABLE:
            if _covers(row, nbytes) and self._takes(row[1], nbytes):
                return row[1], None
        raise AssertionError("selector: no usable algorithm")  # "nccl" is always usable

    def _why_not(self, name: str, nbytes: int) -> str:
        if name not in self._usable:
            return f"{name} not usable on this communicator"
        why = f"{name} does not fit: > {self.limits[name][1]}"
        if ALGORITHMS[name].in_launches:
            why += f" (launches past its buffers need at least {human_bytes(launch_floor(name))} of them)"
        return why


def _threshold(fmt: str, nranks: int, collective: str, machine: Machine,
               found: tuple[Thresholds, str] | None) -> tuple[int | None, str]:
    """:meth:`Selector.quantized` of ``fmt`` from the thresholds found for its collective,
    world size and dtype on ``machine``."""
    if nranks < 2:
        return None, "never: one rank moves nothing over links"
    if found is None:
        what = "quantized" if collective == "all_reduce" else f"quantized {collective}"
        return None, (f"never: not measured for {nranks} ranks on {machine.label()} (no selector table has "
                      f"{what} thresholds for them; python -m ubnext.tune --quantized measures them)")
    thresholds, where = found
    if fmt not in thresholds:
        return None, f"never: {fmt} not measured ({where})"
    if thresholds[fmt] is None:
        return None, f"never (measured not to pay: {where})"
    return thresholds[fmt], f"from {human_bytes(thresholds[fmt])} ({where})"


def _covers(row: Row, nbytes: int) -> bool:
    return row[0] is None or nbytes <= row[0]


def _past_rows() -> str:
    """``"twoshot ≤ 8 MiB, nccl"``: the rows after a table's own."""
    return ", ".join(name if limit is None else f"{name} ≤ {human_bytes(limit)}" for limit, name in _PAST_TABLE)


def _row_label(rows: tuple[Row, ...], index: int) -> str:
    """``"≤ 512 KiB"``, or for the open last row ``"> 32 MiB"`` (``"any size"`` when alone)."""
    limit = rows[index][0]
    if limit is not None:
        return f"≤ {human_bytes(limit)}"
    return f"> {human_bytes(rows[index - 1][0])}" if index else "(any size)"
