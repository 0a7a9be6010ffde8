"""An all-gather of any dtype of torch tensors, for the torch layer's own bookkeeping (the
backend's DDP metadata, the MoE router-weight gradients): ``comm.all_gather``, except where
no ubnext kernel gathers the dtype and NCCL cannot run (ranks sharing a GPU), where it is an
all-to-all of x repeated once per rank, which the pool's copy form serves for every dtype
with the same layout."""

from __future__ import annotations

from ubnext._protocol.algorithms import KERNEL_DTYPES


def all_gather_any(comm, x, out=None):
    """``comm.all_gather(x, out=out)`` for any dtype (module docstring). Collective."""
    if str(x.dtype).removeprefix("torch.") in KERNEL_DTYPES or not comm.selector.nccl_problem:
        return comm.all_gather(x, out=out)
    n = comm.size
    if out is None:
        out = x.new_empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,))
    comm.all_to_all(x.reshape(1, -1).expand(n, -1).contiguous(), out=out.view(n, -1))
    return out
