"""The error of the quantized all-reduce and reduce-scatter, measured on the host (CPU only).

    python bench/quant_error.py [--count 1048576] [--outdir bench/results]

The GPU kernels' results equal ubnext/_protocol/quant.py's host emulation bit for bit
(tests/test_gpu_quant.py), so the emulation measures the kernels' error without a GPU.
For every format, input dtype, rank count and kind of data, every rank's input of
``--count`` elements is reduced by the emulation (sum); each group's error is its largest
|result - exact| (exact: the fp64 sum) over M, the sum over ranks of each rank's largest
magnitude in the group (_quant.group_errors). The table gives the median, 99th
percentile and maximum over groups, the stated bound (_quant.bound), and the same
maximum for the full-precision path (the fp32 sum rounded once to the dtype) beside it;
then the reduce-scatter's median and maximum (the same inputs as N slices, every rank's
output) and its own bound. Per group over M, more ranks look more accurate (M grows with
N faster than the sum's magnitude does), so each case also gives the error relative to
the result (``rel2``): ||result - exact||_2 / ||exact||_2 over the whole message, of the
all-reduce, of the reduce-scatter (every rank's output in rank order: the message) and
of the full-precision path. Writes ``quant_error.txt``, ``.json`` and ``.png`` (the
all-reduce's distribution per format, the reduce-scatter's dashed) to ``--outdir``.

Kinds of data: ``normal`` N(0, 1); ``heavy`` Student t with 2 degrees of freedom;
``outliers`` N(0, 1) with 0.5 % of the elements 1000x larger; ``channels`` rows of 4096
activations whose 8 fixed channels are 100x larger (the outlier features of LLM
activations). float16 inputs are the same values times 8 (its normal range).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if __package__ in (None, ""):  # run as a script: bench/_standalone.py puts the repository on the path
    import _standalone  # noqa: F401

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from ubnext._protocol import quant as _quant  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
KINDS = ("normal", "heavy", "outliers", "channels")
NP = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
HIDDEN, OUTLIER_CHANNELS = 4096, 8


def rank_data(kind: str, dtype: str, count: int, rank: int, seed: int = 0) -> np.ndarray:
    """One rank's input of ``kind`` (see the module docstring)."""
    rng = np.random.default_rng([KINDS.index(kind), rank, seed])
    if kind == "heavy":
        x = rng.standard_t(2, count)
    else:
        x = rng.standard_normal(count)
    if kind == "outliers":
        x[rng.choice(count, max(1, count // 200), replace=False)] *= 1000
    elif kind == "channels":
        channels = np.random.default_rng(seed).choice(HIDDEN, OUTLIER_CHANNELS, replace=False)
        rows = x[:count // HIDDEN * HIDDEN].reshape(-1, HIDDEN)
        rows[:, channels] *= 100
    return (x * (8.0 if dtype == "float16" else 1.0)).astype(NP[dtype])


def full_precision(inputs) -> np.ndarray:
    """The exact path's result: the fp32 sum in rank order, rounded once."""
    acc = inputs[0].astype(np.float32)
    for x in inputs[1:]:
        acc = acc + x.astype(np.float32)
    return acc.astype(inputs[0].dtype)


def reduce_scatter_errors(inputs, outputs) -> np.ndarray:
    """Every group's error of the quantized reduce-scatter ``outputs`` (every rank's, in rank
    order) of ``inputs`` (N slices each)."""
    k = inputs[0].size // len(inputs)
    return np.concatenate([_quant.group_errors([x[r * k:(r + 1) * k] for x in inputs], out, "sum")
                           for r, out in enumerate(outputs)])


def relative_2norm(inputs, result) -> float:
    """The error relative to the result: ||result - exact||_2 / ||exact||_2 over the message
    (exact: the fp64 sum of ``inputs``)."""
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0).reshape(-1)
    return float(np.linalg.norm(np.asarray(result, np.float64).reshape(-1) - exact) / np.linalg.norm(exact))


def measure(fmt: str, dtype: str, nranks: int, kind: str, count: int) -> dict:
    inputs = [rank_data(kind, dtype, count // nranks * nranks, r) for r in range(nranks)]
    result, exact_path = _quant.all_reduce(inputs, fmt), full_precision(inputs)
    rs_outputs = _quant.reduce_scatter(inputs, fmt)
    errors = _quant.group_errors(inputs, result, "sum")
    baseline = _quant.group_errors(inputs, exact_path, "sum")
    rs = reduce_scatter_errors(inputs, rs_outputs)
    return {"format": fmt, "dtype": dtype, "ranks": nranks, "data": kind, "groups": int(errors.size),
            "median": float(np.median(errors)), "p99": float(np.percentile(errors, 99)),
            "max": float(errors.max()), "bound": _quant.bound(fmt, dtype, nranks),
            "exact_path_max": float(baseline.max()), "distribution": np.quantile(errors, np.linspace(0, 1, 129)),
            "rs_median": float(np.median(rs)), "rs_max": float(rs.max()),
            "rs_bound": _quant.bound(fmt, dtype, nranks, "reduce_scatter"),
            "rs_distribution": np.quantile(rs, np.linspace(0, 1, 129)),
            "rel2": relative_2norm(inputs, result), "rs_rel2": relative_2norm(inputs, np.concatenate(rs_outputs)),
            "exact_path_rel2": relative_2norm(inputs, exact_path)}


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'format':<6} {'dtype':<9} {'ranks':>5} {'data':<9} {'median':>9} {'p99':>9} {'max':>9} "
             f"{'bound':>9} {'exact max':>9} {'rs median':>9} {'rs max':>9} {'rs bound':>9} {'rel2':>9} "
             f"{'rs rel2':>9} {'exact rel2':>10}"]
    for r in rows:
        lines.append(f"{r['format']:<6} {r['dtype']:<9} {r['ranks']:>5} {r['data']:<9} {r['median']:>9.5f} "
                     f"{r['p99']:>9.5f} {r['max']:>9.5f} {r['bound']:>9.5f} {r['exact_path_max']:>9.5f} "
                     f"{r['rs_median']:>9.5f} {r['rs_max']:>9.5f} {r['rs_bound']:>9.5f} {r['rel2']:>9.5f} "
                     f"{r['rs_rel2']:>9.5f} {r['exact_path_rel2']:>10.5f}")
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(_quant.FORMATS), figsize=(12, 4.5), sharey=True)
    for ax, fmt in zip(axes, _quant.FORMATS):
        for r in rows:
            if r["format"] == fmt and r["dtype"] == "bfloat16" and r["ranks"] == 4:
                d = np.asarray(r["distribution"])
                line, = ax.plot(d, np.linspace(0, 1, d.size), label=r["data"])
                d = np.asarray(r["rs_distribution"])
                ax.plot(d, np.linspace(0, 1, d.size), ls="--", color=line.get_color())
        ax.axvline(_quant.bound(fmt, "bfloat16", 4), color="k", ls="--", label="stated bound")
        ax.axvline(_quant.bound(fmt, "bfloat16", 4, "reduce_scatter"), color="k", ls=":",
                   label="reduce-scatter bound (its errors dashed)")
        ax.set_title(f"{fmt}, bfloat16, 4 ranks: group error / M")
        ax.set_xlabel("max |result - exact| / M per group")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    axes[0].set_ylabel("fraction of groups")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1 << 20, help="elements per rank (default 1M)")
    p.add_argument("--ranks", default="2,4,8", help="rank counts (default 2,4,8)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    args = p.parse_args(argv)
    rows = [measure(fmt, dtype, int(n), kind, args.count) for fmt in _quant.FORMATS for dtype in NP
            for n in args.ranks.split(",") for kind in KINDS]
    over = [r for r in rows if r["max"] > r["bound"] or r["rs_max"] > r["rs_bound"]]
    head = [f"# quantized all-reduce error (host emulation, bit-identical to the kernel), sum of {args.count} "
            f"elements per rank, groups of {_quant.GROUP} with an fp32 scale; {time.strftime('%Y-%m-%d')}, "
            f"numpy {np.__version__}, {platform.machine()}",
            "# per group: max |result - exact fp64 sum| / M, M = sum over ranks of the rank's largest |x| in "
            "the group",
            "# rs: the quantized reduce-scatter of the same inputs (N slices, every rank's output): one "
            "quantization, no requantization",
            "# rel2: relative to the result, ||result - exact||_2 / ||exact||_2 over the message (the "
            "all-reduce's, the reduce-scatter's, the full-precision path's)",
            *[f"# {fmt}: {_quant.bytes_per_element(fmt):.3f} bytes per element on the links "
              f"({_quant.wire_fraction(fmt):.1%} of bfloat16's)" for fmt in _quant.FORMATS]]
    text = "\n".join(head + table(rows) + [f"# rows whose maximum exceeds the bound: {len(over)}"]) + "\n"
    print(text, end="")
    os.makedirs(args.outdir, exist_ok=True)
    with open(os.path.join(args.outdir, "quant_error.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.outdir, "quant_error.json"), "w") as f:
        json.dump({"count": args.count, "group": _quant.GROUP,
                   "rows": [{**r, **{key: [round(float(v), 7) for v in r[key]]
                                     for key in ("distribution", "rs_distribution")}} for r in rows]}, f)
    plot(rows, os.path.join(args.outdir, "quant_error.png"))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
