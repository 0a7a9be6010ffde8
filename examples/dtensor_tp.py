"""A small Llama-style model with DTensor tensor parallelism (``parallelize_module``:
attention q/k/v and the MLP's w1/w3 column-wise, wo and w2 row-wise) over all ranks, on
the backend given: every rank sees the same batch; prints each step's loss and time.

    python examples/dtensor_tp.py                             # 1 rank
    torchrun --nproc-per-node 2 examples/dtensor_tp.py [--backend gloo]
"""

from _common import Llama, arguments, setup, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


PLAN = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("tp",))
    model = Llama(dim=args.dim, layers=args.layers).to(device)  # 4 heads, split over the ranks
    for block in model.layers:
        parallelize_module(block, mesh, PLAN)
    train("dtensor_tp", args, rank, size, device, model, same_batch=True)


if __name__ == "__main__":
    main()
