"""``python -m ubnext selftest`` on a GPU machine: it passes within its budget with a cold
kernel cache, with no launcher, under mpiexec and under torchrun (ranks may share one
GPU; NCCL is then skipped, saying so), and a communicator that stores one wrong element
on one rank makes every rank exit 1 with the case named in rank 0's table.

The in-process tests run at any number of ranks (``mpirun -n N python -m pytest``); the
cold-cache runs start their own processes and skip under a launcher.
"""

from __future__ import annotations

import io
import os
import re
import sys
import time

import pytest
from launch_support import LAUNCH_VARS, clean_env, run_all

from ubnext import Communicator
from ubnext._protocol.algorithms import KERNEL_DTYPES, TWOSHOT_ONLY_DTYPES
from ubnext._tools import selfcheck as _selfcheck
from ubnext._tools import selftest as _selftest

pytestmark = pytest.mark.gpu


class CorruptingCommunicator(Communicator):
    """Flips the last bit of the last element that the twoshot float32 calls of 7
    elements store on the last rank (on the call's stream, after the kernel)."""

    def all_reduce(self, x, out=None, op="sum", algorithm="auto", stream=None):
        result = super().all_reduce(x, out=out, op=op, algorithm=algorithm, stream=stream)
        if self.rank == self.size - 1 and algorithm == "twoshot" and x.dtype.name == "float32" and x.size == 7:
            import cupy

            with stream:
                bits = result.view(cupy.uint32)
                bits[-1:] ^= 1
        return result


def test_the_selftest_passes_in_process():
    out = io.StringIO()
    status = _selftest.main(out=out)
    assert status == _selftest.OK, out.getvalue()
    if out.getvalue():  # rank 0
        assert out.getvalue().splitlines()[-1].startswith("selftest passed: ")


def test_a_wrong_element_on_the_last_rank_makes_every_rank_exit_1(monkeypatch):
    monkeypatch.setattr(_selfcheck, "COUNTS", (1, 7))
    out = io.StringIO()
    status = _selftest.main(communicator=CorruptingCommunicator, out=out)
    assert status == _selftest.FAILED, out.getvalue()
    text = out.getvalue()
    if text:  # rank 0
        failed = [line.split() for line in text.splitlines() if re.match(r"^\w+ +\w+ +\d+ +\d+ +\w+ +FAIL", line)]
        assert len(failed) == 1 and failed[0][:6] == ["twoshot", "float32", "7", "28", "plain", "FAIL"], text
        assert "the output: 1 of 7 elements differ from the reference: [6]" in text


LAUNCHERS = {
    "none": lambda: [sys.executable, "-m", "ubnext", "selftest"],
    "mpiexec-2": lambda: [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2",
                          sys.executable, "-m", "ubnext", "selftest"],
    "torchrun-2": lambda: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "ubnext", "selftest"],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_cold_kernel_cache_run_passes_within_its_budget(launcher, tmp_path):
    if any(var in os.environ for var in LAUNCH_VARS):
        pytest.skip("starts its own processes: not under a launcher")
    cmd = LAUNCHERS[launcher]()
    if launcher == "mpiexec-2" and not os.access(cmd[0], os.X_OK):
        pytest.skip("no mpiexec next to the Python executable (the test extra's mpich)")
    if launcher == "torchrun-2":
        pytest.importorskip("torch.distributed", reason="torchrun needs torch (the gpu extra)")
    start = time.perf_counter()
    (out,) = run_all([cmd], [clean_env(CUPY_CACHE_DIR=str(tmp_path))], timeout=300)
    took = time.perf_counter() - start
    last = out.splitlines()[-1]
    assert last.startswith("selftest passed: "), out
    # the unicast kernels (multicast is off on the test machines); the two-shot in every dtype
    kernels = 3 * len(KERNEL_DTYPES) + len(TWOSHOT_ONLY_DTYPES)
    assert re.search(rf"kernel compile: [\d.]+ s for {kernels} kernels", out), out
    assert any(tmp_path.iterdir()), "CuPy wrote no kernel to the empty cache directory: nothing was compiled"
    assert took < _selfcheck.BUDGET_S, f"{launcher}: {took:.1f} s, budget {_selfcheck.BUDGET_S} s\n{out}"
