"""Fused all-reduce + residual add + RMSNorm against the unfused sequences.

    mpirun -n 4 python bench/fused_perf.py --tokens 1,8,32,128,512,2048 --hidden 4096,8192

For each (tokens, hidden), bf16 by default, with torch tensors:

* ``ubnext-fused``: ``comm.all_reduce_add_rmsnorm`` (one kernel);
* ``ubnext-allreduce``: ``comm.all_reduce`` alone (what the fused call adds to);
* ``ubnext+torch``: ``comm.all_reduce``, then add + ``rms_norm`` compiled by ``torch.compile``;
* ``nccl+torch``: ``torch.distributed.all_reduce`` (NCCL) in place on its buffer, as on a
  GEMM's output, then the same compiled add + ``rms_norm``;

(no copies in the baselines: the outputs of the compiled epilogue are new tensors);

each checked once against the unfused NCCL result, then timed eagerly and from CUDA
graphs (µs per call, maximum over ranks, median of the repeats). Rank 0 prints a table
per mode with the ratio (nccl+torch time / candidate time) and the fused call's overhead
over the plain all-reduce, and writes ``<outdir>/<name>.json`` and ``<name>.png``.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/fused_perf.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CANDIDATES = ("ubnext-fused", "ubnext-allreduce", "ubnext+torch", "nccl+torch")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fused_perf", description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    p.add_argument("--tokens", type=ints, default=[1, 8, 32, 128, 512, 2048])
    p.add_argument("--hidden", type=ints, default=[4096, 8192])
    p.add_argument("-d", "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("-n", "--iters", type=int, default=50, help="calls per timing (captured per graph)")
    p.add_argument("-G", "--graph-launches", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="eager,graph")
    p.add_argument("-a", "--algo", default="auto", help="ubnext algorithm of the fused call and the all-reduce")
    p.add_argument("--name", default=None, help="file stem (default: fused_<gpu>_<n>gpu_<dtype>_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    return p.parse_args(argv)


def add_rmsnorm(y, res, weight, eps: float):
    """The unfused epilogue of the baselines: ``(rms_norm(y + res) * weight, y + res)``."""
    import torch.nn.functional as F

    r = y + res
    return F.rms_norm(r, (r.shape[-1],), weight, eps), r


def candidates(comm, x, res, weight, eps, algo="auto"):
    """name -> callable that runs one fused or unfused step on torch's current stream and
    returns ``(normed, residual_out)`` (None for the all-reduce alone); and a reset that
    puts x into the NCCL baseline's buffer.

    The baselines move no extra copies: the NCCL one reduces its buffer in place, as it
    would a GEMM's output (so only its first call after the reset computes the block's
    values), and the add + RMSNorm after the all-reduce is compiled by torch.compile
    into new outputs."""
    import torch
    import torch.distributed as dist

    out, rout, y = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    nccl_y = x.clone()
    epilogue = torch.compile(add_rmsnorm, fullgraph=True)

    def fused():
        return comm.all_reduce_add_rmsnorm(x, res, weight, eps=eps, out=out, residual_out=rout, algorithm=algo)

    def allreduce():
        comm.all_reduce(x, out=y, algorithm=algo)

    def ubnext_torch():
        comm.all_reduce(x, out=y, algorithm=algo)
        return epilogue(y, res, weight, eps)

    def nccl_torch():
        dist.all_reduce(nccl_y)
        return epilogue(nccl_y, res, weight, eps)

    fns = dict(zip(CANDIDATES, (fused, allreduce, ubnext_torch, nccl_torch)))
    return fns, lambda: nccl_y.copy_(x)


def check(comm, fns, reset) -> float:
    """Relative difference of the fused outputs from the NCCL + torch ones (max over ranks)."""
    import torch

    reset()
    ref_out, ref_r = (t.double().clone() for t in fns["nccl+torch"]())
    out, rout = fns["ubnext-fused"]()
    torch.cuda.synchronize()
    err = max((a.double() - b).norm().item() / max(b.norm().item(), 1e-30) for a, b in ((out, ref_out), (rout, ref_r)))
    return max(comm.bootstrap.allgather_obj(err))


def main(argv: list[str] | None = None) -> int:
    return tb.main(parse_args, run, argv)


def run(comm, args, argv) -> int:
    """Measures and reports (rank 0); returns the exit status. Collective."""
    import torch

    rank0 = comm.bootstrap.rank == 0
    modes = args.modes.split(",")
    records, bad = [], False
    tdtype = getattr(torch, args.dtype)
    for hidden in args.hidden:
        shared = torch.Generator(device="cuda").manual_seed(hidden)  # the same weight on every rank
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=shared)).to(tdtype)
        for tokens in args.tokens:
            g = torch.Generator(device="cuda").manual_seed(tokens * 7919 + hidden)
            res = torch.randn(tokens, hidden, device="cuda", generator=g).to(tdtype)  # same on every rank
            mine = torch.Generator(device="cuda").manual_seed(comm.rank + 1)
            x = torch.randn(tokens, hidden, device="cuda", generator=mine).to(tdtype)
            fns, reset = candidates(comm, x, res, weight, 1e-6, args.algo)
            err = check(comm, fns, reset)
            bad |= err > 2e-2
            for name, fn in fns.items():
                for mode in modes:
                    if rank0:
                        sys.stderr.write(f"\r{hidden:>6} x {tokens:<5} {name:<18} {mode:<6}")
                    times = tb.time_us(fn, mode, comm.bootstrap, args.iters, args.graph_launches, args.repeats)
                    records.append({"candidate": name, "mode": mode, "tokens": tokens, "hidden": hidden,
                                    "bytes": x.numel() * x.element_size(), "times_us": times,
                                    "median_us": tb.median(times), "rel_err_vs_nccl": err})
    if rank0:
        sys.stderr.write("\n")
        report(comm, args, argv, records)
    return 1 if bad else 0


def table(records, mode: str) -> list[str]:
    by = {(r["hidden"], r["tokens"], r["candidate"]): r["median_us"] for r in records if r["mode"] == mode}
    keys = sorted({(h, t) for h, t, _ in by})
    lines = [f"# {mode}: median us per step; (x) = nccl+torch time / candidate time; "
             f"fused/AR = fused time / ubnext all-reduce time",
             f"{'hidden':>7}{'tokens':>7}" + "".join(f"{c:>20}" for c in CANDIDATES) + f"{'fused/AR':>10}"]
    for h, t in keys:
        ref = by.get((h, t, "nccl+torch"))
        cells = "".join(f"{by[(h, t, c)]:>12.2f} ({ref / by[(h, t, c)]:.2f}x)" for c in CANDIDATES)
        ratio = by[(h, t, "ubnext-fused")] / by[(h, t, "ubnext-allreduce")]
        lines.append(f"{h:>7}{t:>7}{cells}{ratio:>10.2f}")
    return lines


def report(comm, args, argv, records) -> None:
    for mode in args.modes.split(","):
        print("\n".join(table(records, mode)), flush=True)
    path, doc = tb.save_report(comm, "fused_perf", "fused", args, argv, {
        "dtype": args.dtype,
        "config": {"iters": args.iters, "graph_launches": args.graph_launches, "repeats": args.repeats,
                   "algo": args.algo},
        "results": records}, tags=(args.dtype,))
    panels = {}
    for mode in args.modes.split(","):
        for hidden in args.hidden:
            lines = {}
            for c in CANDIDATES:
                rows = sorted((r["tokens"], r["median_us"]) for r in records
                              if r["mode"] == mode and r["hidden"] == hidden and r["candidate"] == c)
                lines[c] = ([t for t, _ in rows], [u for _, u in rows])
            panels[f"{mode}, hidden {hidden}"] = lines
    try:
        png = tb.plot_lines(path + ".png",
                            f"all-reduce + add + RMSNorm, {args.dtype}, {comm.size} x {doc['machine']['gpu']}, "
                            f"{doc['date'][:10]}",
                            panels, "tokens", "median us per step")
        print(f"# wrote {png}")
    except ImportError:
        print("# matplotlib not installed: no PNG")


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
