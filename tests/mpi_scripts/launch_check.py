"""Run under ``mpiexec -n N``: ``ubnext.bootstrap.default()`` finds the MPI launcher
from its variables alone and gives one MPIBootstrap over all N ranks.

mpi4py.MPI is not imported before ``default()`` (so detection cannot lean on a
running MPI). Rank 0 prints ``launch_check OK size=N`` last.
"""

from __future__ import annotations

import sys

from ubnext.bootstrap import MPIBootstrap, default


def main() -> None:
    assert "mpi4py.MPI" not in sys.modules, "MPI was initialized before detection"
    with default() as boot:
        assert type(boot) is MPIBootstrap, type(boot)
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        assert (boot.rank, boot.size) == (world.Get_rank(), world.Get_size())
        assert boot.allgather(b"%d" % boot.rank) == [b"%d" % r for r in range(boot.size)]
        boot.barrier()
        if boot.rank == 0:
            print(f"launch_check OK size={boot.size}", flush=True)


if __name__ == "__main__":
    main()
