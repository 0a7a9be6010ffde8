"""All-reduce benchmark with nccl-tests' flags, table and JSON: ubnext next to NCCL.

    mpirun -n 4 python bench/all_reduce_perf.py -b 8 -e 256M -f 2
    mpirun -n 4 python bench/all_reduce_perf.py -b 8 -e 256M -f 2 --backend nccl
    mpirun -n 4 python bench/all_reduce_perf.py -b 2K -e 1M -f 2 -d bfloat16 -G 10 --algo lamport

Every size is checked before it is timed: inputs are small integers whose sums
are exact in every dtype, outputs are poisoned with NaN first, and the result
is compared bit for bit (``#wrong``). Calls are timed on such inputs too, also with
``-c 0`` (the quantized kernels' speed depends on the values). An in-place all-reduce sum
grows by N a call and reaches infinities within the timed calls, whose quantized groups
then skip their arithmetic: a quantized row whose in-place data reached inf or NaN on any
rank ends with ``*`` (its JSON record ``"non_finite_data": true``) and a note below the
table says so; use its out-of-place columns. The time is measured with CUDA events
around ``-n`` back-to-back calls (eager), or around ``-G`` launches of a CUDA
graph holding ``-n`` calls, and combined over ranks per ``-a`` (as nccl-tests:
0 rank 0, 1 average, 2 minimum, 3 maximum). busbw = algbw * 2(n-1)/n.

``--backend nccl`` runs the real NCCL (``ubnext._engine.nccl.NcclComm``) on the same
kind of buffers, measured the same way, so both can be compared in one job.
``--backend nccl_symmetric`` runs NCCL's symmetric-memory kernels:
``torch.distributed.all_reduce`` on buffers of torch's symmetric memory with its NCCL
backend (registered NCCL windows; in place only, so the out-of-place columns read N/A).
One all-reduce is profiled first; where it runs no NCCL symmetric kernel, or
``NCCL_NVLS_ENABLE=0`` is not set, the run prints why and exits with status 2.
The exit status is 1 when any element was wrong.

The machinery serves every collective benchmark (a ``Program``: its name, its
``common.Collective``, the ubnext algorithms it may name): reduce_scatter_perf.py and
all_gather_perf.py run it with theirs.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script (python bench/all_reduce_perf.py): bench/_standalone.py
    import _standalone  # noqa: F401

import numpy as np  # noqa: E402

from bench import _common as common  # noqa: E402
from ubnext._protocol.quant import FORMATS as QUANT_FORMATS  # noqa: E402

PROGRAM = "all_reduce_perf"

def _quantized_all_reduce(inputs, fmt: str, op: str, rank: int):
    """What ubnext's quantized all-reduce stores on every rank (the host emulation)."""
    from ubnext._tools import reference

    return reference.quantized(inputs, fmt, op)


#: The all-reduce, as nccl-tests' all_reduce.cu describes it.
ALL_REDUCE = common.Collective(
    name="AllReduce",
    count=lambda nbytes, itemsize, nranks: nbytes // itemsize,
    bus_factor=lambda nranks: 2.0 * (nranks - 1) / nranks,
    run=lambda engine, send, recv, dtype, op, stream: engine.all_reduce(send, recv, dtype, op, stream),
    quantized=_quantized_all_reduce,
)


@dataclass(frozen=True)
class Program:
    """One collective benchmark: its name, collective and the ubnext algorithms ``--algo`` takes."""

    name: str
    collective: common.Collective
    algorithms: tuple[str, ...]


ALL_REDUCE_PERF = Program(PROGRAM, ALL_REDUCE, ("auto", "lamport", "twoshot", "nccl"))


# --------------------------------------------------------------------------- arguments


