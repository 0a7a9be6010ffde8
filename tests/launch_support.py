"""Helpers of the launcher tests: an environment without any launcher's variables,
a free TCP port, and running several processes to completion with a timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"

#: Every variable ubnext.bootstrap._launch.detect() reads, cleared before a test fakes its own.
LAUNCH_VARS = (
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
    "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_NTASKS",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, the repository on
    PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float = 180) -> list[str]:
    """Run the commands at once; fail the test (with their output) unless all exit 0 in time.

    Returns:
        Each command's stdout.
    """
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                              start_new_session=True) for c, e in zip(cmds, envs)]
    outs = []
    for cmd, p in zip(cmds, procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)  # each runs in its own session, with its children
            pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s")
        outs.append((cmd, p.returncode, out, err))
    for cmd, rc, out, err in outs:
        assert rc == 0, f"{' '.join(cmd)} exited with {rc}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
    return [out for _, _, out, _ in outs]
