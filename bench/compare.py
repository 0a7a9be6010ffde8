"""Side-by-side all-reduce latency: ubnext's algorithms, NCCL, PyTorch symmetric memory.

    mpirun -n 4 python bench/compare.py --minbytes 2K --maxbytes 256M

For each size (``-b``..``-e``, times ``-f``) and each candidate:

* ``ubnext-auto`` and ``ubnext-<name>`` for every name in ``comm.algorithms()``,
  in place on symmetric memory (``comm.empty``, the zero-copy path);
* ``nccl``: the real NCCL (``ubnext._engine.nccl.NcclComm``), in place on plain cupy memory;
* when torch imports: ``torch-oneshot`` (``torch.ops.symm_mem.one_shot_all_reduce_out``,
  symmetric input, plain output), ``torch-twoshot``
  (``torch.ops.symm_mem.two_shot_all_reduce_``, in place on symmetric memory) and
  ``torch-nccl`` (``torch.distributed.all_reduce``, in place on a plain tensor: the
  eager reference of a PyTorch user);

the result is checked once (exact sums, compared bit for bit), then timed
eagerly (``-n`` back-to-back calls between CUDA events) and from a CUDA graph
(``-n`` calls captured once, launched ``-G`` times), ``--repeats`` times each.
A time is combined over ranks per ``-a`` (default: maximum); the table shows
the median of the repeats. A candidate that refuses a size (raises before
launching) is shown as "—".

Rank 0 prints a table per mode with each candidate's median µs and its ratio
NCCL time / candidate time (> 1: faster than NCCL), shows progress on stderr,
and writes ``<outdir>/<name>.json`` (machine, GPU, date, world size, dtype,
command line, every raw number) plus PNG plots made by ``bench/plot.py``.
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

if __package__ in (None, ""):  # run as a script (python bench/compare.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import plot  # noqa: E402
from bench._torchbench import init_distributed, keep_multicast_off  # noqa: E402
from bench.all_reduce_perf import ALL_REDUCE, NcclEngine, UbnextEngine, nccl_version, pool_mb_for  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("eager", "graph")


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
    p.add_argument("--modes", default="eager,graph", help="comma-separated: eager, graph (default both)")
    p.add_argument("-a", "--average", type=int, default=3, choices=sorted(common.AVERAGE_MODES),
                   help="time over ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum (default 3)")
    p.add_argument("--torch", choices=("auto", "0", "1"), default="auto",
                   help="PyTorch symmetric-memory candidates: auto (when torch imports), 0, 1")
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


def torch_candidates(bootstrap: Any, device: int, dtype: common.DType, count: int, stream: Any) -> list[Candidate]:
    """``torch-oneshot`` and ``torch-twoshot`` over torch.distributed (NCCL backend). Collective.

    torch.distributed is initialized from the bootstrap (RANK, WORLD_SIZE;
    MASTER_ADDR 127.0.0.1 and a free port of rank 0 unless already set), and
    torch's current stream becomes ``stream``. Call :func:`keep_multicast_off`
    before torch is first imported.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    init_distributed(bootstrap, device)
    group = dist.group.WORLD.group_name
    torch.cuda.set_stream(torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", device)))
    tdtype = getattr(torch, dtype.ubnext)
    one_in = symm_mem.empty(count, dtype=tdtype, device=f"cuda:{device}")
    one_out = torch.empty(count, dtype=tdtype, device=f"cuda:{device}")
    two = symm_mem.empty(count, dtype=tdtype, device=f"cuda:{device}")
    for t in (one_in, two):
        symm_mem.rendezvous(t, group)

    plain = torch.empty(count, dtype=tdtype, device=f"cuda:{device}")
    ops = torch.ops.symm_mem
    one_shot = TorchEngine(lambda send, recv, op: ops.one_shot_all_reduce_out(send, op, group, out=recv))
    two_shot = TorchEngine(lambda send, recv, op: ops.two_shot_all_reduce_(send, op, group))
    nccl = TorchEngine(lambda send, recv, op: dist.all_reduce(send))
    return [
        Candidate("torch-oneshot", "out-of-place", one_in, one_out, one_shot, _torch_refuses, ("sum",)),
        Candidate("torch-twoshot", "in-place", two, two, two_shot, _torch_refuses, ("sum",)),
        Candidate("torch-nccl", "in-place", plain, plain, nccl, _torch_refuses, ("sum",)),
    ]


@dataclass(frozen=True)
class TorchEngine:
    """An engine over a ``torch.ops.symm_mem`` call ``fn(send, recv, op)``.

    The ops take no stream argument: they run on torch's current stream,
    which :func:`torch_candidates` sets to the benchmark's stream.
    """

    fn: Any

    def all_reduce(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.fn(send, recv, op)


def _torch_refuses(exc: BaseException) -> bool:
    """torch reports unsupported sizes and dtypes as RuntimeError (NotImplementedError included)."""
    return isinstance(exc, RuntimeError)


def _torch_wanted(choice: str) -> bool:
    if choice != "auto":
        return choice == "1"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


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


def open_session(args: argparse.Namespace) -> Session:
    """Create communicators, stream and candidates. Collective."""
    import cupy

    import ubnext
    from ubnext._engine.nccl import NcclComm

    count = ALL_REDUCE.count(args.maxbytes, args.dtype.itemsize, 1)
    comm = ubnext.Communicator(**pool_mb_for(count * args.dtype.itemsize))
    cupy.cuda.Device(comm.device).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    nccl = NcclComm(comm.bootstrap, comm.device)
    nccl.connect()
    candidates = ubnext_candidates(comm, args.dtype, count) + [nccl_candidate(nccl, args.dtype, count)]
    use_torch = _torch_wanted(args.torch)
    if use_torch:
        candidates += torch_candidates(comm.bootstrap, comm.device, args.dtype, count, stream)
    candidates = [c for c in candidates if args.op in c.ops]
    return Session(comm, nccl, stream, candidates, use_torch)


def trial(s: Session, cand: Candidate, dtype: common.DType, op: str, count: int, seed: int) -> tuple[str, int]:
    """Run once on known data: ``("ok", wrong elements over ranks)`` or ``("skipped", reason)``.

    Ranks agree on whether the candidate accepted the size before anyone waits
    for the GPU, so a refusal never leaves a rank waiting. Collective.

    Raises:
        RuntimeError: some ranks refused and others did not.
    """
    send, recv = cand.send[:count], cand.recv[:count]
    common.upload(send, common.make_input(s.bootstrap.rank, s.bootstrap.size, count, seed), dtype, s.stream)
    if cand.placement == "out-of-place":
        common.poison(recv, count, dtype, s.stream)
    reason = ""
    try:
        ALL_REDUCE.run(cand.engine, send, recv, dtype, op, s.stream)
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
    want = common.encode(common.expected_output(s.bootstrap.size, count, seed, op), dtype)
    wrong = common.count_wrong(got, want, dtype, common.tolerance(op, s.bootstrap.size, dtype))
    return "ok", int(sum(common.allgather_float(s.bootstrap, float(wrong))))


def samples(s: Session, cand: Candidate, count: int, op: str, mode: str, args: argparse.Namespace) -> list[float]:
    """``--repeats`` times per call in µs, each combined over ranks per ``-a``. Collective."""
    send, recv = cand.send[:count], cand.recv[:count]

    def launch() -> None:
        ALL_REDUCE.run(cand.engine, send, recv, args.dtype, op, s.stream)

    for _ in range(args.warmup_iters):
        launch()
    launches = args.cudagraph if mode == "graph" else 0
    sample = common.timer(launch, s.stream, args.iters, launches, s.bootstrap.barrier)
    return [common.combine(common.allgather_float(s.bootstrap, sample()), args.average) * 1e6
            for _ in range(args.repeats)]


def sweep(s: Session, args: argparse.Namespace, progress: Any) -> None:
    """Measure every size × candidate × mode into ``s.records``. Collective."""
    dtype, nranks = args.dtype, s.bootstrap.size
    total, done, seed = len(args.sizes) * len(s.candidates), 0, 0
    for nbytes in args.sizes:
        count = ALL_REDUCE.count(nbytes, dtype.itemsize, nranks)
        for cand in s.candidates:
            done += 1
            progress(f"[{done}/{total}] {common.human_bytes(nbytes):>8}  {cand.name}")
            seed += 1
            status, detail = trial(s, cand, dtype, args.op, count, seed)
            for mode in args.mode_list:
                rec = {"candidate": cand.name, "placement": cand.placement, "mode": mode,
                       "bytes": count * dtype.itemsize, "count": count, "status": status,
                       "wrong": detail if status == "ok" else None,
                       "reason": detail if status != "ok" else "", "times_us": []}
                if status == "ok":
                    rec["times_us"] = samples(s, cand, count, args.op, mode, args)
                    rec["median_us"] = statistics.median(rec["times_us"])
                    rec["busbw_GBps"] = ALL_REDUCE.bandwidths(rec["bytes"], rec["median_us"] / 1e6, nranks)[1]
                s.records.append(rec)


# --------------------------------------------------------------------------- reporting


def table(records: list[dict[str, Any]], mode: str, names: list[str]) -> list[str]:
    """Median µs per size (rows) and candidate (columns) with the ratio NCCL / candidate."""
    by_key = {(r["bytes"], r["candidate"]): r for r in records if r["mode"] == mode}
    sizes = sorted({b for b, _ in by_key})
    width = max(18, *(len(n) + 2 for n in names))
    lines = [f"# {mode}: median us per all-reduce; (x) = NCCL time / candidate time, > 1 is faster than NCCL",
             f"{'size':>10}" + "".join(f"{n:>{width}}" for n in names)]
    for nbytes in sizes:
        nccl = by_key.get((nbytes, "nccl"), {}).get("median_us")
        cells = []
        for name in names:
            rec = by_key.get((nbytes, name))
            if rec is None or rec["status"] != "ok":
                cells.append(f"{'—':>{width}}")
                continue
            med = rec["median_us"]
            text = f"{med:.2f}" + (f" ({nccl / med:.2f}x)" if nccl and med > 0 else "")
            if rec["wrong"]:
                text += " WRONG"
            cells.append(f"{text:>{width}}")
        lines.append(f"{common.human_bytes(nbytes):>10}" + "".join(cells))
    return lines


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
    """Rank 0: print the tables, write the JSON and the plots."""
    names = [c.name for c in s.candidates]
    for mode in args.mode_list:
        print("\n".join(table(s.records, mode, names)), flush=True)
    machine = machine_info(s.comm.device)
    doc = {
        "kind": "ubnext.compare", "version": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine, "world_size": s.bootstrap.size, "dtype": args.dtype.name, "op": args.op,
        "command": shlex.join([sys.executable, *sys.argv[:1], *argv]),
        "env": common.environment_subset(),
        "config": {"iters": args.iters, "warmup_iters": args.warmup_iters, "graph_launches": args.cudagraph,
                   "repeats": args.repeats, "average": common.AVERAGE_MODES[args.average], "modes": args.mode_list,
                   "timer": "cuda events", "sizes": args.sizes},
        "candidates": [{"name": c.name, "placement": c.placement} for c in s.candidates],
        "results": s.records,
    }
    os.makedirs(args.outdir, exist_ok=True)
    name = args.name or default_name(machine["gpu"], s.bootstrap.size, args.dtype)
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
    s = open_session(args)
    try:
        rank0 = s.bootstrap.rank == 0

        def progress(text: str) -> None:
            if rank0:
                sys.stderr.write(f"\r{text:<60}")
                sys.stderr.flush()

        sweep(s, args, progress)
        progress("done")
        if rank0:
            sys.stderr.write("\n")
            report(s, args, argv)
        wrong = any(r["status"] == "ok" and r["wrong"] for r in s.records)
    finally:
        s.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
