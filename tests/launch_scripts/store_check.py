"""Run as every rank of a torchrun-style launch (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set; under torchrun or by hand), on CPU.

1. ``ubnext.bootstrap.default()`` is a StoreBootstrap over all the ranks: allgather,
   bcast, barrier and split_local agree on every rank.
2. ``torch.distributed.init_process_group("gloo")`` still works while that bootstrap
   is open (it shares the store's port) and all-reduces the exact sum.
3. With the group initialized, ``default()`` gives a TorchBootstrap over it.

Each rank prints ``store_check OK rank=R size=N`` last.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ubnext.bootstrap import StoreBootstrap, TorchBootstrap, default


def check_collectives(boot) -> None:
    n = int(os.environ["WORLD_SIZE"])
    assert (boot.rank, boot.size) == (int(os.environ["RANK"]), n), (boot.rank, boot.size)
    for round_ in range(3):  # several exchanges, so the key cleanup is exercised
        mine = b"rank %d round %d;" % (boot.rank, round_) * (boot.rank + 1)
        assert boot.allgather(mine) == [b"rank %d round %d;" % (r, round_) * (r + 1) for r in range(n)]
    assert boot.bcast(b"from the last" if boot.rank == n - 1 else None, root=n - 1) == b"from the last"
    assert boot.allgather_obj(("x", boot.rank)) == [("x", r) for r in range(n)]
    boot.barrier()
    local = boot.split_local()
    assert (local.rank, local.size) == (boot.rank, n), "every rank runs on this host"
    local.close()


def main() -> None:
    boot = default()
    assert type(boot) is StoreBootstrap, type(boot)
    check_collectives(boot)

    dist.init_process_group("gloo")
    x = torch.tensor([float(boot.rank + 1)])
    dist.all_reduce(x)
    n = boot.size
    assert x.item() == n * (n + 1) / 2, x.item()

    with default() as over_group:
        assert type(over_group) is TorchBootstrap, type(over_group)
        check_collectives(over_group)
    boot.close()
    dist.destroy_process_group()
    print(f"store_check OK rank={boot.rank} size={boot.size}", flush=True)


if __name__ == "__main__":
    main()
