"""Where the low-latency dispatch's time goes: variants of its kernel, timed in CUDA graphs.

    PYTHONPATH=. python bench/moe_phases.py                 # one GPU, one rank: bench/NOTES.md's shapes
    PYTHONPATH=. mpirun -n 4 python bench/moe_phases.py     # one rank per GPU

Each variant is kernels/moe_dispatch.cu compiled with other definitions (an
``ExpertParallel`` subclass whose ``_extra_defines["dispatch"]`` carries them) or launched on a
smaller grid, timed as bench/moe_perf.py times ubnext's dispatch (a CUDA graph of
``--iters`` calls replayed ``--launches`` times a sample; median of ``--repeats``, maximum
over ranks), at each shape of ``--shapes`` (hidden/experts/top-k/tokens per rank; the
object's max_tokens is the tokens, its capacity the busiest expert's rows, as moe_perf's):

* ``phase 0`` .. ``phase 3``: ``UB_MOE_PHASES=k``, the dispatch's phases up to k: 0 the
  launch's entry and exit (the PDL wait, the launch state, the rotation), 1 the headers
  (push, every block's wait and vote, their re-poison), 2 the send (rows, release fence,
  records, their re-poison), 3 the scatter's polls, votes and lists, without the copy;
* ``whole``: the dispatch the library runs (phase 4, every fence);
* ``no send fence``, ``no acquire``, ``no fences``: the whole dispatch without the send's
  release fence (``UB_MOE_FENCES=2``), the scatter's acquire loads (1), or both (0);
* ``fences as before``, ``no prefetch``: the whole dispatch with the fences of the kernel
  before branch moefloor (``UB_MOE_FENCES=7``: fence.sc.sys in the send, a fence after
  each record's relaxed polls), or without the prefetch of each block's first token
  (``UB_MOE_PREFETCH=0``): what those changes gained;
* ``grid g``, ``phase 0, grid g``: the whole dispatch, and phase 0, on g blocks instead of
  one per SM (``--grids``).

The phases below the whole and the variants without a fence are for timing only (recv_x
not written, or rows copied before they are known to have arrived); the others are checked
bit for bit against the host reference first (``-c 1``; the ``wrong`` column).
Below the table, what each phase adds (phase k minus phase k - 1), what each fence costs
(whole minus the variant without it) and what the grid changes. Rank 0 prints and writes
``<outdir>/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script (python bench/moe_phases.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402
from bench import moe_perf  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: bench/NOTES.md's one-rank measurements: hidden/experts/top-k/tokens
SHAPES = "7168/256/8/1,7168/256/8/16,7168/256/8/128,128/8/1/1,128/8/1/128"
#: the compiled variants: name, the dispatch's definitions (kernels/moe_dispatch.cu), checked or timing only
VARIANTS = tuple((f"phase {k}", (("UB_MOE_PHASES", str(k)),), False) for k in range(4)) + (
    ("whole", (), True), ("no send fence", (("UB_MOE_FENCES", "2"),), False),
    ("no acquire", (("UB_MOE_FENCES", "1"),), False), ("no fences", (("UB_MOE_FENCES", "0"),), False),
    ("fences as before", (("UB_MOE_FENCES", "7"),), True), ("no prefetch", (("UB_MOE_PREFETCH", "0"),), True))
#: what each phase adds and each fence costs: (label, minuend, subtrahend)
DIFFERENCES = (("headers (1 - 0)", "phase 1", "phase 0"), ("send (2 - 1)", "phase 2", "phase 1"),
               ("polls, votes, lists (3 - 2)", "phase 3", "phase 2"), ("copy (whole - 3)", "whole", "phase 3"),
               ("send fence", "whole", "no send fence"), ("acquire loads", "whole", "no acquire"),
               ("both", "whole", "no fences"), ("fences, this branch's gain", "fences as before", "whole"),
               ("prefetch's gain", "no prefetch", "whole"))


def shape_arg(text: str) -> list[tuple[int, int, int, int]]:
    """``H/E/K/T,...`` as (hidden, experts, top-k, tokens) tuples."""
    shapes = [tuple(int(v) for v in item.split("/")) for item in text.split(",")]
    if any(len(s) != 4 or min(s[:3]) < 1 or s[3] < 0 or s[2] > s[1] for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes are hidden/experts/top-k/tokens, 1 <= top-k <= experts: {text!r}")
    return shapes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("-s", "--shapes", type=shape_arg, default=shape_arg(SHAPES),
                   help="hidden/experts/top-k/tokens per rank, comma-separated")
    p.add_argument("--grids", type=lambda t: [int(v) for v in t.split(",") if v], default=[66, 33],
                   help="blocks of the 'grid g' variants (at most the SMs), comma-separated; empty: none")
    p.add_argument("-d", "--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--fp8", type=int, choices=(0, 1), default=0,
                   help="1: the FP8 dispatch (bfloat16, hidden a multiple of 512)")
    p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    p.add_argument("-n", "--iters", type=int, default=20, help="calls per captured graph")
    p.add_argument("--launches", type=int, default=5, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1)
    p.add_argument("--name", default=None, help="file stem (default: moe_phases_<gpu>_<n>gpu_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    args = p.parse_args(argv)
    if min(args.grids, default=1) < 1:
        p.error("--grids: at least one block")
    return args


def variants(grids: list[int]) -> list[tuple[str, tuple, bool, int | None]]:
    """(name, the dispatch's definitions, checked, blocks or None) of every variant timed."""
    phase0 = VARIANTS[0][1]
    return [(name, defines, checked, None) for name, defines, checked in VARIANTS] + \
        [(f"grid {g}", (), True, g) for g in grids] + [(f"phase 0, grid {g}", phase0, False, g) for g in grids]


def problem(args, shape: tuple[int, int, int, int]) -> SimpleNamespace:
    """moe_perf's arguments for one shape (its routing, payload and check read them)."""
    hidden, experts, top_k, tokens = shape
    return SimpleNamespace(hidden=hidden, experts=experts, top_k=top_k, tokens=tokens, dtype=args.dtype,
                           fp8=args.fp8, routing=args.routing, partials="float32", mode="low-latency")


def measure(comm, args, shape: tuple[int, int, int, int]) -> dict:
    """µs per dispatch of every variant at one shape (and its wrong elements where checked)."""
    import torch

    import ubnext
    from ubnext._moe import layout

    n, r = comm.size, comm.rank
    a = problem(args, shape)
    routes = [moe_perf.routing(a, s, a.tokens) for s in range(n)]
    idxs, ws = [i for i, _ in routes], [w for _, w in routes]
    capacity = moe_perf.busiest_expert(a.experts, idxs)
    sizes = (a.experts, a.hidden, max(a.tokens, 1), a.top_k, a.dtype)
    xs = [moe_perf.payload(a, s, (a.tokens, a.hidden)) for s in range(n)]
    x = moe_perf.to_device(xs[r], a.dtype)
    idx, w = torch.from_numpy(idxs[r]).cuda(), torch.from_numpy(ws[r]).cuda()
    times, wrong = {}, {}
    for name, defines, checked, blocks in variants(args.grids):
        cls = type("PhasedExpertParallel", (ubnext.ExpertParallel,), {"_extra_defines": {"dispatch": defines}})
        ep = cls(comm, *sizes, capacity=capacity, framework="torch", fp8=bool(args.fp8))
        if blocks is not None:
            ep._blocks = min(blocks, ep._blocks)
        if checked and args.check:
            wrong[name] = moe_perf.check(comm, a, ep, layout.shape(n, *sizes, capacity, bool(args.fp8)), xs, idxs,
                                         ws, x, idx, w)

        def fn(ep=ep):
            ep.dispatch(x, idx, w)

        fn()
        times[name] = tb.median(tb.time_us(fn, "graph", comm.bootstrap, args.iters, args.launches, args.repeats))
        del ep
    return {"shape": dict(zip(("hidden", "experts", "top_k", "tokens"), shape)), "capacity": capacity,
            "times_us": times, "wrong": wrong}


def table(records: list[dict], names: list[str]) -> list[str]:
    """The printed lines: µs per variant and shape, then the differences."""
    heads = ["{hidden}/{experts}/{top_k}/{tokens}".format(**rec["shape"]) for rec in records]
    width = max(12, *(len(h) + 1 for h in heads))
    lines = [f"{'variant':<28}" + "".join(f"{h:>{width}}" for h in heads)]
    for name in names:
        lines.append(f"{name:<28}" + "".join(f"{rec['times_us'][name]:>{width}.2f}" for rec in records))
    lines.append(f"{'wrong (checked variants)':<28}" + "".join(
        f"{sum(rec['wrong'].values()) if rec['wrong'] else '-':>{width}}" for rec in records))
    lines.append("# differences, µs")
    rows = list(DIFFERENCES) + [(f"{name} - whole", name, "whole") for name in names if name.startswith("grid ")] + \
        [(f"{name} - phase 0", name, "phase 0") for name in names if name.startswith("phase 0, grid ")]
    for label, plus, minus in rows:
        lines.append(f"{label:<28}" + "".join(f"{rec['times_us'][plus] - rec['times_us'][minus]:>{width}.2f}"
                                               for rec in records))
    return lines


def main(argv: list[str] | None = None) -> int:
    return tb.main(parse_args, run, argv)


def run(comm, args, argv) -> int:
    records = [measure(comm, args, shape) for shape in args.shapes]
    if comm.rank != 0:
        return 0
    names = [name for name, *_ in variants(args.grids)]
    print(f"# {comm.size} ranks, {args.dtype}{', fp8 dispatch' if args.fp8 else ''}, routing {args.routing}; "
          f"dispatch µs in CUDA graphs (median of {args.repeats}, max over ranks); "
          f"columns hidden/experts/top-k/tokens")
    print("\n".join(table(records, names)))
    tb.save_report(comm, "moe_phases", "moe_phases", args, argv, {
        "config": {k: getattr(args, k) for k in ("dtype", "fp8", "routing", "grids", "iters", "launches", "repeats")},
        "variants": {name: dict(defines) for name, defines, *_ in variants(args.grids)}, "results": records})
    return 1 if any(rec["wrong"] and any(rec["wrong"].values()) for rec in records) else 0


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
