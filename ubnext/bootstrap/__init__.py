"""Out-of-band bootstrap: rank discovery and host-side exchange.

``ubnext`` sets up communicators over a :class:`Bootstrap`. :func:`default`
picks one from the launcher's environment: mpi4py (:class:`MPIBootstrap`),
torch.distributed (:class:`TorchBootstrap`), torchrun's TCPStore
(:class:`StoreBootstrap`) or a single process (:class:`SelfBootstrap`). Any
subclass that provides ``rank``, ``size``, ``allgather(bytes)`` and
``barrier()`` can be passed instead.
"""

from __future__ import annotations

import os
import sys

from ubnext._protocol.errors import UbnextError

from ._base import Bootstrap, SelfBootstrap, node_id
from ._launch import Launch, detect
from ._mpi import MPIBootstrap
from ._store import StoreBootstrap
from ._torch import TorchBootstrap

__all__ = [
    "Bootstrap",
    "MPIBootstrap",
    "SelfBootstrap",
    "StoreBootstrap",
    "TorchBootstrap",
    "default",
    "node_id",
]


def default() -> Bootstrap:
    """Return one bootstrap over every rank the launcher started.

    The launcher is read from the environment before MPI or torch is touched
    (see ``ubnext/bootstrap/_launch.py`` for the precedence): an initialized
    torch.distributed default group, then an MPI launcher (``mpirun``,
    ``mpiexec``, ``srun --mpi=...``), then torchrun-style ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, then ``srun``, else one
    process. The ranks and size the launcher announced are checked against
    what the bootstrap sees.

    Collective: yes, over every rank the launcher started.
    Graph-capturable: no (a blocking host exchange).

    Returns:
        A new bootstrap; the caller owns it and closes it.

    Raises:
        UbnextError: the launcher announced ranks the bootstrap does not see
            (e.g. ``mpirun`` of one MPI, mpi4py built for another), a launcher
            variable is invalid, or what the bootstrap needs (mpi4py and an
            MPI library, torch) is missing; each names the fix.
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to look
    torch_initialized = dist is not None and dist.is_available() and dist.is_initialized()
    launch = detect(os.environ, torch_initialized, "mpi4py.MPI" in sys.modules)
    boot = _open(launch)
    try:
        _check(launch, boot)
    except BaseException:
        boot.close()
        raise
    return boot


def _open(launch: Launch) -> Bootstrap:
    if launch.kind == "torch":
        return TorchBootstrap.over_world()
    if launch.kind in ("torchrun", "srun"):
        host, port = launch.master
        return StoreBootstrap.connect(host, port, launch.rank, launch.size,
                                      agent_store=launch.agent_store, attempt=launch.attempt)
    if launch.kind in ("mpi", "srun-mpi", "mpi-running"):
        return MPIBootstrap()
    return SelfBootstrap()


def _check(launch: Launch, boot: Bootstrap) -> None:
    """Raise when the bootstrap does not see the world the launcher announced."""
    if (launch.size is None or boot.size == launch.size) and launch.rank in (None, boot.rank):
        return
    saw = f"rank {boot.rank} of {boot.size}"
    said = f"{launch.size if launch.size is not None else 'several'} ranks ({launch.evidence})"
    if launch.kind == "srun-mpi":
        fix = ("run srun --mpi=pmix (or pmi2) with an MPI built for Slurm, or export MASTER_ADDR and "
               "MASTER_PORT for ubnext's TCPStore bootstrap, or launch with mpirun")
    else:
        fix = ("mpi4py's MPI library is not the one of this mpirun/mpiexec: launch with the mpiexec of the MPI "
               "mpi4py was built for (python -c 'import mpi4py; print(mpi4py.get_config())'), or rebuild "
               "mpi4py against the launcher's MPI")
    raise UbnextError(f"bootstrap.default: the launcher started {said} but MPI sees {saw}; {fix}")
