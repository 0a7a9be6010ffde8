"""The bootstrap interface: rank discovery and out-of-band byte exchange.

A bootstrap is the slow, host-side channel ubnext uses while setting up a
communicator (exchanging node ids, tokens, handles). It is never on the data
path. Implementations provide four things — ``rank``, ``size``,
``allgather(bytes)`` and ``barrier()`` — and inherit the rest.

All collective methods must be called by every rank of the bootstrap, in the
same order, like MPI collectives.
"""

from __future__ import annotations

import abc
import pickle
import socket
from collections.abc import Sequence
from typing import Any

from ubnext._protocol.errors import ClosedError

__all__ = ["Bootstrap", "SelfBootstrap", "node_id"]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def node_id() -> bytes:
    """Identify this machine: hostname plus the kernel boot id.

    Two processes get the same id only if they run under the same kernel boot
    with the same hostname, which is what sharing GPUs over NVLink requires.

    Collective: no.
    Graph-capturable: yes (host only: reads the hostname and the boot id).

    Returns:
        The id as bytes (``hostname`` alone where the boot id is unreadable).

    Raises:
        Nothing.
    """
    try:
        with open(_BOOT_ID_PATH, "rb") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = b""
    return socket.gethostname().encode() + b"/" + boot_id


class Bootstrap(abc.ABC):
    """Out-of-band exchange between the ranks of one job.

    Subclasses implement :attr:`rank`, :attr:`size`, :meth:`allgather` and
    :meth:`barrier`, and may override :meth:`bcast`, :meth:`split_local` and
    :meth:`_close` with something faster or resource-owning.

    A bootstrap is a context manager; leaving the ``with`` block calls
    :meth:`close`. An abstract class: construct one of its implementations.
    """

    _closed = False

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank, in ``[0, size)``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks."""

    @abc.abstractmethod
    def allgather(self, data: bytes) -> list[bytes]:
        """Gather one byte string from every rank.

        Collective: yes. Blocks the host until every rank has contributed.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Args:
            data: this rank's contribution (may differ in length per rank).

        Returns:
            A list of ``size`` byte strings, element ``r`` from rank ``r``.

        Raises:
            ClosedError: the bootstrap is closed.
            TypeError: ``data`` is not bytes.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has called ``barrier``.

        Collective: yes. Blocks the host.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Raises:
            ClosedError: the bootstrap is closed.
        """

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def bcast(self, data: bytes | None, root: int = 0) -> bytes:
        """Broadcast a byte string from ``root`` to every rank.

        The default implementation is an :meth:`allgather` in which only the
        root contributes data.

        Collective: yes. Blocks the host.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Args:
            data: the payload on ``root``; ignored (may be None) elsewhere.
            root: the sending rank.

        Returns:
            The root's payload, on every rank.

        Raises:
            ClosedError: the bootstrap is closed.
            ValueError: ``root`` is out of range.
            TypeError: ``data`` is not bytes on the root.
        """
        self._check_root("bootstrap.bcast", root)
        if self.rank == root:
            _check_bytes("bootstrap.bcast", data)
        return self.allgather(data if self.rank == root else b"")[root]

    def allgather_obj(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank.

        Only use it between the ranks of one job: unpickling runs code chosen by
        the sender.

        Collective: yes. Blocks the host.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Args:
            obj: this rank's object.

        Returns:
            A list of ``size`` objects, element ``r`` from rank ``r``.

        Raises:
            ClosedError: the bootstrap is closed.
        """
        return [pickle.loads(b) for b in self.allgather(pickle.dumps(obj))]

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root`` (see :meth:`allgather_obj`).

        Collective: yes. Blocks the host.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Args:
            obj: the object on ``root``; ignored elsewhere.
            root: the sending rank.

        Returns:
            The root's object, on every rank.

        Raises:
            ClosedError: the bootstrap is closed.
            ValueError: ``root`` is out of range.
        """
        payload = pickle.dumps(obj) if self.rank == root else None
        return pickle.loads(self.bcast(payload, root))

    def split_local(self) -> Bootstrap:
        """Return a bootstrap over the ranks that share this node.

        The default groups ranks by :func:`node_id` (gathered with
        :meth:`allgather`) and returns a view whose collectives run on this
        bootstrap: every rank of *this* bootstrap must take part in each of
        the view's collectives (each node through its own view), in the same
        order. Local ranks follow the order of the ranks here.

        The caller owns the result and closes it; closing it leaves this
        bootstrap open.

        Collective: yes. Blocks the host.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Returns:
            A bootstrap whose ``rank``/``size`` are the local rank and the
            number of ranks on this node.

        Raises:
            ClosedError: the bootstrap is closed.
        """
        ids = self.allgather(node_id())
        mine = ids[self.rank]
        return _SubsetBootstrap(self, [r for r, i in enumerate(ids) if i == mine])

    def close(self) -> None:
        """Release what this bootstrap owns; idempotent.

        Collective: yes where the implementation's release waits for the other ranks
        (MPIBootstrap frees its MPI communicators, StoreBootstrap waits for every rank to
        leave the store); SelfBootstrap's and TorchBootstrap's are local.
        Graph-capturable: no.

        Raises:
            What the implementation's release raises: UbnextError for a store that fails
            (StoreBootstrap), MPI's errors (MPIBootstrap).
        """
        if self._closed:
            return
        self._closed = True
        self._close()

    def _close(self) -> None:
        """Release owned resources; called once by :meth:`close`."""

    def abort(self) -> None:
        """Release what this rank holds without waiting for any other rank; idempotent.

        Collective: no. For error paths, where a peer may be dead
        (``Communicator.abort``, closing a broken communicator).
        Graph-capturable: no.

        Raises:
            What TorchBootstrap's destruction of a group it created raises; the other
            implementations only drop their handles.
        """
        if self._closed:
            return
        self._closed = True
        self._abort()

    def _abort(self) -> None:
        """Local release; called once by :meth:`abort`. By default what :meth:`_close`
        does; a bootstrap whose close waits for the other ranks overrides it."""
        self._close()

    def __enter__(self) -> Bootstrap:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"rank={self.rank} size={self.size}"
        return f"<{type(self).__name__} {state}>"

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ClosedError(f"{op}: the bootstrap is closed")

    def _check_root(self, op: str, root: int) -> None:
        self._check_open(op)
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"{op}: root {root!r} is not a rank in [0, {self.size})")


def _check_bytes(op: str, data: object) -> None:
    if not isinstance(data, bytes):
        raise TypeError(f"{op}: expected bytes, got {type(data).__name__}")


class SelfBootstrap(Bootstrap):
    """A bootstrap of one rank, without MPI (single-process use and tests).

    Collective: no (one rank).
    Graph-capturable: yes (host only).

    Raises:
        Nothing.
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def allgather(self, data: bytes) -> list[bytes]:  # Bootstrap.allgather of one rank
        self._check_open("bootstrap.allgather")
        _check_bytes("bootstrap.allgather", data)
        return [data]

    def barrier(self) -> None:  # Bootstrap.barrier of one rank: nothing to wait for
        self._check_open("bootstrap.barrier")


