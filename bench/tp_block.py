"""A tensor-parallel Llama-style MLP block, ubnext fused vs NCCL + torch.

    mpirun -n 4 python bench/tp_block.py --hidden 8192 --intermediate 28672 --tokens 1,8,32,128,512

Each rank holds 1/N of the MLP: the column-parallel gate and up projections
(hidden -> intermediate/N each), SiLU(gate) * up, the row-parallel down projection
(intermediate/N -> hidden), whose partial sums are then all-reduced, added to the
residual stream and RMS-normalized for the next layer:

* ``ubnext``: ``comm.all_reduce_add_rmsnorm`` (one kernel after the matmuls);
* ``nccl+torch``: ``torch.distributed.all_reduce``, torch add, ``F.rms_norm``.

Both are checked against the same block computed with the full weights on one GPU,
then timed per token batch in eager and CUDA-graph mode (µs per block, maximum over
ranks, median of the repeats). Rank 0 prints the table with the end-to-end speed-up
and writes ``<outdir>/<name>.json`` and ``<name>.png``.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/tp_block.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402

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
    p.add_argument("--modes", default="eager,graph")
    p.add_argument("--name", default=None)
    p.add_argument("--outdir", default=RESULTS_DIR)
    return p.parse_args(argv)


class Block:
    """This rank's shard of the MLP block and its two ways to finish it."""

    def __init__(self, comm, hidden: int, intermediate: int, dtype, eps: float = 1e-6):
        import torch

        n, r = comm.size, comm.rank
        if intermediate % n:
            raise SystemExit(f"tp_block: --intermediate {intermediate} is not divisible by {n} ranks")
        g = torch.Generator(device="cuda").manual_seed(1234)  # the full weights, the same on every rank
        scale = hidden ** -0.5
        self.full_gate = (torch.randn(hidden, intermediate, device="cuda", generator=g) * scale).to(dtype)
        self.full_up = (torch.randn(hidden, intermediate, device="cuda", generator=g) * scale).to(dtype)
        self.full_down = (torch.randn(intermediate, hidden, device="cuda", generator=g)
                          * intermediate ** -0.5).to(dtype)
        self.norm_weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
        part = intermediate // n
        cols = slice(r * part, (r + 1) * part)
        # column-parallel gate|up in one matmul, row-parallel down
        self.gate_up = torch.cat([self.full_gate[:, cols], self.full_up[:, cols]], dim=1).contiguous()
        self.down = self.full_down[cols].contiguous()
        self.part, self.comm, self.eps = part, comm, eps

    def partial(self, h):
        import torch.nn.functional as F

        gu = h @ self.gate_up
        return (F.silu(gu[:, : self.part]) * gu[:, self.part:]) @ self.down

    def reference(self, h, residual):
        """The whole block on this GPU with the full weights: (normed, residual_out)."""
        import torch.nn.functional as F

        y = (F.silu(h @ self.full_gate) * (h @ self.full_up)) @ self.full_down
        r = y + residual
        return F.rms_norm(r.float(), (h.shape[1],), self.norm_weight.float(), self.eps).to(h.dtype), r

    def steps(self, h, residual):
        """path -> callable running one block on torch's current stream; and its outputs."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        out, rout = torch.empty_like(h), torch.empty_like(h)

        def ubnext():
            self.comm.all_reduce_add_rmsnorm(self.partial(h), residual, self.norm_weight, eps=self.eps,
                                             out=out, residual_out=rout)

        def nccl():
            y = self.partial(h)
            dist.all_reduce(y)
            torch.add(y, residual, out=rout)
            out.copy_(F.rms_norm(rout, (h.shape[1],), self.norm_weight, self.eps))

        return dict(zip(PATHS, (ubnext, nccl))), out, rout


def main(argv: list[str] | None = None) -> int:
    return tb.main(parse_args, run, argv)


def run(comm, args, argv) -> int:
    """Measures and reports (rank 0); returns the exit status. Collective."""
    import torch

    rank0 = comm.bootstrap.rank == 0
    dtype = getattr(torch, args.dtype)
    records, bad = [], False
    block = Block(comm, args.hidden, args.intermediate, dtype)
    for tokens in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(tokens)  # the same activations on every rank
        h = torch.randn(tokens, args.hidden, device="cuda", generator=g).to(dtype)
        residual = torch.randn(tokens, args.hidden, device="cuda", generator=g).to(dtype)
        fns, out, rout = block.steps(h, residual)
        ref_out, ref_r = block.reference(h, residual)
        errors = {}
        for name, fn in fns.items():
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = max((a.double() - b.double()).norm().item() / b.double().norm().item()
                      for a, b in ((out, ref_out), (rout, ref_r)))
            errors[name] = max(comm.bootstrap.allgather_obj(err))
            bad |= not errors[name] < 2e-2
        for name, fn in fns.items():
            for mode in args.modes.split(","):
                if rank0:
                    sys.stderr.write(f"\r{tokens:<5} {name:<12} {mode:<6}")
                times = tb.time_us(fn, mode, comm.bootstrap, args.iters, args.graph_launches, args.repeats)
                records.append({"path": name, "mode": mode, "tokens": tokens, "times_us": times,
                                "median_us": tb.median(times), "rel_err_vs_1gpu": errors[name]})
    if rank0:
        sys.stderr.write("\n")
        report(comm, args, argv, records)
    return 1 if bad else 0


def report(comm, args, argv, records) -> None:
    modes = args.modes.split(",")
    for mode in modes:
        by = {(r["tokens"], r["path"]): r for r in records if r["mode"] == mode}
        print(f"# {mode}: µs per MLP block (hidden {args.hidden}, intermediate {args.intermediate}, "
              f"TP={comm.size}); speed-up = nccl+torch / ubnext")
        print(f"{'tokens':>7}{'ubnext':>12}{'nccl+torch':>12}{'speed-up':>10}{'err ubnext':>12}{'err nccl':>10}")
        for t in args.tokens:
            u, n = by[(t, "ubnext")], by[(t, "nccl+torch")]
            print(f"{t:>7}{u['median_us']:>12.1f}{n['median_us']:>12.1f}{n['median_us'] / u['median_us']:>10.2f}"
                  f"{u['rel_err_vs_1gpu']:>12.1e}{n['rel_err_vs_1gpu']:>10.1e}")
    path, doc = tb.save_report(comm, "tp_block", "tp_block", args, argv, {
        "dtype": args.dtype, "hidden": args.hidden, "intermediate": args.intermediate, "results": records})
    panels = {mode: {p: ([r["tokens"] for r in records if r["mode"] == mode and r["path"] == p],
                         [r["median_us"] for r in records if r["mode"] == mode and r["path"] == p]) for p in PATHS}
              for mode in modes}
    try:
        print("# wrote " + tb.plot_lines(path + ".png",
                                         f"TP MLP block, hidden {args.hidden}, {args.dtype}, "
                                         f"{comm.size} x {doc['machine']['gpu']}",
                                         panels, "tokens", "median us per block"))
    except ImportError:
        print("# matplotlib not installed: no PNG")


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
