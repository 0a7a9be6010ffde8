"""The benchmarks of the collectives that move data without reducing it
(bench/broadcast_perf.py, bench/alltoall_perf.py, bench/sendrecv_perf.py): nccl-tests'
layouts and bus factors, run by the machinery of bench/all_reduce_perf.py (its flags,
table, check before timing, JSON). Every result is checked bit for bit (redop "none").
The ubnext backend runs ``comm.broadcast`` and ``comm.all_to_all`` (``--algo``: ``ll``,
the low-latency kernel; ``copy``, the pool's copy form; broadcast's ``scatter_allgather``;
``nccl``; ``auto``; the all-to-all also ``p2p``, the point-to-point kernel on the even
parts given as splits) and ``comm.batch_isend_irecv`` (``--algo``: ``ll``, the
point-to-point kernel; ``nccl``; ``auto``); ``--backend nccl`` runs ``ncclBroadcast`` and grouped
``ncclSend``/``ncclRecv`` (``ubnext._engine.nccl.NcclComm``) on the same kind of buffers.
"""

from __future__ import annotations

import numpy as np

from bench import _common as common
from bench._sliced_perf import script as script  # noqa: F401 (the scripts' entry)
from bench.all_reduce_perf import Program
from ubnext._protocol.algorithms import MOVER_SERVES, P2P_ALGORITHMS

#: root of the broadcast (nccl-tests' default ``-r 0``)
ROOT = 0


def broadcast_data(nranks: int, rank: int, count: int, seed: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s broadcast input and the root's, which every rank receives."""
    return common.make_input(rank, nranks, count, seed), common.make_input(ROOT, nranks, count, seed).astype(np.float64)


def all_to_all_data(nranks: int, rank: int, count: int, seed: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s all-to-all input (``count`` elements, part j for rank j) and what it
    receives: part ``rank`` of every rank's input, in rank order."""
    k = count // nranks
    parts = [common.make_input(r, nranks, count, seed)[rank * k:(rank + 1) * k] for r in range(nranks)]
    return common.make_input(rank, nranks, count, seed), np.concatenate(parts).astype(np.float64)


def sendrecv_data(nranks: int, rank: int, count: int, seed: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s input and what it receives: the previous rank's."""
    prev = (rank - 1) % nranks
    return common.make_input(rank, nranks, count, seed), common.make_input(prev, nranks, count, seed).astype(np.float64)


#: The broadcast, as nccl-tests' broadcast.cu describes it: busbw = algbw; in place when
#: the input is the output.
BROADCAST = common.Collective(
    name="Broadcast", count=lambda nbytes, itemsize, nranks: nbytes // itemsize, bus_factor=lambda nranks: 1.0,
    run=lambda engine, send, recv, dtype, op, stream: engine.broadcast(send, recv, dtype, ROOT, stream),
    data=broadcast_data, reduces=False, root=ROOT)
#: The all-to-all, as nccl-tests' alltoall.cu describes it: a size is one rank's whole
#: input (rounded down to a multiple of the world size), busbw = algbw * (n-1)/n; out of
#: place only (ubnext's all_to_all takes separate arrays).
ALL_TO_ALL = common.Collective(
    name="AlltoAll", count=lambda nbytes, itemsize, nranks: nbytes // itemsize // nranks * nranks,
    bus_factor=lambda nranks: (nranks - 1) / nranks,
    run=lambda engine, send, recv, dtype, op, stream: engine.all_to_all(send, recv, dtype, op, stream),
    data=all_to_all_data, reduces=False, has_in_place=False)
#: The send/recv ring, as nccl-tests' sendrecv.cu describes it: each rank sends its input
#: to the next rank and receives the previous one's, busbw = algbw; out of place only.
SENDRECV = common.Collective(
    name="SendRecv", count=lambda nbytes, itemsize, nranks: nbytes // itemsize, bus_factor=lambda nranks: 1.0,
    run=lambda engine, send, recv, dtype, op, stream: engine.sendrecv(send, recv, dtype, op, stream),
    data=sendrecv_data, reduces=False, has_in_place=False)

#: ``--algo``: ubnext's algorithms of each mover (``ubnext._protocol.algorithms.MOVER_SERVES``);
#: the all-to-all's also ``p2p`` (its even parts given as splits, which the point-to-point
#: kernel runs), the send/recv's those of ``P2P_ALGORITHMS``
BROADCAST_PERF = Program("broadcast_perf", BROADCAST, ("auto", *MOVER_SERVES["broadcast"]))
ALLTOALL_PERF = Program("alltoall_perf", ALL_TO_ALL, ("auto", *MOVER_SERVES["all_to_all"], "p2p"))
SENDRECV_PERF = Program("sendrecv_perf", SENDRECV, ("auto", *P2P_ALGORITHMS))
