"""A peer that never arrives: the waiting rank gets CollectiveTimeoutError naming it.

Run with 2 ranks: ``mpiexec -n 2 python timeout_check.py lamport|twoshot``. Both ranks
run one all-reduce together (compiles the kernel), then only rank 0 calls again; its
kernel must time out (UBNEXT_TIMEOUT_S=2) and trap, and ``synchronize`` must name rank 1.
Then both close the communicator: rank 0 with its CUDA context gone.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import cupy  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ubnext  # noqa: E402

algo = sys.argv[1]
comm = ubnext.Communicator(timeout_s=2, pool_mb=64, staging_mb=8, lamport_max_kb=256,
                           lamport_twoshot_max_kb=2048)
x = cupy.ones(1000, dtype=cupy.float32)
comm.all_reduce(x, out=x, algorithm=algo)
comm.synchronize()
assert float(x[0]) == comm.size, "warm-up all-reduce is wrong"
MPI.COMM_WORLD.Barrier()
if comm.rank == 0:
    t0 = time.monotonic()
    comm.all_reduce(x, out=x, algorithm=algo)
    try:
        comm.synchronize()
        print("NO-TIMEOUT", flush=True)
    except ubnext.CollectiveTimeoutError as e:
        waited = time.monotonic() - t0
        print(f"TIMEOUT-OK peer={e.peer} rank={e.rank} waited={waited:.1f}s: {e}", flush=True)
    with_next_call = None
    try:
        comm.all_reduce(x, algorithm=algo)
    except ubnext.CollectiveTimeoutError:
        with_next_call = "raises"
    print(f"NEXT-CALL {with_next_call}", flush=True)
rank = comm.rank
try:  # collective: rank 0's device is gone, rank 1 must not wait for it forever
    comm.close()
    print(f"CLOSE-OK rank={rank}", flush=True)
except Exception as e:
    print(f"CLOSE-RAISES rank={rank} {type(e).__name__}: {e}", flush=True)
MPI.COMM_WORLD.Barrier()
MPI.Finalize()
os._exit(0)  # rank 0's CUDA context is dead after the trap: skip the CUDA teardown
