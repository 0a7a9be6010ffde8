"""Bootstrap over an mpi4py communicator (the default)."""

from __future__ import annotations

from typing import Any

from ubnext._protocol.errors import UbnextError

from ._base import Bootstrap, _check_bytes

__all__ = ["MPIBootstrap"]


def _import_mpi() -> Any:
    """``mpi4py.MPI`` (importing it initializes MPI), or one line naming what is missing."""
    try:
        import mpi4py  # noqa: F401 - tells a missing mpi4py from a missing MPI library
    except ImportError as exc:
        raise UbnextError(
            "bootstrap.mpi: mpi4py is not importable "
            f"({exc}); install mpi4py and an MPI library (pip install mpi4py mpich), or pass another bootstrap"
        ) from exc
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:  # mpi4py 4 raises RuntimeError without libmpi
        raise UbnextError(
            f"bootstrap.mpi: mpi4py cannot load an MPI library ({exc}); install one (pip install mpich, "
            "or the system's MPI and its mpiexec), or pass another bootstrap"
        ) from exc
    return MPI


class MPIBootstrap(Bootstrap):
    """A bootstrap over an mpi4py communicator.

    The given communicator is duplicated (``Dup``) so that ubnext's traffic
    never matches the application's messages; the duplicate is owned and freed
    by :meth:`close`, as is any communicator :meth:`split_local` creates.

    Collective: yes (construction duplicates the communicator).
    Graph-capturable: no (a blocking host exchange).

    Args:
        comm: any intracommunicator; ``MPI.COMM_WORLD`` when None.

    Raises:
        UbnextError: mpi4py cannot be imported.
    """

    def __init__(self, comm: Any = None) -> None:
        MPI = _import_mpi()
        self._MPI = MPI
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        self._children: list[MPIBootstrap] = []

    @classmethod
    def _adopt(cls, comm: Any, MPI: Any) -> MPIBootstrap:
        """Wrap a communicator this module created, taking ownership of it."""
        self = cls.__new__(cls)
        self._MPI = MPI
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._children = []
        return self

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def comm(self) -> Any:
        """The (owned, duplicated) mpi4py communicator."""
        self._check_open("bootstrap.comm")
        return self._comm

    def allgather(self, data: bytes) -> list[bytes]:  # Bootstrap.allgather by MPI_Allgather
        self._check_open("bootstrap.allgather")
        _check_bytes("bootstrap.allgather", data)
        return self._comm.allgather(data)

    def barrier(self) -> None:  # Bootstrap.barrier by MPI_Barrier
        self._check_open("bootstrap.barrier")
        self._comm.Barrier()

    def bcast(self, data: bytes | None, root: int = 0) -> bytes:  # Bootstrap.bcast by MPI_Bcast
        self._check_root("bootstrap.bcast", root)
        if self._rank == root:
            _check_bytes("bootstrap.bcast", data)
        return self._comm.bcast(data if self._rank == root else None, root=root)

    def split_local(self) -> MPIBootstrap:
        """Ranks on this node, from ``Split_type(COMM_TYPE_SHARED)``.

        Local ranks follow the order of the ranks here (``key=rank``). The
        new communicator is freed when the returned bootstrap is closed, or
        when this one is.

        Collective: yes. Blocks the host.
        Graph-capturable: no (a blocking host exchange; nothing of it is captured).

        Returns:
            An :class:`MPIBootstrap` over this node's ranks.

        Raises:
            ClosedError: the bootstrap is closed.
        """
        self._check_open("bootstrap.split_local")
        local = self._comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self._rank)
        child = MPIBootstrap._adopt(local, self._MPI)
        self._children.append(child)
        return child

    def _close(self) -> None:
        """Free the owned communicators (collective over each of them).

        Skipped once MPI is finalized, when freeing is no longer allowed.
        """
        children, self._children = self._children, []
        comm, self._comm = self._comm, None
        for child in children:
            child.close()
        if not self._MPI.Is_finalized():
            comm.Free()

    def _abort(self) -> None:
        """Drops the communicators without freeing them: ``MPI_Comm_free`` is collective
        (it may wait for a rank that never calls it); MPI reclaims them at finalize."""
        children, self._children = self._children, []
        for child in children:
            child.abort()
        self._comm = None

    def close(self) -> None:
        """Free this bootstrap's communicator and those of its
        :meth:`split_local` children; idempotent.

        Collective: yes (``MPI_Comm_free`` on each owned communicator), over
        the ranks of this bootstrap.
        Graph-capturable: no.

        Raises:
            MPI's errors (``mpi4py.MPI.Exception``) where freeing a communicator fails.
        """
        super().close()
