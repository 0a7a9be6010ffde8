"""Bootstrap over an initialized ``torch.distributed`` process group."""

from __future__ import annotations

from typing import Any

from ubnext._protocol.errors import UbnextError

from ._base import Bootstrap, _check_bytes

__all__ = ["TorchBootstrap"]


def _import_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise UbnextError(
            f"bootstrap.torch: torch is not importable ({exc}); "
            'install it (pip install "ubnext[torch]") or use MPIBootstrap'
        ) from exc
    return dist


class TorchBootstrap(Bootstrap):
    """A bootstrap over a ``torch.distributed`` process group.

    Exchanges go through ``all_gather_object`` on the group. With the NCCL
    backend that stages through the current CUDA device, so call
    ``torch.cuda.set_device`` before creating the communicator, or use
    :meth:`over_world`. A group passed in is not owned: :meth:`close` leaves
    it alone.

    Collective: no (construction only queries the group).
    Graph-capturable: no (call it outside a capture: it queries torch.distributed).

    Args:
        group: a process group; the default (world) group when None.

    Raises:
        UbnextError: torch is not installed, or ``torch.distributed`` is not
            available or not initialized.
    """

    def __init__(self, group: Any = None) -> None:
        dist = _import_dist()
        if not dist.is_available() or not dist.is_initialized():
            raise UbnextError(
                "bootstrap.torch: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first"
            )
        self._dist = dist
        self._group = group
        self._owns_group = False
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @classmethod
    def over_world(cls) -> TorchBootstrap:
        """A bootstrap over the default group's ranks that needs no CUDA device.

        Uses the default group itself when its object collectives run on the
        CPU (a ``gloo`` or ``mpi`` backend, or a ``cpu:...`` pair such as
        ``init_process_group()``'s default ``cpu:gloo,cuda:nccl``). A group of
        NCCL alone would stage every exchange through the current CUDA device,
        which is not chosen yet when a communicator starts (and may be shared
        by several ranks): over such a group this creates a ``gloo`` group of
        the same ranks, owned and destroyed by :meth:`close`.

        Collective: yes, over the default group (``new_group``, where one is made).
        Graph-capturable: no (a blocking host exchange).

        Returns:
            A new bootstrap; the caller owns it and closes it.

        Raises:
            UbnextError: torch is not installed, or torch.distributed is not
                initialized.
        """
        boot = cls()
        backend = str(boot._dist.get_backend()).lower()
        if backend in ("gloo", "mpi") or "cpu:" in backend:
            return boot
        boot._group = boot._dist.new_group(backend="gloo")
        boot._owns_group = True
        return boot

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, data: bytes) -> list[bytes]:  # Bootstrap.allgather by all_gather_object
        self._check_open("bootstrap.allgather")
        _check_bytes("bootstrap.allgather", data)
        out: list[Any] = [None] * self._size
        self._dist.all_gather_object(out, data, group=self._group)
        return out

    def barrier(self) -> None:
        # Bootstrap.barrier as an empty allgather, which, unlike dist.barrier with NCCL,
        # needs no guess of the device

        self._check_open("bootstrap.barrier")
        self.allgather(b"")

    def _close(self) -> None:
        """Destroy the group :meth:`over_world` created (a caller's group stays)."""
        group, self._group = self._group, None
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group(group)
