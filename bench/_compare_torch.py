"""PyTorch's candidates in bench/compare.py: torch.distributed set up over the benchmark's
ranks and stream (:func:`torch_setup`), ``torch-nccl`` for every collective, and NCCL's
symmetric kernels (``nccl-symmetric``: torch's symmetric memory on its NCCL backend, kept
only where one profiled call runs an NCCL symmetric kernel) or, for the all-reduce without
them, torch's own symmetric-memory kernels (``torch-oneshot``, ``torch-twoshot``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench import _common as common
from bench import _compare_moves as moves
from bench import _torchbench as tb
from bench._torchbench import init_distributed


def torch_setup(bootstrap: Any, device: int, stream: Any, nccl_symmetric: bool = False) -> str | None:
    """torch.distributed (NCCL backend) initialized from the bootstrap (RANK, WORLD_SIZE;
    MASTER_ADDR 127.0.0.1 and a free port of rank 0 unless already set), torch's current
    stream made ``stream``, and with ``nccl_symmetric`` NCCL made torch's symmetric-memory
    backend. Collective; call :func:`keep_multicast_off` before torch is first imported.

    Returns:
        None where torch's symmetric memory runs on NCCL, else why not (the first rank's).
    """
    import torch

    init_distributed(bootstrap, device)
    torch.cuda.set_stream(torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", device)))
    # the same choice on every rank: the first rank's reason counts
    reason = tb.select_nccl_symmetric() if nccl_symmetric else "--nccl-symmetric 0"
    return next((r for r in bootstrap.allgather_obj(reason) if r), None)


def all_reduce_candidates(bootstrap: Any, device: int, dtype: common.DType, count: int, candidate,
                          reason: str | None) -> tuple[list, dict[str, str], list[str]]:
    """The all-reduce's PyTorch candidates over torch.distributed, after :func:`torch_setup`
    (``reason``: what it returned; ``candidate``: compare.Candidate). Collective.

    ``torch-nccl``; where torch's symmetric memory takes the NCCL backend, ``nccl-symmetric``
    where one profiled all-reduce on it runs an NCCL symmetric kernel; else
    ``torch-oneshot`` and ``torch-twoshot`` (torch's CUDA backend: one backend per process).

    Returns:
        The candidates, the names left out with their reasons, and the NCCL symmetric
        kernels the probe saw.
    """
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    tdtype = getattr(torch, dtype.ubnext)
    plain = torch.empty(count, dtype=tdtype, device=f"cuda:{device}")
    in_place = TorchEngine(lambda send, recv, op: dist.all_reduce(send))
    candidates = [candidate("torch-nccl", "in-place", plain, plain, in_place, refuses, ("sum",))]
    left_out: dict[str, str] = {}
    kernels: list[str] = []
    if reason is None:
        reason, kernels = tb.probe_nccl_symmetric(bootstrap, device, tdtype)
        if reason is None:
            buf = tb.symmetric_tensor(count, tdtype, device)
            candidates.append(candidate("nccl-symmetric", "in-place", buf, buf, in_place, refuses, ("sum",)))
        why = "torch's symmetric memory runs on its NCCL backend in this run; --nccl-symmetric 0 measures it"
        left_out.update({"torch-oneshot": why, "torch-twoshot": why})
    else:
        candidates += torch_symm_candidates(device, tdtype, count, group, candidate)
    if reason is not None:
        left_out["nccl-symmetric"] = reason
    return candidates, left_out, kernels


def torch_symm_candidates(device: int, tdtype: Any, count: int, group: str, candidate) -> list:
    """``torch-oneshot`` and ``torch-twoshot`` on torch's symmetric memory (CUDA backend). Collective."""
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    one_in = symm_mem.empty(count, dtype=tdtype, device=f"cuda:{device}")
    one_out = torch.empty(count, dtype=tdtype, device=f"cuda:{device}")
    two = symm_mem.empty(count, dtype=tdtype, device=f"cuda:{device}")
    for t in (one_in, two):
        symm_mem.rendezvous(t, group)
    ops = torch.ops.symm_mem
    one_shot = TorchEngine(lambda send, recv, op: ops.one_shot_all_reduce_out(send, op, group, out=recv))
    two_shot = TorchEngine(lambda send, recv, op: ops.two_shot_all_reduce_(send, op, group))
    return [
        candidate("torch-oneshot", "out-of-place", one_in, one_out, one_shot, refuses, ("sum",)),
        candidate("torch-twoshot", "in-place", two, two, two_shot, refuses, ("sum",)),
    ]


@dataclass(frozen=True)
class TorchEngine:
    """An engine over a ``torch.ops.symm_mem`` call ``fn(send, recv, op)``.

    The ops take no stream argument: they run on torch's current stream,
    which :func:`torch_setup` sets to the benchmark's stream.
    """

    fn: Any

    def all_reduce(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        self.fn(send, recv, op)


def refuses(exc: BaseException) -> bool:
    """torch reports unsupported sizes and dtypes as RuntimeError (NotImplementedError included)."""
    return isinstance(exc, RuntimeError)


def wanted(choice: str) -> bool:
    """Whether ``--torch`` (``auto``, ``0``, ``1``) asks for the PyTorch candidates; ``auto``:
    where torch's symmetric memory imports."""
    if choice != "auto":
        return choice == "1"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


class TorchMover:
    """torch.distributed's form of each mover on torch's current stream (compare sets it to
    the benchmark's stream); ``Collective.run`` calls the method of the collective."""

    def broadcast(self, send: Any, recv: Any, dtype: common.DType, root: int, stream: Any) -> None:
        import torch.distributed as dist

        dist.broadcast(recv, root)  # in place: the candidate's send is its recv

    def all_to_all(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        import torch.distributed as dist

        dist.all_to_all_single(recv, send)

    def sendrecv(self, send: Any, recv: Any, dtype: common.DType, op: str, stream: Any) -> None:
        import torch.distributed as dist

        rank, n = dist.get_rank(), dist.get_world_size()
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # the current stream waits; the host does not


def mover_candidates(bootstrap: Any, device: int, collective: str, dtype: common.DType, count: int,
                     candidate, symmetric_reason: str | None) -> tuple[list, dict[str, str], list[str]]:
    """``torch-nccl`` and, where torch's symmetric memory runs on its NCCL backend
    (``symmetric_reason`` None: compare selected it) and one profiled call of the mover on
    it runs an NCCL symmetric kernel, ``nccl-symmetric``. Collective; after compare has set
    torch.distributed up.

    Returns:
        The candidates, the names left out with their reasons, the symmetric kernels seen.
    """
    import torch

    tdtype = getattr(torch, dtype.ubnext)
    engine, coll = TorchMover(), moves.COLLECTIVES[collective]
    in_place = collective == "broadcast"  # dist.broadcast has no out-of-place form

    def tensors(make) -> tuple[Any, Any]:
        send, recv = moves.buffers(collective, dtype, count, bootstrap.size, make)
        return (recv, recv) if in_place else (send, recv)

    placement = "in-place" if in_place else "out-of-place"
    plain = tensors(lambda n: torch.empty(n, dtype=tdtype, device=f"cuda:{device}"))
    candidates = [candidate("torch-nccl", placement, *plain, engine, refuses, common.OPS)]
    left_out: dict[str, str] = {}
    kernels: list[str] = []
    reason = symmetric_reason
    if reason is None:
        symm = tensors(lambda n: tb.symmetric_tensor(n, tdtype, device).fill_(1))
        try:
            names = tb.kernel_names(lambda: coll.run(engine, symm[0], symm[1], dtype, "sum", None))
            reason = tb.symmetric_kernel_problem(names)
            kernels = [n for n in names if tb.SYMMETRIC_KERNEL.search(n)]
        except RuntimeError as exc:
            if "multicast" in str(exc):
                raise
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        reason = next((r for r in bootstrap.allgather_obj(reason) if r), None)
        if reason is None:
            candidates.append(candidate("nccl-symmetric", placement, *symm, engine, refuses, common.OPS))
        else:
            reason = f"no NCCL symmetric kernel for {coll.name}: {reason}"
    if reason is not None:
        left_out["nccl-symmetric"] = reason
    return candidates, left_out, kernels

