"""The backend's example programs (examples/ddp.py, fsdp2.py, dtensor_tp.py,
compiled_functional.py) run on the CPU at 1 rank with backend "ubnext" (CPU tensors: its
Gloo route), printing a finite loss per step (tests/test_gpu_torch_backend.py compares
them with backend "gloo" on a GPU), and leave no Gloo thread once their
destroy_process_group returned (else torn down at interpreter exit)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["ddp", "fsdp2", "dtensor_tp", "compiled_functional"]

# runs the example (argv[1:]) as __main__, its destroy_process_group followed by a report of
# the process's Gloo threads (their names) still running up to 5 s after it returned
_AFTER_DESTROY = """
import os, runpy, sys, time
import torch.distributed as dist

def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if n in ("pt_gloo_runloop", "gloo_tcp_loop")]

destroy = dist.destroy_process_group

def destroy_and_report(*args, **kwargs):
    destroy(*args, **kwargs)
    deadline = time.monotonic() + 5
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("gloo threads after destroy_process_group:", sorted(gloo_threads()), flush=True)

dist.destroy_process_group = destroy_and_report
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(example: str, backend: str) -> str:
    """The example's stdout at 1 rank on the CPU (3 small steps), after its exit status 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _AFTER_DESTROY, str(ROOT / "examples" / f"{example}.py"), "--steps",
                          "3", "--dim", "64", "--device", "cpu", "--backend", backend], capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT / "examples")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"backend {backend}" in out.stdout
    return out.stdout


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(example):
    out = run(example, "ubnext")
    got = [float(m) for m in re.findall(r"loss ([-0-9.e]+)", out)]
    assert len(got) == 3 and all(x == x and 0 < x < 20 for x in got)
    assert "gloo threads after destroy_process_group: []" in out


def test_backend_benchmark_arguments_and_table(capsys):
    sys.path.insert(0, str(ROOT))
    from bench import torch_backend as tb

    args = tb.parse_args(["--bytes", "2K,1M", "--ops", "all_reduce,broadcast", "--modes", "graph"])
    assert (args.bytes, args.ops, args.modes) == ([2048, 1 << 20], ["all_reduce", "broadcast"], ["graph"])
    with pytest.raises(SystemExit):
        tb.parse_args(["--ops", "all_reduce,gossip"])
    rows = [{"op": "all_reduce", "bytes": 2048, "mode": "graph", "candidate": c, "time_us": t}
            for c, t in (("dist ubnext", 6.0), ("comm direct", 4.0), ("dist nccl", 15.0))]
    tb.report(rows + [{"op": "all_reduce", "bytes": 4096, "mode": "eager", "candidate": c, "time_us": 10.0}
                      for c in ("dist ubnext", "comm direct")], args, 4)
    out = capsys.readouterr().out.splitlines()
    assert out[2].split() == ["all_reduce", "2048", "graph", "6.00", "4.00", "2.00", "15.00", "2.50x"]
    assert out[3].split() == ["all_reduce", "4096", "eager", "10.00", "10.00", "0.00", "-", "-"]