def build_parser(program: Program = ALL_REDUCE_PERF) -> argparse.ArgumentParser:
    """The command line: nccl-tests' flags and defaults, plus ubnext's own."""
    p = argparse.ArgumentParser(
        prog=program.name,
        description=f"ubnext {program.collective.name} benchmark (nccl-tests flags and output).",
    )
    p.add_argument("-b", "--minbytes", type=common.size_arg, default=32 << 20, help="smallest size (default 32M)")
    p.add_argument("-e", "--maxbytes", type=common.size_arg, default=32 << 20, help="largest size (default 32M)")
    p.add_argument("-i", "--stepbytes", type=common.size_arg, default=1 << 20, help="size increment (default 1M)")
    p.add_argument("-f", "--stepfactor", type=int, default=1, help="size multiplier; > 1 overrides -i (default 1)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed calls before timing (default 5)")
    p.add_argument("-c", "--check", type=int, default=1, help="check rounds per size; 0 = no check (default 1)")
    p.add_argument("-d", "--datatype", default="float", help="half, float, bfloat16 or all (default float)")
    p.add_argument("-o", "--op", default="sum", help="sum, max, min, avg or all (default sum)")
    p.add_argument("-G", "--cudagraph", type=int, default=0,
                   help="launches of a CUDA graph of -n calls; 0 = eager (default 0)")
    p.add_argument("-a", "--average", type=int, default=1, choices=sorted(common.AVERAGE_MODES),
                   help="time over ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum (default 1)")
    p.add_argument("-J", "--output_file", default="", help="write results as nccl-tests JSON to this file")
    p.add_argument("--backend", choices=("ubnext", "nccl", "nccl_symmetric"), default="ubnext",
                   help="ubnext, the real NCCL through ubnext._engine.nccl.NcclComm, or NCCL's symmetric kernels "
                        "(torch symmetric memory, NCCL backend; in place only) (default ubnext)")
    p.add_argument("--algo", choices=program.algorithms, default="auto",
                   help="ubnext algorithm (backend ubnext only; default auto)")
    p.add_argument("--precision", choices=("auto", "exact", *QUANT_FORMATS), default="auto",
                   help="ubnext precision= (int8/fp8/int4: the quantized two-shot, or its reduce-scatter, opted "
                        "in for the run; bfloat16/half, sum/avg; checked bit for bit against its host emulation)")
    p.add_argument("--symmetric", type=int, choices=(0, 1), default=None,
                   help="1: buffers from comm.empty (symmetric memory), 0: plain cupy buffers "
                        "(default 1 for ubnext, 0 for nccl)")
    return p


