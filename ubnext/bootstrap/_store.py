"""Bootstrap over a ``torch.distributed`` key-value store (TCPStore and others).

This is what torchrun-style launches get: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` name a TCPStore, the same one
``torch.distributed.init_process_group()`` meets at. :meth:`StoreBootstrap.connect`
reaches it exactly as ``init_process_group`` does: under torchrun's agent
(``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the agent's
store; otherwise rank 0 hosts it as a *multi-tenant* server, which a later
``init_process_group`` in the same process shares instead of failing to bind
the port. Either way the program may call ``init_process_group`` before or
after creating a communicator, or never.

Every key lives under a prefix unique to this bootstrap (a per-process serial
number, identical on every rank because bootstraps are created collectively,
plus torchrun's restart count), so nothing collides with torch's own keys or
with a restarted worker group's leftovers. Keys are deleted once every rank has
read them.

torch is imported only when a bootstrap of this kind is created.
"""

from __future__ import annotations

import contextlib
import itertools
from datetime import timedelta
from typing import Any

from ubnext._protocol.errors import UbnextError

from ._base import Bootstrap, _check_bytes

__all__ = ["StoreBootstrap"]

#: Seconds a store operation waits for the other ranks (torch's own default).
STORE_TIMEOUT_S = 300.0

# Serial number of the bootstraps this process created over stores; every rank
# creates them in the same order (creation is collective), so the numbers agree.
_serial = itertools.count()


def _import_dist(op: str) -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise UbnextError(
            f"{op}: torch is not importable ({exc}); a TCPStore bootstrap needs it: "
            'install torch (pip install "ubnext[torch]"), or launch with mpirun'
        ) from exc
    return dist


class StoreBootstrap(Bootstrap):
    """A bootstrap over a ``torch.distributed.Store``.

    Exchanges are keys under ``prefix``: :meth:`allgather` sets this
    rank's key and reads everyone's; the last reader deletes them. The store
    is held, not closed: a TCPStore server hosted by this process stops when
    its last holder lets go, which :meth:`close` delays until every rank is
    done with it.

    Collective: no (construction only wraps the store).
    Graph-capturable: yes (host only: nothing is exchanged yet).

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (TCPStore,
            FileStore, ...), or anything with its ``set``, ``multi_get``,
            ``add``, ``wait`` and ``delete_key``.
        rank: this rank, in ``[0, size)``.
        size: number of ranks.
        prefix: key prefix; must be the same on every rank and unused by others.

    Raises:
        ValueError: ``rank`` is not in ``[0, size)``.
    """

    def __init__(self, store: Any, rank: int, size: int, prefix: str = "ubnext") -> None:
        if not 0 <= rank < size:
            raise ValueError(f"bootstrap.store: rank {rank} is not in [0, {size})")
        self._store = store
        self._prefix = prefix
        self._where = f"the store (keys {prefix}/...)"
        self._rank, self._size = rank, size
        self._seq = 0

    @classmethod
    def connect(cls, host: str, port: int, rank: int, size: int, *, agent_store: bool = False,
                attempt: str = "0", timeout_s: float = STORE_TIMEOUT_S) -> StoreBootstrap:
        """Reach the TCPStore at ``host:port`` as ``init_process_group`` would.

        Collective: yes (every rank connects; each blocks until the store
        answers, up to ``timeout_s``).
        Graph-capturable: no (a blocking host exchange).

        Args:
            host, port: ``MASTER_ADDR`` and ``MASTER_PORT``.
            rank, size: ``RANK`` and ``WORLD_SIZE``.
            agent_store: torchrun's agent hosts the store
                (``TORCHELASTIC_USE_AGENT_STORE=True``); otherwise rank 0 hosts it.
            attempt: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``),
                part of the key prefix, since an agent's store outlives a
                restarted worker group.
            timeout_s: how long connecting and each exchange wait for the others.

        Returns:
            A new bootstrap; the caller owns it and closes it (collectively).

        Raises:
            UbnextError: torch is not importable, or the store cannot be
                reached or hosted (the message names host and port).
        """
        op = "bootstrap.store"
        dist = _import_dist(op)
        hosting = rank == 0 and not agent_store
        try:
            store = dist.TCPStore(host, port, is_master=hosting, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False, multi_tenant=True)
        except Exception as exc:  # torch raises RuntimeError/DistError subclasses
            role = "host" if hosting else "reach"
            raise UbnextError(
                f"{op}: rank {rank} cannot {role} the TCPStore at {host}:{port} ({exc}); "
                f"check MASTER_ADDR/MASTER_PORT (rank 0 hosts it unless torchrun's agent does)"
            ) from exc
        boot = cls(store, rank, size, prefix=f"ubnext/{attempt}/{next(_serial)}")
        boot._where = f"the TCPStore at {host}:{port}"
        return boot

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, data: bytes) -> list[bytes]:  # Bootstrap.allgather: one key per rank
        op = "bootstrap.allgather"
        self._check_open(op)
        _check_bytes(op, data)
        key = f"{self._prefix}/ag{self._seq}"
        self._seq += 1
        names = [f"{key}/{r}" for r in range(self._size)]
        with self._errors(op):
            self._store.set(names[self._rank], data)
            values = [bytes(v) for v in self._store.multi_get(names)]  # waits for every key
            if self._store.add(f"{key}/read", 1) == self._size:  # last reader cleans up
                for name in (*names, f"{key}/read"):
                    self._store.delete_key(name)
        return values

    def barrier(self) -> None:  # Bootstrap.barrier: an empty allgather
        self._check_open("bootstrap.barrier")
        self.allgather(b"")

    def _close(self) -> None:
        """Leave the store once every rank has: rank 0 (the host, unless an agent
        is) waits for the others, so its server outlives their last exchange."""
        closed, everyone = f"{self._prefix}/closed", f"{self._prefix}/all-closed"
        with self._errors("bootstrap.close"):
            if self._store.add(closed, 1) == self._size:
                self._store.set(everyone, b"")
            if self._rank == 0:
                self._store.wait([everyone])
                self._store.delete_key(closed)
                self._store.delete_key(everyone)
        self._store = None

    def close(self) -> None:
        """Release the store after every rank has stopped using it; idempotent.

        Collective: yes (rank 0 waits for every rank's close).
        Graph-capturable: no.

        Raises:
            UbnextError: the store failed (a timeout, a lost connection), in one line.
        """
        super().close()

    def _abort(self) -> None:
        """Drops the connection (rank 0: the server it hosts) without waiting for anyone."""
        self._store = None

    def _errors(self, op: str):
        return _store_errors(op, self._rank, self._where)


@contextlib.contextmanager
def _store_errors(op: str, rank: int, where: str):
    """Turns a store failure (a timeout, a lost connection) into one UbnextError line."""
    try:
        yield
    except UbnextError:
        raise
    except Exception as exc:  # torch raises RuntimeError and DistError subclasses
        raise UbnextError(
            f"{op}: rank {rank}: {where} failed ({type(exc).__name__}: {exc}); "
            f"a rank died, did not take part, or the store is unreachable"
        ) from exc
