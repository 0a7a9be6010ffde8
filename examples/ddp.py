"""A small Llama-style model trained with DistributedDataParallel on the backend given
(``--backend ubnext``, the default; ``nccl`` or ``gloo`` for reference): prints each step's
loss (averaged over the ranks) and time.

    python examples/ddp.py                                   # 1 rank
    torchrun --nproc-per-node 2 examples/ddp.py              # or: mpirun -n 2 python examples/ddp.py
    torchrun --nproc-per-node 2 examples/ddp.py --backend gloo   # the reference (ranks may share a GPU)
"""

import torch
from _common import Llama, arguments, setup, train


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    model = torch.nn.parallel.DistributedDataParallel(Llama(dim=args.dim, layers=args.layers).to(device))
    train("ddp", args, rank, size, device, model)  # backward all-reduces the gradient buckets (averaged)


if __name__ == "__main__":
    main()
