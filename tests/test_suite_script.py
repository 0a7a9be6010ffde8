""".ci/gpu_suite.py, the GPU suite runner, on CPU: JUnit parsing per file and rank, merging
into the summary, its Markdown, the refusal without the multicast variables, the
commands each configuration runs (--dry-run), the per-rank GPU wrapper, and whole runs
through a stand-in mpirun on a CPU test file, one of them timing out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "gpu_suite.py"
spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
suite = sys.modules["gpu_suite"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MULTICAST_VARS = (*MULTICAST_OFF, "UBNEXT_NVLS")
FILES = ["tests/test_gpu_a.py", "tests/test_gpu_b.py"]

RANK0_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="7">
<testcase classname="tests.test_gpu_a" name="test_1" time="1.5" />
<testcase classname="tests.test_gpu_a.TestK" name="test_2" time="0.5" />
<testcase classname="tests.test_gpu_a" name="test_3" time="0.25"><failure message="assert 0">x</failure></testcase>
<testcase classname="tests.test_gpu_a" name="test_3" time="0.0"><error message="failed on teardown">x</error></testcase>
<testcase classname="tests.test_gpu_a" name="test_4" time="0.0"><skipped message="needs 2 ranks">x</skipped></testcase>
<testcase classname="" name="tests.test_gpu_b" time="0.0"><error message="collection failure">x</error></testcase>
</testsuite></testsuites>"""
RANK1_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_gpu_a" name="test_1" time="2.0" />
<testcase classname="tests.test_gpu_a.TestK" name="test_2" time="0.5" />
<testcase classname="tests.test_gpu_a" name="test_3" time="0.25" />
<testcase classname="tests.test_gpu_a" name="test_4" time="0.0"><skipped message="needs 2 ranks">x</skipped></testcase>
<testcase classname="" name="tests.test_gpu_b" time="0.0"><error message="collection failure">x</error></testcase>
</testsuite></testsuites>"""


def sanitized_env(**extra: str) -> dict[str, str]:
    """This environment without the multicast variables and any launcher's, plus extra."""
    drop = (*MULTICAST_VARS, "OUT", "CUDA_VISIBLE_DEVICES", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def script(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=sanitized_env(**MULTICAST_OFF) if env is None else env, timeout=timeout)


def row(config: str, file: str, date: str, passed: int = 1, **extra) -> dict:
    return {"config": config, "ranks": suite.CONFIGS[config].ranks, "layout": suite.CONFIGS[config].layout,
            "file": file, "passed": passed, "failed": 0, "skipped": 0, "errors": 0, "time_s": 1.0,
            "per_rank": {"0": [passed, 0, 0, 0]}, "ranks_agree": True, "missing_ranks": [], "part": "api",
            "gpus": None, "machine": "4x NVIDIA H100 80GB HBM3", "date": date, "wall_s": 60.0,
            "exit_code": 0, "timed_out": False, **extra}


def test_junit_counts_per_file_as_pytest_counts_them(tmp_path):
    (tmp_path / "x.xml").write_text(RANK0_XML)
    counts = suite.parse_junit(tmp_path / "x.xml", FILES)
    assert counts == {
        "tests/test_gpu_a.py": {"passed": 2, "failed": 1, "skipped": 1, "errors": 1, "time_s": 2.25},
        "tests/test_gpu_b.py": {"passed": 0, "failed": 0, "skipped": 0, "errors": 1, "time_s": 0.0},
    }


def test_rows_give_rank_0s_counts_every_ranks_and_name_missing_and_differing_ranks(tmp_path):
    (tmp_path / "r4-api.rank0.xml").write_text(RANK0_XML)
    (tmp_path / "r4-api.rank1.xml").write_text(RANK1_XML)
    (tmp_path / "r4-other.rank2.xml").write_text(RANK1_XML)  # another part's: not read
    rows = suite.collect(tmp_path, "r4-api", FILES + ["tests/test_gpu_c.py"], ranks=4)
    a, b, c = rows
    assert (a["file"], a["passed"], a["failed"], a["skipped"], a["errors"]) == ("tests/test_gpu_a.py", 2, 1, 1, 1)
    assert a["per_rank"] == {"0": [2, 1, 1, 1], "1": [3, 0, 1, 0]} and not a["ranks_agree"]
    assert a["time_s"] == 2.8 and a["missing_ranks"] == [2, 3]
    assert b["ranks_agree"] and b["per_rank"] == {"0": [0, 0, 0, 1], "1": [0, 0, 0, 1]}
    assert (c["file"], c["passed"], c["errors"]) == ("tests/test_gpu_c.py", 0, 0)  # in the part, ran no test
    assert suite.collect(tmp_path, "r4-none", FILES, ranks=2)[0]["passed"] is None  # no XML at all


def test_merge_replaces_a_newer_run_of_the_same_config_and_file_and_keeps_the_rest():
    old = [row("r4", "tests/test_gpu_api.py", "2026-11-20T10:00:00Z", passed=5),
           row("r2", "tests/test_gpu_api.py", "2026-11-20T10:00:00Z", passed=6),
           row("r4", "tests/test_gpu_dtypes.py", "2026-11-22T10:00:00Z", passed=7)]
    new = [row("r4", "tests/test_gpu_api.py", "2026-11-25T10:00:00Z", passed=9),
           row("r4", "tests/test_gpu_dtypes.py", "2026-11-21T10:00:00Z", passed=1),  # older than the kept one
           row("shared4", "tests/test_gpu_api.py", "2026-11-25T10:00:00Z", passed=3)]
    merged = suite.merge_rows(old, new)
    assert [(r["config"], r["file"], r["passed"]) for r in merged] == [
        ("r2", "tests/test_gpu_api.py", 6),
        ("r4", "tests/test_gpu_api.py", 9),
        ("r4", "tests/test_gpu_dtypes.py", 7),
        ("shared4", "tests/test_gpu_api.py", 3),
    ]


def test_markdown_has_a_row_per_config_and_file_with_counts_layout_machine_date_and_notes():
    rows = [row("r8x2", "tests/test_gpu_api.py", "2026-11-25T10:00:00Z", passed=40, skipped=2),
            row("shared4", "tests/test_gpu_fused.py", "2026-11-25T11:00:00Z", passed=None, exit_code=124,
                timed_out=True, wall_s=540.2, missing_ranks=[0, 1, 2, 3], per_rank={}),
            row("r2", "tests/test_gpu_rsag.py", "2026-11-24T09:00:00Z", passed=8, exit_code=1, ranks_agree=False,
                per_rank={"0": [8, 0, 0, 0], "1": [7, 1, 0, 0]})]
    lines = suite.render_markdown(rows).splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].split(" | ")[:5] == ["| config", "ranks", "layout", "file", "passed"]
    assert table[1] == ("| r8x2 | 8 | 2 ranks per GPU, 4 GPUs | test_gpu_api.py | 40 | 0 | 2 | 0 | 1 | api (60) "
                        "| 4x NVIDIA H100 80GB HBM3 | 2026-11-25 |  |")
    assert "| shared4 | 4 | 4 ranks on 1 GPU | test_gpu_fused.py | - | 0 | 0 | 0 |" in table[2]
    assert table[2].endswith("| timed out (540 s); no XML from rank 0, 1, 2, 3 |")
    assert table[3].endswith("| part exit 1; ranks differ (p/f/s/e): r0 8/0/0/0; r1 7/1/0/0 |")
    assert "No run yet." in suite.render_markdown([]) and "| config" not in suite.render_markdown([])


