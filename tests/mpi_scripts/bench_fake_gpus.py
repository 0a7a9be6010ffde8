"""bench/all_reduce_perf.py over MPI ranks on the numpy stand-in for GPUs (tests/bench_fakes.py).

Run by tests/test_bench.py under ``mpiexec -n N``; rank 0 prints the table.
Exits non-zero when the run reports wrong elements.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]

import bench_fakes as fakes  # noqa: E402
from mpi4py import MPI  # noqa: E402

cupy = fakes.install()

from bench import all_reduce_perf as arp  # noqa: E402

argv = ["-b", "8", "-e", "128K", "-f", "4", "-d", "all", "-o", "all", "-n", "2", "-w", "1", "-G", "1"]
args = arp.parse_args(argv)
boot = fakes.Bootstrap(MPI.COMM_WORLD)
world = arp.World(fakes.Comm(boot), fakes.ReduceEngine(boot), cupy.cuda.Stream(),
                  lambda count, dtype: cupy.empty((count,), dtype.numpy), [])
sys.exit(arp.run(args, world, argv))
