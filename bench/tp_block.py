"""A tensor-parallel Llama-style MLP block, ubnext.torch's layers vs NCCL + torch.

    mpirun -n 4 python bench/tp_block.py --hidden 8192 --intermediate 28672 --tokens 1,8,32,128,512

Each rank holds 1/N of the MLP: the column-parallel gate and up projections
(hidden -> intermediate/N each, one GEMM), SiLU(gate) * up, the row-parallel down
projection (intermediate/N -> hidden), whose partial sums are then all-reduced, added to
the residual stream and RMS-normalized for the next layer:

* ``ubnext``: ``ubnext.torch.TensorParallelMLP`` with a ``BufferPlan`` (the down GEMM
  writes into planned symmetric memory; one fused all-reduce + add + RMSNorm kernel);
* ``nccl+torch``: the same GEMMs, ``torch.distributed.all_reduce`` in place on the down
  GEMM's output, then add + ``F.rms_norm`` compiled by ``torch.compile`` (no copies).

Both are checked against the same block computed with the full weights on one GPU,
then timed per token batch (µs per block, maximum over ranks, median of the repeats) in
``eager`` and ``graph`` mode and in the ``dependent`` mode: there the block's own down
GEMM is the producer whose output the all-reduce reads, so a graph of ``-n`` blocks is
timed and, right after each sample, a graph of ``-n`` of the block's GEMMs and SiLU alone
(the same for both paths); the difference is what the all-reduce and its epilogue cost
inside the block, and the block's outputs after one replay of a one-block graph are
checked against the one-GPU reference (relative error: SiLU makes exact integers
impossible; ``compare.py`` and ``fused_perf.py`` check their dependent mode bit for
bit). With the peak of torch's allocated memory per path (and ubnext's symmetric pool,
which holds the planned buffers). Runs at 1 rank too. Rank 0
prints the table with the end-to-end speed-up and writes ``<outdir>/<name>.json`` and
``<name>.png``.

What the quantized all-reduce (``docs/quantized.md``) does to the block: with
``--precision int8,fp8,int4`` the block also runs unfused on ubnext (the same GEMMs, the
down GEMM into the planned buffer, ``comm.all_reduce(y, out=y, precision=...)``, the
compiled add + RMSNorm), once per format, the format forced whatever the size thresholds
say, and once with ``precision="exact"``: the full precision they are measured against
(the same steps and inputs, so the all-reduce is the only difference). A further table
gives per token count and format the largest absolute and the relative (2-norm)
difference of the normed output and of the residual stream from full precision's, the
relative error against the one-GPU reference, and the µs per block in each mode beside
full precision's (quantized paths are checked for NaN only; ``exact`` as the others). The
communicator opts in with ``UBNEXT_QUANTIZED`` (the first format, unless set), which
changes no other path: the fused call and NCCL never quantize.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/tp_block.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402
from ubnext._protocol.quant import FORMATS as QUANT_FORMATS  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PATHS = ("ubnext", "nccl+torch")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tp_block", description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=28672)
    p.add_argument("--tokens", type=ints, default=[1, 8, 32, 128, 512])
    p.add_argument("-d", "--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-G", "--graph-launches", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="eager,graph,dependent", help="comma-separated: eager, graph, dependent")
    p.add_argument("--precision", type=lambda text: text.split(","), default=[],
                   help="comma-separated quantized formats (int8, fp8, int4): also run the block with its all-reduce "
                        "in each and in full precision, and report the output error against full precision")
    p.add_argument("--name", default=None)
    p.add_argument("--outdir", default=RESULTS_DIR)
    args = p.parse_args(argv)
    if any(m not in tb.MODES for m in args.modes.split(",")):
        p.error(f"--modes takes a comma-separated subset of {', '.join(tb.MODES)}")
    if set(args.precision) - set(QUANT_FORMATS) or len(set(args.precision)) < len(args.precision):
        p.error(f"--precision takes a comma-separated subset of {', '.join(QUANT_FORMATS)}")
    return args


def parse_and_opt_in(argv: list[str]) -> argparse.Namespace:
    """:func:`parse_args`; with ``--precision``, opts the communicator about to be created in
    to the quantized all-reduce (``UBNEXT_QUANTIZED``, the first format, unless set: any
    format reserves every format's areas)."""
    args = parse_args(argv)
    if args.precision:
        os.environ.setdefault("UBNEXT_QUANTIZED", args.precision[0])
    return args


def precision_paths(formats: list[str]) -> dict[str, str]:
    """The paths ``--precision`` adds, each to its ``precision=``: full precision first
    (what the formats are measured against); none without formats."""
    return {f"ubnext {p}": p for p in ("exact", *formats)} if formats else {}


def deviation(outputs, refs) -> dict[str, float]:
    """How far the block's ``(normed, residual_out)`` lie from ``refs`` (float64): per
    output (``out``, ``residual``), the largest absolute difference and the norm of the
    difference over the norm of the reference."""
    d = {}
    for key, a, b in zip(("out", "residual"), outputs, refs):
        diff = a.double() - b.double()
        d[f"max_abs_{key}"] = diff.abs().max().item()
        d[f"rel_{key}"] = diff.norm().item() / b.double().norm().item()
    return d


def nan_max(values) -> float:
    """The largest of ``values``, NaN where one is NaN."""
    return max(values, key=lambda v: (math.isnan(v), v))


def add_rmsnorm(y, residual, weight, eps: float):
    """The unfused epilogue of the baseline: ``(rms_norm(y + residual) * weight, y + residual)``."""
    import torch.nn.functional as F

    r = y + residual
    return F.rms_norm(r, (r.shape[-1],), weight, eps), r


class Block:
    """This rank's shard of the MLP block (``ubnext.torch.TensorParallelMLP``) and the two ways to run it."""

    def __init__(self, comm, hidden: int, intermediate: int, dtype, max_tokens: int, eps: float = 1e-6):
        import torch

        import ubnext.torch as ut

        if intermediate % comm.size:
            raise SystemExit(f"tp_block: --intermediate {intermediate} is not divisible by {comm.size} ranks")
        g = torch.Generator(device="cuda").manual_seed(1234)  # the full weights, the same on every rank
        self.full_gate = (torch.randn(intermediate, hidden, device="cuda", generator=g) * hidden ** -0.5).to(dtype)
        self.full_up = (torch.randn(intermediate, hidden, device="cuda", generator=g) * hidden ** -0.5).to(dtype)
        self.full_down = (torch.randn(hidden, intermediate, device="cuda", generator=g)
                          * intermediate ** -0.5).to(dtype)
        self.norm_weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
        # planned symmetric buffers where there is a pool (none where ubnext runs on NCCL only)
        self.plan = ut.BufferPlan(comm, max_tokens, {"mlp": hidden}, dtype) if comm.pool else None
        self.mlp = ut.TensorParallelMLP(hidden, intermediate, comm, eps=eps, plan=self.plan, dtype=dtype,
                                        device="cuda").requires_grad_(False)
        self.mlp.load_full(self.full_gate, self.full_up, self.full_down, self.norm_weight)
        self.epilogue = torch.compile(add_rmsnorm, fullgraph=True)
        self.eps = eps
        self.comm = comm

    def reference(self, h, residual):
        """The whole block on this GPU with the full weights: (normed, residual_out)."""
        import torch.nn.functional as F

        y = F.linear(F.silu(F.linear(h, self.full_gate)) * F.linear(h, self.full_up), self.full_down)
        r = y + residual
        return F.rms_norm(r.float(), (h.shape[1],), self.norm_weight.float(), self.eps).to(h.dtype), r

    def steps(self, h, residual, precisions: dict[str, str] | None = None):
        """path -> callable running one block on torch's current stream and returning
        ``(normed, residual_out)``: ``PATHS``, then each path of ``precisions`` (path ->
        ``precision=``, :func:`precision_paths`): the unfused block with ubnext's all-reduce
        in place in the planned buffer in that precision."""
        import torch.distributed as dist
        import torch.nn.functional as F

        mlp, comm = self.mlp, self.comm

        def ubnext():
            return mlp(h, residual)

        def unfused(down, all_reduce):
            """The GEMMs (the down one by ``down``), ``all_reduce`` in place on its output, then
            the compiled add + RMSNorm."""
            def step():
                gate, up = F.linear(h, mlp.gate_up.weight).chunk(2, dim=-1)
                y = down(F.silu(gate) * up)
                all_reduce(y)
                return self.epilogue(y, residual, mlp.norm.weight, self.eps)

            return step

        fns = dict(zip(PATHS, (ubnext, unfused(lambda a: F.linear(a, mlp.down.weight), dist.all_reduce))))
        for path, precision in (precisions or {}).items():
            fns[path] = unfused(mlp.down.partial, lambda y, p=precision: comm.all_reduce(y, out=y, precision=p))
        return fns

    def compute(self, h):
        """The block's GEMMs and SiLU alone (no all-reduce, no epilogue): what the dependent
        mode subtracts."""
        import torch.nn.functional as F

        gate, up = F.linear(h, self.mlp.gate_up.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.mlp.down.weight)


def main(argv: list[str] | None = None) -> int:
    return tb.main(parse_and_opt_in, run, argv)


def run(comm, args, argv) -> int:
    """Measures and reports (rank 0); returns the exit status. Collective."""
    import torch

    rank0 = comm.bootstrap.rank == 0
    dtype = getattr(torch, args.dtype)
    records, bad = [], False
    precisions = precision_paths(args.precision)
    if precisions and (comm.pool is None or comm.config.quantized == "off"):
        raise SystemExit(f"tp_block: --precision needs the quantized all-reduce: a communicator opted in "
                         f"(UBNEXT_QUANTIZED={comm.config.quantized}) with kernels on the pool ({comm.path})")
    limit = {path: float("inf") for path, p in precisions.items() if p != "exact"}  # the formats: NaN only
    block = Block(comm, args.hidden, args.intermediate, dtype, max(args.tokens))
    pool = comm.pool["bytes"] if comm.pool else 0
    for tokens in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(tokens)  # the same activations on every rank
        h = torch.randn(tokens, args.hidden, device="cuda", generator=g).to(dtype)
        residual = torch.randn(tokens, args.hidden, device="cuda", generator=g).to(dtype)
        fns = block.steps(h, residual, precisions)
        ref_out, ref_r = block.reference(h, residual)

        def worst(outputs, refs) -> dict[str, float]:
            """:func:`deviation`, each figure the maximum over ranks."""
            ranks = comm.bootstrap.allgather_obj(deviation(outputs, refs))
            return {k: nan_max(r[k] for r in ranks) for k in ranks[0]}

        def error(outputs) -> float:
            """Relative error of (normed, residual_out) against the reference, max over ranks."""
            d = worst(outputs, (ref_out, ref_r))
            return nan_max((d["rel_out"], d["rel_residual"]))

        errors, vs_exact = {}, {}
        with torch.no_grad():
            for name, fn in fns.items():
                outputs = fn()
                torch.cuda.synchronize()
                errors[name] = error(outputs)
                bad |= not errors[name] < limit.get(name, 2e-2)
                if name in precisions:  # "exact" first: what the formats are measured against
                    if precisions[name] == "exact":
                        exact = outputs
                    vs_exact[name] = worst(outputs, exact)
            for name, fn in fns.items():
                for mode in args.modes.split(","):
                    if rank0:
                        sys.stderr.write(f"\r{tokens:<5} {name:<12} {mode:<9}")
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    rec = {"path": name, "mode": mode, "tokens": tokens, "rel_err_vs_1gpu": errors[name]}
                    if name in precisions:
                        rec.update(precision=precisions[name], vs_exact=vs_exact[name])
                    if mode == "dependent":  # the block's GEMMs are the producer; they are subtracted
                        rec["rel_err_vs_1gpu"] = error(tb.replay_once(fn))
                        bad |= not rec["rel_err_vs_1gpu"] < limit.get(name, 2e-2)
                        rec.update(common.dependent_samples(
                            tb.timer(fn, mode, comm.bootstrap, args.iters, args.graph_launches),
                            tb.timer(lambda: block.compute(h), mode, comm.bootstrap, args.iters, args.graph_launches),
                            args.repeats))
                        rec["raw_median_us"] = tb.median(rec["raw_us"])
                        rec["gemm_median_us"] = tb.median(rec["gemm_us"])
                    else:
                        rec["times_us"] = tb.time_us(fn, mode, comm.bootstrap, args.iters, args.graph_launches,
                                                     args.repeats)
                    peak = max(comm.bootstrap.allgather_obj(torch.cuda.max_memory_allocated() - before))
                    records.append({**rec, "median_us": tb.median(rec["times_us"]), "peak_torch_bytes": peak,
                                    "ubnext_pool_bytes": 0 if name == "nccl+torch" else pool})
    if rank0:
        sys.stderr.write("\n")
        report(comm, args, argv, records)
    return 1 if bad else 0


def report(comm, args, argv, records) -> None:
    modes = args.modes.split(",")
    for mode in modes:
        by = {(r["tokens"], r["path"]): r for r in records if r["mode"] == mode}
        what = ("µs per MLP block less its GEMMs and SiLU alone (raw: whole block; GEMMs: the part subtracted)"
                if mode == "dependent" else "µs per MLP block")
        print(f"# {mode}: {what} (hidden {args.hidden}, intermediate {args.intermediate}, "
              f"TP={comm.size}); speed-up = nccl+torch / ubnext")
        print(f"{'tokens':>7}{'ubnext':>12}{'nccl+torch':>12}{'speed-up':>10}{'err ubnext':>12}{'err nccl':>10}"
              f"{'MiB ubnext':>12}{'MiB nccl':>10}")
        for t in args.tokens:
            u, n = by[(t, "ubnext")], by[(t, "nccl+torch")]
            print(f"{t:>7}{u['median_us']:>12.1f}{n['median_us']:>12.1f}{n['median_us'] / u['median_us']:>10.2f}"
                  f"{u['rel_err_vs_1gpu']:>12.1e}{n['rel_err_vs_1gpu']:>10.1e}"
                  f"{u['peak_torch_bytes'] / 2**20:>12.1f}{n['peak_torch_bytes'] / 2**20:>10.1f}"
                  + (f"  raw {u['raw_median_us']:.1f} / {n['raw_median_us']:.1f}, GEMMs {u['gemm_median_us']:.1f}"
                     if mode == "dependent" else ""))
    print(f"# MiB: peak torch allocations while timing, beyond what was allocated before; ubnext's symmetric "
          f"pool (planned buffers, staging) adds {max(r['ubnext_pool_bytes'] for r in records) / 2**20:.0f} MiB "
          f"per rank, allocated once" if records else "")
    if args.precision:
        report_precision(args, records)
    path, doc = tb.save_report(comm, "tp_block", "tp_block", args, argv, {
        "dtype": args.dtype, "hidden": args.hidden, "intermediate": args.intermediate,
        "precision": args.precision, "results": records})
    paths = (*PATHS, *precision_paths(args.precision))
    panels = {mode: {p: ([r["tokens"] for r in records if r["mode"] == mode and r["path"] == p],
                         [r["median_us"] for r in records if r["mode"] == mode and r["path"] == p]) for p in paths}
              for mode in modes}
    try:
        print("# wrote " + tb.plot_lines(path + ".png",
                                         f"TP MLP block, hidden {args.hidden}, {args.dtype}, "
                                         f"{comm.size} x {doc['machine']['gpu']}",
                                         panels, "tokens", "median us per block"))
    except ImportError:
        print("# matplotlib not installed: no PNG")


def report_precision(args, records) -> None:
    """The ``--precision`` table: per token count and precision, the block's difference
    from full precision's outputs, its error against the one-GPU reference, and µs per
    block in each mode beside full precision's."""
    modes = args.modes.split(",")
    by = {(r["tokens"], r["path"], r["mode"]): r for r in records}
    print("# precision: the block unfused on ubnext (GEMMs, all_reduce(precision=...) in place, compiled add + "
          "RMSNorm), each format against the same in full precision (exact): the largest absolute difference "
          "(max|d|) and |d| / |exact| (rel, 2-norms) of the normed output (out) and of the residual stream (res); "
          "vs 1 GPU: relative error against the one-GPU reference; <mode> µs as in the tables above, x exact: "
          "exact's µs / the format's")
    print(f"{'tokens':>7}{'format':>8}{'max|d| out':>12}{'rel out':>10}{'max|d| res':>12}{'rel res':>10}"
          f"{'vs 1 GPU':>10}" + "".join(f"{mode + ' µs':>14}{'x exact':>9}" for mode in modes))
    for t in args.tokens:
        for path, precision in precision_paths(args.precision).items():
            first = by[(t, path, modes[0])]
            d = first["vs_exact"]
            print(f"{t:>7}{precision:>8}{d['max_abs_out']:>12.2e}{d['rel_out']:>10.2e}"
                  f"{d['max_abs_residual']:>12.2e}{d['rel_residual']:>10.2e}{first['rel_err_vs_1gpu']:>10.1e}"
                  + "".join(f"{by[(t, path, m)]['median_us']:>14.1f}"
                            f"{by[(t, 'ubnext exact', m)]['median_us'] / by[(t, path, m)]['median_us']:>9.2f}"
                            for m in modes))


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
