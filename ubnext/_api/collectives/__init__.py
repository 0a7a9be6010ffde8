"""The Communicator's collectives, each in its module with its validation, selection and
launch: ``all_reduce``, ``all_reduce_add_rmsnorm``, ``reduce_scatter``, ``all_gather``,
``reduce_scatter_add_rmsnorm`` (ubnext's kernels), and NCCL's set beyond the reductions:
``broadcast``, ``reduce``, ``all_to_all``,
``send_recv`` (send, recv, batch_isend_irecv), ``gather``, ``scatter``, ``barrier``;
``rung``: what they share (the NCCL rung that serves them where no ubnext kernel does,
the checks of root and peer ranks); ``pool_copy``: the pool's copy form of the data
movers (broadcast, even all-to-all, gather, scatter); ``p2p``: the pool's point-to-point
kernel (send/recv, batches, uneven all-to-all).

Each module holds one base class of the Communicator (as ``_api.calls.CallSteps``):
its public method runs on the state the Communicator's constructor sets, inside the
call's launch section. Imports: the layers below ``_api``.
"""

from ubnext._api.collectives.all_gather import AllGather
from ubnext._api.collectives.all_reduce import AllReduce
from ubnext._api.collectives.all_reduce_add_rmsnorm import AllReduceAddRmsnorm
from ubnext._api.collectives.all_to_all import AllToAll
from ubnext._api.collectives.barrier import Barrier
from ubnext._api.collectives.broadcast import Broadcast
from ubnext._api.collectives.gather import Gather
from ubnext._api.collectives.reduce import Reduce
from ubnext._api.collectives.reduce_scatter import ReduceScatter
from ubnext._api.collectives.reduce_scatter_add_rmsnorm import ReduceScatterAddRmsnorm
from ubnext._api.collectives.scatter import Scatter
from ubnext._api.collectives.send_recv import SendRecv

__all__ = ["AllGather", "AllReduce", "AllReduceAddRmsnorm", "AllToAll", "Barrier", "Broadcast", "Gather", "Reduce",
           "ReduceScatter", "ReduceScatterAddRmsnorm", "Scatter", "SendRecv"]
