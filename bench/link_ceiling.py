"""What NVLink moves between the GPUs of a node: the floor under every large all-reduce.

    mpirun -n 4 python bench/link_ceiling.py --bytes 1M,4M,16M,64M,256M

A two-shot all-reduce of S bytes (and a ring, which moves the same) sends 2(n-1)/n·S
bytes out of every GPU and receives as many: 2S/n to and from each peer. For each S,
in the same run and the same way (CUDA graphs, maximum over ranks, median of
``--repeats``):

* ``push``: every rank stores 2S/n bytes into each peer's pool segment (one kernel,
  16-byte stores, every peer in every thread as in ubnext's kernels); no reduction, no
  synchronization: what stores can move;
* ``pull``: the same bytes by 16-byte loads from the peers;
* ``ubnext auto`` (torch tensors), ``ubnext twoshot`` (in place on ``comm.empty``) and
  ``NCCL`` (``torch.distributed.all_reduce``): the all-reduce of S.

Every row gives µs and bus bandwidth (busbw = 2(n-1)/n·S / time, the nccl-tests
definition); for ``push`` and ``pull`` that is the link rate per direction. Rank 0
prints a table and writes ``<outdir>/<name>.json`` and ``.png``. The receive buffers
take 1.5·S of pool (``UBNEXT_POOL_MB``, 2048 unless set).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/link_ceiling.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402
from bench.all_reduce_perf import ALL_REDUCE  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CANDIDATES = ("push", "pull", "ubnext auto", "ubnext twoshot", "NCCL")
THREADS = 512

# Each rank moves `chunk` 16-byte vectors to or from every peer; thread i handles
# vector i of every peer's chunk (all loads before the stores), like ubnext's kernels.
_SOURCE = r"""
typedef unsigned long long u64;
#define MAXN 8

extern "C" __global__ void __launch_bounds__(512)
push(char* base, u64 stride, int rank, int n, u64 off, const uint4* src, u64 chunk) {
  for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < chunk; j += (u64)blockDim.x * gridDim.x) {
    uint4 v[MAXN - 1];
#pragma unroll
    for (int k = 0; k < MAXN - 1; ++k) if (k < n - 1) v[k] = src[k * chunk + j];
#pragma unroll
    for (int k = 0; k < MAXN - 1; ++k) {
      if (k < n - 1) {
        const int peer = (rank + 1 + k) % n;
        ((uint4*)(base + peer * stride + off))[rank * chunk + j] = v[k];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(512)
pull(char* base, u64 stride, int rank, int n, u64 off, uint4* dst, u64 chunk) {
  for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < chunk; j += (u64)blockDim.x * gridDim.x) {
    uint4 v[MAXN - 1];
#pragma unroll
    for (int k = 0; k < MAXN - 1; ++k) {
      if (k < n - 1) {
        const int peer = (rank + 1 + k) % n;
        v[k] = __ldcg((const uint4*)(base + peer * stride + off) + rank * chunk + j);
      }
    }
#pragma unroll
    for (int k = 0; k < MAXN - 1; ++k) if (k < n - 1) dst[k * chunk + j] = v[k];
  }
}
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="link_ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=lambda t: [common.size_arg(v) for v in t.split(",")],
                   default=[1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20])
    p.add_argument("-n", "--iters", type=int, default=10, help="calls per captured graph")
    p.add_argument("--launches", type=int, default=5, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default=None, help="file stem (default: link_ceiling_<gpu>_<n>gpu_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    return p.parse_args(argv)


def candidates(comm, nbytes: int, module) -> dict:
    """name -> callable enqueuing one operation of message size ``nbytes`` on torch's
    current stream (read at call time, so that graph capture sees it)."""
    import cupy
    import torch
    import torch.distributed as dist

    from ubnext._engine.launch import I32, U64, Launcher

    n = comm.size
    chunk = 2 * nbytes // n // 16                       # vectors to / from each peer
    pool = comm._node.pool
    recv = comm.empty((n * chunk * 4,), "float32", "torch")  # a slot of chunk vectors per rank
    off = recv.data_ptr() - pool.local_ptr(0)                # the same in every segment
    local = torch.randn((n - 1) * chunk * 4, device="cuda")
    blocks = cupy.cuda.Device(comm.device).attributes["MultiProcessorCount"]
    kernels = {name: Launcher(module.get_function(name), (U64, U64, I32, I32, U64, U64, U64),
                              (pool.base, pool.stride, comm.rank, n, off), (local.data_ptr(), chunk))
               for name in ("push", "pull")}

    def launch(name):
        kernels[name](blocks, THREADS, torch.cuda.current_stream().cuda_stream)
        return recv, local  # the buffers live as long as the callables

    count = nbytes // 2
    x = torch.randn(count, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    sym = comm.empty((count,), "bfloat16", "torch")
    sym.copy_(x)
    return dict(zip(CANDIDATES, (
        lambda: launch("push"),
        lambda: launch("pull"),
        lambda: comm.all_reduce(x, out=y),
        lambda: comm.all_reduce(sym, out=sym, algorithm="twoshot"),
        lambda: dist.all_reduce(y),
    )))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("UBNEXT_POOL_MB", "2048")
    return tb.main(parse_args, run, argv)


def run(comm, args, argv) -> int:
    import cupy

    module = cupy.RawModule(code=_SOURCE)
    records = []
    for nbytes in args.bytes:
        calls = candidates(comm, nbytes, module)
        for name, fn in calls.items():
            fn()  # first call outside the capture: compiles, connects NCCL
            times = tb.time_us(fn, "graph", comm.bootstrap, args.iters, args.launches, args.repeats)
            us = tb.median(times)
            busbw = ALL_REDUCE.bandwidths(nbytes, us * 1e-6, comm.size)[1]
            records.append({"bytes": nbytes, "candidate": name, "time_us": us, "busbw_gbs": busbw,
                            "samples_us": times})
        del calls
    if comm.rank != 0:
        return 0
    print(f"# {comm.size} ranks, CUDA graphs, µs (median of {args.repeats}, max over ranks); "
          f"busbw = 2(n-1)/n·S / time (push, pull: link rate per direction)")
    print(f"{'bytes':>10} " + " ".join(f"{c:>22}" for c in CANDIDATES))
    for nbytes in args.bytes:
        cells = [next(r for r in records if r["bytes"] == nbytes and r["candidate"] == c) for c in CANDIDATES]
        print(f"{nbytes:>10} " + " ".join(f"{r['time_us']:11.2f} {r['busbw_gbs']:6.1f} GB/s" for r in cells))
    path, _ = tb.save_report(comm, "link_ceiling", "link_ceiling", args, argv, {
        "config": {"iters": args.iters, "launches": args.launches, "repeats": args.repeats, "threads": THREADS},
        "results": records})
    tb.plot_candidates(path + ".png", f"link ceiling vs all-reduce, {comm.size} GPUs", records, CANDIDATES,
                       (("time (µs)", "time_us"), ("bus bandwidth (GB/s)", "busbw_gbs")),
                       "message bytes S", "µs | GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
