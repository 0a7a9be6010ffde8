"""A small Llama-style model trained with FSDP2 (``fully_shard`` per block and at the
root: parameters sharded over the ranks, all-gathered before use with prefetching,
gradients reduce-scattered) on the backend given: prints each step's loss and time.

    python examples/fsdp2.py                                  # 1 rank
    torchrun --nproc-per-node 2 examples/fsdp2.py [--backend gloo]
"""

import torch
import torch.distributed as dist
from _common import Llama, Report, arguments, batch, loss_of, setup
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    model = Llama(dim=args.dim, layers=args.layers).to(device)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = Report("fsdp2", args, rank, size, device)
    for step in range(args.steps):
        report.start()
        tokens, targets = batch(step, rank, device)
        loss = loss_of(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        report.step(step, loss)
    report.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
