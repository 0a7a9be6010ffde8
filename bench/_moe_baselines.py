"""The expert-parallel baselines of ``bench/moe_perf.py``: what a user has besides ubnext.

* :class:`NcclBaseline`: NCCL's ``all_to_all_single`` with a count exchange read on the
  host (the common implementation; eager only, it syncs the host);
* :class:`VdevBaseline`: torch's symmetric-memory ``all_to_all_vdev_2d`` (NVSHMEM), the
  device-split exchange torchtitan's MoE uses: no host sync, so it is timed in the mode
  ubnext is (CUDA graphs where its capture works, else eager: the record says which).

Both move what their users' layers move: the NCCL form sends a token once per destination
GPU (as ubnext) and brings back one fp32 partial per GPU; the vdev form sends a token once
per *expert* slot (its splits are per (rank, expert)) and brings every slot's row back,
summed on the token's rank with the router weights in fp32.
"""

from __future__ import annotations


class NcclBaseline:
    """The all_to_all_single dispatch and combine of one rank's routing (module docstring)."""

    def __init__(self, args, nranks: int, x, idx):
        import torch

        self.n, self.x, self.hidden = nranks, x, args.hidden
        local = args.experts // nranks
        gpu = torch.where(idx >= 0, idx // local, -1)
        dest = torch.stack([(gpu == g).any(dim=1) for g in range(nranks)])  # [N, T]
        self.counts = dest.sum(dim=1).to(torch.int64)
        self.order = torch.cat([torch.nonzero(dest[g]).flatten() for g in range(nranks)])  # tokens by destination
        self.out_dtype = x.dtype

    def dispatch(self):
        import torch
        import torch.distributed as dist

        recv_counts = torch.empty_like(self.counts)
        dist.all_to_all_single(recv_counts, self.counts)
        splits_in, splits_out = self.counts.tolist(), recv_counts.tolist()  # the host sync
        send = self.x.index_select(0, self.order)
        recv = send.new_empty((sum(splits_out), self.hidden))
        dist.all_to_all_single(recv, send, splits_out, splits_in)
        self._splits = (splits_in, splits_out)
        return recv

    def combine(self, partials):
        import torch
        import torch.distributed as dist

        splits_in, splits_out = self._splits
        back = partials.new_empty((sum(splits_in), self.hidden))
        dist.all_to_all_single(back, partials, splits_in, splits_out)
        acc = torch.zeros((self.x.shape[0], self.hidden), device=back.device, dtype=torch.float32)
        acc.index_add_(0, self.order, back.float())
        return acc.to(self.out_dtype)


def vdev_problem() -> str | None:
    """Why torch's ``all_to_all_vdev_2d`` cannot run here (None: it can, as far as the host
    can tell: the op exists and NVSHMEM's library loads)."""
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
        return f"torch {torch.__version__} has no symm_mem.all_to_all_vdev_2d"
    if not symm_mem.is_nvshmem_available():
        return "NVSHMEM's library does not load"
    return None


class VdevBaseline:
    """Dispatch and combine through ``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset``.

    Dispatch: the token slots sorted by global expert (a stable sort: by expert, then token
    index), their rows gathered into the symmetric input and the per-expert counts into the
    symmetric splits, then ``all_to_all_vdev_2d``: every rank receives its local experts'
    rows, expert-major (local expert, then source rank). Combine: ``..._offset`` sends each
    received row back to its slot's place in the sender's sorted order, and the sender sums
    each token's slots with their weights in fp32 (``index_add_`` of the weighted rows) and
    rounds once. Collective at creation (symmetric allocations and their rendezvous)."""

    def __init__(self, args, nranks: int, x, idx, w):
        import torch
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        self.group = dist.group.WORLD.group_name
        T, K, H = idx.shape[0], idx.shape[1], args.hidden
        flat = idx.reshape(-1).long()
        keep = torch.nonzero(flat >= 0).flatten()
        order = keep[torch.argsort(flat[keep], stable=True)]  # slots by expert, then token
        self.x, self.token = x, order // K
        self.weight = w.reshape(-1)[order].float().unsqueeze(1)
        slots = T * K
        cap = max(1, slots * nranks)  # the most rows a rank can receive
        dev = x.device
        self.inp = symm_mem.empty((max(1, slots), H), dtype=x.dtype, device=dev)
        self.out = symm_mem.empty((cap, H), dtype=x.dtype, device=dev)
        self.back = symm_mem.empty((max(1, slots), H), dtype=x.dtype, device=dev)
        self.splits = symm_mem.empty((args.experts,), dtype=torch.int64, device=dev)
        self.out_so = symm_mem.empty((2, args.experts), dtype=torch.int64, device=dev)
        self.back_so = symm_mem.empty((2, args.experts), dtype=torch.int64, device=dev)
        for t in (self.inp, self.out, self.back, self.splits, self.out_so, self.back_so):
            symm_mem.rendezvous(t, self.group)
        self.counts = torch.bincount(flat[keep], minlength=args.experts).to(torch.int64)
        self.T, self.H = T, H

    def dispatch(self):
        import torch

        n = self.token.numel()
        self.inp[:n].copy_(self.x.index_select(0, self.token))
        self.splits.copy_(self.counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(self.inp, self.out, self.splits, self.out_so, self.group)
        return self.out

    def combine(self, y):
        """``y``: the experts' outputs in the dispatch's received layout (``self.out``)."""
        import torch

        torch.ops.symm_mem.all_to_all_vdev_2d_offset(y, self.back, self.out_so, self.back_so, self.group)
        n = self.token.numel()
        acc = torch.zeros((self.T, self.H), device=y.device, dtype=torch.float32)
        acc.index_add_(0, self.token, self.back[:n].float() * self.weight)
        return acc.to(self.x.dtype)