@pytest.mark.parametrize("missing", [*MULTICAST_OFF, "UBNEXT_NVLS=1"])
def test_refuses_to_run_unless_multicast_is_off(missing):
    env = sanitized_env(**{k: v for k, v in MULTICAST_OFF.items() if k != missing})
    if missing == "UBNEXT_NVLS=1":
        env["UBNEXT_NVLS"] = "1"
    proc = script("run", "--config", "r4", "--part", "api", "--dry-run", env=env)
    assert proc.returncode == 3 and proc.stdout == ""
    assert "refusing to run: NVLink multicast must stay off" in proc.stderr
    assert (f"{missing}=<unset>" if missing in MULTICAST_OFF else "UBNEXT_NVLS=1") in proc.stderr


MPIRUN = ("mpirun --allow-run-as-root --oversubscribe -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE "
          "-x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x XLA_PYTHON_CLIENT_PREALLOCATE")
PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider --continue-on-collection-errors"
API = "tests/test_gpu_api.py tests/test_gpu_fallback.py tests/test_gpu_tune.py"
XML = "'--junitxml=XMLDIR/{}-api.rank$OMPI_COMM_WORLD_RANK.xml'"


@pytest.mark.parametrize("config, gpus, expected", [
    ("r1", None, f"timeout -k 10 540 {PYTEST} --junitxml=XMLDIR/r1-api.rank0.xml {API}"),
    ("r1", "3", f"CUDA_VISIBLE_DEVICES=3 timeout -k 10 540 {PYTEST} --junitxml=XMLDIR/r1-api.rank0.xml {API}"),
    ("r2", None, f"timeout -k 10 540 {MPIRUN} -n 2 {PYTEST} {XML.format('r2')} {API}"),
    ("r2", "2,3", f"CUDA_VISIBLE_DEVICES=2,3 timeout -k 10 540 {MPIRUN} -x CUDA_VISIBLE_DEVICES -n 2 {PYTEST} "
                  f"{XML.format('r2')} {API}"),
    ("r4", None, f"timeout -k 10 540 {MPIRUN} -n 4 {PYTEST} {XML.format('r4')} {API}"),
    ("r8x2", None, f"timeout -k 10 540 {MPIRUN} -n 8 {PYTEST} {XML.format('r8x2')} {API}"),
    ("shared4", None, f"CUDA_VISIBLE_DEVICES=0 timeout -k 10 540 {MPIRUN} -x CUDA_VISIBLE_DEVICES -n 4 {PYTEST} "
                      f"{XML.format('shared4')} {API}"),
    ("shared4", "2", f"CUDA_VISIBLE_DEVICES=2 timeout -k 10 540 {MPIRUN} -x CUDA_VISIBLE_DEVICES -n 4 {PYTEST} "
                     f"{XML.format('shared4')} {API}"),
    ("own-visible4", None, f"timeout -k 10 540 {MPIRUN} -n 4 bash .ci/own_gpu.sh 0,1,2,3 {PYTEST} "
                           f"{XML.format('own-visible4')} {API}"),
    ("own-visible2", "2,3", f"timeout -k 10 540 {MPIRUN} -n 2 bash .ci/own_gpu.sh 2,3 {PYTEST} "
                            f"{XML.format('own-visible2')} {API}"),
])
def test_dry_run_prints_each_configurations_command(config, gpus, expected):
    proc = script("run", "--config", config, "--part", "api", *(("--gpus", gpus) if gpus else ()), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [expected]


def test_one_rank_only_files_run_at_1_rank_and_are_left_out_under_mpirun():
    r1 = script("run", "--config", "r1", "--part", "all", "--dry-run")
    r4 = script("run", "--config", "r4", "--part", "all", "--dry-run")
    assert all(f in r1.stdout for f in suite.ONE_RANK_ONLY)
    assert r4.returncode == 0 and not any(f in r4.stdout for f in suite.ONE_RANK_ONLY)
    assert "tests/test_gpu_selftest.py" in r4.stdout and "tests/test_gpu_api.py" in r4.stdout
    launch = script("run", "--config", "r2", "--part", "launch", "--dry-run")
    assert launch.returncode == 0 and "nothing to run at 2 ranks" in launch.stdout


def test_a_gpu_list_of_the_wrong_length_is_refused():
    proc = script("run", "--config", "r4", "--part", "api", "--gpus", "0,1", "--dry-run")
    assert proc.returncode == 1 and "spreads its ranks over 4 GPU(s); --gpus names 2" in proc.stderr


def test_parts_name_existing_files_each_once_and_every_gpu_file_lands_in_one():
    named = [f for files in suite.PARTS.values() for f in files]
    assert len(named) == len(set(named))
    assert all((REPO / f).is_file() for f in named), [f for f in named if not (REPO / f).is_file()]
    found = suite.discover()
    assert "tests/test_gpu_api.py" in found and all(f.startswith("tests/test_gpu_") for f in found)
    for f in found:
        parts = [p for p in (*suite.PARTS, "rest") if f in suite.part_files(p, found)]
        assert len(parts) == 1, (f, parts)
    assert suite.part_files("all", found) == found and set(suite.ONE_RANK_ONLY) <= set(named)


@pytest.mark.parametrize("local_rank, visible", [("0", "4"), ("2", "6")])
def test_own_gpu_wrapper_gives_each_rank_its_entry_of_the_list(local_rank, visible):
    proc = subprocess.run(["bash", ".ci/own_gpu.sh", "4,5,6,7", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "OMPI_COMM_WORLD_LOCAL_RANK": local_rank})
    assert proc.returncode == 0 and proc.stdout == f"{visible}\n"
    short = subprocess.run(["bash", ".ci/own_gpu.sh", "4", "true"], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert short.returncode == 2 and "local rank 1, but the GPU list has 1 entries" in short.stderr


FAKE_MPIRUN = textwrap.dedent("""\
    #!{python}
    # Open MPI's mpirun for the test: skips its options, starts -n N copies with the rank variables.
    import os, subprocess, sys, time
    if os.environ.get("FAKE_MPIRUN_HANG"):
        time.sleep(600)
    args = sys.argv[1:]
    while args[0] != "-n":
        args = args[2:] if args[0] == "-x" else args[1:]
    n, cmd = int(args[1]), args[2:]
    procs = [subprocess.Popen(cmd, env={{**os.environ, "OMPI_COMM_WORLD_RANK": str(r),
                                        "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(n)}})
             for r in range(n)]
    sys.exit(max(p.wait() for p in procs))
    """)


@pytest.fixture
def fake_mpirun_env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text(FAKE_MPIRUN.format(python=sys.executable))
    (bin_dir / "mpirun").chmod(0o755)
    return sanitized_env(**MULTICAST_OFF, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"))


@pytest.mark.parametrize("config", ["r1", "own-visible2"])
def test_a_run_writes_one_json_and_one_log_with_every_ranks_counts(config, fake_mpirun_env, tmp_path):
    proc = script("run", "--config", config, "--files", "tests/test_agreement.py", "--name", "agree",
                  env=fake_mpirun_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [f"{config}-agree.json", f"{config}-agree.log"]
    result = json.loads((out / f"{config}-agree.json").read_text())
    ranks = suite.CONFIGS[config].ranks
    assert (result["exit_code"], result["timed_out"], result["machine"]) == (0, False, "unknown")
    assert result["date"].endswith("Z") and result["wall_s"] > 0
    (r,) = result["rows"]
    assert (r["config"], r["file"], r["failed"], r["errors"], r["ranks_agree"]) == (
        config, "tests/test_agreement.py", 0, 0, True)
    assert r["passed"] >= 8 and r["per_rank"] == {str(k): [r["passed"], 0, 0, 0] for k in range(ranks)}
    log = (out / f"{config}-agree.log").read_text()
    assert log.startswith(f"===== {config}-agree: {ranks} ranks") and "\n===== exit 0 after" in log
    assert f"{r['passed']} passed" in log and "test_agreement.py" in proc.stdout
    merged = script("merge", str(out / f"{config}-agree.json"), "--summary", str(tmp_path / "s" / "summary.json"))
    assert merged.returncode == 0, merged.stderr
    assert json.loads((tmp_path / "s" / "summary.json").read_text()) == result["rows"]
    assert f"| {config} | {ranks} |" in (tmp_path / "s" / "summary.md").read_text()


def test_a_hung_part_is_killed_at_its_timeout_and_recorded_as_such(fake_mpirun_env, tmp_path):
    proc = script("run", "--config", "r2", "--files", "tests/test_agreement.py", "--timeout", "2",
                  env={**fake_mpirun_env, "FAKE_MPIRUN_HANG": "1"})
    assert proc.returncode == 124, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "r2-files.json").read_text())
    assert result["timed_out"] and 2 <= result["wall_s"] < 30
    assert result["rows"][0]["passed"] is None and result["rows"][0]["missing_ranks"] == [0, 1]
    assert "TIMED OUT" in proc.stdout
