"""Run on a GPU machine as ``torchrun --standalone --nproc-per-node N torchrun_allreduce.py``
(ranks may share a GPU: on a 1-GPU machine they all do).

1. ``ubnext.Communicator()`` with no arguments spans all N ranks (a StoreBootstrap over
   torchrun's store): every usable algorithm gives the exact sum 1 + 2 + ... + N in
   float32 and bfloat16.
2. Ranks sharing a GPU: the lowest of each group logs one warning naming the ranks; the
   others log none. The NCCL rung then raises one line on every rank instead of
   ``ncclCommInitRank ... invalid usage``. With a GPU each, no warning, and NCCL is exact.
   (Where cupy cannot load NCCL, the NCCL rung is skipped with a printed line.)
3. ``close()`` closes the bootstrap the communicator created.
4. After ``init_process_group("gloo")``, ``Communicator()`` runs over that group
   (TorchBootstrap) and is exact; with a GPU each, also over an NCCL-only group.

Every rank prints ``torchrun_allreduce OK rank=R size=N`` last.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import ubnext
from ubnext.bootstrap import StoreBootstrap, TorchBootstrap

COUNT = 4099  # odd: the kernels' tail path too


class Records(logging.Handler):
    """Keeps the ``ubnext`` logger's records."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_exact(comm, algorithms) -> None:
    n = comm.size
    expected = n * (n + 1) // 2
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.full((COUNT,), float(comm.rank + 1), device=f"cuda:{comm.device}", dtype=dtype)
        for algo in algorithms:
            y = comm.all_reduce(x, algorithm=algo)
            comm.synchronize()
            wrong = int((y.float() != expected).sum())
            assert wrong == 0, f"rank {comm.rank}: {algo} {dtype}: {wrong} of {COUNT} elements differ from {expected}"


def check_nccl(comm, sharing: bool) -> None:
    from cupy.cuda import nccl

    if not nccl.available:
        print(f"rank {comm.rank}: NCCL rung not checked: cupy cannot load NCCL here", flush=True)
        return
    x = torch.full((COUNT,), float(comm.rank + 1), device=f"cuda:{comm.device}")
    if not sharing:
        check_exact(comm, ["nccl"])
        return
    try:
        comm.all_reduce(x, algorithm="nccl")
    except ubnext.UbnextError as e:
        assert "share one GPU, which NCCL refuses" in str(e) and "\n" not in str(e), str(e)
    else:
        raise AssertionError(f"rank {comm.rank}: NCCL accepted ranks sharing a GPU")


def main() -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus = torch.cuda.device_count()
    sharing = gpus < local_size
    records = Records()
    logging.getLogger("ubnext").addHandler(records)

    comm = ubnext.Communicator()
    assert (comm.rank, comm.size) == (rank, size), (comm.rank, comm.size)
    assert type(comm.bootstrap) is StoreBootstrap, type(comm.bootstrap)
    torch.cuda.set_device(comm.device)
    kernels = [a for a in comm.algorithms() if a != "nccl"]
    assert kernels, f"rank {rank}: no kernel algorithm usable ({comm.describe()})"
    check_exact(comm, ["auto", *kernels])

    # Ranks that see the same devices take them in turn (local rank modulo count); the
    # lowest rank of each shared device warns.
    warned = [r.getMessage() for r in records.records
              if r.levelno == logging.WARNING and "share one GPU" in r.getMessage()]
    should_warn = local_rank < gpus and local_rank + gpus < local_size
    assert len(warned) == int(should_warn), f"local rank {local_rank}: warnings {warned}"
    check_nccl(comm, sharing)
    comm.close()
    assert comm.bootstrap.closed, "close() left the default bootstrap open"

    dist.init_process_group("gloo")
    with ubnext.Communicator() as over_gloo:
        assert type(over_gloo.bootstrap) is TorchBootstrap, type(over_gloo.bootstrap)
        check_exact(over_gloo, ["auto"])
    dist.destroy_process_group()

    if not sharing:  # an NCCL-only group: ubnext exchanges over a gloo group of its own
        dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
        with ubnext.Communicator() as over_nccl:
            assert type(over_nccl.bootstrap) is TorchBootstrap, type(over_nccl.bootstrap)
            check_exact(over_nccl, ["auto"])
        dist.destroy_process_group()
    print(f"torchrun_allreduce OK rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
