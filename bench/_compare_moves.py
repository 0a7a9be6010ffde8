"""The data movers in bench/compare.py (``--collectives broadcast,all_to_all,sendrecv``):
their candidates beside the all-reduce's, in the same run, on the same communicators.

* ``ubnext-auto`` and ``ubnext-<name>`` for each algorithm of the mover
  (``ubnext._protocol.algorithms.MOVER_SERVES``: ``ll``, ``copy``, ``scatter_allgather``,
  ``nccl``; send/recv: ``auto``, a ring in one ``batch_isend_irecv``), out of place on plain
  cupy arrays, as ``python -m ubnext.tune --movers`` times them;
* ``nccl``: the real NCCL (``ncclBroadcast``, grouped ``ncclSend``/``ncclRecv``), out of place;
* when torch imports, torch's (bench/_compare_torch.py): ``torch-nccl`` (``dist.broadcast``
  in place, ``dist.all_to_all_single``, a ring of ``dist.batch_isend_irecv``), and
  ``nccl-symmetric``: the same calls on tensors of torch's symmetric memory with its NCCL
  backend (registered NCCL windows), kept only where one call profiled first runs an NCCL
  symmetric kernel (NCCL has symmetric kernels for some collectives only; elsewhere it is
  left out with the reason, as for the all-reduce).

Layouts, checks and bus factors: nccl-tests', as bench/_moves_perf.py describes them (root
0; a size is one rank's whole input for the all-to-all); every result is checked bit for bit.
"""

from __future__ import annotations

from typing import Any

from bench import _common as common
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
