"""The NCCL library as a collective engine (all-reduce, reduce-scatter, all-gather,
broadcast, reduce, and grouped sends and receives, of which the collectives CuPy's
binding lacks are composed: all-to-all, gather, scatter), through ``cupy.cuda.nccl``.

:class:`NcclComm` is what ``algorithm="nccl"`` runs and what the communicator
falls back to (several nodes, no P2P, a message the pool cannot hold). The
benchmarks also use it directly to measure NCCL on the same buffers as ubnext.

The NCCL communicator is created on first use, over a ubnext bootstrap: the
ranks compare their GPUs (NCCL serves one rank per GPU), rank 0 asks NCCL for a
unique id and broadcasts it, then every rank joins. That first
use is therefore collective and blocks the host (``ncclCommInitRank``); it must
not happen while a stream is being captured into a CUDA graph. Call
:meth:`NcclComm.connect` beforehand to choose when it happens.
"""

from __future__ import annotations

from typing import Any

from ubnext._engine.copies import copy
from ubnext._environment import devices as _devices
from ubnext._environment.install import load_nccl, nccl_problem
from ubnext._protocol.algorithms import DTYPES
from ubnext._protocol.errors import ClosedError, UbnextError

__all__ = ["NcclComm", "cannot_run"]

#: ncclBfloat16 and ncclAvg, for a cupy that does not name them.
_NCCL_BFLOAT16 = 9
_NCCL_AVG = 4


def cannot_run(local: Any, device: int) -> str | None:
    """Why NCCL cannot serve the ranks of ``local`` (a node's bootstrap), or None where it
    can: ranks sharing a GPU (NCCL refuses them), or a rank that cannot load NCCL. The
    same answer on every rank.

    Collective: yes, over ``local`` (one allgather). Blocks the host.
    """
    views = local.allgather_obj((_devices.device_uuid(device), nccl_problem()))
    clashes = _devices.shared([uuid for uuid, _ in views])
    if clashes:
        ranks = next(iter(clashes.values()))
        return f"local ranks {', '.join(map(str, ranks))} share one GPU, which NCCL refuses"
    failed = [(rank, problem) for rank, (_, problem) in enumerate(views) if problem]
    if failed:
        return f"local rank {failed[0][0]}: {failed[0][1]}"
    return None


def _tables(nccl: Any) -> tuple[dict[str, int], dict[str, int]]:
    """ubnext dtype and op names -> NCCL enum values."""
    dtypes = {
        "bfloat16": getattr(nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16),
        "float16": nccl.NCCL_FLOAT16,
        "float32": nccl.NCCL_FLOAT32,
        "float64": nccl.NCCL_FLOAT64,
        "int8": nccl.NCCL_INT8,
        "uint8": nccl.NCCL_UINT8,
        "int32": nccl.NCCL_INT32,
        "uint32": nccl.NCCL_UINT32,
        "int64": nccl.NCCL_INT64,
        "uint64": nccl.NCCL_UINT64,
    }
    ops = {
        "sum": nccl.NCCL_SUM,
        "avg": getattr(nccl, "NCCL_AVG", _NCCL_AVG),
        "max": nccl.NCCL_MAX,
        "min": nccl.NCCL_MIN,
    }
    return dtypes, ops


