"""The data movers in bench/compare.py (``--collectives broadcast,all_to_all,sendrecv``):
their candidates beside the all-reduce's, in the same run, on the same communicators.

* ``ubnext-auto`` and ``ubnext-<name>`` for each algorithm of the mover
  (``ubnext._protocol.algorithms.MOVER_SERVES``: ``ll``, ``copy``, ``scatter_allgather``,
  ``nccl``; send/recv: ``auto``, a ring in one ``batch_isend_irecv``), out of place on plain
  cupy arrays, as ``python -m ubnext.tune --movers`` times them;
* ``nccl``: the real NCCL (``ncclBroadcast``, grouped ``ncclSend``/``ncclRecv``), out of place;
* when torch imports: ``torch-nccl`` (``dist.broadcast`` in place, ``dist.all_to_all_single``,
  a ring of ``dist.batch_isend_irecv``), and ``nccl-symmetric``: the same calls on tensors
  of torch's symmetric memory with its NCCL backend (registered NCCL windows), kept only
  where one call profiled first runs an NCCL symmetric kernel (NCCL has symmetric kernels
  for some collectives only; elsewhere it is left out with the reason, as for the
  all-reduce).

Layouts, checks and bus factors: nccl-tests', as bench/_moves_perf.py describes them (root
0; a size is one rank's whole input for the all-to-all); every result is checked bit for bit.
"""

from __future__ import annotations

from typing import Any

from bench import _common as common
from bench import _torchbench as tb
from bench._moves_perf import ALL_TO_ALL, BROADCAST, SENDRECV
from bench.all_reduce_perf import NcclEngine, UbnextEngine
from ubnext._protocol.algorithms import MOVER_SERVES

#: compare's name of each mover -> its benchmark record
COLLECTIVES = {"broadcast": BROADCAST, "all_to_all": ALL_TO_ALL, "sendrecv": SENDRECV}
#: compare's name -> the algorithms ubnext's call takes (send/recv's batch takes none yet)
ALGORITHMS = {"broadcast": ("auto", *MOVER_SERVES["broadcast"]), "all_to_all": ("auto", *MOVER_SERVES["all_to_all"]),
              "sendrecv": ("auto",)}


def buffers(collective: str, dtype: common.DType, count: int, nranks: int, make) -> tuple[Any, Any]:
    """A send and a receive buffer of ``collective`` for ``count`` elements, by ``make(n)``."""
    send, recv = COLLECTIVES[collective].buffers(count, nranks)
    return make(send), make(recv)


def ubnext_candidates(comm: Any, collective: str, dtype: common.DType, count: int, candidate, refuses) -> list:
    """``ubnext-auto`` and ``ubnext-<name>`` per algorithm of the mover, out of place on plain
    cupy arrays shared by them (``candidate``: compare.Candidate; ``refuses``: ubnext's)."""
    import cupy

    send, recv = buffers(collective, dtype, count, comm.size, lambda n: cupy.empty((n,), dtype=dtype.numpy))
    return [candidate(f"ubnext-{algo}", "out-of-place", send, recv, UbnextEngine(comm, algo), refuses)
            for algo in ALGORITHMS[collective]]


def nccl_candidate(nccl: Any, collective: str, dtype: common.DType, count: int, candidate):
    """The real NCCL, out of place on plain cupy memory."""
    import cupy

    send, recv = buffers(collective, dtype, count, nccl.size, lambda n: cupy.empty((n,), dtype=dtype.numpy))
    return candidate("nccl", "out-of-place", send, recv, NcclEngine(nccl), lambda exc: isinstance(exc, ValueError))


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


def torch_candidates(bootstrap: Any, device: int, collective: str, dtype: common.DType, count: int,
                     candidate, refuses, symmetric_reason: str | None) -> tuple[list, dict[str, str], list[str]]:
    """``torch-nccl`` and, where torch's symmetric memory runs on its NCCL backend
    (``symmetric_reason`` None: compare selected it) and one profiled call of the mover on
    it runs an NCCL symmetric kernel, ``nccl-symmetric``. Collective; after compare has set
    torch.distributed up.

    Returns:
        The candidates, the names left out with their reasons, the symmetric kernels seen.
    """
    import torch

    tdtype = getattr(torch, dtype.ubnext)
    engine, coll = TorchMover(), COLLECTIVES[collective]
    in_place = collective == "broadcast"  # dist.broadcast has no out-of-place form

    def tensors(make) -> tuple[Any, Any]:
        send, recv = buffers(collective, dtype, count, bootstrap.size, make)
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

