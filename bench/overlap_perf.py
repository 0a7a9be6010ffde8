"""The sequence-parallel GEMMs with their communication hidden: ubnext's overlapped ops vs
the GEMM alone, the communication alone, the unoverlapped sequences and torch's async TP.

    NCCL_NVLS_ENABLE=0 mpirun -n 4 python bench/overlap_perf.py --tokens 2048,4096,8192,16384

For each MLP shape (``--shapes``: hidden/intermediate, default 8192/28672 and 4096/14336;
TP = the ranks) and token count, the two GEMMs of a sequence-parallel MLP block, bf16, in
CUDA graphs (µs per call, maximum over ranks, median of the repeats; every candidate of a
size captured first, then sampled in rotation, one sample of each per repeat):

* ``ag``: ``all_gather_matmul(x_shard, gate_up.T)``: tokens/N x hidden gathered, times
  hidden x 2*intermediate/N;
* ``rs``: ``matmul_reduce_scatter(h, down.T)``: tokens x intermediate/N times
  intermediate/N x hidden, reduce-scattered to tokens/N x hidden.

Candidates of each: ``overlapped`` (ubnext.torch's op), ``gemm`` (the unchunked GEMM
alone, same shapes), ``chunks`` (the overlapped op without its communication: the same
chunked GEMMs, and on the reduce-scatter side the same rank-order reduction, on one
stream; ``chunks - gemm`` is what chunking costs, ``overlapped - chunks`` the
communication left exposed), ``comm`` (ubnext's all-gather or reduce-scatter alone), ``ubnext+gemm``
and ``nccl+gemm`` (the collective, then the GEMM, unoverlapped), and ``torch-async-tp``
(``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``), left
out with the reason printed where torch's symmetric memory cannot be set up. The
reduce-scatter side also measures the sequence-parallel epilogue (residual add + RMSNorm
of this rank's rows, hidden-wide weight, no bias): ``rs+norm fused``
(``matmul_reduce_scatter_add_rmsnorm``: the norm in each round's reduction) against
``rs, norm`` (``matmul_reduce_scatter``, then the add + RMSNorm in torch, as the blocks
ran it before); ``fused/unf`` is their ratio (below 1: the fused op is faster). Rank 0
prints the table with ``hidden = 1 - (overlapped - gemm) / comm`` (the share of the
communication hidden) and writes ``<outdir>/<name>.json`` and ``.png``.

NVLink multicast stays off: torch's async TP runs only where
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set (``_torchbench.keep_multicast_off`` sets it
from ``NCCL_NVLS_ENABLE=0``), so torch's symmetric memory creates no multicast object.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/overlap_perf.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: the sequence-parallel epilogue's candidates (reduce-scatter side): fused, and the unfused sequence
NORM_PAIR = ("rs+norm fused", "rs, norm")
CANDIDATES = ("overlapped", "gemm", "chunks", "comm", "ubnext+gemm", "nccl+gemm", "torch-async-tp", *NORM_PAIR)
#: the add + RMSNorm's epsilon of the norm candidates
EPS = 1e-5
SIDES = ("ag", "rs")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="overlap_perf", description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    p.add_argument("--tokens", type=ints, default=[2048, 4096, 8192, 16384])
    p.add_argument("--shapes", default="8192/28672,4096/14336", help="hidden/intermediate, comma-separated")
    p.add_argument("-n", "--iters", type=int, default=5, help="calls per captured graph")
    p.add_argument("-G", "--graph-launches", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default=None)
    p.add_argument("--outdir", default=RESULTS_DIR)
    p.add_argument("--trace", action="store_true",
                   help="also profile one overlapped call of each side at the first shape and token count "
                        "(torch.profiler, a CUDA graph replay): rank 0 writes a Chrome trace per side and "
                        "prints how much of the copies' time ran under a GEMM and the GEMMs' share of the span")
    return p.parse_args(argv)


def torch_async_tp():
    """(group name, None) where torch's symmetric memory serves the world group, else
    (None, the reason)."""
    import torch
    import torch.distributed as dist

    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        return None, "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is not set (run with NCCL_NVLS_ENABLE=0): multicast stays off"
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        name = dist.group.WORLD.group_name
        enable_symm_mem_for_group(name)
        torch.ops.symm_mem.fused_all_gather_matmul  # noqa: B018 (the op exists in this torch)
        return name, None
    except Exception as e:  # noqa: BLE001 (any failure: the candidate is left out, with why)
        return None, f"{type(e).__name__}: {e}"


def candidates(comm, side: str, tokens: int, hidden: int, intermediate: int, group_name):
    """{candidate: fn} of one side at one size (the operands made here, the same bits on every rank)."""
    import torch
    import torch.distributed as dist

    import ubnext.torch as ut
    from ubnext.torch import _rmsnorm

    n = comm.size
    g = torch.Generator(device="cuda").manual_seed(tokens * 31 + comm.rank)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(bf)

    if side == "ag":
        a, b = rnd(tokens // n, hidden), rnd(hidden, 2 * intermediate // n, scale=hidden ** -0.5)
        gathered = torch.empty(tokens, hidden, device="cuda", dtype=bf)
        fns = {"overlapped": lambda: ut.all_gather_matmul(a, b, group=comm),
               "gemm": lambda: gathered @ b,
               "chunks": chunked_gemms(side, a, b, n, comm.rank),
               "comm": lambda: comm.all_gather(a, out=gathered),
               "ubnext+gemm": lambda: comm.all_gather(a) @ b,
               "nccl+gemm": lambda: _nccl_gather(dist, gathered, a) @ b}
        if group_name:
            fns["torch-async-tp"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)
    else:
        a, b = rnd(tokens, intermediate // n), rnd(intermediate // n, hidden, scale=(intermediate // n) ** -0.5)
        product, shard = a @ b, torch.empty(tokens // n, hidden, device="cuda", dtype=bf)
        fns = {"overlapped": lambda: ut.matmul_reduce_scatter(a, b, group=comm),
               "gemm": lambda: a @ b,
               "chunks": chunked_gemms(side, a, b, n, comm.rank),
               "comm": lambda: comm.reduce_scatter(product, out=shard),
               "ubnext+gemm": lambda: comm.reduce_scatter(a @ b),
               "nccl+gemm": lambda: dist.reduce_scatter_tensor(shard, a @ b)}
        if group_name:
            fns["torch-async-tp"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)
        residual, weight = rnd(tokens // n, hidden), 1 + rnd(hidden, scale=0.1)
        fns[NORM_PAIR[0]] = lambda: ut.matmul_reduce_scatter_add_rmsnorm(a, b, residual, weight, None, EPS,
                                                                          group=comm)
        fns[NORM_PAIR[1]] = lambda: _rmsnorm.add_rmsnorm(ut.matmul_reduce_scatter(a, b, group=comm), residual, weight,
                                                         None, EPS)
    return fns


def chunked_gemms(side: str, a, b, size: int, rank: int):
    """The overlapped op of ``side`` without its communication, as a function: its GEMMs on
    the chunks of ``ubnext.torch._overlap_plan`` in its order, into buffers made here, and
    on the reduce-scatter side its rank-order reduction of each round's slots."""
    import torch

    from ubnext._engine.slot_sum import SlotSum
    from ubnext.torch import _overlap_plan as plan

    if side == "ag":
        m = a.shape[0]
        gathered, out = a.new_empty((size * m, a.shape[1])), a.new_empty((size * m, b.shape[1]))
        rounds, order = plan.gather_rounds(m, a.shape[1] * a.element_size()), [rank, *plan.pull_order(rank, size)]

        def fn():
            for r0, rows in rounds.parts:
                for src in order:
                    first = src * m + r0
                    torch.matmul(gathered[first:first + rows], b, out=out[first:first + rows])
            return out
        return fn
    m, n = a.shape[0] // size, b.shape[1]
    rounds = plan.scatter_rounds(m, n * a.element_size(), size)
    # the slots as the area lays them out: slot_bytes apart
    area, out = torch.empty(size * rounds.slot_bytes, dtype=torch.uint8, device=a.device), a.new_empty((m, n))
    slots = [area[s * rounds.slot_bytes:(s + 1) * rounds.slot_bytes].view(a.dtype) for s in range(size)]
    summed = SlotSum(a.device.index, torch.cuda.get_device_properties(a.device).multi_processor_count, size)
    dtype = str(a.dtype).removeprefix("torch.")

    def fn():
        for r0, rows in rounds.parts:
            for dst in plan.push_order(rank, size):
                torch.matmul(a[dst * m + r0:dst * m + r0 + rows], b, out=slots[dst][:rows * n].view(rows, n))
            if rows:
                summed(dtype, area.data_ptr(), rounds.slot_bytes, rows * n, out[r0].data_ptr(),
                       torch.cuda.current_stream().cuda_stream)
        return out
    return fn


