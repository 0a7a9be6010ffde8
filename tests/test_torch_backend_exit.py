"""A ubnext group's Gloo route and the interpreter's exit, in two processes (rank 0 and 1 of
a FileStore group on the CPU).

The flake it pins (fsdp2 example, CI: "terminate called without an active exception",
SIGABRT at exit): a Gloo worker thread that drops the last reference to a finished op's
tensor after the interpreter began finalizing. The tensor's Python object lives on in
C++ once Python dropped it, so the worker takes the GIL to release it; Python ends a
thread that asks for the GIL while it finalizes (pthread_exit), and the unwinding
through the worker's noexcept frames calls std::terminate. It happened when the worker
was late (CPU contention: it asked for the GIL before the interpreter began finalizing and
got it after) and its backend still ran at exit, which it did because
destroy_process_group did not destroy it. Here the lateness is made certain: rank 1 joins
rank 0's async all-reduce only once rank 0 is past destroy_process_group, while rank 0's
last exit handler holds the GIL. The group's shutdown destroys the backend, which waits
for that op (its worker taking the GIL meanwhile), so rank 0 exits cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60  # every wait of the ranks is bounded by this

_RANK = """
import atexit, ctypes, os, sys, time

rank, out, wait_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
if rank == 0:
    # the last exit handlers (registered first), C calls that keep the GIL: "0-exiting" made,
    # then the GIL held 2 s right before the interpreter finalizes, while rank 1 joins the op:
    # a worker that finishes it waits for the GIL across the start of finalization
    libc = ctypes.PyDLL(None)
    atexit.register(libc.sleep, 2)
    atexit.register(libc.creat, f"{out}/0-exiting".encode(), 0o644)

import torch, torch.distributed as dist
import ubnext.torch  # noqa: F401 (registers "ubnext")

# everything bound at definition: they also run while the interpreter finalizes
def wait_for(name, wait_s=wait_s, out=out, sleep=time.sleep, exists=os.path.exists, monotonic=time.monotonic):
    deadline = monotonic() + wait_s
    while not exists(f"{out}/{name}") and monotonic() < deadline:
        sleep(0.01)  # the GIL released

def mark(name, out=out, open=open):
    open(f"{out}/{name}", "w").close()

dist.init_process_group("ubnext", store=dist.FileStore(f"{out}/store", 2), rank=rank, world_size=2)
dist.barrier()  # on the CPU: both ranks' Gloo backends made (collectively)
if rank == 0:
    t = torch.ones(4)
    t.note = "Python state"  # the tensor's Python object lives on in C++ once Python drops it
    work = dist.all_reduce(t, async_op=True)  # in flight until rank 1 joins
    del t, work

    class Finalizing:  # freed while the interpreter finalizes: waits there for rank 1, the GIL released
        def __del__(self, wait_for=wait_for):
            wait_for("1-done")

    at_finalization = Finalizing()
    mark("0-destroying")
    dist.destroy_process_group()
else:
    wait_for("0-destroying")
    wait_for("0-exiting", wait_s=3.0)  # rank 0 past its destroy_process_group, or 3 s waiting in it
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()
    mark("1-done")
"""


def test_an_op_finished_late_at_exit_does_not_abort(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = str(ROOT)
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path), str(WAIT_S)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=3 * WAIT_S)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(f"rank {r}:\n{o[-3000:]}" for r, o in enumerate(outs))
    assert (tmp_path / "1-done").exists()