class NcclComm:
    """One NCCL communicator over the ranks of a ubnext bootstrap.

    Constructing it is local and cheap; the NCCL communicator is created by
    :meth:`connect` or by the first :meth:`all_reduce`, whichever comes first.

    Collective: no (construction); see :meth:`connect`.

    Args:
        bootstrap: a :class:`ubnext.bootstrap.Bootstrap`; it must stay open
            until the NCCL communicator exists. It is not owned.
        device: CUDA device ordinal this rank uses.
    """

    def __init__(self, bootstrap: Any, device: int) -> None:
        self._bootstrap = bootstrap
        self.device = int(device)
        self._comm: Any = None
        self._closed = False
        self._nccl: Any = None
        self._dtypes: dict[str, int] = {}
        self._ops: dict[str, int] = {}

    @property
    def rank(self) -> int:
        """This rank in the bootstrap (and in NCCL)."""
        return self._bootstrap.rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._bootstrap.size

    @property
    def connected(self) -> bool:
        """Whether the NCCL communicator exists."""
        return self._comm is not None

    def connect(self, op: str = "nccl.connect") -> None:
        """Create the NCCL communicator now; does nothing if it exists.

        Collective: yes, over the bootstrap, the first time. Blocks the host
        until every rank has joined. Not capturable in a CUDA graph. Runs with
        ``device``'s context current, where NCCL joins: a communicator calls it
        in its launch section (``_interop.streams.LaunchOrder``); the benchmarks
        with the communicator's device current.

        Args:
            op: operation name that starts error messages.

        Raises:
            ClosedError: :meth:`close` was called.
            UbnextError: NCCL is missing, several ranks use one GPU (on every
                rank, naming them), rank 0 could not make a unique id, or
                ``ncclCommInitRank`` failed.
        """
        if self._closed:
            raise ClosedError(f"{op}: the NCCL communicator is closed")
        if self._comm is not None:
            return
        nccl = self._module(op)
        self._refuse_shared_gpus(op)
        uid = self._unique_id(nccl, op)
        try:  # NCCL joins on the current device: the section's, the communicator's (no switch here)
            self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        except nccl.NcclError as exc:
            raise UbnextError(
                f"{op}: ncclCommInitRank failed on rank {self.rank} "
                f"(device {self.device}): {exc}"
            ) from exc

    def all_reduce(
        self,
        send_ptr: int,
        recv_ptr: int,
        count: int,
        dtype: str,
        op: str,
        stream_ptr: int,
    ) -> None:
        """Enqueue ``ncclAllReduce`` on a stream.

        In place when ``send_ptr == recv_ptr``. The first call creates the
        communicator (see :meth:`connect`).

        Collective: yes; every rank calls it with the same count, dtype and op.
        Does not block the host after the first call. Capturable in a CUDA
        graph once connected.

        Args:
            send_ptr: device address of ``count`` input elements.
            recv_ptr: device address of ``count`` output elements.
            count: number of elements (0 is allowed).
            dtype: a key of ``ubnext.DTYPES``.
            op: ``"sum"``, ``"avg"`` (floating-point dtypes), ``"max"`` or ``"min"``.
            stream_ptr: ``cudaStream_t`` handle as an int (0: legacy default).

        Raises:
            ValueError: unknown dtype or op, or a negative count.
            ClosedError: :meth:`close` was called.
            UbnextError: NCCL reported an error.
        """
        name = "nccl.all_reduce"
        nccl = self._check(name, dtype, op, count)
        if not self._one_rank_average(send_ptr, recv_ptr, count, dtype, op, stream_ptr):
            self._call(nccl, name, "allReduce", send_ptr, recv_ptr, count, dtype, op, stream_ptr)

    def reduce_scatter(self, send_ptr: int, recv_ptr: int, recv_count: int, dtype: str, op: str,
                       stream_ptr: int) -> None:
        """Enqueue ``ncclReduceScatter``: ``recv_count`` elements of the reduction of
        ``size * recv_count`` input elements, rank r's the r-th ``recv_count``.

        In place when ``recv_ptr == send_ptr + rank * recv_count`` elements. Collective,
        capturable and raising as :meth:`all_reduce`.
        """
        name = "nccl.reduce_scatter"
        nccl = self._check(name, dtype, op, recv_count)
        if not self._one_rank_average(send_ptr, recv_ptr, recv_count, dtype, op, stream_ptr):
            self._call(nccl, name, "reduceScatter", send_ptr, recv_ptr, recv_count, dtype, op, stream_ptr)

    def all_gather(self, send_ptr: int, recv_ptr: int, send_count: int, dtype: str, stream_ptr: int) -> None:
        """Enqueue ``ncclAllGather``: every rank's ``send_count`` elements, rank r's at
        element ``r * send_count`` of ``recv_ptr``.

        In place when ``send_ptr == recv_ptr + rank * send_count`` elements. Collective,
        capturable and raising as :meth:`all_reduce`.
        """
        name = "nccl.all_gather"
        nccl = self._check(name, dtype, None, send_count)
        self._call(nccl, name, "allGather", send_ptr, recv_ptr, send_count, dtype, None, stream_ptr)

    # -- the rest of NCCL's set: rooted calls, and sends and receives in one group ------
    def broadcast(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, root: int, stream_ptr: int) -> None:
        """Enqueue ``ncclBroadcast``: root's ``count`` elements at ``send_ptr`` into
        ``recv_ptr`` on every rank (``send_ptr`` is read on the root only; in place when the
        two are equal). Collective, capturable and raising as :meth:`all_reduce`."""
        name = "nccl.broadcast"
        nccl = self._check(name, dtype, None, count)
        self._check_rank(name, root, "root")
        self._invoke(nccl, name, "broadcast", send_ptr, recv_ptr, count, self._dtypes[dtype], root, stream_ptr)

    def reduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, op: str, root: int,
               stream_ptr: int) -> None:
        """Enqueue ``ncclReduce``: the reduction of every rank's ``count`` elements into
        ``recv_ptr`` on the root (written there only). Collective, capturable and raising as
        :meth:`all_reduce`."""
        name = "nccl.reduce"
        nccl = self._check(name, dtype, op, count)
        self._check_rank(name, root, "root")
        if self.rank == root and self._one_rank_average(send_ptr, recv_ptr, count, dtype, op, stream_ptr):
            return
        self._invoke(nccl, name, "reduce", send_ptr, recv_ptr, count, self._dtypes[dtype], self._ops[op], root,
                     stream_ptr)

    def exchange(self, sends: list, recvs: list, stream_ptr: int, name: str = "nccl.exchange") -> None:
        """Enqueue ``ncclSend`` and ``ncclRecv`` calls of bytes as one group
        (``ncclGroupStart`` ... ``ncclGroupEnd``): NCCL runs them together, so their order
        within the group does not matter and none waits for another. What they move is
        bytes (``ncclUint8``): every dtype alike.

        Matching rule (NCCL's): between two ranks a and b, the k-th send of a to b matches
        the k-th receive of b from a (over a's and b's groups and single calls in issue
        order), with the same byte count; a rank may send to and receive from itself within
        one group.

        Collective: no, between the pairs named (but the first NCCL call of the
        communicator connects it, collectively: :meth:`connect`). Capturable as
        :meth:`all_reduce`.

        Args:
            sends: ``(ptr, nbytes, peer)`` triples.
            recvs: ``(ptr, nbytes, peer)`` triples.
            stream_ptr: as for :meth:`all_reduce`.
            name: the operation that starts error messages.

        Raises:
            ValueError: a negative byte count or a peer out of range.
            ClosedError, UbnextError: as :meth:`all_reduce`.
        """
        nccl = self._module(name)
        for _, nbytes, peer in (*sends, *recvs):
            self._check(name, "uint8", None, nbytes)
            self._check_rank(name, peer, "peer")
        self.connect(name)
        code = self._dtypes["uint8"]
        try:
            nccl.groupStart()
            try:
                for ptr, nbytes, peer in sends:
                    self._comm.send(ptr, nbytes, code, peer, stream_ptr)
                for ptr, nbytes, peer in recvs:
                    self._comm.recv(ptr, nbytes, code, peer, stream_ptr)
            finally:
                nccl.groupEnd()
        except nccl.NcclError as exc:
            raise UbnextError(f"{name}: {exc}") from exc

    def close(self) -> None:
        """Destroy the NCCL communicator; idempotent.

        ``ncclCommDestroy`` waits for this rank's outstanding NCCL work and
        may wait for the other ranks of the node: call it on every rank.

        Collective: yes (in practice, see above). Blocks the host.
        """
        self._closed = True
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()

    def abort(self) -> None:
        """Abort the NCCL communicator (``ncclCommAbort``): local, waits for no rank;
        idempotent."""
        self._closed = True
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def __enter__(self) -> NcclComm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._comm is not None else "lazy")
        return f"<NcclComm rank={self.rank} size={self.size} device={self.device} {state}>"

    def _check(self, name: str, dtype: str, op: str | None, count: int) -> Any:
        """``cupy.cuda.nccl`` once the arguments are checked (``op`` None: a collective
        without a reduction)."""
        nccl = self._module(name)
        if dtype not in self._dtypes:
            raise ValueError(f"{name}: unsupported dtype {dtype!r}; expected one of {sorted(self._dtypes)}")
        if op is not None and op not in self._ops:
            raise ValueError(f"{name}: unsupported op {op!r}; expected one of {sorted(self._ops)}")
        if count < 0:
            raise ValueError(f"{name}: count must be >= 0, got {count}")
        return nccl

    def _one_rank_average(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, op: str,
                          stream_ptr: int) -> bool:
        """Whether the call is an average over one rank, done here as a copy of the input:
        NCCL before 2.29.7 leaves the last count % blocks elements of a one-rank average
        unwritten (NVIDIA/nccl#1950)."""
        if self.size != 1 or op != "avg":
            return False
        if send_ptr != recv_ptr and count:
            copy(recv_ptr, send_ptr, count * DTYPES[dtype][1], stream_ptr)
        return True

    def _call(self, nccl: Any, name: str, call: str, send_ptr: int, recv_ptr: int, count: int, dtype: str,
              op: str | None, stream_ptr: int) -> None:
        """Connects on first use, then calls cupy's ``call``."""
        ops = () if op is None else (self._ops[op],)
        self._invoke(nccl, name, call, send_ptr, recv_ptr, count, self._dtypes[dtype], *ops, stream_ptr)

    def _invoke(self, nccl: Any, name: str, call: str, *args: Any) -> None:
        """Connects on first use, then calls cupy's ``call`` with ``args``."""
        self.connect(name)
        try:
            getattr(self._comm, call)(*args)
        except nccl.NcclError as exc:
            raise UbnextError(f"{name}: {exc}") from exc

    def _check_rank(self, name: str, rank: int, what: str) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"{name}: {what} {rank} is not a rank of {self.size}")

    def _module(self, op: str) -> Any:
        """``cupy.cuda.nccl``, loaded once, with the name tables built from it."""
        if self._closed:
            raise ClosedError(f"{op}: the NCCL communicator is closed")
        if self._nccl is None:
            nccl = load_nccl(op)
            self._dtypes, self._ops = _tables(nccl)
            self._nccl = nccl
        return self._nccl

    def _refuse_shared_gpus(self, op: str) -> None:
        """Raise on every rank where ranks share a GPU, which NCCL cannot serve
        (``ncclCommInitRank`` would fail with "invalid usage"). UUIDs are unique
        across nodes, so the whole world is compared at once."""
        clashes = _devices.shared(self._bootstrap.allgather_obj(_devices.device_uuid(self.device)))
        if clashes:
            uuid, ranks = next(iter(clashes.items()))
            raise UbnextError(
                f"{op}: NCCL cannot serve several ranks on one GPU (ranks {', '.join(map(str, ranks))} use "
                f"{uuid}); give each rank its own GPU, or keep to ubnext's kernels (an algorithm other than nccl)"
            )

    def _unique_id(self, nccl: Any, op: str) -> bytes:
        """Rank 0's NCCL unique id, on every rank (empty payload = rank 0 failed)."""
        if self.rank != 0:
            uid = self._bootstrap.bcast(None, 0)
            if not uid:
                raise UbnextError(f"{op}: rank 0 could not create an NCCL unique id")
            return uid
        try:
            uid = nccl.get_unique_id()  # bytes since cupy 14
        except nccl.NcclError as exc:
            self._bootstrap.bcast(b"", 0)
            raise UbnextError(f"{op}: ncclGetUniqueId failed: {exc}") from exc
        return self._bootstrap.bcast(uid, 0)
