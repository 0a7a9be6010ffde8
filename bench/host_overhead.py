"""Host cost of one eager all-reduce call: ubnext against torch.distributed (NCCL).

    mpirun -n 4 python bench/host_overhead.py --bytes 2K,16K,128K

For each message size (bf16 torch tensors unless said), every candidate is called
``--iters`` times back to back on torch's current stream:

* ``host``: CPU time per call until the last call returns (no GPU wait), i.e. what a
  framework thread spends in the call;
* ``total``: time per call until the GPU has finished them all (eager time with a full
  launch queue: the larger of host and GPU time per call).

Candidates: ``ubnext out=`` (a preallocated output), ``ubnext in-place``, ``ubnext new``
(the call allocates the output), ``ubnext cupy`` (CuPy arrays, out=), ``ubnext fused``
(``all_reduce_add_rmsnorm`` of rows of up to 4096 with a residual, preallocated outputs),
``torch op`` (``torch.ops.ubnext.all_reduce_``, in place), ``torch.distributed``
(``dist.all_reduce``, in place), torch symmetric memory's ``symm one-shot``
(``torch.ops.symm_mem.one_shot_all_reduce_out``, symmetric input, plain output) and
``symm two-shot`` (``two_shot_all_reduce_``, in place; both left out, with the reason
printed, where torch cannot set symmetric memory up), and ``floor``: the fastest public launch path from
Python, an empty kernel with the all-reduce's 11 parameters through cuda.bindings'
``cuLaunchKernel`` with a prebuilt pack (bench/launch_floor.py; its ``total`` is the
empty kernel's, not a collective's). Candidates are sampled in interleaved rounds, the
order rotated each round (this host's speed drifts by phases). Maximum over ranks,
median of ``--repeats``. Rank 0 prints a table and writes ``<outdir>/<name>.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if __package__ in (None, ""):  # run as a script (python bench/host_overhead.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CANDIDATES = ("ubnext out=", "ubnext in-place", "ubnext new", "ubnext cupy", "ubnext fused", "torch op",
              "torch.distributed", "symm one-shot", "symm two-shot", "floor")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=lambda t: [common.size_arg(v) for v in t.split(",")], default=[2048])
    p.add_argument("-d", "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("-n", "--iters", type=int, default=500, help="back-to-back calls per sample")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--name", default=None, help="file stem (default: host_overhead_<gpu>_<n>gpu_<dtype>_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    return p.parse_args(argv)


def candidates(comm, nbytes: int, dtype: str) -> dict:
    """name -> callable making one call (on torch's / CuPy's current stream)."""
    import torch
    import torch.distributed as dist

    import ubnext.torch
    from bench.launch_floor import launch_candidates
    from ubnext._interop.arrays import wrap

    count = nbytes // {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    x = torch.randn(count, device="cuda").to(getattr(torch, dtype))
    y = torch.empty_like(x)
    cx, cy = (wrap(t.data_ptr(), (count,), dtype, comm.device, "cupy", t) for t in (x.clone(), y.clone()))
    hidden = math.gcd(count, 4096)  # whole rows of up to a model's hidden size
    row = x.view(-1, hidden)
    residual, weight = torch.randn_like(row), torch.ones(hidden, device="cuda", dtype=x.dtype)
    normed, res_out = torch.empty_like(row), torch.empty_like(row)
    op, group = torch.ops.ubnext.all_reduce_, ubnext.torch.handle(comm)
    floor = launch_candidates()["cuda.bindings cuLaunchKernel"]
    found = dict(zip(CANDIDATES[:7], (
        lambda: comm.all_reduce(x, out=y),
        lambda: comm.all_reduce(x, out=x),
        lambda: comm.all_reduce(x),
        lambda: comm.all_reduce(cx, out=cy),
        lambda: comm.all_reduce_add_rmsnorm(row, residual, weight, out=normed, residual_out=res_out),
        lambda: op(x, "sum", "exact", group),
        lambda: dist.all_reduce(x),
    )))
    found.update(symm_mem_candidates(x))
    found["floor"] = floor
    return found


def symm_mem_candidates(x) -> dict:
    """torch symmetric memory's one-shot and two-shot all-reduce of x's size and dtype
    (buffers allocated and rendezvoused here), or none, with the reason printed. Collective."""
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        one_in, two = (symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device) for _ in range(2))
        for t in (one_in, two):
            symm_mem.rendezvous(t, group)
            t.copy_(x)
        one_out, ops = torch.empty_like(x), torch.ops.symm_mem
        ops.one_shot_all_reduce_out(one_in, "sum", group, out=one_out)
        ops.two_shot_all_reduce_(two, "sum", group)
    except (ImportError, RuntimeError) as exc:
        print(f"# torch symmetric memory not measured: {exc}")
        return {}
    return {"symm one-shot": lambda: ops.one_shot_all_reduce_out(one_in, "sum", group, out=one_out),
            "symm two-shot": lambda: ops.two_shot_all_reduce_(two, "sum", group)}


def sample(fn, iters: int, bootstrap) -> tuple[float, float]:
    """(host µs per call, total µs per call), each the maximum over ranks. Collective."""
    import torch

    torch.cuda.synchronize()
    bootstrap.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    mine = ((t1 - t0) / iters * 1e6, (t2 - t0) / iters * 1e6)
    every = bootstrap.allgather_obj(mine)
    return max(h for h, _ in every), max(t for _, t in every)


def main(argv: list[str] | None = None) -> int:
    return tb.main(parse_args, run, argv)


def run(comm, args, argv) -> int:
    records = []
    for nbytes in args.bytes:
        found = candidates(comm, nbytes, args.dtype)
        for fn in found.values():
            for _ in range(20):  # warm up: compiles, allocator caches
                fn()
        names, samples = list(found), {name: [] for name in found}
        for r in range(args.repeats):  # interleaved rounds, the order rotated each round
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(sample(found[name], args.iters, comm.bootstrap))
        for name, runs in samples.items():
            records.append({"bytes": nbytes, "candidate": name,
                            "host_us": tb.median([h for h, _ in runs]), "total_us": tb.median([t for _, t in runs]),
                            "host_samples_us": [h for h, _ in runs], "total_samples_us": [t for _, t in runs]})
    if comm.rank != 0:
        return 0
    print(f"# eager all-reduce, {args.dtype}, {comm.size} ranks: µs per call (median of {args.repeats}, "
          f"max over ranks); ratio = torch.distributed / candidate")
    print(f"{'bytes':>8} {'candidate':<18} {'host':>8} {'total':>8} {'ratio':>7}")
    for r in records:
        ref = next(o for o in records if o["bytes"] == r["bytes"] and o["candidate"] == "torch.distributed")
        print(f"{r['bytes']:>8} {r['candidate']:<18} {r['host_us']:8.2f} {r['total_us']:8.2f} "
              f"{ref['total_us'] / r['total_us']:6.2f}x")
    path, _ = tb.save_report(comm, "host_overhead", "host_overhead", args, argv, {
        "dtype": args.dtype, "config": {"iters": args.iters, "repeats": args.repeats}, "results": records},
        tags=(args.dtype,))
    tb.plot_candidates(path + ".png", f"eager all-reduce, {args.dtype}, {comm.size} GPUs", records, CANDIDATES,
                       (("host time per call", "host_us"), ("host + GPU time per call", "total_us")),
                       "bytes", "µs per call")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
