"""PNG plots from a ``bench/compare.py`` JSON report, or from nccl-tests JSON files of
``bench/*_perf.py -J``; runs on a machine without a GPU.

    python bench/plot.py bench/results/compare_NVIDIA-H200_4gpu_bfloat16_20260101-120000.json
    python bench/plot.py --perf bench/results/quant_kernel_h100x1.png A.json B.json ...

writes, next to the JSON (or into ``-o DIR``):

* ``<stem>_latency.png``: median µs per all-reduce vs message size, log-log,
  one panel per mode (eager, graph, dependent: the subtracted time), one line per candidate;
* ``<stem>_busbw.png``: bus bandwidth (GB/s) vs message size.

Only results with status "ok" are drawn; refused sizes leave gaps. ``--perf PNG`` draws
the out-of-place time (in place where a backend has only that) of each nccl-tests file
against message size, one line per file, named by its run's
``--backend``/``--algo``/``--precision``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a script (python bench/plot.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench._common import human_bytes  # noqa: E402

#: (file suffix, record key, y label, log y axis)
METRICS = (
    ("latency", "median_us", "median time per all-reduce (us)", True),
    ("busbw", "busbw_GBps", "bus bandwidth (GB/s)", False),
)


def series(doc: dict[str, Any], mode: str, key: str) -> dict[str, tuple[list[int], list[float]]]:
    """``candidate -> (sizes, values)`` of the "ok" results of ``mode``, in candidate order."""
    out: dict[str, tuple[list[int], list[float]]] = {c["name"]: ([], []) for c in doc["candidates"]}
    rows = sorted((r for r in doc["results"] if r["mode"] == mode and r["status"] == "ok"),
                  key=lambda r: r["bytes"])
    for r in rows:
        xs, ys = out.setdefault(r["candidate"], ([], []))
        xs.append(r["bytes"])
        ys.append(r[key])
    return {name: xy for name, xy in out.items() if xy[0]}


def title(doc: dict[str, Any]) -> str:
    """``all-reduce, bfloat16 sum, 4 x NVIDIA H200 (host), 2026-01-01`` (the document's
    ``collective``: ``broadcast, ...`` for a data mover's)."""
    m = doc["machine"]
    return (f"{doc.get('collective', 'all_reduce').replace('_', '-')}, {doc['dtype']} {doc.get('op', 'sum')}, {doc['world_size']} x {m['gpu']} "
            f"({m['hostname']}), {doc['date'][:10]}")


def plot_document(doc: dict[str, Any], prefix: str) -> list[str]:
    """Write ``<prefix>_latency.png`` and ``<prefix>_busbw.png``; returns their paths.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    modes = list(doc["config"]["modes"])
    paths = []
    for suffix, key, ylabel, logy in METRICS:
        fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 5), squeeze=False)
        for ax, mode in zip(axes[0], modes, strict=True):
            for name, (xs, ys) in series(doc, mode, key).items():
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(LogLocator(base=2, numticks=64))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(int(round(v)))))
            ax.tick_params(axis="x", labelrotation=60, labelsize=7)
            if logy:
                ax.set_yscale("log")
            ax.set_xlabel("message size")
            ax.set_ylabel(ylabel)
            ax.set_title(mode)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(title(doc), fontsize=10)
        fig.tight_layout()
        path = f"{prefix}_{suffix}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_file(path: str, outdir: str | None = None) -> list[str]:
    """Plot the JSON report at ``path`` into ``outdir`` (default: beside it); returns the PNG paths.

    Raises:
        ImportError: matplotlib is not installed.
    """
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    stem = os.path.splitext(os.path.basename(path))[0]
    return plot_document(doc, os.path.join(outdir or os.path.dirname(os.path.abspath(path)), stem))


#: the options of a bench/*_perf.py run that name its line in a --perf plot
_PERF_OPTIONS = ("--backend", "--algo", "--precision")


def perf_label(doc: dict[str, Any]) -> str:
    """``all_reduce_perf --precision int8`` from an nccl-tests JSON's ``args``."""
    args = doc["args"]
    named = [f"{a} {b}" for a, b in zip(args, args[1:]) if a in _PERF_OPTIONS]
    return " ".join([args[0], *named])


def plot_perf(paths: list[str], png: str) -> str:
    """One PNG at ``png``: out-of-place time (us) per message size of each nccl-tests JSON
    file, log-log; returns ``png``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        rows = sorted(doc["results"], key=lambda r: r["size"])
        # out of place, or in place where the backend has no out-of-place call (nccl_symmetric)
        times = [(r["out_of_place"] or r["in_place"])["time"] for r in rows]
        ax.loglog([r["size"] for r in rows], times, marker="o", markersize=3, label=perf_label(doc))
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per call, out of place where run (us)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    """``python bench/plot.py REPORT.json [...] [-o DIR]`` or ``--perf PNG PERF.json [...]``."""
    p = argparse.ArgumentParser(prog="plot", description="PNG plots from bench/compare.py JSON reports.")
    p.add_argument("reports", nargs="+", help="JSON files written by bench/compare.py (with --perf: by -J)")
    p.add_argument("-o", "--outdir", default=None, help="where PNGs go (default: beside each JSON)")
    p.add_argument("--perf", metavar="PNG", default=None,
                   help="draw the nccl-tests JSON files (bench/*_perf.py -J) into one PNG at this path")
    args = p.parse_args(argv)
    if args.perf:
        print(plot_perf(args.reports, args.perf))
        return 0
    for report in args.reports:
        for png in plot_file(report, args.outdir):
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
