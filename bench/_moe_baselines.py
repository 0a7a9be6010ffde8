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

* :class:`NcclEpBaseline`: NCCL's expert-parallel library (``nccl_ep``, the ``nccl.ep``
  module of the ``nccl-extensions`` wheel) in its low-latency mode, expert-major layout:
  its own ``[local experts, N x max tokens, H]`` receive buffer, the router weights
  applied by its combine (bench/install_nccl_ep.sh installs it; ``nccl_ep_problem`` says
  why it cannot run).
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


#: the oldest libnccl that nccl_ep (nccl-extensions 0.1.0) runs on
NCCL_EP_MIN_NCCL = (2, 30, 7)


def _loaded_nccl_version() -> tuple[int, int, int] | None:
    """The version of the ``libnccl.so.2`` this process already loaded (the one that
    libnccl_ep.so's ``NEEDED libnccl.so.2`` binds to), or None if none is loaded."""
    import ctypes
    import os

    try:
        lib = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError:
        return None
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    v = code.value
    return (v // 10000, v % 10000 // 100, v % 100) if v >= 10000 else (v // 1000, v % 1000 // 100, v % 100)


def _loaded_nccl_files() -> set[str]:
    """The distinct files of every libnccl.so* mapped into this process."""
    import os

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libnccl.so" in line}
    return {os.path.realpath(p) for p in paths}


def nccl_ep_problem(loaded=_loaded_nccl_version, files=_loaded_nccl_files) -> str | None:
    """Why NCCL's ``nccl_ep`` cannot run in this process (None: it imports, one libnccl is
    loaded, torch's and nccl4py's, and it is new enough). ``loaded``, ``files``: the
    loaded libnccl's version and files (test seams)."""
    want = ".".join(map(str, NCCL_EP_MIN_NCCL))
    try:
        import nccl.core
        import nccl.ep  # noqa: F401

        nccl.core.get_version()  # nccl4py loads its libnccl now, not at the first call
    except Exception as err:  # ImportError, or its library's loader's OSError/RuntimeError
        return f"nccl.ep does not import ({type(err).__name__}: {str(err).splitlines()[0][:100]}; " \
               f"bench/install_nccl_ep.sh)"
    copies = files()
    if len(copies) > 1:
        return f"two libnccl loaded ({', '.join(sorted(copies))}): nccl4py's communicator and libnccl_ep.so's " \
               f"calls would use different ones (bench/install_nccl_ep.sh: LD_PRELOAD one)"
    have = loaded()
    if have is None:
        return "no libnccl.so.2 loaded in this process (torch.distributed's NCCL backend loads it)"
    if have < NCCL_EP_MIN_NCCL:
        return f"the libnccl.so.2 loaded here is {'.'.join(map(str, have))}; nccl_ep needs {want} or newer " \
               f"(bench/install_nccl_ep.sh: LD_PRELOAD the newer one)"
    return None


def _stream() -> int:
    """torch's current stream (the capture stream under a graph), as nccl.ep takes it."""
    import torch

    return torch.cuda.current_stream().cuda_stream


class NcclEpBaseline:
    """NCCL ``nccl_ep``'s low-latency dispatch and combine of one rank's routing.

    At creation (collective, not capturable): an NCCL communicator of nccl4py over the
    ranks (the unique id broadcast by ubnext's bootstrap), the EP group (``Group.create``,
    ``Algorithm.LOW_LATENCY``, ``max_token_bytes`` a bf16 or fp32 row) and the routing's
    handle (``create_handle`` with ``Layout.EXPERT_MAJOR`` and int64 ``topk_idx``), so that
    the timed calls allocate nothing. Dispatch: ``tokens`` ``[T, H]`` into ``recv``
    ``[L, N x M, H]`` (M: the group's max tokens per rank), the per-expert counts into
    ``counts`` ``[L]`` int32. Combine: ``y`` of recv's shape back into ``out`` ``[T, H]``,
    the router weights ``[T, K]`` float32 applied on the receive side. Both on torch's
    current stream (the capture stream under a graph).

    Args:
        args: moe_perf's arguments (experts, hidden).
        bootstrap: ubnext's bootstrap (``rank``, ``size``, ``bcast_obj``).
        x: ``[T, H]`` tokens (CUDA); idx: ``[T, K]`` experts; w: ``[T, K]`` weights.
        ep: the ``nccl.ep`` module (None: imported; tests pass a fake).
        core: the ``nccl.core`` module (None: imported; tests pass a fake).
    """

    def __init__(self, args, bootstrap, x, idx, w, ep=None, core=None):
        import torch

        if ep is None:
            import nccl.core as core
            import nccl.ep as ep
        self.ep = ep
        n, rank = bootstrap.size, bootstrap.rank
        tokens, hidden = x.shape
        self.max_tokens = max(1, tokens)
        local = args.experts // n
        uid = bootstrap.bcast_obj(core.get_unique_id().as_bytes if rank == 0 else None)
        self.comm = core.Communicator.init(n, rank, core.UniqueId.from_bytes(bytearray(uid)))  # the current device
        self.group = ep.Group.create(self.comm, ep.GroupConfig(
            algorithm=ep.Algorithm.LOW_LATENCY, num_experts=args.experts,
            max_dispatch_tokens_per_rank=self.max_tokens, max_token_bytes=hidden * x.element_size()))
        self.x, self.idx, self.w = x, idx.to(torch.int64).contiguous(), w.to(torch.float32).contiguous()
        self.recv = x.new_zeros((local, n * self.max_tokens, hidden))
        self.counts = torch.zeros((local,), dtype=torch.int32, device=x.device)
        self.out = torch.empty_like(x)
        self.handle = self.group.create_handle(ep.Layout.EXPERT_MAJOR, ep.Tensor(self.idx),
                                               stream=_stream())
        self._dispatch = (ep.DispatchInputs(tokens=ep.Tensor(x)), ep.DispatchOutputs(tokens=ep.Tensor(self.recv)),
                          ep.LayoutInfo(expert_counters=ep.Tensor(self.counts)))
        self._combine_in: dict = {}
        self._combine_out = ep.CombineOutputs(tokens=ep.Tensor(self.out), topk_weights=ep.Tensor(self.w))

    def dispatch(self):
        inputs, outputs, info = self._dispatch
        self.handle.dispatch(inputs, outputs, layout_info=info, stream=_stream())
        return self.recv

    def combine(self, y):
        """``y``: the experts' outputs, ``recv``'s shape and dtype; returns ``out``."""
        key = (y.data_ptr(), tuple(y.shape), y.dtype)
        if key not in self._combine_in:  # a descriptor per buffer, not per call (eager timing)
            self._combine_in[key] = self.ep.CombineInputs(tokens=self.ep.Tensor(y))
        self.handle.combine(self._combine_in[key], self._combine_out, stream=_stream())
        return self.out
