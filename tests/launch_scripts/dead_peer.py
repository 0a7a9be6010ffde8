"""A peer that dies: rank 1 exits after the first all-reduce; rank 0's next one must
raise CollectiveTimeoutError naming rank 1, leave NaN, keep torch working, and let the
process abort the communicator and build a new one.

Started as 2 processes with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
(tests/test_gpu_dead_peer.py); prints one line per step for the test to check.
"""

import os
import time

import torch

import ubnext

comm = ubnext.Communicator(timeout_s=3, pool_mb=256, staging_mb=16, lamport_max_kb=256,
                           lamport_twoshot_max_kb=4096)
torch.cuda.set_device(comm.device)
algorithm = os.environ["DEAD_PEER_ALGORITHM"]
x = torch.ones(4096, device="cuda", dtype=torch.float32)
comm.all_reduce(x, out=x, algorithm=algorithm)
comm.synchronize()
assert torch.equal(x, torch.full_like(x, 2.0)), "the first all-reduce is wrong"
if comm.rank == 1:
    print("rank 1 exits", flush=True)
    os._exit(0)  # no close, no goodbye: a crash
time.sleep(2)
t0 = time.monotonic()
out = comm.all_reduce(x, algorithm=algorithm)
try:
    comm.synchronize()
    print("NO ERROR", flush=True)
except ubnext.CollectiveTimeoutError as e:
    print(f"TIMEOUT peer={e.peer} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
print(f"OUTPUT all-NaN={bool(torch.isnan(out).all())}", flush=True)
t = torch.arange(1000, device="cuda", dtype=torch.float32)
print(f"TORCH sum={t.sum().item():.0f}", flush=True)
t0 = time.monotonic()
comm.abort()
print(f"ABORT took {time.monotonic() - t0:.1f} s", flush=True)
with ubnext.Communicator(bootstrap=ubnext.bootstrap.SelfBootstrap(), device=comm.device) as again:
    y = torch.full((1000,), 3.0, device="cuda")
    again.all_reduce(y, out=y)
    again.synchronize()
    print(f"NEW communicator sum={y.sum().item():.0f}", flush=True)
