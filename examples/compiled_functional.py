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
from _common import Llama, Report, arguments, batch, loss_of, setup


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    model = Llama(dim=args.dim, layers=args.layers).to(device)
    params = [p for p in model.parameters()]
    group = dist.group.WORLD

    @torch.compile(fullgraph=True)
    def average(grads):
        flat = fc.all_reduce(torch.cat([g.reshape(-1) for g in grads]), "sum", group) / size
        return flat.split([g.numel() for g in grads])

    opt = torch.optim.AdamW(params, lr=1e-3)
    report = Report("compiled_functional", args, rank, size, device)
    for step in range(args.steps):
        report.start()
        tokens, targets = batch(step, rank, device)
        loss = loss_of(model(tokens), targets)
        loss.backward()
        for p, g in zip(params, average([p.grad for p in params])):
            p.grad = g.view_as(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        report.step(step, loss)
    report.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
