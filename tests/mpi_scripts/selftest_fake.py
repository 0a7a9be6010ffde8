"""``python -m ubnext selftest``'s main over MPI ranks, on the numpy stand-in for GPUs
(tests/bench_fakes.py) and a stand-in communicator (tests/selftest_fakes.py).

Run by tests/test_selftest.py under ``mpiexec -n N`` with a mode:

* ``fault``: rank 1's twoshot float32 call of 7 elements stores one wrong bit; every
  rank exits with the selftest's status (1), rank 0 prints the table.
* ``setup``: rank 1 cannot create its communicator (a UbnextError) while the others
  wait for it in a collective: it prints the line and ends the whole job.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]

import bench_fakes  # noqa: E402
from mpi4py import MPI  # noqa: E402
from selftest_fakes import KERNELS, FakeComm  # noqa: E402

from ubnext import UbnextError
from ubnext._tools import selfcheck as _selfcheck
from ubnext._tools import selftest as _selftest  # noqa: E402

bench_fakes.install()
_selfcheck.COUNTS = (1, 7)
mode = sys.argv[1]
boot = bench_fakes.Bootstrap(MPI.COMM_WORLD)


def fault(rank, algorithm, dtype, count):
    return "element" if (rank, algorithm, dtype, count) == (1, "twoshot", "float32", 7) else None


def communicator(**overrides):
    if mode == "setup" and boot.rank == 1:
        raise UbnextError("Communicator: a fake setup failure on rank 1")
    return FakeComm(boot, algorithms=KERNELS, fault=fault)


status = _selftest.main(communicator=communicator, environ={})
print(f"rank {boot.rank} status {status}", file=sys.stderr, flush=True)
sys.exit(status)
