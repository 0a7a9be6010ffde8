"""``python -m ubnext info`` without a GPU, and ``comm.describe()`` on a stand-in
communicator (the selector and config are real; the pool and device are not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ubnext import Config
from ubnext._api import report as _report
from ubnext._selection.select import Selector, buffer_limits
from ubnext._selection.table_format import load_table
from ubnext._tools import info as _info

REPO_ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def run_info(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("UBNEXT_")}
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "ubnext", "info", *args], cwd=REPO_ROOT, env=environ,
                          capture_output=True, text=True, timeout=120)


def test_info_prints_versions_config_and_tables_without_a_gpu():
    if _info.gpu_count()[0]:
        pytest.skip("this machine has a CUDA device")
    proc = run_info(env={"UBNEXT_POOL_MB": "512"})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    out = proc.stdout
    for heading in ("# versions", "# GPUs", "# configuration (UBNEXT_*)", "# selector tables", "# algorithms"):
        assert heading in out
    assert "  ubnext: 0.1.0" in out and "  mpi4py: " in out and "  MPI: " in out
    assert "  no CUDA device (" in out
    assert "UBNEXT_POOL_MB         512        environment" in out
    assert "UBNEXT_ALGO            auto       default" in out
    assert "default table:\n    entry NVIDIA H200 nvlink plain graph: world sizes 2 (" in out
    assert "for a GPU not known here: entry NVIDIA H200 nvlink plain graph (GPU not known: NVIDIA H200, " \
           "nearest measured (first such entry); its quantized thresholds not taken (measured on NVIDIA H200 " \
           "nvlink plain graph only))" in out
    assert "UBNEXT_TUNE_FILE: not set" in out


def test_info_checks_the_tune_file_and_reports_bad_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = run_info(env={"UBNEXT_TUNE_FILE": str(bad), "UBNEXT_POOL_MB": "lots"})
    assert proc.returncode == 0, proc.stderr
    assert f"UBNEXT_TUNE_FILE is not usable: selector: tune file {bad}: missing key(s)" in proc.stdout
    assert "invalid configuration: Config: invalid UBNEXT_POOL_MB='lots'" in proc.stdout


def test_info_comm_without_a_gpu_says_so():
    if _info.gpu_count()[0]:
        pytest.skip("this machine has a CUDA device")
    proc = run_info("--comm")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no CUDA device: no communicator to describe" in proc.stdout


def test_info_usage():
    proc = subprocess.run([sys.executable, "-m", "ubnext"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "info" in proc.stderr


def test_version_codes():
    assert _info._cuda_version(13020) == "13.2" and _info._cuda_version(0) == "none"
    assert _info._nccl_version(22809) == "2.28.9"


# --------------------------------------------------------------------------- describe


def fake_comm(usable=("lamport", "twoshot", "nccl"), nccl_reason=None, table=None, nvls=None, **config):
    cfg = Config.from_env({}, **config)
    selector = Selector(4, buffer_limits(cfg), list(usable), table, nccl_reason or "")
    pool = None
    if "lamport" in usable:
        pool = {"bytes": 1024 * MiB, "user_heap_bytes": 700 * MiB, "user_heap_free_bytes": 600 * MiB}
    path = "kernels on the symmetric pool" if nccl_reason is None else f"NCCL only: {nccl_reason}"
    comm = SimpleNamespace(rank=0, size=4, device=0, config=cfg, pool=pool, path=path, local_rank=0,
                           local_size=4, selector=selector,
                           algorithms=lambda: [n for n in ("lamport", "twoshot", "nccl") if n in usable])
    if nvls is not None:
        comm.nvls = nvls
    return comm


@pytest.fixture(autouse=True)
def no_device(monkeypatch):
    monkeypatch.setattr("ubnext._environment.devices.device_name", lambda device: "Fake GPU")


def test_describe_reports_path_pool_tables_and_selection():
    d = _report.report(fake_comm())
    json.dumps(d)  # a plain dict underneath
    assert d["path"] == "kernels on the symmetric pool" and d["local_ranks"] == 4
    assert d["nvls"] == {"enabled": False, "reason": "not available in this build"}
    assert d["config"]["UBNEXT_POOL_MB"] == 1024
    assert d["tables"] == ["default table: NVIDIA H200 nvlink plain graph (GPU not known: NVIDIA H200, "
                           "nearest measured (first such entry); its quantized thresholds not taken (measured on "
                           "NVIDIA H200 nvlink plain graph only))"]
    assert [row[0] for row in d["selection"]["bfloat16"]] == _report.SIZES
    assert _report.SIZES[0] == 1 << 10 and _report.SIZES[-1] == 1 << 30
    text = str(d)
    assert text.startswith("ubnext communicator: rank 0 of 4 (local rank 0 of 4), device 0 (Fake GPU)")
    assert "pool: 1024.0 MiB per rank; user heap 700.0 MiB, 600.0 MiB free" in text
    assert "NVLink multicast: off (not available in this build)" in text
    assert "  UBNEXT_LAMPORT_MAX_KB  1024" in text
    assert "       4 KiB  lamport  table row ≤ 512 KiB for 4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph)" in text
    assert "       1 GiB  nccl     table row > 32 MiB for 4 ranks float32 (default table: NVIDIA H200 nvlink plain graph)" in text


def test_describe_explains_the_reduce_scatter_and_all_gather_choice():
    d = _report.report(fake_comm(usable=("lamport", "lamport_twoshot", "twoshot", "nccl")))
    for collective in ("reduce_scatter", "all_gather"):
        rows = d["collectives"][collective]["bfloat16"]
        assert [row[0] for row in rows] == _report.SIZES
        assert rows[0][1:] == ["lamport_twoshot",
                               f"table row ≤ 32 MiB for 4 ranks bfloat16 ({collective}, default table: NVIDIA H200 nvlink plain graph)"]
        assert rows[-1][1] == "nccl"
        assert f"  {collective} bfloat16" in str(d)
    d = _report.report(fake_comm(usable=("lamport", "lamport_twoshot", "twoshot", "nccl"), algorithm="lamport"))
    assert d["collectives"]["all_gather"]["bfloat16"][0][1] == "lamport_twoshot"  # lamport has no all-gather


def test_describe_nccl_only_forced_algorithm_nvls_and_tune_file(tmp_path):
    d = _report.report(fake_comm(usable=("nccl",), nccl_reason="UBNEXT_ALGO=nccl", algorithm="nccl"))
    assert d["path"] == "NCCL only: UBNEXT_ALGO=nccl" and d["pool"] is None
    assert d["selection"]["float16"][0][1:] == ["nccl", "only NCCL usable: UBNEXT_ALGO=nccl"]

    d = _report.report(fake_comm(algorithm="lamport", nvls=SimpleNamespace(enabled=True, reason="all 4 GPUs")))
    assert d["selection"]["bfloat16"][0][1:] == ["lamport", "UBNEXT_ALGO=lamport"]
    assert d["selection"]["bfloat16"][-1][1] == "error"
    assert "NVLink multicast: on (all 4 GPUs)" in str(d)

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": 1, "machine": "m", "tables": {"4": {"bfloat16": [[None, "twoshot"]]}}}))
    d = _report.report(fake_comm(table=load_table(str(path))))
    assert d["tables"][0] == f"tune file {path}: any machine (format-1 file: one entry for any machine)"
    assert d["tables"][1].startswith("default table: NVIDIA H200 nvlink plain graph (")
    assert d["selection"]["bfloat16"][0][1] == "twoshot"
    assert "selector tables: tune file " in str(d) and ", then default table: NVIDIA H200" in str(d)
