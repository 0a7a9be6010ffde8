"""A small Llama-style model trained with FSDP2 (``fully_shard`` per block and at the
root: parameters sharded over the ranks, all-gathered before use with prefetching,
gradients reduce-scattered) on the backend given: prints each step's loss and time.

    python examples/fsdp2.py                                  # 1 rank
    torchrun --nproc-per-node 2 examples/fsdp2.py [--backend gloo]
"""

from _common import Llama, arguments, setup, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rank, size, device = setup(args)
    model = Llama(dim=args.dim, layers=args.layers).to(device)
    mesh = init_device_mesh(device.type, (size,))  # the run's device (fully_shard's default is the GPU's)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train("fsdp2", args, rank, size, device, model)


if __name__ == "__main__":
    main()
