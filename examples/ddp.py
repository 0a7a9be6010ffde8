"""A small Llama-style model trained with DistributedDataParallel on the backend given
(``--backend ubnext``, the default; ``nccl`` or ``gloo`` for reference): prints each step's
loss (averaged over the ranks) and time.

    python examples/ddp.py                                   # 1 rank
    torchrun --nproc-per-node 2 examples/ddp.py              # or: mpirun -n 2 python examples/ddp.py
    torchrun --nproc-per-node 2 examples/ddp.py --backend gloo   # the reference (ranks may share a GPU)
"""

import torch
import torch.distributed as dist
from _common import Llama, Report, arguments, batch, loss_of, setup


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    model = torch.nn.parallel.DistributedDataParallel(Llama(dim=args.dim, layers=args.layers).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = Report("ddp", args, rank, size, device)
    for step in range(args.steps):
        report.start()
        tokens, targets = batch(step, rank, device)
        loss = loss_of(model(tokens), targets)
        loss.backward()  # DDP all-reduces the gradient buckets (averaged) as they are ready
        opt.step()
        opt.zero_grad(set_to_none=True)
        report.step(step, loss)
    report.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
