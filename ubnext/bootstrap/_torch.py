"""Bootstrap over an initialized ``torch.distributed`` process group."""

from __future__ import annotations

from typing import Any

from .._errors import UbnextError
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
    ``torch.cuda.set_device`` before creating the communicator. The group is
    not owned: :meth:`close` leaves it alone.

    Collective: no (construction only queries the group).

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
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, data: bytes) -> list[bytes]:
        """See :meth:`Bootstrap.allgather`; ``all_gather_object``. Collective: yes."""
        self._check_open("bootstrap.allgather")
        _check_bytes("bootstrap.allgather", data)
        out: list[Any] = [None] * self._size
        self._dist.all_gather_object(out, data, group=self._group)
        return out

    def barrier(self) -> None:
        """See :meth:`Bootstrap.barrier`.

        Implemented as an empty :meth:`allgather`, which, unlike
        ``dist.barrier`` with NCCL, needs no guess of the device.

        Collective: yes.
        """
        self._check_open("bootstrap.barrier")
        self.allgather(b"")