def _nccl_gather(dist, out, x):
    dist.all_gather_into_tensor(out, x)
    return out


def run(comm, args, argv) -> int:
    """Measures and reports (rank 0); returns the exit status. Collective."""
    import torch

    rank0 = comm.bootstrap.rank == 0
    shapes = [tuple(int(v) for v in s.split("/")) for s in args.shapes.split(",")]
    group_name, why = torch_async_tp() if comm.size > 1 else (None, "one rank: nothing to overlap")
    if rank0 and why:
        print(f"# torch-async-tp left out: {why}")
    records, bad = [], False
    for hidden, intermediate in shapes:
        for tokens in args.tokens:
            for side in SIDES:
                fns = candidates(comm, side, tokens, hidden, intermediate, group_name)
                with torch.no_grad():
                    got = fns["overlapped"]()
                    want = fns["ubnext+gemm"]()
                    got = got[1] if side == "ag" else got
                    torch.cuda.synchronize()
                    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                    err = max(comm.bootstrap.allgather_obj(err))
                    bad |= not err < 1e-2
                    norm_err = None
                    if NORM_PAIR[0] in fns:  # normed of the fused op against the unfused sequence's
                        fused, unfused = (fns[name]()[0].double() for name in NORM_PAIR)
                        torch.cuda.synchronize()
                        norm_err = max(comm.bootstrap.allgather_obj(
                            ((fused - unfused).norm() / unfused.norm()).item()))
                        bad |= not norm_err < 1e-2
                    if rank0:
                        sys.stderr.write(f"\r{hidden}/{intermediate} {tokens:<6} {side}")
                    samplers = {}
                    for name, fn in fns.items():
                        fn()  # eager first: the ops' first calls allocate and compile
                        torch.cuda.synchronize()
                        samplers[name] = tb.timer(fn, "graph", comm.bootstrap, args.iters, args.graph_launches)
                    # the candidates' samples in rotation, so that what drifts during a size (clocks,
                    # what an earlier candidate left behind) falls on every candidate alike
                    times = {name: [] for name in fns}
                    for _ in range(args.repeats):
                        for name, sample in samplers.items():
                            times[name].append(sample())
                    del samplers
                    for name in fns:
                        records.append({"hidden": hidden, "intermediate": intermediate, "tokens": tokens,
                                        "side": side, "candidate": name, "times_us": times[name],
                                        "median_us": tb.median(times[name]), "rel_err_vs_unoverlapped": err,
                                        "rel_err_fused_norm_vs_unfused": norm_err})
                del fns
                torch.cuda.empty_cache()
    if rank0:
        sys.stderr.write("\n")
        report(comm, args, argv, records, shapes, why)
    if args.trace:
        trace(comm, args, shapes[0], group_name)
    return 1 if bad else 0


