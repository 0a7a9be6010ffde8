"""The ubnext torch.distributed backend's cost: per-op times of ``dist.*`` on a group of
backend "ubnext", beside the same group's Communicator called directly (``comm.*``: the
difference is what the c10d dispatch into the backend costs) and beside a group of
backend "nccl" over the same ranks (where NCCL can run: one GPU per rank).

    mpirun -n 4 python bench/torch_backend.py --bytes 2K,128K,2M,32M --modes eager,graph

For each op (``--ops``: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, and
broadcast / all_to_all_single where the Communicator has them), size and mode (eager:
``--iters`` back-to-back calls; graph: the calls captured once and replayed), µs per call
(maximum over ranks, median of ``--repeats``). Rank 0 prints a table and writes
``<outdir>/<name>.json``. The step times of the example programs (DDP, FSDP2, DTensor
tensor parallelism, compiled functional collectives) are what ``examples/*.py`` print
with ``--backend ubnext`` and ``--backend nccl``.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script (python bench/torch_backend.py): bench/_standalone.py
    import _standalone  # noqa: F401

from bench import _common as common  # noqa: E402
from bench import _torchbench as tb  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")
#: the Communicator method each op needs
NEEDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "broadcast": "broadcast", "all_to_all_single": "all_to_all"}
CANDIDATES = ("dist ubnext", "comm direct", "dist nccl")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torch_backend", description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=lambda t: [common.size_arg(v) for v in t.split(",")], default=[2048, 128 << 10])
    p.add_argument("--ops", type=lambda t: t.split(","), default=list(OPS))
    p.add_argument("--modes", type=lambda t: t.split(","), default=["eager", "graph"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--outdir", default=RESULTS_DIR)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    bad = [o for o in args.ops if o not in OPS] + [m for m in args.modes if m not in ("eager", "graph")]
    if bad:
        p.error(f"unknown ops or modes {bad}; ops: {', '.join(OPS)}; modes: eager, graph")
    return args


def calls(op: str, nbytes: int, tdtype, size: int, group, comm) -> dict:
    """Candidate name -> a function that enqueues one ``op`` of ``nbytes`` (per rank's input)."""
    import torch
    import torch.distributed as dist

    count = max(size, nbytes // torch.tensor([], dtype=tdtype).element_size() // size * size)
    x = torch.ones(count, dtype=tdtype, device="cuda")
    big, shard = torch.empty(count * size, dtype=tdtype, device="cuda"), torch.empty(count // size, dtype=tdtype,
                                                                                     device="cuda")
    out = torch.empty_like(x)
    via_dist = {
        "all_reduce": lambda g: lambda: dist.all_reduce(x, group=g),
        "all_gather_into_tensor": lambda g: lambda: dist.all_gather_into_tensor(big, x, group=g),
        "reduce_scatter_tensor": lambda g: lambda: dist.reduce_scatter_tensor(shard, x, group=g),
        "broadcast": lambda g: lambda: dist.broadcast(x, src=0, group=g),
        "all_to_all_single": lambda g: lambda: dist.all_to_all_single(out, x, group=g),
    }[op]
    direct = {
        "all_reduce": lambda: comm.all_reduce(x, out=x, precision="exact"),
        "all_gather_into_tensor": lambda: comm.all_gather(x, out=big),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter(x, out=shard, precision="exact"),
        "broadcast": lambda: comm.broadcast(x, root=0, out=x),
        "all_to_all_single": lambda: comm.all_to_all(x, out=out),
    }[op]
    found = {"dist ubnext": via_dist(None), "comm direct": direct}
    if group is not None:
        found["dist nccl"] = via_dist(group)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    tb.keep_multicast_off()
    import torch
    import torch.distributed as dist

    import ubnext.torch  # noqa: F401 (registers "ubnext")
    from ubnext.bootstrap import default

    boot = default()
    device = boot.rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    port = boot.bcast_obj(tb._free_port() if boot.rank == 0 else None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    # no device_id: a world bound to a device would make torch split the NCCL group below from it
    dist.init_process_group("ubnext", rank=boot.rank, world_size=boot.size)
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))  # the world's communicator
        comm = dist.group.WORLD.communicator
        shared = boot.size > torch.cuda.device_count()
        nccl = None if shared else dist.new_group(backend="nccl")
        if shared and boot.rank == 0:
            print("# dist nccl left out: ranks share a GPU, which NCCL refuses")
        tdtype = getattr(torch, args.dtype)
        records = []
        for op in args.ops:
            if not hasattr(comm, NEEDS[op]):
                if boot.rank == 0:
                    print(f"# {op} left out: this Communicator has no {NEEDS[op]}() yet")
                continue
            for nbytes in args.bytes:
                for name, fn in calls(op, nbytes, tdtype, boot.size, nccl, comm).items():
                    for mode in args.modes:
                        runs = tb.time_us(fn, mode, boot, args.iters, repeats=args.repeats)
                        records.append({"op": op, "bytes": nbytes, "candidate": name, "mode": mode,
                                        "time_us": tb.median(runs), "samples_us": runs})
        if boot.rank == 0:
            report(records, args, boot.size)
            fake = type("Run", (), {"device": device, "size": boot.size})()
            tb.save_report(fake, "torch_backend", "torch_backend", args, argv,
                           {"dtype": args.dtype, "config": {"iters": args.iters, "repeats": args.repeats},
                            "results": records}, tags=(args.dtype,))
    finally:
        dist.destroy_process_group()
        boot.barrier()  # rank 0 hosts the store: it stays until every rank has left the groups
        boot.close()
    return 0


def report(records: list[dict], args, size: int) -> None:
    """The table: µs per call of each candidate; dispatch = dist ubnext - comm direct;
    speedup = dist nccl / dist ubnext."""
    print(f"# torch.distributed on backend ubnext, {args.dtype}, {size} ranks: µs per call "
          f"(median of {args.repeats}, max over ranks)")
    print(f"{'op':<24} {'bytes':>9} {'mode':<6} {'dist ubnext':>12} {'comm direct':>12} {'dispatch':>9} "
          f"{'dist nccl':>10} {'vs nccl':>8}")
    keys = sorted({(r["op"], r["bytes"], r["mode"]) for r in records}, key=lambda k: (OPS.index(k[0]), k[1], k[2]))
    for op, nbytes, mode in keys:
        t = {r["candidate"]: r["time_us"] for r in records if (r["op"], r["bytes"], r["mode"]) == (op, nbytes, mode)}
        ub, direct, nccl = t["dist ubnext"], t["comm direct"], t.get("dist nccl")
        theirs, vs = (f"{nccl:10.2f}", f"{nccl / ub:7.2f}x") if nccl else ("-".rjust(10), "-".rjust(8))
        print(f"{op:<24} {nbytes:>9} {mode:<6} {ub:12.2f} {direct:12.2f} {ub - direct:9.2f} {theirs} {vs}")


if __name__ == "__main__":
    sys.exit(common.run_or_abort(main))
