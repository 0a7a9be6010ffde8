"""Fused all-reduce + residual add + RMSNorm against the unfused sequences.

    mpirun -n 4 python bench/fused_perf.py --tokens 1,8,32,128,512,2048 --hidden 4096,8192

For each (tokens, hidden), bf16 by default, with torch tensors:

* ``ubnext-fused``: ``comm.all_reduce_add_rmsnorm`` (one kernel);
* ``ubnext-allreduce``: ``comm.all_reduce`` alone (what the fused call adds to);
* ``ubnext+torch``: ``comm.all_reduce``, then add + ``rms_norm`` compiled by ``torch.compile``;
* ``nccl+torch``: ``torch.distributed.all_reduce`` (NCCL) in place on its buffer, as on a
  GEMM's output, then the same compiled add + ``rms_norm``;

(no copies in the baselines: the outputs of the compiled epilogue are new tensors);

each checked once against the unfused NCCL result, then timed per mode (µs per call,
maximum over ranks, median of the repeats): ``eager`` (back-to-back calls), ``graph``
(back-to-back calls in a CUDA graph) and ``dependent``: a graph of ``-n`` (GEMM, step)
pairs, the GEMM (``--gemm M,K,N``, same stream) writing the step's input (the first
M*N elements of the tokens x hidden input; where the input is smaller, it is a prefix
of the GEMM's output), minus a graph of the GEMMs alone, timed in turn. In the
dependent mode the inputs and the residual are small integers (the GEMM's operands
make its output exact), so each step's all-reduce-derived output (``residual_out``,
or the all-reduce's output) is checked bit for bit after one replay with the GEMM's
output region poisoned with NaN first. Rank 0 prints a table per mode with the ratio
(nccl+torch time / candidate time) and the fused call's overhead over the plain
all-reduce, and writes ``<outdir>/<name>.json`` and ``<name>.png``.
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
    p.add_argument("--modes", default="eager,graph,dependent", help="comma-separated: eager, graph, dependent")
    p.add_argument("--gemm", type=common.gemm_arg, default=common.GEMM_SHAPE,
                   help="M,K,N of the GEMM before each step in the dependent mode (default 64,4096,4096)")
    p.add_argument("-a", "--algo", default="auto", help="ubnext algorithm of the fused call and the all-reduce")
    p.add_argument("--name", default=None, help="file stem (default: fused_<gpu>_<n>gpu_<dtype>_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    args = p.parse_args(argv)
    if any(m not in tb.MODES for m in args.modes.split(",")):
        p.error(f"--modes takes a comma-separated subset of {', '.join(tb.MODES)}")
    return args


def add_rmsnorm(y, res, weight, eps: float):
    """The unfused epilogue of the baselines: ``(rms_norm(y + res) * weight, y + res)``."""
    import torch.nn.functional as F

    r = y + res
    return F.rms_norm(r, (r.shape[-1],), weight, eps), r


def candidates(comm, x, res, weight, eps, algo="auto", nccl_x=None):
    """name -> callable that runs one fused or unfused step on torch's current stream and
    returns ``(normed, residual_out)`` (``(None, all-reduce output)`` for the all-reduce
    alone); and a reset that puts x into the NCCL baseline's buffer (``nccl_x``, default a
    copy of x).

    The baselines move no extra copies: the NCCL one reduces its buffer in place, as it
    would a GEMM's output (so only its first call after the reset computes the block's
    values), and the add + RMSNorm after the all-reduce is compiled by torch.compile
    into new outputs."""
    import torch
    import torch.distributed as dist

    out, rout, y = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    nccl_y = x.clone() if nccl_x is None else nccl_x
    epilogue = torch.compile(add_rmsnorm, fullgraph=True)

    def fused():
        return comm.all_reduce_add_rmsnorm(x, res, weight, eps=eps, out=out, residual_out=rout, algorithm=algo)

    def allreduce():
        comm.all_reduce(x, out=y, algorithm=algo)
        return None, y

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
                for mode in [m for m in modes if m != "dependent"]:
                    if rank0:
                        sys.stderr.write(f"\r{hidden:>6} x {tokens:<5} {name:<18} {mode:<6}")
                    times = tb.time_us(fn, mode, comm.bootstrap, args.iters, args.graph_launches, args.repeats)
                    records.append({"candidate": name, "mode": mode, "tokens": tokens, "hidden": hidden,
                                    "bytes": x.numel() * x.element_size(), "times_us": times,
                                    "median_us": tb.median(times), "rel_err_vs_nccl": err})
            if "dependent" in modes:
                found = dependent(comm, args, tokens, hidden, weight, err, rank0)
                bad |= any(r["wrong"] for r in found)
                records += found
    if rank0:
        sys.stderr.write("\n")
        report(comm, args, argv, records)
    return 1 if bad else 0


def dependent(comm, args, tokens: int, hidden: int, weight, err: float, rank0: bool) -> list[dict]:
    """The dependent mode at one (tokens, hidden): records per candidate. Collective.

    The step's input x (and the NCCL baseline's own buffer) is the head of a flat buffer
    that also holds the GEMM's whole output; the residual is small integers, the same on
    every rank, so ``residual_out`` = all-reduce + residual is exact.
    """
    import torch

    dtype = common.parse_dtypes(args.dtype)[0]
    tdtype = getattr(torch, args.dtype)
    count, nranks = tokens * hidden, comm.size
    data = common.GemmData(args.gemm, nranks, seed=tokens * 7919 + hidden)
    size = max(count, data.elements)
    flat = {"x": torch.zeros(size, dtype=tdtype, device="cuda"), "nccl": torch.zeros(size, dtype=tdtype, device="cuda")}
    res_values = common.make_input(nranks + 1, nranks + 1, count, data.seed + 1)  # small integers, same on every rank
    res = torch.from_numpy(res_values.astype("float32")).to(device="cuda", dtype=tdtype).view(tokens, hidden)
    fns, _ = candidates(comm, flat["x"][:count].view(tokens, hidden), res, weight, 1e-6, args.algo,
                        nccl_x=flat["nccl"][:count].view(tokens, hidden))
    into = common.gemm_launcher(data, comm.rank, dtype, use_torch=True)
    total = data.expected(count, "sum")
    records = []
    for name, fn in fns.items():
        buf = flat["nccl" if name == "nccl+torch" else "x"]
        gemm = into(buf)
        # the check: NaN where the GEMM writes, so a step that reads before it wrote reads NaN
        tb.poison_tensor(buf[:data.elements], dtype)
        buf[data.elements:count].zero_()
        def step(gemm=gemm, fn=fn):
            gemm()
            return fn()[1]  # residual_out, or the all-reduce's output

        got = tb.replay_once(step)
        want = total if name == "ubnext-allreduce" else total + res_values
        wrong = common.count_wrong(tb.bits(got, dtype), common.encode(want, dtype), dtype)
        wrong = sum(comm.bootstrap.allgather_obj(wrong))
        if rank0:
            sys.stderr.write(f"\r{hidden:>6} x {tokens:<5} {name:<18} dependent")
        d = tb.dependent_us(gemm, fn, comm.bootstrap, args.iters, args.graph_launches, args.repeats)
        records.append({"candidate": name, "mode": "dependent", "tokens": tokens, "hidden": hidden,
                        "bytes": count * dtype.itemsize, **d, "median_us": tb.median(d["times_us"]),
                        "raw_median_us": tb.median(d["raw_us"]), "gemm_median_us": tb.median(d["gemm_us"]),
                        "wrong": wrong, "rel_err_vs_nccl": err})
    return records


def table(records, mode: str, key: str = "median_us", what: str = "median us per step") -> list[str]:
    by = {(r["hidden"], r["tokens"], r["candidate"]): r[key] for r in records if r["mode"] == mode}
    keys = sorted({(h, t) for h, t, _ in by})
    lines = [f"# {mode}: {what}; (x) = nccl+torch time / candidate time; "
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
        if mode == "dependent":
            print("\n".join(table(records, mode, what="median us per step after a GEMM on its input, the GEMMs' "
                                                    "own graph time subtracted")), flush=True)
            print("\n".join(table(records, mode, "raw_median_us", "raw: median us per GEMM + step")), flush=True)
            if any(r.get("wrong") for r in records):
                print("# WRONG: a dependent-mode result differed from the exact one (see 'wrong' in the JSON)")
        else:
            print("\n".join(table(records, mode)), flush=True)
    path, doc = tb.save_report(comm, "fused_perf", "fused", args, argv, {
        "dtype": args.dtype,
        "config": {"iters": args.iters, "graph_launches": args.graph_launches, "repeats": args.repeats,
                   "algo": args.algo, "gemm_mnk": list(args.gemm)},
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