def parse_args(argv: list[str] | None = None, program: Program = ALL_REDUCE_PERF) -> argparse.Namespace:
    """Parse and validate ``argv``; adds ``program``, ``dtypes``, ``ops`` (``["none"]`` for a
    collective without a reduction) and ``sizes`` and resolves ``symmetric``."""
    parser = build_parser(program)
    args = parser.parse_args(argv)
    args.program = program
    try:
        args.dtypes = common.parse_dtypes(args.datatype)
        args.ops = common.parse_ops(args.op) if program.collective.reduces else ["none"]
        args.sizes = common.size_list(args.minbytes, args.maxbytes, args.stepbytes, args.stepfactor)
    except ValueError as exc:
        parser.error(str(exc))
    for flag in ("iters", "warmup_iters", "check", "cudagraph"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0")
    if args.iters == 0:
        parser.error("--iters must be >= 1")
    if args.symmetric is None:
        args.symmetric = int(args.backend == "ubnext")
    if args.backend != "ubnext" and args.algo != "auto":
        parser.error("--algo applies to --backend ubnext only")
    if args.backend == "nccl_symmetric" and (args.symmetric or program is not ALL_REDUCE_PERF):
        parser.error("--backend nccl_symmetric: the all-reduce only, on its own buffers (no --symmetric 1)")
    if args.precision in QUANT_FORMATS and program.collective.quantized is None:
        parser.error(f"--precision {args.precision}: {program.name} has no quantized form (it stays exact)")
    if args.precision in QUANT_FORMATS and (
            args.backend != "ubnext" or args.algo != "auto"
            or {d.ubnext for d in args.dtypes} - {"bfloat16", "float16"} or set(args.ops) - {"sum", "avg"}):
        parser.error(f"--precision int8/fp8/int4 (the quantized {program.name.removesuffix('_perf')}) takes "
                     "--backend ubnext, --algo auto, -d bfloat16/half, -o sum/avg")
    if args.output_file and not os.path.isdir(os.path.dirname(os.path.abspath(args.output_file))):
        parser.error(f"-J: the directory of {args.output_file} does not exist")
    return args


# --------------------------------------------------------------------------- engines


class UbnextEngine:
    """``comm.all_reduce`` (and reduce-scatter, all-gather) with a fixed algorithm and precision."""

    def __init__(self, comm: Any, algorithm: str, precision: str = "auto") -> None:
        self.comm = comm
        self.algorithm = algorithm
        self.precision = precision

    def all_reduce(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.comm.all_reduce(send, out=recv, op=op, algorithm=self.algorithm, stream=stream, precision=self.precision)

    def reduce_scatter(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.comm.reduce_scatter(send, out=recv, op=op, algorithm=self.algorithm, stream=stream,
                                 precision=self.precision)

    def all_gather(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.comm.all_gather(send, out=recv, algorithm=self.algorithm, stream=stream)

    def broadcast(self, send: Any, recv: Any, dtype: common.DType, root: int, stream: Any) -> None:
        self.comm.broadcast(send, root, out=recv, stream=stream, algorithm=self.algorithm)

    def all_to_all(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        """``--algo p2p``: the even parts given as host splits, on the point-to-point kernel."""
        if self.algorithm == "p2p":
            splits = [send.size // self.comm.size] * self.comm.size
            self.comm.all_to_all(send, out=recv, in_splits=splits, out_splits=splits, stream=stream, algorithm="ll")
            return
        self.comm.all_to_all(send, out=recv, stream=stream, algorithm=self.algorithm)

    def sendrecv(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        """To the next rank, from the previous one (nccl-tests' sendrecv), as one batch."""
        n, rank = self.comm.size, self.comm.rank
        self.comm.batch_isend_irecv([("send", send, (rank + 1) % n), ("recv", recv, (rank - 1) % n)], stream=stream,
                                    algorithm=self.algorithm)


class NcclEngine:
    """The real NCCL on the raw pointers of cupy arrays."""

    def __init__(self, nccl: Any) -> None:
        self.nccl = nccl

    def all_reduce(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.nccl.all_reduce(send.data.ptr, recv.data.ptr, send.size, dtype.ubnext, op, stream.ptr)

    def reduce_scatter(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.nccl.reduce_scatter(send.data.ptr, recv.data.ptr, recv.size, dtype.ubnext, op, stream.ptr)

    def all_gather(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.nccl.all_gather(send.data.ptr, recv.data.ptr, send.size, dtype.ubnext, stream.ptr)

    def broadcast(self, send: Any, recv: Any, dtype: common.DType, root: int, stream: Any) -> None:
        self.nccl.broadcast(send.data.ptr, recv.data.ptr, send.size, dtype.ubnext, root, stream.ptr)

    def all_to_all(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        """Grouped sends and receives of equal parts (CuPy's binding has no ncclAlltoAll)."""
        n = self.nccl.size
        part = send.size // n * dtype.itemsize
        self.nccl.exchange([(send.data.ptr + j * part, part, j) for j in range(n)],
                           [(recv.data.ptr + j * part, part, j) for j in range(n)], stream.ptr, "nccl.all_to_all")

    def sendrecv(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        n, rank, nbytes = self.nccl.size, self.nccl.rank, send.size * dtype.itemsize
        self.nccl.exchange([(send.data.ptr, nbytes, (rank + 1) % n)], [(recv.data.ptr, nbytes, (rank - 1) % n)],
                           stream.ptr, "nccl.sendrecv")


class TorchNcclEngine:
    """``torch.distributed.all_reduce`` (NCCL), in place, on torch's current stream (set to
    the benchmark's). On a registered window NCCL runs its symmetric kernels."""

    in_place_only = True

    def all_reduce(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        import torch.distributed as dist

        if send.data_ptr() != recv.data_ptr():
            raise ValueError("torch.distributed.all_reduce works in place only")
        dist.all_reduce(recv, op=getattr(dist.ReduceOp, op.upper()))


class Unavailable(Exception):
    """The chosen backend cannot run here; the message says why."""


@dataclass
class World:
    """What a benchmark process holds: the ubnext communicator, its engine, a stream, two buffers.

    ``allocate(count, dtype)`` makes one 1-D cupy array; :meth:`buffers` keeps
    one send and one receive buffer of the current dtype, sized for ``-e``;
    ``collective`` says how a call uses them.
    """

    comm: Any
    engine: Any
    stream: Any
    allocate: Any
    notes: list[str]
    send: Any = None
    recv: Any = None
    collective: common.Collective = ALL_REDUCE
    #: (dtype name, elements) of send and recv (cupy arrays or torch tensors)
    holds: tuple = ()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def buffers(self, dtype: common.DType, maxbytes: int) -> None:
        """Make ``send`` and ``recv`` hold ``maxbytes`` of ``dtype``, dropping the previous pair first.

        Collective when ``allocate`` is (``comm.empty``).
        """
        count = max(1, maxbytes // dtype.itemsize)
        if not self.holds or self.holds[0] != dtype.name or self.holds[1] < count:
            self.send = self.recv = None  # symmetric memory returns to the pool
            self.send, self.recv = self.allocate(count, dtype), self.allocate(count, dtype)
            self.holds = (dtype.name, count)

    def views(self, count: int, in_place: bool) -> tuple[Any, Any]:
        """``(send, recv)`` views for a message of ``count`` elements (``collective.buffers``);
        in place, both in ``recv`` at the collective's offsets (the same view where they
        coincide)."""
        send_n, recv_n = self.collective.buffers(count, self.size)
        if not in_place:
            return self.send[:send_n], self.recv[:recv_n]
        send_at, recv_at = self.collective.in_place(count, self.size, self.rank)
        recv = self.recv[recv_at:recv_at + recv_n]
        return (recv if (send_at, send_n) == (recv_at, recv_n) else self.recv[send_at:send_at + send_n]), recv

    def close(self) -> None:
        """Collective: closes the NCCL engine (if any) and the communicator."""
        if isinstance(self.engine, NcclEngine):
            self.engine.nccl.close()
        if isinstance(self.engine, TorchNcclEngine):
            import torch.distributed as dist

            self.send = self.recv = None  # the windows go before the communicator
            dist.destroy_process_group()
        self.comm.close()


def pool_mb_for(nbytes: int) -> dict[str, int]:
    """Config overrides giving the pool room for ``nbytes`` of user buffers, unless ``UBNEXT_POOL_MB`` is set."""
    if "UBNEXT_POOL_MB" in os.environ:
        return {}
    return {"pool_mb": max(1024, math.ceil(nbytes / (1 << 20)) + 512)}


def open_world(args: argparse.Namespace) -> World:
    """Create the communicator, the engine, a stream and the buffers. Collective."""
    import cupy

    import ubnext
    from ubnext._engine.nccl import NcclComm

    if args.symmetric:
        overrides = pool_mb_for(2 * args.maxbytes)
    else:  # no pool needed; with an NCCL backend, ubnext sets up no kernels at all
        overrides = {"algorithm": "nccl"} if args.backend != "ubnext" else {}
    if args.precision in QUANT_FORMATS:
        overrides["quantized"] = args.precision
    comm = ubnext.Communicator(**overrides)
    cupy.cuda.Device(comm.device).use()
    notes = []
    stream = cupy.cuda.Stream(non_blocking=True)
    if args.backend == "nccl_symmetric":
        engine, allocate, notes = torch_symmetric(comm, args, stream)
        return World(comm, engine, stream, allocate, notes, collective=args.program.collective)
    if args.backend == "nccl":
        nccl = NcclComm(comm.bootstrap, comm.device)
        nccl.connect()
        engine: Any = NcclEngine(nccl)
    else:
        engine = UbnextEngine(comm, args.algo, args.precision)
    if args.symmetric:
        def allocate(count: int, dtype: common.DType) -> Any:
            return comm.empty((count,), dtype.ubnext)

        notes.append("# Buffers: symmetric memory (comm.empty)")
    else:
        def allocate(count: int, dtype: common.DType) -> Any:
            return cupy.empty((count,), dtype=dtype.numpy)

        notes.append("# Buffers: cupy.empty (not symmetric)")
    return World(comm, engine, stream, allocate, notes, collective=args.program.collective)


def torch_symmetric(comm: Any, args: argparse.Namespace, stream: Any) -> tuple[Any, Any, list[str]]:
    """``--backend nccl_symmetric``: torch.distributed over the bootstrap with torch's stream
    set to ``stream``, torch's symmetric memory on its NCCL backend, and one profiled
    all-reduce that must run an NCCL symmetric kernel: ``(engine, allocate, notes)``.
    Collective.

    Raises:
        Unavailable: on every rank, with the first rank's reason (torch.distributed and
            the communicator are closed first).
    """
    import torch
    import torch.distributed as dist

    from bench import _torchbench as tb

    tb.init_distributed(comm.bootstrap, comm.device)
    torch.cuda.set_stream(torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", comm.device)))
    reason = next((r for r in comm.bootstrap.allgather_obj(tb.select_nccl_symmetric()) if r), None)
    kernels: list[str] = []
    if reason is None:
        reason, kernels = tb.probe_nccl_symmetric(comm.bootstrap, comm.device, getattr(torch, args.dtypes[0].ubnext))
    if reason is not None:
        dist.destroy_process_group()
        comm.close()
        raise Unavailable(reason)

    def allocate(count: int, dtype: common.DType) -> Any:
        return tb.symmetric_tensor(count, getattr(torch, dtype.ubnext), comm.device)

    return TorchNcclEngine(), allocate, [
        "# Buffers: torch symmetric memory, NCCL backend (registered NCCL windows); in place only",
        f"# NCCL symmetric kernels seen in a profiled all-reduce: {', '.join(kernels)}"]


# --------------------------------------------------------------------------- one size


def _launcher(world: World, send: Any, recv: Any, dtype: common.DType, op: str):
    return lambda: world.collective.run(world.engine, send, recv, dtype, op, world.stream)


def warm_up(world: World, args: argparse.Namespace, dtype: common.DType, op: str) -> None:
    """Eager calls at the smallest and largest size before anything is checked or captured.

    Lazy set-up (NCCL communicator creation, kernel compilation) thus never
    happens inside a CUDA graph capture. Collective; blocks the host.
    """
    in_place = getattr(world.engine, "in_place_only", False)
    for nbytes in sorted({args.sizes[0], args.sizes[-1]}):
        send, recv = world.views(world.collective.count(nbytes, dtype.itemsize, world.size), in_place)
        launch = _launcher(world, send, recv, dtype, op)
        for _ in range(max(1, args.warmup_iters)):
            launch()
    world.stream.synchronize()


def check(world: World, args: argparse.Namespace, dtype: common.DType, op: str, count: int,
          in_place: bool, seed: int) -> int:
    """Run one call on known data and count wrong output elements, summed over ranks.

    Out-of-place outputs are poisoned with NaN first. With ``-G`` the checked
    call is launched from a CUDA graph, as the timed calls are.
    Collective; blocks the host.
    """
    send, recv = world.views(count, in_place)
    values, expected = world.collective.data(world.size, world.rank, count, seed, op)
    common.upload(send, values, dtype, world.stream)
    if not in_place:
        common.poison(recv, expected.size, dtype, world.stream)
    launch = _launcher(world, send, recv, dtype, op)
    if args.cudagraph:
        graph = common.capture_graph(launch, world.stream, 1)
        graph.launch(world.stream)
    else:
        launch()
    got = common.download(recv, expected.size, dtype, world.stream)
    if args.precision in QUANT_FORMATS:  # the quantized collective's result, bit for bit
        inputs = [world.collective.data(world.size, r, count, seed, op)[0].astype(dtype.numpy)
                  for r in range(world.size)]
        want = world.collective.quantized(inputs, args.precision, op, world.rank).view(dtype.bits)
        wrong = common.count_wrong(got, want, dtype)
    else:
        want = common.encode(expected, dtype)
        wrong = common.count_wrong(got, want, dtype, common.tolerance(op, world.size, dtype))
    return int(sum(common.allgather_float(world.comm.bootstrap, float(wrong))))


def measure(world: World, args: argparse.Namespace, dtype: common.DType, op: str, count: int,
            in_place: bool) -> float:
    """Seconds per call, combined over ranks per ``-a``, on this rank's :func:`common.make_input`
    data (also with ``-c 0``: the quantized kernels' time depends on the values, e.g. a group
    of zeros skips its divisions). Collective; blocks the host."""
    send, recv = world.views(count, in_place)
    send_n = world.collective.buffers(count, world.size)[0]  # send.size is a method on a torch tensor
    common.upload(send, common.make_input(world.rank, world.size, send_n, 0).astype("float64"), dtype, world.stream)
    launch = _launcher(world, send, recv, dtype, op)
    for _ in range(args.warmup_iters):
        launch()
    sample = common.timer(launch, world.stream, args.iters, args.cudagraph, world.comm.bootstrap.barrier)
    seconds = sample()
    return common.combine(common.allgather_float(world.comm.bootstrap, seconds), args.average)


# --------------------------------------------------------------------------- the run


def header_lines(args: argparse.Namespace, world: World, device_lines: list[str]) -> list[str]:
    """Everything printed above the table."""
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    algo = "-" if args.backend != "ubnext" else args.algo
    return [
        f"# ubnext {args.program.name}: backend {args.backend} algorithm {algo} precision {args.precision} "
        f"nccl-library={nccl_version()}",
        f"# Collective test starting: {args.program.name}",
        f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
        f"warmup iters: {args.warmup_iters} iters: {args.iters} agg iters: 1 "
        f"validation: {args.check} graph: {args.cudagraph}",
        "#",
        "# Using devices",
        *device_lines,
        *world.notes,
        f"# Time: CUDA events, {common.AVERAGE_MODES[args.average]} over ranks (-a {args.average})",
    ]


def nccl_version() -> int:
    """The NCCL library version code, or 0 where cupy cannot load NCCL."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return 0
    return nccl.get_version() if nccl.available else 0


def json_document(args: argparse.Namespace, argv: list[str], device_lines: list[str],
                  world: World, start: str) -> dict[str, Any]:
    """The nccl-tests (version 2) JSON document, before results are added."""
    config = {
        "nthreads": 1, "ngpus": 1, "minimum_bytes": args.minbytes, "maximum_bytes": args.maxbytes,
        "warmup_iters": args.warmup_iters, "iterations": args.iters, "aggregated_iterations": 1,
        "validation": args.check, "graph": args.cudagraph, "blocking_collectives": "false",
        "parallel_init": "false", "devices": [common.parse_device_line(line) for line in device_lines],
    }
    config["step_factor" if args.stepfactor > 1 else "step_bytes"] = (
        args.stepfactor if args.stepfactor > 1 else args.stepbytes
    )
    return {
        "version": 2, "start_time": start, "args": [args.program.name, *argv], "env": common.environment_subset(),
        "nccl_version": nccl_version(), "config": config,
        "ubnext": {"backend": args.backend, "algorithm": args.algo, "precision": args.precision,
                   "symmetric": bool(args.symmetric),
                   "world_size": world.size, "average": args.average, "timer": "cuda events"},
        "results": [],
    }


def bench_size(world: World, args: argparse.Namespace, dtype: common.DType, op: str, nbytes: int,
               seeds: Iterator[int]) -> tuple[str, dict[str, Any], int, list[float]]:
    """Check and time one size out of place and in place. Collective.

    Returns:
        The table row, its JSON record, how many placements had wrong
        elements, and the two bus bandwidths.
    """
    count = world.collective.count(nbytes, dtype.itemsize, world.size)
    nbytes = count * dtype.itemsize
    root = world.collective.root
    line = common.row_prefix(nbytes, count, dtype.name, op, root)
    record: dict[str, Any] = {"size": nbytes, "count": count, "type": dtype.name, "redop": op, "root": f"{root:6d}"}
    failed, busbws = 0, []
    for in_place in (False, True):
        if (not in_place and getattr(world.engine, "in_place_only", False)) or (
                in_place and not world.collective.has_in_place):
            line += common.row_absent()
            record["out_of_place"] = None
            continue
        wrong = None
        for _ in range(args.check):
            wrong = check(world, args, dtype, op, count, in_place, next(seeds))
            if wrong:
                break
        failed += bool(wrong)
        seconds = measure(world, args, dtype, op, count, in_place)
        algbw, busbw = world.collective.bandwidths(nbytes, seconds, world.size)
        busbws.append(busbw)
        line += common.row_result(seconds * 1e6, algbw, busbw, wrong)
        record["in_place" if in_place else "out_of_place"] = {
            "time": seconds * 1e6, "alg_bw": algbw, "bus_bw": busbw, "nwrong": wrong}
        if in_place and args.precision in QUANT_FORMATS and reached_non_finite(world, dtype, count):
            line += f"  {NON_FINITE_MARK}"
            record["in_place"]["non_finite_data"] = True
    record.update(actual_iterations=args.iters, experiment_name="")
    return line, record, failed, busbws


#: the end of a row whose in-place quantized timing ran on data that reached inf or NaN
NON_FINITE_MARK = "*"
NON_FINITE_NOTE = (f"# {NON_FINITE_MARK}: in place, the timed calls' data reached inf or NaN (an all-reduce sum "
                   "multiplies it by N a call), whose quantized groups skip their arithmetic: not a time of finite "
                   "data; use the out-of-place columns")


def reached_non_finite(world: World, dtype: common.DType, count: int) -> bool:
    """Whether the in-place buffer of the calls just timed holds inf or NaN on any rank.
    Collective; blocks the host."""
    send = world.views(count, True)[0]
    bits = common.download(send, world.collective.buffers(count, world.size)[0], dtype, world.stream)
    bad = not np.isfinite(bits.view(dtype.numpy).astype(np.float32)).all()
    return any(common.allgather_float(world.comm.bootstrap, float(bad)))


def run(args: argparse.Namespace, world: World, argv: list[str]) -> int:
    """Sweep dtypes × ops × sizes; rank 0 prints the table. Collective. Returns the exit status."""
    start = common.now_string()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    device_lines = [b.decode() for b in world.comm.bootstrap.allgather(
        common.device_line(world.rank, world.comm.device).encode())]
    for line in header_lines(args, world, device_lines) + common.table_header():
        say(line, flush=True)
    doc = json_document(args, argv, device_lines, world, start)
    failed, busbws, seeds = 0, [], itertools.count(1)
    for dtype in args.dtypes:
        world.buffers(dtype, args.maxbytes)
        for op in args.ops:
            warm_up(world, args, dtype, op)
            for nbytes in args.sizes:
                line, record, wrong_tests, bws = bench_size(world, args, dtype, op, nbytes, seeds)
                say(line, flush=True)
                doc["results"].append(record)
                failed += wrong_tests
                busbws += bws
    avg_busbw = sum(busbws) / len(busbws) if busbws else 0.0
    if any((r.get("in_place") or {}).get("non_finite_data") for r in doc["results"]):
        say(NON_FINITE_NOTE, flush=True)
    for line in common.footer(failed, avg_busbw, args.program.name):
        say(line, flush=True)
    if args.output_file and world.rank == 0:
        doc.update({
            "out_of_bounds": {"count": failed, "okay": "true" if not failed else "false"},
            "average_bus_bandwidth": {"bandwidth": avg_busbw, "okay": "unchecked"},
            "errors": [], "end_time": common.now_string(),
        })
        say(f"# Wrote JSON output to {common.write_json(args.output_file, doc)}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None, program: Program = ALL_REDUCE_PERF) -> int:
    """Entry point of ``program``; ``argv`` defaults to ``sys.argv[1:]``. Collective over
    ``MPI.COMM_WORLD``."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, program)
    if args.backend == "nccl_symmetric":
        from bench._torchbench import keep_multicast_off

        keep_multicast_off()  # before torch is imported
    try:
        world = open_world(args)
    except Unavailable as exc:
        print(f"# {program.name}: --backend {args.backend} cannot run: {exc}", flush=True)
        return 2
    try:
        return run(args, world, argv)
    finally:
        world.close()


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
