"""Shared machinery of the torch-level benchmarks (``fused_perf.py``, ``tp_block.py``):
torch.distributed over ubnext's bootstrap, timing of a torch callable in eager and
CUDA-graph mode, and a line plot. Call :func:`keep_multicast_off` before torch is
first imported."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import statistics
import sys
import time
from typing import Any, Callable

from bench import _common as common

MODES = ("eager", "graph")


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


def time_us(fn: Callable[[], None], mode: str, bootstrap: Any, iters: int = 50, launches: int = 10,
            repeats: int = 5) -> list[float]:
    """µs per call of ``fn`` (which enqueues work on torch's current stream), per repeat,
    the maximum over ranks. Collective.

    eager: ``iters`` back-to-back calls between CUDA events. graph: ``iters`` calls
    captured once into a CUDA graph, replayed ``launches`` times between events.
    """
    import torch

    stream = torch.cuda.current_stream()
    if mode == "graph":
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
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        bootstrap.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        body()
        end.record(stream)
        end.synchronize()
        mine = start.elapsed_time(end) * 1e3 / calls
        out.append(max(bootstrap.allgather_obj(mine)))
    return out


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
