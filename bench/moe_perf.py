"""Expert-parallel dispatch and combine: ubnext.ExpertParallel beside NCCL's all_to_all_single.

    mpirun -n 4 python bench/moe_perf.py -t 1,16,128 --hidden 7168 -k 8 -e 256 -d bfloat16

For each tokens-per-rank T (``-t``), in the same run (CUDA graphs with ``-G 1``, the
default; the NCCL baseline is always eager, since it reads the counts on the host):

* ``ubnext dispatch`` / ``ubnext combine``: one call of ``ExpertParallel`` (docs/moe.md),
  or with ``--mode packed`` of ``PackedExpertParallel`` (the throughput mode: its dispatch
  with ``sync=False``, ``max_rows`` the most rows any rank receives in the run);
* ``nccl dispatch``: the common implementation a user writes: the per-destination counts
  exchanged by ``all_to_all_single``, read on the host, the tokens gathered in destination
  order (one copy per destination GPU, as ubnext sends) and exchanged by
  ``all_to_all_single`` with those splits;
* ``nccl combine``: each GPU's partial per token (the same bytes as ubnext's) sent
  back by ``all_to_all_single`` with the dispatch's splits, summed per token by
  ``index_add_`` and rounded.
* ``vdev dispatch`` / ``vdev combine``: torch's symmetric-memory ``all_to_all_vdev_2d``
  and ``all_to_all_vdev_2d_offset`` (NVSHMEM; no host sync, timed as ubnext is, eager
  where its capture fails), a row per expert slot each way (bench/_moe_baselines.py).
  Not run at one rank, where ranks share a GPU or where torch lacks the op; the table
  says why.

* ``nccl_ep dispatch`` / ``nccl_ep combine``: NCCL's expert-parallel library (``nccl_ep``,
  the ``nccl-extensions`` wheel) in its low-latency mode, expert-major layout, its own
  buffers (a row per expert slot each way, the router weights applied by its combine),
  timed as ubnext is. It needs NCCL 2.30.7 or newer loaded in the process
  (bench/install_nccl_ep.sh); the table says why where it does not run (not importable,
  the NCCL too old, ranks sharing a GPU).

Routing (``--routing``): ``uniform`` (each token's K distinct experts uniformly at
random) or ``skewed`` (from the first 2K experts only: hot experts on the first GPUs).
The capacity is the most tokens any expert receives in the run (``recv_x`` no larger than
the routing fills). Bytes are the most any rank sends to other GPUs (dispatch: rows;
combine: partials, fp32 or with ``--partials bfloat16`` bf16);
``floor`` is those bytes at the NVLink push rate measured in the same run
(bench/link_ceiling.py's ``push`` kernel at ``--ceiling-bytes``), ``frac`` the floor over
the time. Times: µs per call, median of ``--repeats``, maximum over ranks. Before timing,
one dispatch and combine are checked bit for bit against the host reference
(``-c 0`` skips it; the ``wrong`` column counts differing elements on rank 0).
Rank 0 prints the table and writes ``<outdir>/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/moe_perf.py): bench/_standalone.py
    import _standalone  # noqa: F401

import numpy as np  # noqa: E402

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402
from bench._moe_baselines import NcclBaseline, NcclEpBaseline, VdevBaseline, nccl_ep_problem, vdev_problem  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: the baselines beside ubnext, in the table's order
BASELINES = ("nccl", "vdev", "nccl_ep")
CANDIDATES = tuple(f"{who} {kind}" for kind in ("dispatch", "combine") for who in ("ubnext",) + BASELINES)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe_perf", description=__doc__.split("\n\n")[0])
    p.add_argument("-t", "--tokens", type=lambda t: [int(v) for v in t.split(",")], default=[1, 16, 128],
                   help="tokens per rank, comma-separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("-k", "--top-k", type=int, default=8)
    p.add_argument("-e", "--experts", type=int, default=256)
    p.add_argument("-d", "--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    p.add_argument("--partials", choices=("float32", "bfloat16"), default="float32",
                   help="the combine's partials on the link (bfloat16: a bfloat16 payload only)")
    p.add_argument("--fp8", type=int, choices=(0, 1), default=0,
                   help="1: the FP8 dispatch (e4m3 codes, a scale per 128 channels; bfloat16, hidden a multiple of 512)")
    p.add_argument("--mode", choices=("low-latency", "packed"), default="low-latency",
                   help="ExpertParallel (low-latency) or PackedExpertParallel (throughput)")
    p.add_argument("-G", "--graphs", type=int, choices=(0, 1), default=1, help="1: CUDA graphs; 0: eager")
    p.add_argument("-n", "--iters", type=int, default=20, help="calls per sample (per captured graph)")
    p.add_argument("--launches", type=int, default=5, help="graph replays per sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1)
    p.add_argument("--ceiling-bytes", type=common.size_arg, default=64 << 20,
                   help="message of the push-rate measurement (bench/link_ceiling.py)")
    p.add_argument("--name", default=None, help="file stem (default: moe_perf_<gpu>_<n>gpu_<date>)")
    p.add_argument("--outdir", default=RESULTS_DIR)
    args = p.parse_args(argv)
    if min(args.tokens) < 0 or args.top_k < 1 or args.experts < args.top_k:
        p.error("tokens >= 0, 1 <= top-k <= experts")
    if args.mode == "packed" and (args.fp8 or args.partials != "float32"):
        p.error("--mode packed has fp32 partials and no FP8 dispatch (the low-latency mode's options)")
    return args


def routing(args, rank: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s ``[T, K]`` int32 experts and float32 weights (the same on any run)."""
    rng = np.random.default_rng(1000 * rank + tokens)
    pool = args.experts if args.routing == "uniform" else min(args.experts, 2 * args.top_k)
    idx = np.stack([rng.permutation(pool)[:args.top_k] for _ in range(tokens)]).reshape(tokens, args.top_k)
    return idx.astype(np.int32), rng.random((tokens, args.top_k)).astype(np.float32)


