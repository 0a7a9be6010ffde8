"""What ``python -m ubnext.tune``'s times make of a selector table: each size's winner, the
rows, the quantized thresholds, the entry merged into the file (and the file read and
written), and the report rank 0 prints. Pure: no GPU, no communicator."""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Sequence
from typing import Any

from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, MOVER_TABLES, MOVERS
from ubnext._protocol.errors import UbnextError
from ubnext._selection.table import ANY, DEFAULT_LINK, FORMAT, FORMAT_1, Machine, human_bytes
from ubnext._selection.table_format import NEVER, load_table, parse_table, upgrade


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


#: The ``note`` tune gives the rows of a data mover (``MOVER_TABLES``) in an entry where it
#: adds them.
MOVER_NOTE = ("Measured by python -m ubnext.tune --movers on plain arrays, out of place, in CUDA graphs in the "
              "entry's mode, as the all-reduce's rows: every algorithm of the mover (ubnext's forms and NCCL) in "
              "one run, a size being the bytes moved (the broadcast's message from root 0, the all-to-all's "
              "whole input of one rank, the send/recv ring's message). The measurements: the entry's measured "
              "record, under the mover's name.")
#: every algorithm a size may be won by, in the order that breaks ties (the reductions',
#: then the movers')
_ORDER = list(dict.fromkeys((*ALGORITHMS, *MOVERS)))


def winner(times: Times, margin: float) -> str:
    """The algorithm a size should use.

    The fastest measured algorithm, except that a ubnext kernel replaces NCCL
    only when ``t_kernel * (1 + margin / 100) <= t_nccl``. Ties go to the
    algorithm listed first in ``ALGORITHMS`` (then ``MOVERS``, a data mover's).

    Raises:
        ValueError: nothing was measured.
    """
    measured = [(t, _ORDER.index(name), name) for name, t in times.items() if t is not None and name in _ORDER]
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
        collective_rows: collective other than the all-reduce (a data mover of
            ``MOVER_TABLES`` too) -> dtype -> its rows; a collective without any (not
            measured) is left as it was.

    Returns:
        A new document: the entry of this machine key (added when there is none) with
        ``tables[world][dtype]``, ``measured[world][dtype]`` and, where measured,
        ``collectives[c]["tables"][world][dtype]`` (a collective added with the note
        :data:`COLLECTIVE_NOTE`, a mover with :data:`MOVER_NOTE`; one already there keeps
        its note),
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
        kept = {c: r for c, r in records.get(dtype, {}).items()
                if c in (*COLLECTIVES, *MOVER_TABLES) and c not in record}
        records[dtype] = {**record, **kept}
    for collective, by_dtype in (collective_rows or {}).items():
        if by_dtype:
            note = MOVER_NOTE if collective in MOVER_TABLES else COLLECTIVE_NOTE
            place = entry.setdefault("collectives", {}).setdefault(collective, {"note": note})
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
    names = [n for n in (*_ORDER, *_quant.FORMATS) if any(t.get(n) is not None for t in times)]
    what = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter (size: the whole input)",
            "all_gather": "all-gather (size: the whole output)", "broadcast": "broadcast (size: the message, root 0)",
            "all_to_all": "all-to-all (size: one rank's whole input)",
            "send_recv": "send/recv in a ring (size: one message)"}[collective]
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
