"""torchrun gives one communicator over all its ranks, on a GPU machine: runs
``launch_scripts/torchrun_allreduce.py`` under ``torchrun --standalone`` (ranks may
share one GPU; the script checks the sharing warning and the NCCL refusal then)."""

from __future__ import annotations

import os
import re
import sys

import pytest
from launch_support import LAUNCH_VARS, SCRIPTS, clean_env, run_all

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nproc", [2])
def test_torchrun_all_reduce_is_exact(nproc):
    pytest.importorskip("torch.distributed", reason="needs torch")
    if any(var in os.environ for var in LAUNCH_VARS):
        pytest.skip("pytest already runs under a launcher; not nesting torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPTS / "torchrun_allreduce.py")]
    (out,) = run_all([cmd], [clean_env()], timeout=600)
    # the ranks share torchrun's stdout, so their lines may run together
    assert sorted(re.findall(r"torchrun_allreduce OK rank=\d+ size=\d+", out)) == [
        f"torchrun_allreduce OK rank={r} size={nproc}" for r in range(nproc)], out