def trace(comm, args, shape, group_name) -> None:
    """Profiles one CUDA graph replay of an overlapped call of each side at ``shape`` and
    the first token count (torch.profiler, CUDA activity; the graph captured after an
    eager call, as the table's figures are: no host gaps in the timeline; collective);
    rank 0 writes ``<name>_trace_<side>.json`` (Chrome trace: open in chrome://tracing
    or Perfetto) and prints its ``timeline``: the copies' time and the part of it under a
    GEMM kernel, and the GEMM kernels' share of the replay's span."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    hidden, intermediate = shape
    tokens = args.tokens[0]
    for side in SIDES:
        fn = candidates(comm, side, tokens, hidden, intermediate, group_name)["overlapped"]
        with torch.no_grad():
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                comm.bootstrap.allgather_obj(0)  # the ranks replay together (the profiler starts apart)
                graph.replay()
                torch.cuda.synchronize()
        del graph
        if comm.bootstrap.rank != 0:
            continue
        path = os.path.join(args.outdir, f"{args.name or 'overlap'}_trace_{side}.json")
        prof.export_chrome_trace(path)
        t = timeline(path)
        print(f"# trace {side} ({hidden}/{intermediate}, {tokens} tokens, a graph replay): span {t['span']:.1f} µs, "
              f"GEMM kernels {t['gemms']:.1f} µs of it ({100 * t['gemms'] / max(t['span'], 1e-9):.0f} %); copies "
              f"{t['copies']:.1f} µs, {t['under']:.1f} µs of it under a GEMM kernel "
              f"({100 * t['under'] / max(t['copies'], 1e-9):.0f} %); {path}")


def timeline(path: str) -> dict[str, float]:
    """What a Chrome trace of torch.profiler says of the overlap, µs: ``span`` (first
    start to last end of the GPU's kernels and copies), ``gemms`` (time some GEMM kernel
    ran), ``copies`` (the ``gpu_memcpy`` events' time) and ``under`` (their time during a
    GEMM kernel). GEMMs are the kernels that are not ubnext's (``ub_*``: the barrier and
    the slot sum) nor torch's elementwise or reduction kernels; time under two at once
    counts once."""
    import json

    events = json.load(open(path))["traceEvents"]
    spans = lambda kind: [(e["ts"], e["ts"] + e["dur"]) for e in events  # noqa: E731
                          if e.get("cat") == kind and e.get("dur")]
    gemms = _merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and e.get("dur")
                     and not e["name"].startswith("ub_") and "elementwise" not in e["name"]
                     and "reduce_kernel" not in e["name"]])
    copies = spans("gpu_memcpy")
    gpu = spans("kernel") + spans("gpu_memset") + copies
    return {"span": max(b for _, b in gpu) - min(a for a, _ in gpu) if gpu else 0.0,
            "gemms": sum(b - a for a, b in gemms),
            "copies": sum(b - a for a, b in copies),
            "under": sum(max(0.0, min(b, d) - max(a, c)) for a, b in copies for c, d in gemms)}


def _merged(spans: list) -> list:
    """Overlapping intervals merged (so a copy under two GEMMs counts once)."""
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def fused_ratio(by: dict) -> float:
    """(rs+norm fused) / (rs, norm): below 1 where folding the add + RMSNorm into the
    reduce-scatter's reduction measures better than running it after the op."""
    return by[NORM_PAIR[0]] / by[NORM_PAIR[1]]


