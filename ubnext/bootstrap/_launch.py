"""Which launcher started this process, read from its environment alone.

Nothing here imports ``mpi4py.MPI`` (that import initializes MPI) or torch:
:func:`detect` is a pure function of the environment and of whether a
``torch.distributed`` default group is already initialized, so that
:func:`ubnext.bootstrap.default` can pick the bootstrap before touching either.

Precedence, first match wins:

1. ``torch.distributed`` default group already initialized: the user's own
   world (:class:`~ubnext.bootstrap.TorchBootstrap`).
2. An MPI launcher (``mpirun``/``mpiexec``, or ``srun --mpi=pmix|pmi2``):
   ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``, ``PMI_RANK``, ``PMIX_RANK`` or
   ``MV2_COMM_WORLD_SIZE`` is set (:class:`~ubnext.bootstrap.MPIBootstrap`).
3. torchrun or anything like it: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
   ``MASTER_PORT`` (a TCPStore, :class:`~ubnext.bootstrap.StoreBootstrap`).
4. ``srun`` without PMI variables (``SLURM_STEP_NUM_TASKS`` and
   ``SLURM_PROCID``, set by srun for each task, not by sbatch for the batch
   script): with ``MASTER_ADDR``/``MASTER_PORT`` a TCPStore with Slurm's rank
   and task count; otherwise MPI, which finds the tasks only if it was built
   for Slurm's PMI (the size check below says so if it does not).
5. Nothing of the above: one process. :class:`~ubnext.bootstrap.MPIBootstrap`
   when the program has already imported ``mpi4py.MPI`` (MPI is running, its
   ``COMM_WORLD`` is the world), else :class:`~ubnext.bootstrap.SelfBootstrap`.

Every kind but the first records the rank and size the launcher announced,
and the caller checks them against what the bootstrap sees: several ranks
announced but a world of one (a ``mpi4py`` built for another MPI than the
launcher's, ``srun`` without PMI) is an error, not a silent 1-rank world.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ubnext._protocol.errors import UbnextError

__all__ = ["MPI_VARS", "Launch", "detect"]

#: Variables whose presence means an MPI launcher (or srun with PMI) started us.
MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
#: (size, rank) variable pairs of the MPI launchers, in the order they are read.
_MPI_SIZE_RANK = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),  # Open MPI (mpirun, srun --mpi=pmix)
    ("PMI_SIZE", "PMI_RANK"),  # MPICH hydra, Intel MPI, srun --mpi=pmi2
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),  # MVAPICH
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),  # srun --mpi=pmix sets only PMIX_RANK
)
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SRUN_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID")

_OP = "bootstrap.default"


@dataclass(frozen=True)
class Launch:
    """What the environment says about this process's job.

    Attributes:
        kind: ``"torch"`` (initialized torch.distributed group), ``"mpi"``,
            ``"torchrun"``, ``"srun"`` (srun with MASTER_ADDR/MASTER_PORT: a
            TCPStore), ``"srun-mpi"`` (srun alone: MPI), ``"mpi-running"``
            (one process that already initialized MPI) or ``"single"``.
        rank: the rank the launcher announced, or None where it says none.
        size: the number of ranks it announced, or None.
        evidence: the variables that decided it, for messages
            (e.g. ``"OMPI_COMM_WORLD_SIZE=4"``).
        master: ``(MASTER_ADDR, MASTER_PORT)`` for the TCPStore kinds, else None.
        agent_store: torchrun's agent hosts that store
            (``TORCHELASTIC_USE_AGENT_STORE=True``); otherwise rank 0 does.
        attempt: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``).
    """

    kind: str
    rank: int | None = None
    size: int | None = None
    evidence: str = ""
    master: tuple[str, int] | None = None
    agent_store: bool = False
    attempt: str = "0"


def detect(environ: Mapping[str, str], torch_initialized: bool = False,
           mpi_initialized: bool = False) -> Launch:
    """Decide the launcher from the environment (see the module docstring).

    Pure: reads only its arguments. Collective: no.

    Args:
        environ: the process environment (``os.environ``).
        torch_initialized: whether a ``torch.distributed`` default group exists.
        mpi_initialized: whether the program already imported ``mpi4py.MPI``.

    Returns:
        A :class:`Launch`.

    Raises:
        UbnextError: a launcher variable is not an integer, a rank is outside
            ``[0, size)``, or ``RANK``/``WORLD_SIZE`` announce several ranks
            without ``MASTER_ADDR``/``MASTER_PORT`` to meet at.
    """
    if torch_initialized:
        return Launch("torch", evidence="torch.distributed is initialized")
    present = [v for v in MPI_VARS if v in environ]
    if present:
        size, rank, used = _first_pair(environ, _MPI_SIZE_RANK)
        rank = rank if rank is not None else _int(environ, "PMIX_RANK", default=None)
        return _checked(Launch("mpi", rank, size, _evidence(environ, dict.fromkeys((*present, *used)))))
    if all(v in environ for v in _TORCHRUN_VARS):
        size, rank = _int(environ, "WORLD_SIZE"), _int(environ, "RANK")
        launch = Launch("torchrun", rank, size, _evidence(environ, _TORCHRUN_VARS), _master(environ),
                        environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                        environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return _checked(launch) if size > 1 else Launch("single", 0, 1, launch.evidence)
    if _int(environ, "WORLD_SIZE", default=1) > 1:
        missing = ", ".join(v for v in _TORCHRUN_VARS if v not in environ)
        raise UbnextError(
            f"{_OP}: WORLD_SIZE={environ['WORLD_SIZE']} announces several ranks but {missing} "
            f"is not set; launch with torchrun (which sets them), set them yourself, or use mpirun"
        )
    if all(v in environ for v in _SRUN_VARS) and _int(environ, "SLURM_STEP_NUM_TASKS") > 1:
        size, rank = _int(environ, "SLURM_STEP_NUM_TASKS"), _int(environ, "SLURM_PROCID")
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            used = (*_SRUN_VARS, "MASTER_ADDR", "MASTER_PORT")
            return _checked(Launch("srun", rank, size, _evidence(environ, used), _master(environ)))
        return _checked(Launch("srun-mpi", rank, size, _evidence(environ, _SRUN_VARS)))
    if mpi_initialized:
        return Launch("mpi-running", evidence="mpi4py.MPI is imported")
    return Launch("single", 0, 1, "no launcher variables")


def _first_pair(environ: Mapping[str, str], pairs) -> tuple[int | None, int | None, tuple[str, ...]]:
    """(size, rank, the variables read) of the first pair whose size variable is set."""
    for size_var, rank_var in pairs:
        if size_var in environ:
            used = (size_var, rank_var) if rank_var in environ else (size_var,)
            return _int(environ, size_var), _int(environ, rank_var, default=None), used
    return None, None, ()


def _int(environ: Mapping[str, str], name: str, default: int | None = 0) -> int | None:
    text = environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise UbnextError(f"{_OP}: {name}={text!r} is not an integer; fix or unset it") from None


def _master(environ: Mapping[str, str]) -> tuple[str, int]:
    port = _int(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise UbnextError(f"{_OP}: MASTER_PORT={port} is not a TCP port (1..65535); fix it")
    return environ["MASTER_ADDR"], port


def _evidence(environ: Mapping[str, str], names) -> str:
    return " ".join(f"{n}={environ[n]}" for n in names if n in environ)


def _checked(launch: Launch) -> Launch:
    if launch.size is not None and launch.size < 1:
        raise UbnextError(f"{_OP}: the launcher announces {launch.size} ranks ({launch.evidence}); fix the variable")
    if launch.rank is not None and launch.size is not None and not 0 <= launch.rank < launch.size:
        raise UbnextError(f"{_OP}: rank {launch.rank} is outside [0, {launch.size}) ({launch.evidence}); "
                          f"the launcher variables disagree")
    return launch
