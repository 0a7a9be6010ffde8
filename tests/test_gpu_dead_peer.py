"""A dead peer on GPUs (outside MPI, whose launchers end the job when a rank dies): the
survivor raises CollectiveTimeoutError naming it, keeps its CUDA context, aborts the
communicator and builds a new one. Ranks may share one GPU."""

from __future__ import annotations

import os
import sys

import pytest
from gpu_support import require_gpu_and_torch
from launch_support import SCRIPTS, clean_env, free_port, run_all

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("algo", ["lamport", "lamport_twoshot", "twoshot"])
def test_a_dead_peer_is_named_and_the_survivor_goes_on(algo):
    require_gpu_and_torch()
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        pytest.skip("runs its own 2 processes: not under an MPI launcher")
    port = str(free_port())
    envs = [clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      DEAD_PEER_ALGORITHM=algo) for r in range(2)]
    out = run_all([[sys.executable, str(SCRIPTS / "dead_peer.py")]] * 2, envs, timeout=240)
    survivor = out[0]
    assert "TIMEOUT peer=1" in survivor, survivor
    assert "OUTPUT all-NaN=True" in survivor, survivor
    assert "TORCH sum=499500" in survivor, survivor
    took = float(survivor.split("ABORT took ")[1].split(" s")[0])
    assert took < 10, survivor
    assert "NEW communicator sum=3000" in survivor, survivor