def hidden_share(by: dict) -> float:
    """1 - (overlapped - gemm) / comm: the share of the communication hidden under the GEMM."""
    return 1 - (by["overlapped"] - by["gemm"]) / by["comm"]


def report(comm, args, argv, records, shapes, why) -> None:
    names = [c for c in CANDIDATES if any(r["candidate"] == c for r in records)]
    for hidden, intermediate in shapes:
        for side in SIDES:
            fused = side == "rs" and all(c in names for c in NORM_PAIR)
            print(f"# {side}: µs per call in CUDA graphs, hidden {hidden}, intermediate {intermediate}, "
                  f"TP={comm.size}, bf16; hidden = 1 - (overlapped - gemm) / comm; x gemm = overlapped / gemm"
                  + ("; fused/unf = (rs+norm fused) / (rs, norm)" if fused else ""))
            print(f"{'tokens':>7}" + "".join(f"{c:>16}" for c in names) + f"{'hidden':>9}{'x gemm':>9}{'rel err':>10}"
                  + (f"{'fused/unf':>10}" if fused else ""))
            for tokens in args.tokens:
                rows = [r for r in records if (r["hidden"], r["intermediate"], r["tokens"], r["side"]) ==
                        (hidden, intermediate, tokens, side)]
                by = {r["candidate"]: r["median_us"] for r in rows}
                print(f"{tokens:>7}" + "".join(f"{by[c]:>16.1f}" if c in by else f"{'-':>16}" for c in names)
                      + f"{hidden_share(by):>9.1%}{by['overlapped'] / by['gemm']:>9.3f}"
                      + f"{rows[0]['rel_err_vs_unoverlapped']:>10.1e}"
                      + (f"{fused_ratio(by):>10.3f}" if fused else ""))
    path, doc = tb.save_report(comm, "overlap_perf", "overlap_perf", args, argv, {
        "dtype": "bfloat16", "shapes": [list(s) for s in shapes], "torch_async_tp_left_out": why,
        "results": records})
    panels = {f"{side} {h}/{i}": {c: ([r["tokens"] for r in records if (r["side"], r["hidden"], r["candidate"]) ==
                                       (side, h, c)],
                                      [r["median_us"] for r in records if (r["side"], r["hidden"], r["candidate"]) ==
                                       (side, h, c)]) for c in names}
              for h, i in shapes for side in SIDES}
    try:
        print("# wrote " + tb.plot_lines(path + ".png", f"overlapped GEMMs, {comm.size} x {doc['machine']['gpu']}",
                                         panels, "tokens", "median us per call"))
    except ImportError:
        print("# matplotlib not installed: no PNG")


def main(argv: list[str] | None = None) -> int:
    return tb.main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
