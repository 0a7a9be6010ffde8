"""Shared machinery of the torch-level benchmarks (``fused_perf.py``, ``tp_block.py``):
torch.distributed over ubnext's bootstrap, timing of a torch callable in eager,
CUDA-graph and dependent-kernel mode, NCCL's symmetric kernels through torch's symmetric
memory (also used by ``compare.py`` and ``all_reduce_perf.py``), and a line plot. Call :func:`keep_multicast_off` before torch is
first imported."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
import statistics
import sys
import time
from typing import Any, Callable

from bench import _common as common

MODES = ("eager", "graph", "dependent")


def multicast_disabled(environ: Any = os.environ) -> bool:
    """True when any of the host's opt-out variables asks for no NVLink multicast
    (the same list as ubnext's own gate)."""
    from ubnext._environment.nvls_gate import env_blockers

    return bool(env_blockers(environ))


def keep_multicast_off(environ: Any = os.environ) -> None:
    """Where one opt-out variable switches multicast off, set torch's and NVSHMEM's too.

    Must run before torch is imported, so torch's symmetric memory creates no
    multicast object on a host that asked for none (e.g. ``NCCL_NVLS_ENABLE=0``).
    """
    if multicast_disabled(environ):
        environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        environ["NVSHMEM_DISABLE_NVLS"] = "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(bootstrap: Any, device: int) -> None:
    """torch.distributed (NCCL backend) over the ranks of ``bootstrap``. Collective.

    RANK and WORLD_SIZE from the bootstrap; MASTER_ADDR 127.0.0.1 and a free port of
    rank 0 unless already set.
    """
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    port = bootstrap.bcast_obj(_free_port() if bootstrap.rank == 0 else None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.update(RANK=str(bootstrap.rank), WORLD_SIZE=str(bootstrap.size), LOCAL_RANK=str(device))
    dist.init_process_group("nccl", rank=bootstrap.rank, world_size=bootstrap.size,
                            device_id=torch.device("cuda", device))


@contextlib.contextmanager
def session():
    """A ubnext Communicator over MPI plus torch.distributed over the same ranks, with
    multicast kept off where the host asked for that; both torn down at the end.
    Collective."""
    keep_multicast_off()
    import ubnext

    comm = ubnext.Communicator()
    try:
        init_distributed(comm.bootstrap, comm.device)
        yield comm
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        comm.close()


def main(parse_args: Callable[[list[str]], Any], run: Callable[[Any, Any, list[str]], int],
         argv: list[str] | None = None) -> int:
    """Entry point of the torch-level benchmarks: parse ``argv`` (default: the command
    line), then ``run(comm, args, argv)`` inside a :func:`session`. Collective."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    with session() as comm:
        return run(comm, args, argv)


def save_report(comm: Any, kind: str, prefix: str, args: Any, argv: list[str], fields: dict[str, Any],
                tags: tuple[str, ...] = ()) -> tuple[str, dict]:
    """Rank 0: writes ``<args.outdir>/<stem>.json`` (kind ``ubnext.<kind>``, machine, date,
    world size, command, environment, then ``fields``); returns the path without
    ``.json`` and the document.

    The stem is ``args.name``, else ``<prefix>_<gpu>_<n>gpu[_<tags>]_<date>``.
    """
    gpu = common.device_properties(comm.device)["name"]
    stem = args.name or "_".join([prefix, "-".join(gpu.split()), f"{comm.size}gpu", *tags,
                                  time.strftime("%Y%m%d-%H%M%S")])
    os.makedirs(args.outdir, exist_ok=True)
    doc = {"kind": f"ubnext.{kind}", "version": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": {"hostname": socket.gethostname(), "gpu": gpu}, "world_size": comm.size,
           "command": shlex.join([sys.executable, *sys.argv[:1], *argv]), "env": common.environment_subset(),
           **fields}
    path = os.path.join(args.outdir, stem)
    print(f"# wrote {common.write_json(path + '.json', doc, overwrite=True)}")
    return path, doc


def timer(fn: Callable[[], None], mode: str, bootstrap: Any, iters: int = 50,
          launches: int = 10) -> Callable[[], float]:
    """A sampler of ``fn`` (which enqueues work on torch's current stream): each call times
    one sample and returns µs per call of ``fn``, the maximum over ranks. Collective (each
    sample).

    eager: ``iters`` back-to-back calls between CUDA events. graph (and dependent): ``iters``
    calls captured once, now, into a CUDA graph and replayed once (untimed); a sample
    replays it ``launches`` times between events.
    """
    import torch

    stream = torch.cuda.current_stream()
    if mode in ("graph", "dependent"):
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(iters):
                fn()
        graph.replay()

        def body() -> None:
            for _ in range(launches):
                graph.replay()

        calls = iters * launches
    else:

        def body() -> None:
            for _ in range(iters):
                fn()

        calls = iters
    body()  # warm up

    def sample() -> float:
        torch.cuda.synchronize()
        bootstrap.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        body()
        end.record(stream)
        end.synchronize()
        return max(bootstrap.allgather_obj(start.elapsed_time(end) * 1e3 / calls))

    return sample


def time_us(fn: Callable[[], None], mode: str, bootstrap: Any, iters: int = 50, launches: int = 10,
            repeats: int = 5) -> list[float]:
    """µs per call of ``fn`` per repeat, the maximum over ranks (:func:`timer`). Collective."""
    sample = timer(fn, mode, bootstrap, iters, launches)
    return [sample() for _ in range(repeats)]


def dependent_us(gemm: Callable[[], None], fn: Callable[[], None], bootstrap: Any, iters: int = 50,
                 launches: int = 10, repeats: int = 5) -> dict[str, list[float]]:
    """The dependent mode of ``fn`` after its producer ``gemm`` (:func:`common.dependent_samples`):
    a graph of ``iters`` (gemm, fn) pairs and a graph of ``iters`` gemms alone, sampled in
    turn; ``times_us`` is their difference, per call of ``fn``. Collective."""
    def pair() -> None:
        gemm()
        fn()

    return common.dependent_samples(timer(pair, "dependent", bootstrap, iters, launches),
                                    timer(gemm, "dependent", bootstrap, iters, launches), repeats)


def replay_once(fn: Callable[[], Any]) -> Any:
    """Capture one call of ``fn`` into a CUDA graph, replay it once and wait; returns what
    ``fn`` returned during the capture (tensors that hold the replay's results)."""
    import torch

    stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def bits(t: Any, dtype: common.DType) -> Any:
    """The bit patterns of a torch tensor (numpy, ``dtype.bits``), on the host."""
    import torch

    signed = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    return t.contiguous().view(-1).view(signed).cpu().numpy().view(dtype.bits)


def poison_tensor(t: Any, dtype: common.DType) -> None:
    """Fill a torch tensor with ``dtype``'s quiet NaN, on torch's current stream."""
    import torch

    signed = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    t.view(-1).view(signed).fill_(dtype.nan)  # every quiet NaN here is positive as a signed integer


# --------------------------------------------------------------------------- NCCL's symmetric kernels
# NCCL >= 2.27 runs its symmetric-memory kernels when an all-reduce's buffers lie in windows
# registered with NCCL_WIN_COLL_SYMMETRIC. torch's symmetric memory with its NCCL backend
# allocates with ncclMemAlloc and registers such a window at rendezvous; torch.distributed's
# all_reduce on that tensor then runs them. torch has one symmetric-memory backend per process,
# chosen before the first allocation: with NCCL chosen, the CUDA backend's buffers (torch's own
# one-shot / two-shot ops) are not to be had in the same process.

#: NCCL's symmetric kernels (src/device/symmetric/generate.py: ncclSymDevKernel_* in 2.27,
#: ncclSymkDevKernel_* from 2.28), e.g. ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16.
SYMMETRIC_KERNEL = re.compile(r"ncclSymk?DevKernel_(\w+)")
#: their NVLink-multicast variants: an algorithm part ending in MC (AGxLLMC_R, RSxLDMC_AGxSTMC, STMC)
MULTICAST_KERNEL = re.compile(r"MC(_|$)")


def nccl_symmetric_blocker(environ: Any = os.environ) -> str | None:
    """Why NCCL's symmetric kernels cannot be offered here, or None. Local; before torch
    allocates anything.

    NCCL must have NVLink multicast switched off (``NCCL_NVLS_ENABLE=0``): with it on, a
    registered window may be bound to a multicast object.
    """
    if environ.get("NCCL_NVLS_ENABLE") != "0":
        return "NCCL_NVLS_ENABLE=0 is not set (NCCL windows could be bound to NVLink multicast)"
    try:
        import torch.cuda.nccl as tnccl
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return f"torch's symmetric memory does not import ({exc})"
    if not hasattr(symm_mem, "set_backend"):
        return "this torch's symmetric memory has no NCCL backend (no set_backend)"
    version = tuple(tnccl.version())
    if version < (2, 27):
        return f"torch's NCCL {'.'.join(map(str, version))} has no symmetric kernels (2.27 or newer needed)"
    return None


def select_nccl_symmetric() -> str | None:
    """Make NCCL torch's symmetric-memory backend for this process; returns why not, or None.
    Local; call before any ``symm_mem.empty``."""
    reason = nccl_symmetric_blocker()
    if reason:
        return reason
    import torch.distributed._symmetric_memory as symm_mem

    try:
        symm_mem.set_backend("NCCL")
    except Exception as exc:  # RuntimeError from c10d: another backend already in use
        return f"symm_mem.set_backend('NCCL') failed: {exc}"
    return None


def symmetric_tensor(count: int, tdtype: Any, device: int) -> Any:
    """A 1-D tensor of torch's symmetric memory, rendezvoused over the world group (with the
    NCCL backend: a registered NCCL window). Collective."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(count, dtype=tdtype, device=f"cuda:{device}")
    symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    return t


def kernel_names(fn: Callable[[], None]) -> list[str]:
    """Names of the events torch.profiler records around one call of ``fn`` (GPU kernels
    among them). Waits for the GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events()})


def symmetric_kernel_problem(names: list[str]) -> str | None:
    """None where ``names`` hold an NCCL symmetric kernel, else why not.

    Raises:
        RuntimeError: a multicast variant ran: NVLink multicast is on despite the settings.
    """
    symmetric = [n for n in names if SYMMETRIC_KERNEL.search(n)]
    multicast = [n for n in symmetric if MULTICAST_KERNEL.search(SYMMETRIC_KERNEL.search(n).group(1))]
    if multicast:
        raise RuntimeError(f"NCCL ran a multicast kernel ({multicast[0]}); NVLink multicast must stay off")
    if not symmetric:
        kernels = [n for n in names if n.startswith("nccl")]
        return f"no NCCL symmetric kernel ran (NCCL kernels seen: {', '.join(kernels) or 'none'})"
    return None


def probe_nccl_symmetric(bootstrap: Any, device: int, tdtype: Any, count: int = 1024) -> tuple[str | None, list[str]]:
    """Run one all-reduce of ``count`` elements on a registered window under torch.profiler:
    ``(reason, kernels)``: reason None where every rank saw an NCCL symmetric kernel, else the
    first rank's reason; the symmetric kernels this rank saw. Collective; after
    :func:`select_nccl_symmetric`."""
    import torch
    import torch.distributed as dist

    reason, seen = None, []
    try:
        dist.all_reduce(torch.ones(1, device=f"cuda:{device}"))  # the NCCL communicator exists first
        t = symmetric_tensor(count, tdtype, device).fill_(1)
        names = kernel_names(lambda: dist.all_reduce(t))
        reason = symmetric_kernel_problem(names)
        seen = [n for n in names if SYMMETRIC_KERNEL.search(n)]
    except RuntimeError as exc:
        if "multicast" in str(exc):
            raise
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
    reasons = [r for r in bootstrap.allgather_obj(reason) if r]
    return (reasons[0] if reasons else None), seen


def median(values: list[float]) -> float:
    return statistics.median(values)


def plot_candidates(path: str, title: str, records: list[dict[str, Any]], candidates: tuple[str, ...],
                    metrics: tuple[tuple[str, str], ...], xlabel: str, ylabel: str) -> None:
    """One PNG of ``records`` (dicts with ``bytes``, ``candidate`` and the metric keys): a
    panel per ``(title, key)`` of ``metrics``, a line per candidate over bytes. Prints
    where it went, or why there is no plot (matplotlib missing)."""
    panels = {what: {c: ([r["bytes"] for r in records if r["candidate"] == c],
                         [r[key] for r in records if r["candidate"] == c]) for c in candidates}
              for what, key in metrics}
    try:
        print(f"# wrote {plot_lines(path, title, panels, xlabel, ylabel)}")
    except ImportError as exc:
        print(f"# no plot ({exc})")


def plot_lines(path: str, title: str, panels: dict[str, dict[str, tuple[list, list]]], xlabel: str,
               ylabel: str, logx: bool = True) -> str:
    """One PNG, one panel per key of ``panels``, one line per series ``name -> (xs, ys)``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (panel, lines) in zip(axes[0], panels.items()):
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(panel, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
