"""The floor of an eager call: host time per launch of an empty kernel from Python.

    python bench/launch_floor.py --name launch_floor_h100

One process, one GPU. The kernel has the parameter list of ubnext's all-reduce entry
points (two u64, an int, eight u64), so every candidate passes the same 11 values:

* ``cupy launchKernel``: CuPy's compiled binding of ``cuLaunchKernel`` with a prebuilt
  argument pack (a private CuPy module; what ``ubnext._engine.launch`` calls);
* ``cuda.bindings cuLaunchKernel``: the same driver call through cuda-python's public
  binding, with the same prebuilt pack;
* ``cupy RawKernel()``: CuPy's public kernel call, arguments converted per call;
* ``ubnext Launcher``: ``ubnext._engine.launch.Launcher``, the pack written per call (8 values);
* ``ubnext Packed``: ``ubnext._engine.launch.Packed``, a call plan's launch: its own pack,
  written once;
* ``ubnext Launcher, dependent`` and ``ubnext Packed, dependent``: the same with
  programmatic dependent launch (``Config.pdl``: libcuda's ``cuLaunchKernelEx`` through
  ctypes, the launch config prebuilt).

Then the ways to read torch's current stream (``torch._C._cuda_getCurrentRawStream``,
private, which ubnext uses, against the public ``torch.cuda.current_stream``) and CuPy's.

Candidates are timed in interleaved rounds (this host's speed drifts by phases), each
sample ``--iters`` calls back to back, the GPU drained between samples. The table gives
the median and the minimum over ``--rounds`` of host µs per call; ``<outdir>/<name>.json``,
``.txt`` and ``.png`` keep them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import sys
import time

if __package__ in (None, ""):  # run as a script (python bench/launch_floor.py): bench/_standalone.py
    import _standalone  # noqa: F401

from ubnext._engine.launch import I32, U64, Launcher, Packed  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SOURCE = r"""
extern "C" __global__ void empty(unsigned long long a, unsigned long long b, int c,
    unsigned long long d0, unsigned long long d1, unsigned long long d2, unsigned long long d3,
    unsigned long long d4, unsigned long long d5, unsigned long long d6, unsigned long long d7) {}
"""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="launch_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--iters", type=int, default=500, help="calls per sample")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--name", default="launch_floor")
    p.add_argument("--outdir", default=RESULTS_DIR)
    return p.parse_args(argv)


def launch_candidates():
    """name -> a callable making one launch of the empty kernel on CuPy's current stream."""
    import cupy
    from cuda.bindings import driver
    from cupy_backends.cuda.api import driver as cupy_driver

    kernel = cupy.RawModule(code=SOURCE).get_function("empty")
    stream = cupy.cuda.get_current_stream().ptr
    types = (U64, U64, I32) + (U64,) * 8
    values = (1, 2, 3) + tuple(range(8))
    slots = ctypes.create_string_buffer(8 * len(types))
    struct.pack_into("<QQi4x" + "Q" * 8, slots, 0, *values)
    pack = (ctypes.c_void_p * len(types))(*[ctypes.addressof(slots) + 8 * i for i in range(len(types))])
    pack_ptr = ctypes.addressof(pack)
    func = kernel.kernel.ptr
    cu_func = driver.CUfunction(init_value=func)
    launcher = Launcher(kernel, types, prefix=(1, 2, 3))
    packed = Packed(launcher, 1, 32, tuple(range(8)))
    dependent = Launcher(kernel, types, prefix=(1, 2, 3), dependent=True)
    dependent_packed = Packed(dependent, 1, 32, tuple(range(8)))
    args = (cupy.uint64(1), cupy.uint64(2), cupy.int32(3)) + tuple(cupy.uint64(v) for v in range(8))

    keep = (slots, pack)  # the pack's memory, read through pack_ptr: every launcher below keeps it

    def bindings(params):
        def launch(_keep=keep):
            (err,) = driver.cuLaunchKernel(cu_func, 1, 1, 1, 32, 1, 1, 0, stream, params, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernel: {err}")
        return launch

    return {
        "cupy launchKernel": lambda _keep=keep: cupy_driver.launchKernel(func, 1, 1, 1, 32, 1, 1, 0, stream, pack_ptr, 0),
        "cuda.bindings cuLaunchKernel": bindings(pack_ptr),
        "cupy RawKernel()": lambda: kernel((1,), (32,), args),
        "ubnext Launcher": lambda: launcher(1, 32, stream, *range(8)),
        "ubnext Packed": lambda: packed(stream),
        "ubnext Launcher, dependent": lambda: dependent(1, 32, stream, *range(8)),
        "ubnext Packed, dependent": lambda: dependent_packed(stream),
    }


def stream_candidates():
    """name -> a callable reading a current stream's handle (torch's where torch imports)."""
    import cupy

    found = {"cupy get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr}
    try:
        import torch
    except ImportError:
        return found
    torch.cuda.init()
    found["torch._C._cuda_getCurrentRawStream(0)"] = lambda: torch._C._cuda_getCurrentRawStream(0)
    found["torch.cuda.current_stream(0).cuda_stream"] = lambda: torch.cuda.current_stream(0).cuda_stream
    found["torch.cuda.current_stream().cuda_stream"] = lambda: torch.cuda.current_stream().cuda_stream
    return found


def measure(candidates: dict, iters: int, rounds: int, drain) -> dict:
    """name -> host µs per call of every round (interleaved, the order rotated per round)."""
    for name, fn in list(candidates.items()):
        try:
            for _ in range(50):
                fn()
            drain()
        except Exception as e:  # a path this install lacks: reported, not timed
            print(f"# {name}: {type(e).__name__}: {e}", file=sys.stderr)
            del candidates[name]
    names = list(candidates)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = candidates[name]
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters * 1e6)
            drain()
    return samples


def main(argv=None) -> int:
    import cupy

    args = parse_args(sys.argv[1:] if argv is None else argv)
    drain = cupy.cuda.get_current_stream().synchronize
    groups = {"launch": measure(launch_candidates(), args.iters, args.rounds, drain),
              "current stream": measure(stream_candidates(), args.iters, args.rounds, drain)}
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    lines = [f"# host µs per call on {device}: median (min) of {args.rounds} interleaved rounds of {args.iters} calls"]
    records = []
    for group, samples in groups.items():
        lines.append(f"{group:<44} {'median':>8} {'min':>8}")
        for name, s in samples.items():
            med, low = sorted(s)[len(s) // 2], min(s)
            lines.append(f"  {name:<42} {med:8.3f} {low:8.3f}")
            records.append({"group": group, "candidate": name, "median_us": med, "min_us": low, "samples_us": s})
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.outdir, exist_ok=True)
    stem = os.path.join(args.outdir, args.name)
    with open(stem + ".json", "w") as f:
        json.dump({"device": device, "iters": args.iters, "rounds": args.rounds, "argv": sys.argv[1:],
                   "results": records}, f, indent=1)
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    plot(stem + ".png", device, records)
    return 0


def plot(path: str, device: str, records: list) -> None:
    """A horizontal bar per candidate: median host µs, the minimum as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(records) + 1))
    names = [f"{r['group']}: {r['candidate']}" for r in records]
    ax.barh(names, [r["median_us"] for r in records], color="tab:blue")
    ax.plot([r["min_us"] for r in records], names, "k|", markersize=12, label="min")
    ax.invert_yaxis()
    ax.set_xlabel("host µs per call (median; | = min)")
    ax.set_title(f"Python launch floor, empty kernel with 11 parameters, {device}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
