"""Side-by-side all-reduce latency: ubnext's algorithms, NCCL, PyTorch symmetric memory.

    mpirun -n 4 python bench/compare.py --minbytes 2K --maxbytes 256M
    mpirun -n 4 python bench/compare.py --collectives all_reduce,broadcast,all_to_all,sendrecv

For each size (``-b``..``-e``, times ``-f``) and each candidate:

* ``ubnext-auto`` and ``ubnext-<name>`` for every name in ``comm.algorithms()``,
  in place on symmetric memory (``comm.empty``, the zero-copy path);
* ``nccl``: the real NCCL (``ubnext._engine.nccl.NcclComm``), in place on plain cupy memory;
* when torch imports: ``torch-nccl`` (``torch.distributed.all_reduce``, in place on a plain
  tensor: the eager reference of a PyTorch user), and
* ``nccl-symmetric`` (``--nccl-symmetric``, default when torch has it): NCCL's
  symmetric-memory kernels: ``torch.distributed.all_reduce`` in place on a tensor of torch's
  symmetric memory with its NCCL backend (a registered NCCL window). One all-reduce is
  profiled first; without an NCCL symmetric kernel in it the candidate is left out, with
  the reason printed. Needs ``NCCL_NVLS_ENABLE=0`` (multicast stays off);
* ``torch-oneshot`` (``torch.ops.symm_mem.one_shot_all_reduce_out``, symmetric input, plain
  output) and ``torch-twoshot`` (``torch.ops.symm_mem.two_shot_all_reduce_``, in place on
  symmetric memory), on torch's CUDA backend, so only with ``--nccl-symmetric 0``: torch
  has one symmetric-memory backend per process;

the result is checked once (exact sums, compared bit for bit), then timed per mode,
``--repeats`` times each:

* ``eager``: ``-n`` back-to-back calls between CUDA events;
* ``graph``: ``-n`` back-to-back calls captured once in a CUDA graph, launched ``-G`` times;
* ``dependent``: what a tensor-parallel model runs: a graph of ``-n`` (GEMM, all-reduce)
  pairs, the GEMM (``--gemm M,K,N``, on the same stream) writing the all-reduce's input,
  launched ``-G`` times; a graph of the ``-n`` GEMMs alone is timed right after each
  sample and subtracted. Checked in that mode: the GEMM's output is exact small
  integers, its region is poisoned with NaN before one replay of (GEMM, all-reduce), and
  the result is compared bit for bit.

``--collectives`` adds the data movers to the same run (``broadcast``, ``all_to_all``,
``sendrecv``; default ``all_reduce`` alone): each with ubnext's algorithms of it, ``nccl``,
``torch-nccl`` and, where NCCL runs a symmetric kernel for it, ``nccl-symmetric``
(bench/_compare_moves.py), in the eager and graph modes (the dependent mode's GEMM writes
an all-reduce's input: all-reduce only), each checked bit for bit, with tables and a JSON
(``<name>_<collective>.json``) of their own.

A time is combined over ranks per ``-a`` (default: maximum); the table shows
the median of the repeats. A candidate that refuses a size (raises before
launching) is shown as "—".

Rank 0 prints a table per mode with each candidate's median µs and its ratio to the
faster NCCL at that size: the fastest of ``nccl``, ``torch-nccl`` and ``nccl-symmetric``
in this run (> 1: faster than it; the ``vs`` column names it); in the dependent mode a
second table has the raw times (GEMM included). It shows progress on stderr and writes
``<outdir>/<name>.json`` (machine, GPU, date, world size, dtype, command line, every raw
number) plus PNG plots made by ``bench/plot.py``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script (python bench/compare.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _compare_moves as moves  # noqa: E402
from bench import _compare_torch as ct  # noqa: E402
from bench import plot  # noqa: E402
from bench._torchbench import keep_multicast_off  # noqa: E402
from bench.all_reduce_perf import ALL_REDUCE, NcclEngine, UbnextEngine, nccl_version, pool_mb_for  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("eager", "graph", "dependent")
#: the NCCL candidates; each ratio is against the fastest of them at that size
NCCL_NAMES = ("nccl", "torch-nccl", "nccl-symmetric")
#: what ``--collectives`` takes: the all-reduce, then the data movers
COLLECTIVES = {"all_reduce": ALL_REDUCE, **moves.COLLECTIVES}


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The command line (size flags as in all_reduce_perf)."""
    p = argparse.ArgumentParser(prog="compare", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=common.size_arg, default=2 << 10, help="smallest size (default 2K)")
    p.add_argument("-e", "--maxbytes", type=common.size_arg, default=256 << 20, help="largest size (default 256M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("-d", "--datatype", default="bfloat16", help="half, float or bfloat16 (default bfloat16)")
    p.add_argument("-o", "--op", default="sum", help="sum, max, min or avg (default sum; torch: sum only)")
    p.add_argument("-n", "--iters", type=int, default=20, help="calls per timed sample (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed calls per mode (default 5)")
    p.add_argument("-G", "--cudagraph", type=int, default=10,
                   help="graph launches per graph-mode sample (default 10)")
    p.add_argument("--repeats", type=int, default=5, help="samples per size and mode; the median is shown (default 5)")
    p.add_argument("--modes", default="eager,graph,dependent",
                   help="comma-separated: eager, graph, dependent (default all three)")
    p.add_argument("--gemm", type=common.gemm_arg, default=common.GEMM_SHAPE,
                   help="M,K,N of the GEMM before each all-reduce in the dependent mode (default 64,4096,4096)")
    p.add_argument("-a", "--average", type=int, default=3, choices=sorted(common.AVERAGE_MODES),
                   help="time over ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum (default 3)")
    p.add_argument("--torch", choices=("auto", "0", "1"), default="auto",
                   help="PyTorch candidates: auto (when torch imports), 0, 1")
    p.add_argument("--nccl-symmetric", choices=("auto", "0", "1"), default="auto",
                   help="NCCL's symmetric kernels on torch's symmetric memory: auto (where available; "
                        "torch-oneshot/twoshot then left out), 0 (torch-oneshot/twoshot instead), 1 (required)")
    p.add_argument("--collectives", default="all_reduce",
                   help=f"comma-separated, in one run: {', '.join(COLLECTIVES)} (default all_reduce)")
    p.add_argument("--name", default="", help="results file stem (default: compare_<gpu>_<n>gpu_<dtype>_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR, help="where JSON and PNG go (default bench/results)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; adds ``dtype`` (a DType), ``sizes`` and ``mode_list``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        dtypes, ops = common.parse_dtypes(args.datatype), common.parse_ops(args.op)
        if len(dtypes) != 1 or len(ops) != 1:
            raise ValueError("compare takes one datatype and one op")
        args.dtype, args.op = dtypes[0], ops[0]
        args.sizes = common.size_list(args.minbytes, args.maxbytes, 0, args.stepfactor)
    except ValueError as exc:
        parser.error(str(exc))
    args.collective_list = [c for c in COLLECTIVES if c in args.collectives.split(",")]
    unknown = [c for c in args.collectives.split(",") if c and c not in COLLECTIVES]
    if unknown or not args.collective_list:
        parser.error(f"--collectives takes a comma-separated subset of {', '.join(COLLECTIVES)}")
    args.mode_list = [m for m in args.modes.split(",") if m]
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        parser.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}")
    if min(args.iters, args.repeats) < 1 or args.warmup_iters < 0 or args.cudagraph < 1:
        parser.error("--iters, --repeats and -G must be >= 1, -w >= 0")
    return args


# --------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    """One implementation under test.

    Attributes:
        name: column label.
        placement: ``"in-place"`` or ``"out-of-place"``.
        send, recv: full-size 1-D arrays (cupy or torch); the same object when in place.
        engine: has ``all_reduce(send, recv, dtype, op, stream)`` (``ALL_REDUCE.run`` calls it).
        refuses: ``exc -> bool``: whether an exception from the engine means "not this
            size or dtype" (shown as "—") rather than a failure.
        ops: reduction ops it implements.
    """

    name: str
    placement: str
    send: Any
    recv: Any
    engine: Any
    refuses: Any
    ops: tuple[str, ...] = common.OPS


def ubnext_refuses(exc: BaseException) -> bool:
    """Whether ``exc`` is ubnext refusing its arguments (not a CUDA error or a timeout)."""
    from ubnext._protocol.errors import CollectiveTimeoutError, CudaError, UbnextError

    fatal = isinstance(exc, (CudaError, CollectiveTimeoutError))
    return isinstance(exc, (ValueError, UbnextError)) and not fatal


def ubnext_candidates(comm: Any, dtype: common.DType, count: int) -> list[Candidate]:
    """``ubnext-auto`` and one candidate per algorithm, sharing one buffer. Collective.

    The buffer is symmetric memory (``comm.empty``) unless the communicator
    has no pool (it runs everything on NCCL).
    """
    if comm.algorithms() == ["nccl"]:
        import cupy

        buf = cupy.empty((count,), dtype=dtype.numpy)
    else:
        buf = comm.empty((count,), dtype.ubnext)
    return [Candidate(f"ubnext-{algo}", "in-place", buf, buf, UbnextEngine(comm, algo), ubnext_refuses)
            for algo in ("auto", *comm.algorithms())]


def nccl_candidate(nccl: Any, dtype: common.DType, count: int) -> Candidate:
    """The real NCCL, in place on plain cupy memory."""
    import cupy

    buf = cupy.empty((count,), dtype=dtype.numpy)
    return Candidate("nccl", "in-place", buf, buf, NcclEngine(nccl), lambda exc: isinstance(exc, ValueError))


# --------------------------------------------------------------------------- measuring


@dataclass
class Session:
    """The open communicators, the stream and the candidates of one run."""

    comm: Any
    nccl: Any
    stream: Any
    candidates: list[Candidate]
    torch_used: bool
    records: list[dict[str, Any]] = field(default_factory=list)
    #: candidates left out, with the reason (printed, and kept in the JSON)
    left_out: dict[str, str] = field(default_factory=dict)
    #: the NCCL symmetric kernels the probe saw
    symmetric_kernels: list[str] = field(default_factory=list)
    #: the dependent mode's GEMM operands, and per candidate the launch of its GEMM into its input
    gemm_data: common.GemmData | None = None
    gemms: dict[str, Any] = field(default_factory=dict)
    #: the collective measured (``--collectives``: a key of COLLECTIVES) and its record
    label: str = "all_reduce"
    collective: common.Collective = ALL_REDUCE

    @property
    def bootstrap(self) -> Any:
        return self.comm.bootstrap

    def close(self) -> None:
        """Collective: tears down torch.distributed, NCCL and the communicator."""
        if self.torch_used:
            import torch.distributed as dist

            dist.destroy_process_group()
        self.nccl.close()
        self.comm.close()


def open_sessions(args: argparse.Namespace) -> list[Session]:
    """Create the communicators, the stream and, per collective of ``--collectives``, a
    Session with its candidates (all sharing the communicators). Collective."""
    import cupy

    import ubnext
    from ubnext._engine.nccl import NcclComm

    count = ALL_REDUCE.count(args.maxbytes, args.dtype.itemsize, 1)
    dependent = "dependent" in args.mode_list and "all_reduce" in args.collective_list
    if dependent:  # every input buffer holds the GEMM's whole output
        count = max(count, args.gemm[0] * args.gemm[2])
    comm = ubnext.Communicator(**pool_mb_for(count * args.dtype.itemsize))
    cupy.cuda.Device(comm.device).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    nccl = NcclComm(comm.bootstrap, comm.device)
    nccl.connect()
    use_torch = ct.wanted(args.torch)
    reason = ct.torch_setup(comm.bootstrap, comm.device, stream, args.nccl_symmetric != "0") if use_torch else None
    sessions = []
    for label in args.collective_list:
        if label == "all_reduce":
            candidates = ubnext_candidates(comm, args.dtype, count) + [nccl_candidate(nccl, args.dtype, count)]
        else:
            n = COLLECTIVES[label].count(args.maxbytes, args.dtype.itemsize, comm.size)
            candidates = (moves.ubnext_candidates(comm, label, args.dtype, n, Candidate, ubnext_refuses)
                          + [moves.nccl_candidate(nccl, label, args.dtype, n, Candidate)])
        left_out, kernels = {}, []
        if use_torch and label == "all_reduce":
            more, left_out, kernels = ct.all_reduce_candidates(comm.bootstrap, comm.device, args.dtype, count,
                                                               Candidate, reason)
            candidates += more
        elif use_torch:
            more, left_out, kernels = ct.mover_candidates(comm.bootstrap, comm.device, label, args.dtype, n,
                                                          Candidate, reason)
            candidates += more
        else:
            left_out["nccl-symmetric"] = "needs torch (--torch 0, or torch does not import)"
        if args.nccl_symmetric == "1" and "nccl-symmetric" in left_out and label == "all_reduce":
            raise RuntimeError(f"compare: --nccl-symmetric 1, but NCCL symmetric is not to be had: "
                               f"{left_out['nccl-symmetric']}")
        if label != "all_reduce" and "dependent" in args.mode_list:
            left_out["dependent mode"] = "all_reduce only (its GEMM writes an all-reduce's input)"
        candidates = [c for c in candidates if args.op in c.ops]
        sessions.append(Session(comm, nccl, stream, candidates, use_torch, left_out=left_out,
                                symmetric_kernels=kernels, label=label, collective=COLLECTIVES[label]))
    if dependent:
        s = sessions[0]  # the all-reduce's
        s.gemm_data = common.GemmData(args.gemm, comm.size)
        into = common.gemm_launcher(s.gemm_data, comm.rank, args.dtype, use_torch, stream)
        s.gemms = {c.name: into(c.send) for c in s.candidates}
    return sessions


def trial(s: Session, cand: Candidate, dtype: common.DType, op: str, count: int, seed: int) -> tuple[str, int]:
    """Run once on known data: ``("ok", wrong elements over ranks)`` or ``("skipped", reason)``.

    Ranks agree on whether the candidate accepted the size before anyone waits
    for the GPU, so a refusal never leaves a rank waiting. Collective.

    Raises:
        RuntimeError: some ranks refused and others did not.
    """
    send, recv = cand.send[:count], cand.recv[:count]
    mine, expected = s.collective.data(s.bootstrap.size, s.bootstrap.rank, count, seed, op)
    common.upload(send, mine, dtype, s.stream)
    if cand.placement == "out-of-place":
        common.poison(recv, count, dtype, s.stream)
    reason = ""
    try:
        s.collective.run(cand.engine, send, recv, dtype, op, s.stream)
    except Exception as exc:
        if not cand.refuses(exc):
            raise
        reason = f"{type(exc).__name__}: {exc}"
    reasons = s.bootstrap.allgather_obj(reason)
    if any(reasons) and not all(reasons):
        raise RuntimeError(f"compare: ranks disagree whether {cand.name} takes {count} elements: {reasons}")
    if reason:
        return "skipped", reason.splitlines()[0]
    got = common.download(recv, count, dtype, s.stream)
    tol = common.tolerance(op, s.bootstrap.size, dtype) if s.collective.reduces else 0.0
    wrong = common.count_wrong(got, common.encode(expected, dtype), dtype, tol)
    return "ok", int(sum(common.allgather_float(s.bootstrap, float(wrong))))


def samples(s: Session, cand: Candidate, count: int, op: str, mode: str, args: argparse.Namespace) -> list[float]:
    """``--repeats`` times per call in µs, each combined over ranks per ``-a``. Collective."""
    send, recv = cand.send[:count], cand.recv[:count]

    def launch() -> None:
        s.collective.run(cand.engine, send, recv, args.dtype, op, s.stream)

    for _ in range(args.warmup_iters):
        launch()
    launches = args.cudagraph if mode == "graph" else 0
    sample = common.timer(launch, s.stream, args.iters, launches, s.bootstrap.barrier)
    return [common.combine(common.allgather_float(s.bootstrap, sample()), args.average) * 1e6
            for _ in range(args.repeats)]


def dependent_trial(s: Session, cand: Candidate, dtype: common.DType, op: str, count: int) -> int:
    """The dependent mode's check: wrong elements over ranks after one replay of a graph of
    (GEMM, all-reduce). Collective.

    The GEMM's output region is poisoned with NaN first (zeros past it, as the mode runs),
    so an all-reduce that read its input before the GEMM wrote it reads NaN; the result
    must equal the exact all-reduce of the GEMM outputs bit for bit.
    """
    data, gemm = s.gemm_data, s.gemms[cand.name]
    send, recv = cand.send[:count], cand.recv[:count]
    common.poison(cand.send, data.elements, dtype, s.stream)
    if count > data.elements:
        common.upload(cand.send[data.elements:count], np.zeros(count - data.elements), dtype, s.stream)
    if cand.placement == "out-of-place":
        common.poison(recv, count, dtype, s.stream)

    def pair() -> None:
        gemm()
        ALL_REDUCE.run(cand.engine, send, recv, dtype, op, s.stream)

    common.capture_graph(pair, s.stream, 1).launch(s.stream)
    got = common.download(recv, count, dtype, s.stream)
    want = common.encode(data.expected(count, op), dtype)
    wrong = common.count_wrong(got, want, dtype, common.tolerance(op, s.bootstrap.size, dtype))
    return int(sum(common.allgather_float(s.bootstrap, float(wrong))))


def dependent_samples(s: Session, cand: Candidate, count: int, op: str, args: argparse.Namespace) -> dict[str, Any]:
    """The dependent mode's ``--repeats`` samples (:func:`common.dependent_samples`): µs per
    all-reduce with the GEMMs' time subtracted (``times_us``), the raw (GEMM + all-reduce)
    and the GEMMs alone, each combined over ranks per ``-a``. Collective."""
    gemm = s.gemms[cand.name]
    send, recv = cand.send[:count], cand.recv[:count]

    def pair() -> None:
        gemm()
        ALL_REDUCE.run(cand.engine, send, recv, args.dtype, op, s.stream)

    def sampler(fn: Any) -> Any:
        sample = common.timer(fn, s.stream, args.iters, args.cudagraph, s.bootstrap.barrier)
        return lambda: common.combine(common.allgather_float(s.bootstrap, sample()), args.average) * 1e6

    for _ in range(args.warmup_iters):
        pair()
    return common.dependent_samples(sampler(pair), sampler(gemm), args.repeats)


def sweep(s: Session, args: argparse.Namespace, progress: Any) -> None:
    """Measure every size × candidate × mode into ``s.records``. Collective."""
    dtype, nranks = args.dtype, s.bootstrap.size
    total, done, seed = len(args.sizes) * len(s.candidates), 0, 0
    for nbytes in args.sizes:
        count = s.collective.count(nbytes, dtype.itemsize, nranks)
        for cand in s.candidates:
            done += 1
            progress(f"[{done}/{total}] {common.human_bytes(nbytes):>8}  {cand.name}"
                     + ("" if s.label == "all_reduce" else f" ({s.label})"))
            seed += 1
            status, detail = trial(s, cand, dtype, args.op, count, seed)
            for mode in [m for m in args.mode_list if m != "dependent" or s.label == "all_reduce"]:
                rec = {"candidate": cand.name, "placement": cand.placement, "mode": mode,
                       "bytes": count * dtype.itemsize, "count": count, "status": status,
                       "wrong": detail if status == "ok" else None,
                       "reason": detail if status != "ok" else "", "times_us": []}
                if status == "ok" and mode == "dependent":
                    rec["wrong"] = dependent_trial(s, cand, dtype, args.op, count)
                    rec.update(dependent_samples(s, cand, count, args.op, args))
                    rec["raw_median_us"] = statistics.median(rec["raw_us"])
                    rec["gemm_median_us"] = statistics.median(rec["gemm_us"])
                elif status == "ok":
                    rec["times_us"] = samples(s, cand, count, args.op, mode, args)
                if status == "ok":
                    rec["median_us"] = statistics.median(rec["times_us"])
                    rec["busbw_GBps"] = s.collective.bandwidths(rec["bytes"], rec["median_us"] / 1e6, nranks)[1]
                s.records.append(rec)


# --------------------------------------------------------------------------- reporting


def faster_nccl(at_size: dict[str, dict[str, Any]], key: str = "median_us") -> tuple[str, float] | None:
    """``(name, time)`` of the fastest NCCL candidate (:data:`NCCL_NAMES`) among ``at_size``
    (candidate -> record, one size and mode) by ``key``; only correct, positive times count.
    None when no NCCL candidate has one."""
    times = [(rec[key], name) for name, rec in at_size.items()
             if name in NCCL_NAMES and rec["status"] == "ok" and not rec["wrong"] and rec.get(key, 0) > 0]
    if not times:
        return None
    time_us, name = min(times)
    return name, time_us


def table(records: list[dict[str, Any]], mode: str, names: list[str], key: str = "median_us",
          what: str = "median us per all-reduce") -> list[str]:
    """``key`` per size (rows) and candidate (columns), each with its ratio faster NCCL /
    candidate, the faster NCCL (:func:`faster_nccl`) of that size named in column ``vs``."""
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        if r["mode"] == mode:
            by_size.setdefault(r["bytes"], {})[r["candidate"]] = r
    width = max(18, *(len(n) + 2 for n in names))
    lines = [f"# {mode}: {what}; (x) = faster NCCL's time / candidate's time at that size "
             f"(> 1: faster than the faster NCCL, named under vs)",
             f"{'size':>10}{'vs':>16}" + "".join(f"{n:>{width}}" for n in names)]
    for nbytes in sorted(by_size):
        ref = faster_nccl(by_size[nbytes], key)
        cells = []
        for name in names:
            rec = by_size[nbytes].get(name)
            if rec is None or rec["status"] != "ok":
                cells.append(f"{'—':>{width}}")
                continue
            value = rec[key]
            text = f"{value:.2f}" + (f" ({ref[1] / value:.2f}x)" if ref and value > 0 else "")
            if rec["wrong"]:
                text += " WRONG"
            cells.append(f" {text:>{width - 1}}")  # a space between cells, even where one overflows
        lines.append(f"{common.human_bytes(nbytes):>10}{ref[0] if ref else '—':>16}" + "".join(cells))
    return lines


def tables(records: list[dict[str, Any]], mode: str, names: list[str], per: str = "all-reduce") -> list[str]:
    """The tables of one mode (``per``: what one call is): the dependent mode's subtracted
    times, then its raw ones."""
    if mode != "dependent":
        return table(records, mode, names, what=f"median us per {per}")
    return (table(records, mode, names, what="median us per all-reduce after a GEMM on its input, "
                  "the GEMMs' own graph time subtracted")
            + table(records, mode, names, "raw_median_us", "raw: median us per GEMM + all-reduce"))


def machine_info(device: int) -> dict[str, Any]:
    """Host, GPU and library versions for the JSON report."""
    import cupy

    info = {"hostname": socket.gethostname(), "gpu": common.device_properties(device)["name"],
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cupy": cupy.__version__,
            "nccl": nccl_version()}
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    return info


def default_name(gpu: str, nranks: int, dtype: common.DType) -> str:
    """``compare_NVIDIA-H200_4gpu_bfloat16_20260101-120000``."""
    slug = "-".join(gpu.replace("/", " ").split())
    return f"compare_{slug}_{nranks}gpu_{dtype.name}_{time.strftime('%Y%m%d-%H%M%S')}"


def report(s: Session, args: argparse.Namespace, argv: list[str]) -> None:
    """Rank 0: print the tables, write the JSON (a data mover's: ``<name>_<collective>``) and
    the plots."""
    names = [c.name for c in s.candidates]
    per = "all-reduce" if s.label == "all_reduce" else s.collective.name
    if s.label != "all_reduce":
        print(f"# {per} ({s.label}): bit for bit; busbw per nccl-tests", flush=True)
    for name, reason in s.left_out.items():
        print(f"# {name} left out: {reason}", flush=True)
    for mode in sorted({r["mode"] for r in s.records}, key=args.mode_list.index):
        print("\n".join(tables(s.records, mode, names, per)), flush=True)
    machine = machine_info(s.comm.device)
    doc = {
        "kind": "ubnext.compare", "version": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine, "world_size": s.bootstrap.size, "dtype": args.dtype.name, "op": args.op,
        "collective": s.label,
        "command": shlex.join([sys.executable, *sys.argv[:1], *argv]),
        "env": common.environment_subset(),
        "config": {"iters": args.iters, "warmup_iters": args.warmup_iters, "graph_launches": args.cudagraph,
                   "repeats": args.repeats, "average": common.AVERAGE_MODES[args.average], "modes": args.mode_list,
                   "timer": "cuda events", "sizes": args.sizes, "gemm_mnk": list(args.gemm),
                   "ratio_reference": f"fastest of {', '.join(NCCL_NAMES)} at each size"},
        "candidates": [{"name": c.name, "placement": c.placement} for c in s.candidates],
        "left_out": s.left_out, "nccl_symmetric_kernels": s.symmetric_kernels,
        "results": s.records,
    }
    os.makedirs(args.outdir, exist_ok=True)
    name = args.name or default_name(machine["gpu"], s.bootstrap.size, args.dtype)
    if s.label != "all_reduce":
        name += f"_{s.label}"
    path = common.write_json(os.path.join(args.outdir, name + ".json"), doc)
    print(f"# wrote {path}", flush=True)
    try:
        for png in plot.plot_file(path):
            print(f"# wrote {png}", flush=True)
    except ImportError as exc:
        print(f"# no plots ({exc}); run 'python bench/plot.py {path}' where matplotlib is installed", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]``. Collective over ``MPI.COMM_WORLD``."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    keep_multicast_off()
    sessions = open_sessions(args)
    try:
        s = sessions[0]
        rank0 = s.bootstrap.rank == 0
        if rank0 and not args.name:  # one stem for every collective's file
            args.name = default_name(common.device_properties(s.comm.device)["name"], s.bootstrap.size, args.dtype)

        def progress(text: str) -> None:
            if rank0:
                sys.stderr.write(f"\r{text:<60}")
                sys.stderr.flush()

        for s in sessions:
            sweep(s, args, progress)
        progress("done")
        if rank0:
            sys.stderr.write("\n")
            for s in sessions:
                report(s, args, argv)
        wrong = any(r["status"] == "ok" and r["wrong"] for s in sessions for r in s.records)
    finally:
        sessions[0].close()  # the communicators all sessions share
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
