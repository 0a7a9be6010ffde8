"""What the quantized all-reduce does to training: a short data-parallel run whose gradients
are averaged in each format, its loss curve beside full precision's.

    NCCL_NVLS_ENABLE=0 mpirun -n 4 python bench/quant_training.py --steps 300

A small MLP (``--width``, 3 layers, GELU) learns a fixed random teacher's classes of
Gaussian inputs (``--classes``). Every rank starts from the same weights and draws its own
batches; the same batches in every format, so the curves differ only by how the
gradients were reduced. Each step the bfloat16 gradients, flattened into one buffer, are
averaged by ``comm.all_reduce(..., op="avg", precision=fmt)`` (``exact``: ubnext's full
precision; ``int8``, ``fp8``, ``int4``: the quantized two-shot), then Adam updates the fp32
weights. Rank 0 prints the final training loss (mean of the last 20 steps), the held-out
loss and accuracy per format and how far the final weights drifted from full
precision's, and writes ``<outdir>/<name>.json`` and ``.png``. The communicator opts in to
the quantized formats (``UBNEXT_QUANTIZED=int8`` unless set: any format reserves every
format's areas).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/quant_training.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FORMATS = ("exact", "int8", "fp8", "int4")
#: training steps whose loss the final training loss averages
TAIL = 20


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quant_training", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    p.add_argument("--dim", type=int, default=256, help="input features")
    p.add_argument("--width", type=int, default=1024, help="hidden width")
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: exact, int8, fp8, int4")
    p.add_argument("--name", default=None)
    p.add_argument("--outdir", default=RESULTS_DIR)
    return p.parse_args(argv)


def mlp(dim: int, width: int, classes: int, seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, classes)).cuda()


def batch(teacher, args, seed: int):
    """Inputs and the teacher's classes of them, the same for a seed on every run."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(args.batch, args.dim, device="cuda", generator=g)
    with torch.no_grad():
        return x, teacher(x).argmax(1)


def train(comm, args, fmt: str, teacher, held_out) -> dict:
    """One run in ``fmt``: the losses per step (rank 0's batch), then the held-out loss,
    accuracy and the final weights (flattened). Collective."""
    import torch
    import torch.nn.functional as F

    model = mlp(args.dim, args.width, args.classes, seed=1)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    flat = torch.empty(sum(p.numel() for p in params), device="cuda", dtype=torch.bfloat16)
    views, offset = [], 0  # each parameter's gradient in the flat bfloat16 buffer
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    losses = []
    for step in range(args.steps):
        x, y = batch(teacher, args, seed=1_000_003 * step + comm.rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        for p, v in zip(params, views):
            v.copy_(p.grad)  # to bfloat16
        comm.all_reduce(flat, out=flat, op="avg", precision=fmt)
        for p, v in zip(params, views):
            p.grad.copy_(v)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = held_out
        logits = model(x)
        return {"losses": losses, "held_out_loss": F.cross_entropy(logits, y).item(),
                "held_out_accuracy": (logits.argmax(1) == y).float().mean().item(),
                "weights": torch.cat([p.reshape(-1) for p in params])}


def summary(runs: dict) -> list[dict]:
    """Per format: the final training loss (mean of the last TAIL steps), the held-out
    loss and accuracy, and the final weights' relative distance from ``exact``'s (where
    it ran)."""
    base = runs.get("exact", {}).get("weights")
    rows = []
    for fmt, r in runs.items():
        tail = r["losses"][-TAIL:]
        drift = None
        if base is not None and fmt != "exact":
            drift = ((r["weights"] - base).norm() / base.norm()).item()
        rows.append({"format": fmt, "final_train_loss": sum(tail) / len(tail),
                     "held_out_loss": r["held_out_loss"], "held_out_accuracy": r["held_out_accuracy"],
                     "weights_rel_drift_vs_exact": drift})
    return rows


def run(comm, args, argv) -> int:
    """Trains once per format and reports (rank 0). Collective."""
    import torch

    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise SystemExit(f"quant_training: unknown formats {sorted(unknown)} (choose from {', '.join(FORMATS)})")
    teacher = mlp(args.dim, args.width, args.classes, seed=0)
    held_out = batch(teacher, argparse.Namespace(batch=4096, dim=args.dim), seed=7)
    runs = {fmt: train(comm, args, fmt, teacher, held_out) for fmt in formats}
    torch.cuda.synchronize()
    if comm.bootstrap.rank != 0:
        return 0
    rows = summary(runs)
    print(f"# data-parallel training, {comm.size} ranks, MLP {args.dim}-{args.width}-{args.width}-{args.classes}, "
          f"{args.steps} steps of {args.batch} per rank, gradients averaged in bfloat16 by ubnext")
    print(f"{'format':>8}{'train loss':>12}{'held-out loss':>15}{'accuracy':>10}{'drift vs exact':>16}")
    for r in rows:
        drift = "-" if r["weights_rel_drift_vs_exact"] is None else f"{r['weights_rel_drift_vs_exact']:.2e}"
        print(f"{r['format']:>8}{r['final_train_loss']:>12.4f}{r['held_out_loss']:>15.4f}"
              f"{r['held_out_accuracy']:>10.3f}{drift:>16}")
    path, doc = tb.save_report(comm, "quant_training", "quant_training", args, argv, {
        "formats": formats, "summary": rows, "losses": {f: r["losses"] for f, r in runs.items()}})
    steps = list(range(1, args.steps + 1))
    try:
        print("# wrote " + tb.plot_lines(path + ".png", f"training loss, gradients averaged per format, "
                                         f"{comm.size} x {doc['machine']['gpu']}",
                                         {"training loss (rank 0's batches)": {f: (steps, r["losses"])
                                                                              for f, r in runs.items()}},
                                         "step", "cross-entropy", logx=False))
    except ImportError:
        print("# matplotlib not installed: no PNG")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("UBNEXT_QUANTIZED", "int8")  # opt in before the communicator exists
    return tb.main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
