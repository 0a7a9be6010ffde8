"""Measure where each collective's algorithms win on this machine; write a selector table.

    mpirun -n 4 python -m ubnext.tune -o tune.json
    mpirun -n 2 python -m ubnext.tune -o tune.json      # adds 2 ranks to the same file
    export UBNEXT_TUNE_FILE=$PWD/tune.json
    mpirun -n 4 python -m ubnext.tune --mode dependent -o tune.json   # adds the dependent entry
    export UBNEXT_TABLE_MODE=dependent                  # communicators take it

For each dtype (``--dtype``), collective (``--collectives``: the all-reduce, the
reduce-scatter and the all-gather by default) and message size (``-b`` to ``-e``, times
``-f``), every algorithm the communicator can run (``comm.algorithms()``) that serves the
collective is timed on plain cupy arrays (what callers pass; out of place): ``-n`` calls
captured in a CUDA graph, the graph launched ``-G`` times between CUDA events per sample,
each sample the maximum over ranks, the median of ``--repeats`` samples. A size is the
whole message: the all-reduce's, the reduce-scatter's input, the all-gather's output (size
x k elements, k = bytes // itemsize // world size, as ``reduce_scatter_perf`` and
``all_gather_perf`` count them, and as ``comm.select`` takes them); a size below one
element per rank is left out. The winner of a size is the fastest algorithm, but a ubnext
kernel wins over NCCL only when it is at least ``--margin`` percent faster. Adjacent sizes
with the same winner become one table row; the last row has no upper limit. The
all-reduce's rows are the entry's ``tables``, the others' its ``collectives`` (format 2 of
``ubnext._selection.table``); the all-reduce is always measured (an entry's ``tables`` are
required), the others only where ``--collectives`` names them.

``--mode`` says how the calls are issued, and keys the entry written. ``graph`` (the
default): back to back. ``dependent``: as in a model, each call after a GEMM
(``--gemm M,K,N``, torch's GEMM on the same stream: it needs torch) that writes its input, so a ubnext
kernel's programmatic dependent launch overlaps its prologue with the GEMM's tail: the
graph holds ``-n`` (GEMM, call) pairs, a graph of the ``-n`` GEMMs alone is timed right
after each sample (``ubnext._tools.dependent``, as ``bench/compare.py --modes dependent``
does), and their difference, the call's time as a model sees it, is what is ranked (every
collective, algorithm and quantized format alike). One mode per run: a run of
the other mode with the same ``-o`` adds its entry beside, and ``UBNEXT_TABLE_MODE`` says
which entries a communicator takes.

On a communicator opted in to the quantized collectives (``UBNEXT_QUANTIZED`` set, or
``--quantized``), each quantized format (``precision=int8|fp8|int4``; fp8 where the GPU
has it) is timed beside them for bfloat16/float16, in the all-reduce's sweep and in the
reduce-scatter's (the all-gather stays exact), against the size's winner in full
precision of the same sweep: the format's threshold is the smallest measured size from
which it is at least ``--margin`` percent faster at every larger measured size, or
``"never"`` where it is not at the largest; ``auto`` quantizes from that size on this
machine and world size (the entry's ``quantized`` thresholds, the reduce-scatter's under
``quantized.collectives.reduce_scatter``; format 2 of ``ubnext._selection.table``).

Rank 0 prints the timings, rows and thresholds of each collective and writes the table
(``-o``, format 2 of ``ubnext._selection.table``): an entry keyed by this machine (the
GPU's name, the ``nvlink`` link, ``plain`` arrays) and ``--mode``; its measured record
keeps the all-reduce's times and, under the collective's name, each other collective's,
and in the dependent mode the GEMM's shape and the raw (GEMM + call) and GEMM-alone times
beside the ranked ones. A file that already exists is merged into: in this machine's entry
of the mode (added when the file has none) the measured world size and dtypes are
replaced, collective by collective; its other world sizes and dtypes, the collectives not
measured, the entry of the other mode and the other machines' entries are kept (the
quantized thresholds alike: those of the measured world size and dtypes replaced, where
the run measured them). A format-1 file is rewritten as format 2,
its rows kept as an entry for any machine; an entry added beside such an entry starts
from its rows, so what a run does not measure keeps serving this machine as before. All ranks see the
same (max over ranks) times, and rank 0's outcome is broadcast, so every rank
exits alike; a failing rank aborts the whole MPI job.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ubnext._environment.config import TABLE_MODES, Config
from ubnext._environment.devices import device_name
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, DTYPES, KERNEL_DTYPES
from ubnext._protocol.errors import CollectiveTimeoutError, CudaError, UbnextError
from ubnext._selection.table import (ANY, DEFAULT_LINK, FORMAT, FORMAT_1, NEVER, Machine, human_bytes,
                                     load_table, parse_table, upgrade)
from ubnext._tools.cli import run_or_abort, size_arg, size_list
from ubnext._tools.dependent import GEMM_SHAPE, gemm_arg

#: times of one size: algorithm (or quantized format) -> µs, or None where the communicator
#: refused the call
Times = dict[str, float | None]
#: The ``note`` tune gives the quantized thresholds of an entry it writes.
QUANTIZED_NOTE = ("Measured by python -m ubnext.tune on plain arrays, out of place, in CUDA graphs in the "
                  "entry's mode (back to back, or each call after a GEMM, less the GEMM): each format "
                  "against the full-precision winner of each size (a reduce-scatter's against the reduce-scatter "
                  "algorithms, its sizes those of the whole input); a format is used from the smallest measured "
                  "size from which it is faster by the margin at every larger measured size; never: not at the "
                  "largest. The measurements: the entry's measured record.")
#: The ``note`` tune gives the rows of a collective other than the all-reduce in an entry
#: where it adds them (the ``collectives`` key); an existing collective keeps its own.
COLLECTIVE_NOTE = ("Measured by python -m ubnext.tune on plain arrays, out of place, in CUDA graphs in the "
                   "entry's mode (back to back, or each call after a GEMM, less the GEMM), as the all-reduce's "
                   "rows: every algorithm that has the collective, a size being the whole message (the "
                   "reduce-scatter's input, the all-gather's output: size x k elements). The measurements: the "
                   "entry's measured record, under the collective's name.")


class Timed(NamedTuple):
    """One call's time at one size, µs: the median of ``--repeats`` samples, each the maximum
    over ranks. ``us`` is what is ranked: per call (graph mode), or per (GEMM, call) pair less
    the GEMM alone timed right after it (dependent mode, whose ``raw_us`` and ``gemm_us`` are
    the medians of those two; None in the graph mode)."""

    us: float
    raw_us: float | None = None
    gemm_us: float | None = None


@dataclasses.dataclass(frozen=True)
class Measured:
    """The times of one dtype and collective at the measured ``sizes`` (ascending; those of
    ``-b`` to ``-e`` with at least one element per rank): ``times``, the ranked
    (:attr:`Timed.us`), and in the dependent mode ``raw`` and ``gemm`` (empty in the graph mode),
    one per size."""

    sizes: list[int]
    times: list[Times]
    raw: list[Times] = dataclasses.field(default_factory=list)
    gemm: list[Times] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, sizes: Sequence[int], rows: Sequence[dict[str, Timed | None]], dependent: bool) -> Measured:
        """From each size's :class:`Timed` per name (None: refused), measured in the dependent
        mode or not."""
        def part(i: int) -> list[Times]:
            return [{name: None if t is None else t[i] for name, t in row.items()} for row in rows]

        return cls(list(sizes), part(0), part(1), part(2)) if dependent else cls(list(sizes), part(0))

    def record(self, winners: Sequence[str]) -> dict[str, Any]:
        """The measured record of one collective: sizes, winners and µs (:func:`_us`): the
        ranked, and in the dependent mode the raw and GEMM-alone ones."""
        return {"sizes": list(self.sizes), "winners": list(winners), "us": _us(self.times),
                **({"raw_us": _us(self.raw), "gemm_us": _us(self.gemm)} if self.raw else {})}


# --------------------------------------------------------------------------- decisions (pure)


def winner(times: Times, margin: float) -> str:
    """The algorithm a size should use.

    The fastest measured algorithm, except that a ubnext kernel replaces NCCL
    only when ``t_kernel * (1 + margin / 100) <= t_nccl``. Ties go to the
    algorithm listed first in ``ALGORITHMS``.

    Raises:
        ValueError: nothing was measured.
    """
    measured = [(t, list(ALGORITHMS).index(name), name) for name, t in times.items()
                if t is not None and name in ALGORITHMS]
    if not measured:
        raise ValueError("tune: no algorithm was measured at this size")
    kernels = [m for m in measured if m[2] != "nccl"]
    nccl = times.get("nccl")
    if not kernels:
        return "nccl"
    best_time, _, best = min(kernels)
    if nccl is None or best_time * (1 + margin / 100) <= nccl:
        return best
    return "nccl"


def table_rows(sizes: Sequence[int], winners: Sequence[str]) -> list[list]:
    """Rows ``[[max_bytes, algorithm], ..., [None, algorithm]]`` from the winner of each ascending size.

    Adjacent sizes with the same winner merge; a row ends at the largest size
    its algorithm won, and the last row has no limit (it also serves sizes
    beyond the largest measured).
    """
    if not sizes or len(sizes) != len(winners):
        raise ValueError("tune: need one winner per size, and at least one size")
    rows: list[list] = []
    for nbytes, name in zip(sizes, winners):
        if rows and rows[-1][1] == name:
            rows[-1][0] = nbytes
        else:
            rows.append([nbytes, name])
    rows[-1][0] = None
    return rows


def quantized_thresholds(sizes: Sequence[int], times: Sequence[Times], winners: Sequence[str],
                         margin: float) -> dict[str, int | str]:
    """Each quantized format's threshold from the times of the ascending ``sizes``: the
    smallest size from which ``t_format * (1 + margin / 100) <= t_winner`` (the size's
    full-precision winner) at every larger measured size, or ``"never"`` where not at the
    largest. Formats not measured at any size (refused: fp8 before sm_89) are left out."""
    out: dict[str, int | str] = {}
    for fmt in _quant.FORMATS:
        if all(t.get(fmt) is None for t in times):
            continue
        start: int | str = NEVER
        for nbytes, t, win in reversed(list(zip(sizes, times, winners))):
            if t.get(fmt) is None or t[fmt] * (1 + margin / 100) > t[win]:
                break
            start = nbytes
        out[fmt] = start
    return out


def entry_of(document: dict[str, Any], key: dict[str, str]) -> dict[str, Any] | None:
    """The entry of a format-2 ``document`` whose machine key is ``key`` (gpu, link,
    placement, mode), or None."""
    return next((e for e in document["entries"] if all(e.get(k) == v for k, v in key.items())), None)


def merged_document(existing: dict[str, Any] | None, machine: str, world: int,
                    rows: dict[str, list], measured: dict[str, dict[str, Any]],
                    link: str = DEFAULT_LINK, placement: str = "plain", mode: str = "graph",
                    quantized: dict[str, dict[str, int | str]] | None = None,
                    quantized_rs: dict[str, dict[str, int | str]] | None = None,
                    collective_rows: dict[str, dict[str, list]] | None = None) -> dict[str, Any]:
    """The table document (format 2) after tuning ``world`` ranks for the dtypes in ``rows``.

    Args:
        existing: the document already in the output file (format 2, or a format-1
            document, which is converted: its rows become an entry for any machine), or None.
        machine: this machine's GPU, e.g. ``"NVIDIA H200"``: the entry's ``gpu``.
        world: the measured world size.
        rows: dtype -> table rows (:func:`table_rows`) of the all-reduce.
        measured: dtype -> the record of the measurement (kept under the entry's ``measured``).
        link, placement, mode: the rest of the entry's machine key (what tune measures:
            plain arrays in CUDA graphs, back to back (``"graph"``) or each after a GEMM
            (``"dependent"``: ``--mode``); the link ubnext assumes, ``table.DEFAULT_LINK``). An
            entry of one mode is never merged into, or started from, an entry of another.
        quantized: dtype -> the quantized thresholds measured (:func:`quantized_thresholds`);
            a dtype without any (none measured) is left as it was.
        quantized_rs: the same, of the reduce-scatter.
        collective_rows: collective other than the all-reduce -> dtype -> its rows; a
            collective without any (not measured) is left as it was.

    Returns:
        A new document: the entry of this machine key (added when there is none) with
        ``tables[world][dtype]``, ``measured[world][dtype]`` and, where measured,
        ``collectives[c]["tables"][world][dtype]`` (a collective added with the note
        :data:`COLLECTIVE_NOTE`; one already there keeps its note),
        ``quantized.tables[world][dtype]`` and
        ``quantized.collectives.reduce_scatter.tables[world][dtype]`` replaced; its other world
        sizes, dtypes and collectives, and every other entry, kept. An entry added where an entry for any
        GPU served this machine (a format-1 file's rows) starts from that entry's rows
        (``tables``, ``collectives``, ``quantized``): a communicator takes one entry of a file, so what
        this run did not measure keeps serving this machine as before, as format 1's merge kept it.
    """
    if existing is None:
        doc: dict[str, Any] = {"format": FORMAT, "entries": []}
    elif existing.get("format") == FORMAT_1:
        doc = upgrade(existing)
    else:
        doc = copy.deepcopy(existing)
    key = {"gpu": machine, "link": link, "placement": placement, "mode": mode}
    entry = entry_of(doc, key)
    if entry is None:
        entry = {**key, "tables": {}}
        served = parse_table(doc, "the table being merged into").choose(Machine(machine, link, placement, mode)) \
            if doc["entries"] else None
        if served is not None and served.gpu == ANY and all(
                getattr(served, k) in (v, ANY) for k, v in key.items() if k != "gpu"):
            for part in ("tables", "collectives", "quantized"):
                if part in served.entry:
                    entry[part] = copy.deepcopy(served.entry[part])
            entry["note"] = (f"rows not measured on {machine} start from those of the entry for {served.label}, "
                             f"which served it before this entry was added")
        doc["entries"].append(entry)
    entry["tables"].setdefault(str(world), {}).update(rows)
    records = entry.setdefault("measured", {}).setdefault(str(world), {})
    for dtype, record in measured.items():  # a collective this run left out keeps its record
        kept = {c: r for c, r in records.get(dtype, {}).items() if c in COLLECTIVES and c not in record}
        records[dtype] = {**record, **kept}
    for collective, by_dtype in (collective_rows or {}).items():
        if by_dtype:
            place = entry.setdefault("collectives", {}).setdefault(collective, {"note": COLLECTIVE_NOTE})
            place.setdefault("tables", {}).setdefault(str(world), {}).update(by_dtype)
    for measured_by_dtype, path in ((quantized, ()), (quantized_rs, ("collectives", "reduce_scatter"))):
        measured_formats = {dtype: t for dtype, t in (measured_by_dtype or {}).items() if t}
        if measured_formats:
            place = entry.setdefault("quantized", {"note": QUANTIZED_NOTE})
            for key in path:
                place = place.setdefault(key, {})
            place.setdefault("tables", {}).setdefault(str(world), {}).update(measured_formats)
    parse_table(doc, "the table being written")  # never write what ubnext cannot read
    return doc


def _width(name: str) -> int:
    """Column width of an algorithm in the report: its name and a space, at least 12."""
    return max(12, len(name) + 1)


def report(world: int, dtype: str, machine: str, sizes: Sequence[int], times: Sequence[Times],
           winners: Sequence[str], args: argparse.Namespace, collective: str = "all_reduce") -> list[str]:
    """The lines rank 0 prints for one dtype and collective: µs per size and algorithm (and
    quantized format), the winner, the rows, the quantized thresholds."""
    names = [n for n in (*ALGORITHMS, *_quant.FORMATS) if any(t.get(n) is not None for t in times)]
    what = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter (size: the whole input)",
            "all_gather": "all-gather (size: the whole output)"}[collective]
    if args.mode == "dependent":
        gemm = "x".join(map(str, args.gemm))
        how = (f"dependent mode: CUDA graphs of {args.iters} (GEMM {gemm} writing the call's input, call) pairs, "
               f"{args.launches} launches per sample, each less a sample of the GEMMs alone taken right after it")
        what += " less the GEMM before it"
        where = "plain arrays, out of place; raw and GEMM-alone times: the entry's measured record"
    else:
        how = f"graph mode: CUDA graphs of {args.iters} calls back to back, {args.launches} launches per sample"
        where = "plain arrays, out of place"
    lines = [f"# ubnext.tune: {world} ranks, {dtype}, {machine}; {how}, median of {args.repeats} samples, "
             f"max over ranks",
             f"# µs per {what} ({where}); a kernel beats NCCL only when {args.margin:g}% faster",
             f"{'size':>10}" + "".join(f"{n:>{_width(n)}}" for n in names) + "  winner"]
    for nbytes, row, win in zip(sizes, times, winners):
        cells = "".join(f"{'—' if row.get(n) is None else f'{row[n]:.2f}':>{_width(n)}}" for n in names)
        lines.append(f"{human_bytes(nbytes):>10}{cells}  {win}")
    of = "" if collective == "all_reduce" else f" {collective}"
    text = ", ".join(f"≤ {human_bytes(limit)} {name}" if limit else f"then {name}"
                     for limit, name in table_rows(sizes, winners))
    lines.append(f"#{of} rows for {world} ranks {dtype}: {text}")
    thresholds = quantized_thresholds(sizes, times, winners, args.margin)
    if thresholds:
        label = f"quantized{of}"
        text = ", ".join(f"{fmt} {t if t == NEVER else 'from ' + human_bytes(t)}" for fmt, t in thresholds.items())
        lines.append(f"# {label} for {world} ranks {dtype} (against the winner, {args.margin:g}% faster): {text}")
    return lines


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ubnext.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16",
                   help=f"comma-separated dtypes to tune, or all ({', '.join(KERNEL_DTYPES)}; default bfloat16)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help=f"comma-separated collectives to tune, all_reduce among them (its rows are the entry's "
                        f"tables, which every entry has); sizes are whole messages: the reduce-scatter's input, "
                        f"the all-gather's output (default {','.join(COLLECTIVES)})")
    p.add_argument("-b", "--minbytes", type=size_arg, default=1 << 10, help="smallest size (default 1K)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=256 << 20, help="largest size (default 256M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("--margin", type=float, default=3.0,
                   help="percent by which a ubnext kernel must beat NCCL to be chosen (default 3)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="calls (dependent mode: (GEMM, call) pairs) captured in the CUDA graph (default 20)")
    p.add_argument("-G", "--launches", type=int, default=5, help="graph launches per sample (default 5)")
    p.add_argument("--repeats", type=int, default=7, help="samples per size and algorithm; median (default 7)")
    p.add_argument("-w", "--warmup", type=int, default=3, help="eager calls before capturing (default 3)")
    p.add_argument("--mode", choices=TABLE_MODES, default=Config.table_mode,
                   help="how each call is issued, and the mode of the entry written: graph (back to back) or "
                        "dependent (each after a GEMM that writes its input, the GEMM alone subtracted); one "
                        "mode per run: a run of the other with the same -o adds its entry beside (default graph)")
    p.add_argument("--gemm", type=gemm_arg, default=None, metavar="M,K,N",
                   help="M,K,N of the GEMM before each call in the dependent mode (default "
                        f"{','.join(map(str, GEMM_SHAPE))})")
    p.add_argument("--quantized", action="store_true",
                   help="measure the quantized formats against full precision too (implied by UBNEXT_QUANTIZED)")
    p.add_argument("-o", "--output", default="ubnext_tune.json",
                   help="table file to write or merge into (default ubnext_tune.json)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate; adds ``dtypes`` and ``sizes``, makes ``collectives`` a list (in the
    order of ``COLLECTIVES``), and sets ``gemm`` in the dependent mode (None in the graph mode)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.dtypes = list(KERNEL_DTYPES) if args.dtype == "all" else [d for d in args.dtype.split(",") if d]
    unknown = [d for d in args.dtypes if d not in KERNEL_DTYPES]
    if unknown or not args.dtypes:
        parser.error(f"--dtype: unknown {', '.join(unknown) or '(none)'}; use {', '.join(KERNEL_DTYPES)} or all")
    wanted = [c for c in args.collectives.split(",") if c]
    unknown = [c for c in wanted if c not in COLLECTIVES]
    if unknown:
        parser.error(f"--collectives: unknown {', '.join(unknown)}; use {', '.join(COLLECTIVES)}")
    if "all_reduce" not in wanted:  # a new entry could not be written without its rows
        parser.error("--collectives: all_reduce is always measured (its rows are the entry's tables, which every "
                     "entry has); add the others to it, e.g. all_reduce,reduce_scatter")
    args.collectives = [c for c in COLLECTIVES if c in wanted]
    if args.stepfactor < 2:
        parser.error("-f must be >= 2")
    if args.minbytes < 16:
        parser.error("-b must be >= 16 (one 16-byte vector)")
    try:
        args.sizes = size_list(args.minbytes, args.maxbytes, 0, args.stepfactor)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.iters, args.launches, args.repeats) < 1 or args.warmup < 0 or args.margin < 0:
        parser.error("-n, -G and --repeats must be >= 1; -w and --margin >= 0")
    if args.mode == "dependent":
        args.gemm = args.gemm or GEMM_SHAPE
        try:  # before any rank builds a communicator: the GEMM is torch's (dependent.matmul_into)
            import torch  # noqa: F401
        except ImportError:
            parser.error("--mode dependent needs torch for its GEMM (cupy cannot call cuBLAS while a CUDA graph "
                         "is being captured); install torch, or use --mode graph")
    elif args.gemm is not None:
        parser.error("--gemm shapes the GEMM of --mode dependent; the graph mode has none")
    args.output = os.path.abspath(args.output)
    if not os.path.isdir(os.path.dirname(args.output)):
        parser.error(f"-o: the directory of {args.output} does not exist")
    return args


# --------------------------------------------------------------------------- measuring (GPU, collective)


def time_algorithm(comm, stream, name: str, send, recv, args: argparse.Namespace,
                   collective: str = "all_reduce", gemm=None) -> Timed | None:
    """The time of ``comm.all_reduce(send, out=recv, algorithm=name)`` (``precision=name``
    where ``name`` is a quantized format; ``comm.reduce_scatter`` or ``comm.all_gather`` for
    that ``collective``), or None when refused. Collective.

    Eager warm-up calls come first (compiling the kernel, connecting NCCL,
    outside any capture); a refusal there (the size exceeds the algorithm's
    limit) is the same on every rank, and the ranks check that it is.

    ``gemm`` (the dependent mode: a launch of the GEMM that writes the head of the buffer
    ``send`` views, :func:`gemm_into`) precedes each call, in the warm-up and in the graph;
    a graph of the GEMMs alone is sampled right after each sample of the pairs, and the
    difference ranked (:func:`ubnext._tools.dependent.dependent_samples`).
    """
    from ubnext._tools.dependent import dependent_samples
    from ubnext._tools.timing import timer

    call = {"precision": name} if name in _quant.FORMATS else {"algorithm": name}

    run = getattr(comm, collective)

    def launch() -> None:
        run(send, out=recv, stream=stream, **call)

    def pair() -> None:
        gemm()
        launch()

    refused = None
    try:
        for _ in range(max(1, args.warmup)):
            (launch if gemm is None else pair)()
    except UbnextError as exc:
        if isinstance(exc, (CudaError, CollectiveTimeoutError)):
            raise
        refused = str(exc)
    verdicts = comm.bootstrap.allgather_obj(refused)
    if any(verdicts):
        if not all(verdicts):
            raise UbnextError(f"tune: ranks disagree whether {name} takes {send.size} elements: {verdicts}")
        return None

    def sampler(fn):
        """µs per launch of ``fn`` in one sample of its graph, the maximum over ranks."""
        sample = timer(fn, stream, args.iters, args.launches, comm.bootstrap.barrier)
        return lambda: max(comm.bootstrap.allgather_obj(sample())) * 1e6

    if gemm is None:
        sample = sampler(launch)
        return Timed(statistics.median(sample() for _ in range(args.repeats)))
    found = dependent_samples(sampler(pair), sampler(gemm), args.repeats)
    return Timed(*(statistics.median(found[key]) for key in ("times_us", "raw_us", "gemm_us")))


def buffers(dtype: str, args: argparse.Namespace, stream) -> tuple[Any, Any]:
    """The input and output cupy arrays of one dtype's calls, made on ``stream``: the
    largest size, and in the dependent mode at least the GEMM's output (M x N), which the
    input's head holds. The input holds values spread over [-0.5, 0.5), not zeros: the
    quantized kernels skip the arithmetic of a group of zeros, and would be timed faster
    than on a model's data."""
    import cupy
    import numpy as np

    from ubnext._interop.arrays import _cupy_dtype

    count = args.sizes[-1] // DTYPES[dtype][1]
    if args.mode == "dependent":
        count = max(count, args.gemm[0] * args.gemm[2])
    key = np.arange(count, dtype=np.uint32) * np.uint32(0x9E3779B1)  # a Weyl sequence
    values = (key >> np.uint32(16)).astype(np.float32) / np.float32(65536) - np.float32(0.5)
    if dtype == "bfloat16":  # its bits: the top half of the float32's (truncated: any values will do)
        values = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    elif dtype == "float16":
        values = values.astype(np.float16).view(np.uint16)
    with stream:  # the values ordered before the dependent mode's first GEMM on the stream
        send = cupy.empty((count,), dtype=_cupy_dtype(dtype))
        send.view(values.dtype).set(values, stream=stream)
        return send, cupy.empty_like(send)


def gemm_into(send, args: argparse.Namespace, stream):
    """The dependent mode's GEMM (``--gemm``) on ``stream``, writing the head of ``send``
    (:func:`ubnext._tools.dependent.matmul_into`; run once here), or None in the graph mode.
    Its operands give every output element 1 (A = 1/K, B = 1: exact where K is a power of
    two, bounded in every dtype, so no format quantizes infinities)."""
    if args.mode != "dependent":
        return None
    import cupy

    from ubnext._tools.dependent import matmul_into

    m, k, n = args.gemm
    with stream:
        a = cupy.full((m, k), 1 / k, dtype=send.dtype)
        b = cupy.ones((k, n), dtype=send.dtype)
    return matmul_into(a, b, send, stream)


def call_counts(collective: str, count: int, world: int) -> tuple[int, int]:
    """Elements of the input and of the output of a ``collective`` call on ``world`` ranks whose
    whole message is ``count`` elements: the all-reduce's ``count`` both; with k = count // world,
    the reduce-scatter's world x k in and k out, the all-gather's k in and world x k out
    (0: below one element per rank). Pure."""
    k = count // world
    return {"all_reduce": (count, count), "reduce_scatter": (k * world, k), "all_gather": (k, k * world)}[collective]


def measure(comm, stream, dtype: str, collective: str, args: argparse.Namespace, progress) -> Measured:
    """Times of ``collective`` for one dtype at every size of ``args.sizes`` with at least one
    element per rank (:func:`call_counts`): every usable algorithm that serves it, and every
    quantized format where the communicator opted in and the collective and dtype are ones they
    take (``_quant.COLLECTIVES``, ``_quant.DTYPES``). Collective."""
    width = DTYPES[dtype][1]
    send, recv = buffers(dtype, args, stream)
    gemm = gemm_into(send, args, stream)
    formats = (list(_quant.FORMATS) if comm.config.quantized != "off" and collective in _quant.COLLECTIVES
               and dtype in _quant.DTYPES else [])
    names = [n for n in comm.algorithms() if ALGORITHMS[n].serves(collective)] + formats
    of = "" if collective == "all_reduce" else f" {collective}"
    sizes, rows = [], []
    for nbytes in args.sizes:
        inputs, outputs = call_counts(collective, nbytes // width, comm.size)
        if not min(inputs, outputs):
            continue
        row: dict[str, Timed | None] = {}
        for name in names:
            progress(f"{dtype} {human_bytes(nbytes):>8}{of} {name}")
            row[name] = time_algorithm(comm, stream, name, send[:inputs], recv[:outputs], args, collective, gemm)
        sizes.append(nbytes)
        rows.append(row)
    return Measured.of(sizes, rows, gemm is not None)


def existing_document(path: str) -> dict[str, Any] | None:
    """The valid table already at ``path``, or None when there is none.

    Raises:
        UbnextError: the file exists but is not a valid table (it is not overwritten).
    """
    if not os.path.exists(path):
        return None
    try:
        return load_table(path).document
    except UbnextError as exc:
        raise UbnextError(f"tune: {path} exists and is not a valid table, so it is not merged into or "
                          f"overwritten; move it away or choose another -o ({exc})") from exc


def write_atomically(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` as JSON through a temporary file, so readers never see half a table."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def run(comm, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Measure, print, write (rank 0). Collective. Returns the exit status (the same on every rank)."""
    with comm._context.current():  # its arrays and streams on the communicator's device
        import cupy

        rank0 = comm.rank == 0
        say = print if rank0 else (lambda *a, **k: None)
        error = None
        if rank0:
            try:
                existing_document(args.output)
            except UbnextError as exc:
                error = str(exc)
        if comm.algorithms() == ["nccl"]:
            error = f"tune: this communicator runs {comm.path}; there is nothing to choose"
        unmeasurable = [f"{c} {d}" for d in args.dtypes for c in args.collectives
                        if not min(call_counts(c, args.sizes[-1] // DTYPES[d][1], comm.size))]
        if unmeasurable:
            error = (f"tune: -e {human_bytes(args.sizes[-1])} is below one element per rank at {comm.size} ranks "
                     f"for {', '.join(unmeasurable)}; raise -e or leave them out of --collectives")
        error = comm.bootstrap.bcast_obj(error)
        if error:
            say(error, file=sys.stderr)
            return 2
        machine = device_name(comm.device)
        stream = cupy.cuda.Stream(non_blocking=True)

        def progress(text: str) -> None:
            """Rank 0 shows what is being measured on one stderr line; "" clears it."""
            if rank0:
                sys.stderr.write(f"\r# ubnext.tune {text:<46}" if text else f"\r{'':<60}\r")
                sys.stderr.flush()

        rows: dict[str, dict[str, list]] = {c: {} for c in args.collectives}
        quantized: dict[str, dict[str, dict[str, int | str]]] = {c: {} for c in _quant.COLLECTIVES}
        measured = {}
        for dtype in args.dtypes:
            record = {
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "machine": machine,
                "command": shlex.join([sys.executable, "-m", "ubnext.tune", *argv]),
                "margin_percent": args.margin, "graph_calls": args.iters, "graph_launches": args.launches,
                "repeats": args.repeats, **({"gemm_mnk": list(args.gemm)} if args.gemm else {}),
            }
            for collective in args.collectives:
                found = measure(comm, stream, dtype, collective, args, progress)
                winners = [winner(t, args.margin) for t in found.times]
                progress("")
                for line in report(comm.size, dtype, machine, found.sizes, found.times, winners, args, collective):
                    say(line, flush=True)
                rows[collective][dtype] = table_rows(found.sizes, winners)
                if collective in quantized:  # the formats measured in this sweep, against its winners
                    quantized[collective][dtype] = quantized_thresholds(found.sizes, found.times, winners,
                                                                        args.margin)
                # the all-reduce's record is the dtype's; each other collective's is under its name
                kept = found.record(winners)
                record.update(kept if collective == "all_reduce" else {collective: kept})
            measured[dtype] = record
        outcome = None
        if rank0:
            try:
                doc = merged_document(existing_document(args.output), machine, comm.size, rows["all_reduce"],
                                      measured, mode=args.mode, quantized=quantized["all_reduce"],
                                      quantized_rs=quantized["reduce_scatter"],
                                      collective_rows={c: rows[c] for c in args.collectives if c != "all_reduce"})
                write_atomically(args.output, doc)
                written = Machine(machine, mode=args.mode)  # the key merged_document gives the entry
                entry = entry_of(doc, dataclasses.asdict(written))
                outcome = (f"# wrote {args.output} (entry {written.label()}: world sizes "
                           f"{', '.join(entry['tables'])})\n"
                           f"export UBNEXT_TUNE_FILE={shlex.quote(args.output)}")
                if args.mode != Config.table_mode:  # communicators take this mode's entries when asked
                    outcome += f"\nexport UBNEXT_TABLE_MODE={args.mode}"
            except (OSError, UbnextError) as exc:
                outcome = f"tune: cannot write {args.output}: {exc}"
        outcome = comm.bootstrap.bcast_obj(outcome)
        ok = outcome.startswith("# wrote")
        say(outcome, file=sys.stdout if ok else sys.stderr, flush=True)
        del stream  # destroyed here, in the communicator's context
        return 0 if ok else 1


def _us(times: Sequence[Times]) -> dict[str, list[float | None]]:
    """The measured record's µs: algorithm or format -> its time at each size."""
    return {n: [t.get(n) for t in times] for n in (*ALGORITHMS, *_quant.FORMATS) if any(n in t for t in times)}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]``. Collective over ``MPI.COMM_WORLD``."""
    from ubnext._api.communicator import Communicator

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Measure every algorithm whatever UBNEXT_ALGO / UBNEXT_TUNE_FILE say; only a table is written.
    # --quantized opts in (any format reserves the areas of every format; precision= picks one)
    comm = Communicator(algorithm="auto", tune_file="", **({"quantized": "int8"} if args.quantized else {}))
    try:
        return run(comm, args, argv)
    finally:
        comm.close()


if __name__ == "__main__":
    sys.exit(run_or_abort(main))
