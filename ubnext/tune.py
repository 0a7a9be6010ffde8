"""Measure where each collective's algorithms win on this machine; write a selector table.

    mpirun -n 4 python -m ubnext.tune -o tune.json
    mpirun -n 2 python -m ubnext.tune -o tune.json      # adds 2 ranks to the same file
    export UBNEXT_TUNE_FILE=$PWD/tune.json
    mpirun -n 4 python -m ubnext.tune --mode dependent -o tune.json   # adds the dependent entry
    export UBNEXT_TABLE_MODE=dependent                  # communicators take it
    mpirun -n 4 python -m ubnext.tune --movers -o tune.json   # the data movers' rows too

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

The data movers (``--movers``, or named in ``--collectives``: ``broadcast``, ``all_to_all``,
``send_recv``) are timed the same way, each of its algorithms (``MOVER_SERVES``: the
low-latency kernel, the copy form, broadcast's scatter + all-gather, NCCL) and NCCL in one
run, out of place: the broadcast from root 0, the all-to-all with even splits (a size is
one rank's whole input, as in nccl-tests), send/recv as a ring in one batch; a form that
cannot take a size (the low-latency kernel past 64 KiB per part, NCCL where it cannot run)
is refused there, and a mover that only NCCL serves is not measured. Their rows go under
the entry's ``collectives`` with the mover's name; ``auto`` then hands each size to its
winner (``pool_copy.PoolCopy._sized``).

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
import dataclasses
import os
import shlex
import socket
import sys
import time
from collections.abc import Sequence

from ubnext._environment.config import TABLE_MODES, Config
from ubnext._environment.devices import device_name
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import COLLECTIVES, DTYPES, KERNEL_DTYPES, MOVER_TABLES
from ubnext._protocol.errors import UbnextError
from ubnext._selection.table import Machine, human_bytes
from ubnext._tools.cli import run_or_abort, size_arg, size_list
from ubnext._tools.dependent import GEMM_SHAPE, gemm_arg
from ubnext._tools.tune_measure import call_counts, candidates, measure
from ubnext._tools.tune_table import (entry_of, existing_document, merged_document, quantized_thresholds, report,
                                      table_rows, winner, write_atomically)


#: what a run may tune: the reductions' collectives, then the data movers'
TUNED = (*COLLECTIVES, *MOVER_TABLES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ubnext.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16",
                   help=f"comma-separated dtypes to tune, or all ({', '.join(KERNEL_DTYPES)}; default bfloat16)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help=f"comma-separated collectives to tune, all_reduce among them (its rows are the entry's "
                        f"tables, which every entry has), the data movers {', '.join(MOVER_TABLES)} too; sizes "
                        f"are whole messages: the reduce-scatter's input, the all-gather's output, the "
                        f"all-to-all's input (default {','.join(COLLECTIVES)})")
    p.add_argument("--movers", action="store_true",
                   help=f"also tune the data movers ({', '.join(MOVER_TABLES)}): each of ubnext's forms of them "
                        f"and NCCL, in the same run")
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
    order of :data:`TUNED`, the movers added by ``--movers``), and sets ``gemm`` in the dependent mode (None in the graph mode)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.dtypes = list(KERNEL_DTYPES) if args.dtype == "all" else [d for d in args.dtype.split(",") if d]
    unknown = [d for d in args.dtypes if d not in KERNEL_DTYPES]
    if unknown or not args.dtypes:
        parser.error(f"--dtype: unknown {', '.join(unknown) or '(none)'}; use {', '.join(KERNEL_DTYPES)} or all")
    wanted = [c for c in args.collectives.split(",") if c] + (list(MOVER_TABLES) if args.movers else [])
    unknown = [c for c in wanted if c not in TUNED]
    if unknown:
        parser.error(f"--collectives: unknown {', '.join(unknown)}; use {', '.join(TUNED)}")
    if "all_reduce" not in wanted:  # a new entry could not be written without its rows
        parser.error("--collectives: all_reduce is always measured (its rows are the entry's tables, which every "
                     "entry has); add the others to it, e.g. all_reduce,reduce_scatter")
    args.collectives = [c for c in TUNED if c in wanted]
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
                if len(candidates(comm, collective)) < 2:  # a mover that only NCCL serves
                    say(f"# {collective}: only NCCL serves it; nothing to choose, not measured", flush=True)
                    continue
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