def payload(args, rank: int, shape: tuple) -> np.ndarray:
    """Normal values of ``shape`` in the dtype (host), the same on any run."""
    import ml_dtypes

    rng = np.random.default_rng(7 + rank)
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
    return rng.standard_normal(shape).astype(dtype)


def link_bytes(args, nranks: int, idxs: list[np.ndarray]) -> tuple[int, int]:
    """The most bytes any rank sends to other GPUs: (dispatch rows, combine partials)."""
    local = args.experts // nranks
    row_bytes = args.hidden + args.hidden // 32 if args.fp8 else args.hidden * (2 if args.dtype == "bfloat16" else 4)
    out_rows = [0] * nranks
    partial_rows = [0] * nranks
    for s, idx in enumerate(idxs):
        for row in idx:
            for g in set(int(e) // local for e in row if e >= 0):
                if g != s:
                    out_rows[s] += 1
                    partial_rows[g] += 1
    partial_width = 2 if args.partials == "bfloat16" else 4
    return max(out_rows) * row_bytes, max(partial_rows) * args.hidden * partial_width


def most_rows(experts: int, nranks: int, idxs: list[np.ndarray]) -> int:
    """The most rows any GPU receives (at least 1): the packed mode's max_rows in the run."""
    local = experts // nranks
    rows = [sum(int(((i >= g * local) & (i < (g + 1) * local)).sum()) for i in idxs) for g in range(nranks)]
    return max(1, *rows)


def busiest_expert(experts: int, idxs: list[np.ndarray]) -> int:
    """The most tokens any expert receives (at least 1): the capacity the run needs, so that
    recv_x ([local experts, capacity, hidden]) is no larger than the routing fills."""
    counts = np.bincount(np.concatenate([i.reshape(-1) for i in idxs] + [np.zeros(0, np.int32)]).clip(-1) + 1,
                         minlength=experts + 1)
    return max(1, int(counts[1:].max(initial=0)))


def push_rate(comm, args) -> float:
    """The NVLink push rate (bytes/s per direction) of bench/link_ceiling.py's push kernel."""
    import cupy

    from bench import link_ceiling
    from bench.all_reduce_perf import ALL_REDUCE

    module = cupy.RawModule(code=link_ceiling._SOURCE)
    push = link_ceiling.candidates(comm, args.ceiling_bytes, module)["push"]
    push()
    us = tb.median(tb.time_us(push, "graph", comm.bootstrap, args.iters, args.launches, args.repeats))
    return ALL_REDUCE.bandwidths(args.ceiling_bytes, us * 1e-6, comm.size)[1] * 1e9


def check(comm, args, ep, shape, xs, idxs, ws, x, idx, w) -> int:
    """Elements of this rank's dispatch rows and combine output that differ from the host
    reference (bit for bit, NaN as a class)."""
    import torch

    from ubnext._moe import packed_reference as pref
    from ubnext._moe import reference as ref
    from ubnext._tools import reference as bits

    r, packed = comm.rank, args.mode == "packed"
    recv_x, counts, handle = ep.dispatch(x, idx, w)
    want = (pref if packed else ref).dispatch(shape, xs, idxs, ws)
    rows = (shape.max_rows,) if packed else (shape.local_experts, shape.capacity)
    ys = [payload(args, 100 + g, (*rows, shape.hidden)) for g in range(comm.size)]
    out = ep.combine(to_device(ys[r], args.dtype), handle)
    torch.cuda.synchronize()
    wrong = int((counts.cpu().numpy() != (pref.offsets(want[r]) if packed else want[r].counts)).sum())
    if args.fp8:  # the codes as bytes, the scales NaN as a class
        recv_x, scales = recv_x
        got_s = scales.cpu().numpy()
        for e, n in enumerate(want[r].counts):
            wrong += int(bits.mismatches(got_s[e, :n].reshape(-1), want[r].scales[e, :n].reshape(-1)).size)
    got_x = recv_x.cpu().view(torch.uint8 if args.fp8 else torch.int16 if args.dtype == "bfloat16" else torch.int32)
    got_x = got_x.numpy()
    if packed:  # the rows of every expert, one after the other
        got_x, want_x = got_x[None], want[r].recv_x[None]
        spans = [(0, pref.offsets(want[r])[-1])]
    else:
        want_x, spans = want[r].recv_x, [(0, n) for n in want[r].counts]
    for e, (lo, hi) in enumerate(spans):
        wrong += int((got_x[e, lo:hi].reshape(-1) != want_x[e, lo:hi].reshape(-1).view(got_x.dtype)).sum())
    got_out = out.cpu().view(torch.int16 if args.dtype == "bfloat16" else torch.int32).numpy()
    want_out = (pref.combine(shape, want, ys, idxs) if packed else
                ref.combine(shape, want, ys, idxs, partials=args.partials))[r]
    wrong += int(bits.mismatches(got_out.view(want_out.dtype).reshape(-1), want_out.reshape(-1)).size)
    return wrong


def to_device(a: np.ndarray, dtype: str):
    """Host ``a`` (bfloat16 or float32) as a CUDA tensor of the same bits."""
    import torch

    ints = torch.from_numpy(np.ascontiguousarray(a).view(np.int16 if dtype == "bfloat16" else np.int32))
    return ints.cuda().view(getattr(torch, dtype))


def measure(comm, args, tokens: int, mode: str) -> dict:
    import torch

    import ubnext
    from ubnext._moe import layout, packed_layout

    n, r = comm.size, comm.rank
    routes = [routing(args, s, tokens) for s in range(n)]
    idxs, ws = [i for i, _ in routes], [w for _, w in routes]
    sizes = (args.experts, args.hidden, max(tokens, 1), args.top_k, args.dtype)
    if args.mode == "packed":
        capacity = most_rows(args.experts, n, idxs)
        shape = packed_layout.shape(n, *sizes, capacity)
        ep = ubnext.PackedExpertParallel(comm, *sizes, max_rows=capacity, framework="torch")
    else:
        capacity = busiest_expert(args.experts, idxs)
        shape = layout.shape(n, *sizes, capacity, bool(args.fp8))
        ep = ubnext.ExpertParallel(comm, *sizes, capacity=capacity, framework="torch", partials=args.partials,
                                   fp8=bool(args.fp8))
    xs = [payload(args, s, (tokens, args.hidden)) for s in range(n)]
    x = to_device(xs[r], args.dtype)
    idx, w = torch.from_numpy(idxs[r]).cuda(), torch.from_numpy(ws[r]).cuda()
    wrong = check(comm, args, ep, shape, xs, idxs, ws, x, idx, w) if args.check else None
    recv_x, _, handle = ep.dispatch(x, idx, w)
    y = recv_x[0].to(torch.bfloat16) if args.fp8 else recv_x.clone()  # the experts' outputs: bf16 rows
    out = torch.empty_like(x)
    fns = {"ubnext dispatch": (lambda: ep.dispatch(x, idx, w), mode),
           "ubnext combine": (lambda: ep.combine(y, handle, out=out), mode)}
    notes = baseline_problems(comm)
    if "nccl" not in notes:
        nccl = NcclBaseline(args, n, x, idx.long())
        partials = nccl.dispatch().to(getattr(torch, args.partials))
        fns.update({"nccl dispatch": (nccl.dispatch, "eager"), "nccl combine": (lambda: nccl.combine(partials), "eager")})
    if "vdev" not in notes:
        vdev = VdevBaseline(args, n, x, idx, w)
        if args.check:  # identity experts: every token comes back as x times its weights' sum
            vdev.dispatch()
            got, want = vdev.combine(vdev.out).float(), x.float() * w.float().sum(dim=1, keepdim=True)
            notes["vdev wrong"] = int((~torch.isclose(got, want, rtol=1e-2, atol=1e-2)).sum())
        fns.update({"vdev dispatch": (vdev.dispatch, mode), "vdev combine": (lambda: vdev.combine(vdev.out), mode)})
    if "nccl_ep" not in notes:
        fns.update(nccl_ep_calls(comm, args, x, idx, w, mode, notes))
    times = {}
    for name, (fn, how) in fns.items():
        if name == "ubnext combine":
            handle = ep.dispatch(x, idx, w)[2]  # the latest dispatch's (the timed dispatches ran since)
        fn()
        try:
            samples = tb.time_us(fn, how, comm.bootstrap, args.iters, args.launches, args.repeats)
        except RuntimeError as err:  # a baseline whose capture fails is timed eager, and says so
            if how != "graph" or name.startswith("ubnext"):
                raise
            how, notes[name] = "eager", f"not capturable ({str(err).splitlines()[0][:80]}): eager"
            torch.cuda.synchronize()
            samples = tb.time_us(fn, how, comm.bootstrap, args.iters, args.launches, args.repeats)
        times[name] = {"time_us": tb.median(samples), "samples_us": samples, "mode": how}
    dispatch_bytes, combine_bytes = link_bytes(args, n, idxs)
    return {"tokens": tokens, "capacity": capacity, "dispatch_bytes": dispatch_bytes, "combine_bytes": combine_bytes, "wrong": wrong,
            "times": times, "baseline_notes": notes}


def nccl_ep_calls(comm, args, x, idx, w, mode: str, notes: dict) -> dict:
    """moe_perf's entries of NCCL's nccl_ep (``NcclEpBaseline``), its check (identity
    experts: each token back as x times its weights' sum) in ``notes["nccl_ep wrong"]``;
    none, and the reason in ``notes["nccl_ep"]``, where its creation fails (on every rank:
    the failure is agreed over the bootstrap, so that no rank waits in a collective the
    others left)."""
    import torch

    try:
        ep, why = NcclEpBaseline(args, comm.bootstrap, x, idx, w), None
    except Exception as err:  # the library's NcclError/RuntimeError: a baseline that does not run here
        ep, why = None, f"creation failed ({type(err).__name__}: {str(err).splitlines()[0][:100]})"
    whys = [v for v in comm.bootstrap.allgather_obj(why) if v]
    if whys:
        notes["nccl_ep"] = whys[0]
        return {}
    if args.check:
        ep.dispatch()
        got, want = ep.combine(ep.recv).float(), x.float() * w.float().sum(dim=1, keepdim=True)
        torch.cuda.synchronize()
        notes["nccl_ep wrong"] = int((~torch.isclose(got, want, rtol=1e-2, atol=1e-2)).sum())
    return {"nccl_ep dispatch": (ep.dispatch, mode), "nccl_ep combine": (lambda: ep.combine(ep.recv), mode)}


def baseline_problems(comm) -> dict:
    """The baselines that cannot run on this communicator, with the reason: NCCL's where
    NCCL cannot (ranks sharing a GPU), torch's vdev form where the op or NVSHMEM is missing
    or ranks share a GPU (NVSHMEM takes one rank per GPU), nccl_ep where NCCL cannot or
    it does not import or the NCCL loaded is older than it needs (``nccl_ep_problem``)."""
    problems = {}
    shared = comm._selector.nccl_problem
    if shared:
        problems["nccl"] = shared
    vdev = shared or ("one rank (torch's NVSHMEM rendezvous takes two or more)" if comm.size == 1 else vdev_problem())
    if vdev:
        problems["vdev"] = vdev
    nccl_ep = shared or nccl_ep_problem()
    if nccl_ep:
        problems["nccl_ep"] = nccl_ep
    return problems


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("UBNEXT_POOL_MB", "2048")
    return tb.main(parse_args, run, argv)


def run(comm, args, argv) -> int:
    mode = "graph" if args.graphs else "eager"
    rate = push_rate(comm, args)
    records = [measure(comm, args, t, mode) for t in args.tokens]
    if comm.rank != 0:
        return 0
    print(f"# {comm.size} ranks, hidden {args.hidden}, top-{args.top_k}, {args.experts} experts, {args.dtype}, "
          f"{'fp8 dispatch, ' if args.fp8 else ''}{args.partials} partials, routing {args.routing}, mode {args.mode}; "
          f"ubnext, vdev (torch all_to_all_vdev_2d) and nccl_ep {'in CUDA graphs' if args.graphs else 'eager'}, "
          f"NCCL eager (host sync); "
          f"µs (median of {args.repeats}, max over ranks); push rate {rate / 1e9:.1f} GB/s per direction")
    side = f"{'bytes':>10} {'ubnext':>9} {'floor':>7} {'frac':>5} " + " ".join(f"{b:>9}" for b in BASELINES)
    print(f"{'tokens':>7} {side}   {side} {'wrong':>6}")
    print(f"{'':>7} {'dispatch':>{len(side)}}   {'combine':>{len(side)}}")
    for rec in records:
        cells = []
        for kind, nbytes in (("dispatch", rec["dispatch_bytes"]), ("combine", rec["combine_bytes"])):
            ours = rec["times"][f"ubnext {kind}"]["time_us"]
            floor = nbytes / rate * 1e6 if rate else None  # one rank: no link, nothing crosses it
            rec[f"{kind}_floor_us"] = floor
            bound = f"{'-':>7} {'-':>5}" if floor is None else f"{floor:7.2f} {floor / ours:5.2f}"
            theirs = [rec["times"].get(f"{b} {kind}", {}).get("time_us") for b in BASELINES]
            cells.append(f"{nbytes:>10} {ours:9.2f} {bound} " + " ".join("        -" if t is None else f"{t:9.2f}"
                                                                         for t in theirs))
        wrong = "-" if rec["wrong"] is None else str(rec["wrong"])
        print(f"{rec['tokens']:>7} " + "   ".join(cells) + f" {wrong:>6}")
    for why in sorted({f"{k}: {v}" for rec in records for k, v in rec["baseline_notes"].items()}):
        print(f"# baseline {why}")
    tb.save_report(comm, "moe_perf", "moe_perf", args, argv, {
        "config": {k: getattr(args, k) for k in ("hidden", "top_k", "experts", "dtype", "routing", "mode", "partials",
                                                  "fp8", "graphs", "iters", "launches", "repeats", "ceiling_bytes")},
        "push_rate_gbs": rate / 1e9, "results": records})
    failed = any(rec["wrong"] for rec in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
