"""Out-of-band bootstrap: rank discovery and host-side exchange.

``ubnext`` sets up communicators over a :class:`Bootstrap`: mpi4py by default
(:class:`MPIBootstrap`), ``torch.distributed`` (:class:`TorchBootstrap`), a
single process (:class:`SelfBootstrap`), or any subclass that provides
``rank``, ``size``, ``allgather(bytes)`` and ``barrier()``.
"""

from __future__ import annotations

from ._base import Bootstrap, SelfBootstrap, node_id
from ._mpi import MPIBootstrap
from ._torch import TorchBootstrap

__all__ = [
    "Bootstrap",
    "MPIBootstrap",
    "SelfBootstrap",
    "TorchBootstrap",
    "default",
    "node_id",
]


def default() -> Bootstrap:
    """Return the default bootstrap: :class:`MPIBootstrap` over ``COMM_WORLD``.

    Collective: yes (over ``MPI.COMM_WORLD``).

    Returns:
        A new bootstrap; the caller owns it and closes it.

    Raises:
        UbnextError: mpi4py cannot be imported.
    """
    return MPIBootstrap()