class _SubsetBootstrap(Bootstrap):
    """A view of some ranks of a parent bootstrap.

    Each collective is carried out on the parent, so *every parent rank* must
    call it, each through its own view (ranks of other nodes through theirs),
    in the same order. Closing the view does not close the parent.

    Args:
        parent: the bootstrap the collectives run on.
        ranks: the parent ranks in this view, ascending; must include
            ``parent.rank``.

    Raises:
        ValueError: ``ranks`` is not ascending, or misses this rank.
    """

    def __init__(self, parent: Bootstrap, ranks: Sequence[int]) -> None:
        ranks = list(ranks)
        if ranks != sorted(set(ranks)) or parent.rank not in ranks:
            raise ValueError(
                f"bootstrap.split: ranks {ranks} must be ascending, unique and "
                f"include this rank {parent.rank}"
            )
        self._parent = parent
        self._ranks = ranks
        self._rank = ranks.index(parent.rank)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def parent_ranks(self) -> list[int]:
        """The parent ranks in this view; local rank ``i`` is ``parent_ranks[i]``."""
        return list(self._ranks)

    def allgather(self, data: bytes) -> list[bytes]:
        """See :meth:`Bootstrap.allgather`; runs on the parent (every parent rank)."""
        self._check_open("bootstrap.allgather")
        _check_bytes("bootstrap.allgather", data)
        everything = self._parent.allgather(data)
        return [everything[r] for r in self._ranks]

    def barrier(self) -> None:
        """See :meth:`Bootstrap.barrier`; runs on the parent (every parent rank)."""
        self._check_open("bootstrap.barrier")
        self._parent.barrier()
