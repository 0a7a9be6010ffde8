"""A small Llama-style model trained data-parallel by hand with functional collectives
(``torch.distributed._functional_collectives``) inside ``torch.compile(fullgraph=True)``:
the gradients are flattened, all-reduced and averaged in one compiled function, on the
backend given; prints each step's loss and time.

    python examples/compiled_functional.py                    # 1 rank
    torchrun --nproc-per-node 2 examples/compiled_functional.py [--backend gloo]
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from _common import Llama, arguments, setup, train


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    model = Llama(dim=args.dim, layers=args.layers).to(device)
    params = list(model.parameters())
    group = dist.group.WORLD

    @torch.compile(fullgraph=True)
    def average(grads):
        flat = fc.all_reduce(torch.cat([g.reshape(-1) for g in grads]), "sum", group) / size
        return flat.split([g.numel() for g in grads])

    def all_reduce_gradients():
        for p, g in zip(params, average([p.grad for p in params])):
            p.grad = g.view_as(p)

    train("compiled_functional", args, rank, size, device, model, after_backward=all_reduce_gradients)


if __name__ == "__main__":
    main()
