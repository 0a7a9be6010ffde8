"""A dead peer becomes an exception naming it, never a silent hang (needs 2 GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_support import gpu_count

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).parent / "mpi_scripts" / "timeout_check.py"


@pytest.mark.parametrize("algo", ["lamport", "lamport_twoshot", "twoshot"])
def test_missing_peer_times_out_with_its_rank(run_mpi, algo):
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    proc = run_mpi(SCRIPT, 2, args=(algo,), timeout=120)
    out = proc.stdout
    assert "TIMEOUT-OK peer=1 rank=0" in out, out
    assert "NEXT-CALL raises" in out, out
    assert "CLOSE-OK rank=0" in out and "CLOSE-OK rank=1" in out, out  # no hang, no error from cleanup
