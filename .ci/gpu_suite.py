#!/usr/bin/env python3
"""Runs the GPU test suites (every tests/test_gpu_*.py) in one configuration of ranks and
GPUs at a time, in parts that each fit a 10-minute command, and keeps the record of the
rank counts they last passed at (tests/gpu_suite/summary.md; see README.md there).

  python .ci/gpu_suite.py parts                                # the parts and their files
  python .ci/gpu_suite.py run --config r4 --part api           # 4 ranks, a GPU each
  python .ci/gpu_suite.py run --config r2 --gpus 2,3 --files tests/test_gpu_api.py --name api23
  python .ci/gpu_suite.py run --config r8x2 --part dtypes --dry-run   # print the command only
  python .ci/gpu_suite.py merge gpu_suite_out/*.json           # into tests/gpu_suite/summary.*

Configurations (CONFIGS): r1 plain pytest; under mpirun r2, r4 (a GPU per rank), r8x2 (two
ranks per GPU on 4), shared2/4 (all ranks on one GPU), own-visible2/4 (each rank sees only
its GPU, as `srun --gpus-per-task=1` gives: .ci/own_gpu.sh). --gpus pins a part to GPUs, so
parts on disjoint sets may run side by side. ONE_RANK_ONLY files start their own processes
and skip every test under a launcher: they run at 1 rank only. A run writes only
<out>/<config>-<part>.json and .log (--out, else $OUT, else ./gpu_suite_out); the JUnit XML
go to a temporary directory. Refuses to run unless NVLink multicast is off (the rule is
.ci/gpu_env.sh's). Exit status: pytest's (mpirun's); 124 when the part timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUMMARY = REPO / "tests" / "gpu_suite" / "summary.json"
OUTCOMES = ("passed", "failed", "skipped", "errors")
#: variables mpirun hands to every rank (-x); CUDA_VISIBLE_DEVICES too where the part pins GPUs
EXPORTED = ("PYTHONPATH", "PYTHONUNBUFFERED", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "NVSHMEM_DISABLE_NVLS", "XLA_PYTHON_CLIENT_PREALLOCATE")
MPIRUN = ("mpirun", "--allow-run-as-root", "--oversubscribe")
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors")
#: each rank's JUnit file: pytest expands variables in --junitxml
RANK_VAR = "$OMPI_COMM_WORLD_RANK"
TIMEOUT_S = 540  # a part and its start-up within a 10-minute command
KILL_AFTER_S = 10


@dataclass(frozen=True)
class Config:
    ranks: int
    gpus: int  # how many GPUs the ranks spread over
    layout: str
    own: bool = False  # each rank sees only its own GPU (.ci/own_gpu.sh)


CONFIGS = {
    "r1": Config(1, 1, "1 rank"),
    "r2": Config(2, 2, "1 GPU per rank"),
    "r4": Config(4, 4, "1 GPU per rank"),
    "r8x2": Config(8, 4, "2 ranks per GPU, 4 GPUs"),
    "shared2": Config(2, 1, "2 ranks on 1 GPU"),
    "shared4": Config(4, 1, "4 ranks on 1 GPU"),
    "own-visible2": Config(2, 2, "1 GPU per rank, each sees only its own", own=True),
    "own-visible4": Config(4, 4, "1 GPU per rank, each sees only its own", own=True),
}

#: Parts, each meant to run within TIMEOUT_S. "all" is every file; "rest" every file no part names.
PARTS = {
    # at 4 ranks this file alone needs about 17 minutes (a third of it ran in 320 s on 4 H100s):
    # run it in slices, e.g. PYTEST_ADDOPTS="-k 'lamport and not twoshot'" (tests/gpu_suite/README.md)
    "allreduce": ("tests/test_gpu_allreduce.py",),
    "protocol": ("tests/test_gpu_deterministic.py", "tests/test_gpu_protocol.py", "tests/test_gpu_pdl.py",
                 "tests/test_gpu_subnormal.py"),
    "api": ("tests/test_gpu_api.py", "tests/test_gpu_fallback.py", "tests/test_gpu_tune.py"),
    "dtypes": ("tests/test_gpu_dtypes.py", "tests/test_gpu_quant.py"),
    "rsag": ("tests/test_gpu_rsag.py", "tests/test_gpu_streams.py"),
    "fused": ("tests/test_gpu_fused.py", "tests/test_gpu_plans.py", "tests/test_gpu_failures.py"),
    "frameworks": ("tests/test_gpu_torch_ops.py", "tests/test_gpu_torch_tp.py", "tests/test_gpu_interop.py",
                   "tests/test_gpu_selftest.py"),
    "launch": ("tests/test_gpu_launch.py", "tests/test_gpu_dead_peer.py"),
}
#: start their own ranks (torchrun, two processes) and skip every test under mpirun
ONE_RANK_ONLY = ("tests/test_gpu_launch.py", "tests/test_gpu_dead_peer.py")


def discover() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("test_gpu_*.py"))


def part_files(part: str, found: list[str]) -> list[str]:
    if part == "all":
        return found
    if part == "rest":
        named = {f for files in PARTS.values() for f in files}
        return [f for f in found if f not in named]
    return [f for f in PARTS[part] if f in found]


def require_multicast_off() -> None:
    """Exits 3 unless .ci/gpu_env.sh, the one place with the rule, accepts this environment."""
    if subprocess.run(["bash", str(REPO / ".ci" / "gpu_env.sh")]).returncode != 0:
        sys.exit(3)


def machine() -> tuple[int, str]:
    """(GPU count, "4x NVIDIA H100 80GB HBM3"), or (0, "unknown") without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, "unknown"
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return len(names), ", ".join(f"{names.count(n)}x {n}" for n in sorted(set(names))) or "unknown"


def choose_gpus(name: str, given: str | None) -> list[str] | None:
    """The GPUs a part uses (CUDA_VISIBLE_DEVICES entries), or None to inherit them."""
    config = CONFIGS[name]
    if given:
        gpus = given.split(",")
        if len(gpus) != config.gpus:
            sys.exit(f"--config {name} spreads its ranks over {config.gpus} GPU(s); --gpus names {len(gpus)}")
        return gpus
    if config.own or (config.gpus == 1 and config.ranks > 1):  # own-visible*, shared*
        return [str(i) for i in range(config.gpus)]
    return None


def command(config: Config, files: list[str], gpus: list[str] | None, xml_stem: str) -> list[str]:
    """The command of one part, without the timeout around it."""
    rank = RANK_VAR if config.ranks > 1 else "0"
    pytest = [sys.executable, *PYTEST, f"--junitxml={xml_stem}.rank{rank}.xml", *files]
    if config.ranks == 1:
        return pytest
    exported = EXPORTED + (("CUDA_VISIBLE_DEVICES",) if gpus and not config.own else ())
    launcher = [*MPIRUN, *(a for var in exported for a in ("-x", var)), "-n", str(config.ranks)]
    wrapper = ["bash", ".ci/own_gpu.sh", ",".join(gpus)] if config.own else []
    return launcher + wrapper + pytest


def rank_env(config: Config, gpus: list[str] | None) -> dict[str, str]:
    """The variables a part sets for its ranks, on top of this environment."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if gpus and not config.own:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def run_part(argv: list[str], env: dict[str, str], log, timeout_s: int) -> tuple[int, float, bool]:
    """Runs argv under `timeout` (SIGTERM, then SIGKILL), output appended to log; (rc, s, timed out)."""
    start = time.monotonic()
    proc = subprocess.Popen(["timeout", "-k", str(KILL_AFTER_S), str(timeout_s), *argv], cwd=REPO,
                            env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout_s + KILL_AFTER_S + 30)
    except subprocess.TimeoutExpired:  # `timeout` itself hung: end its whole session
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    wall = time.monotonic() - start
    return rc, wall, rc in (124, 137, -signal.SIGKILL) and wall >= timeout_s


def file_of(case: ET.Element, files: list[str]) -> str:
    """The test file of a JUnit testcase: classname tests.test_x[.Class], or name for a collection error."""
    dotted = case.get("classname") or case.get("name", "")
    for f in files:
        module = f.removesuffix(".py").replace("/", ".")
        if dotted == module or dotted.startswith(module + "."):
            return f
    return dotted


def parse_junit(path: Path, files: list[str]) -> dict[str, dict[str, float]]:
    """Per test file: passed, failed, skipped, errors (pytest's counts) and time_s, from one XML."""
    counts: dict[str, dict[str, float]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        c = counts.setdefault(file_of(case, files), dict.fromkeys((*OUTCOMES, "time_s"), 0))
        kinds = {child.tag for child in case}
        outcome = next((o for t, o in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped"))
                        if t in kinds), "passed")
        c[outcome] += 1
        c["time_s"] += float(case.get("time") or 0)
    return counts


def collect(xml_dir: Path, stem: str, files: list[str], ranks: int) -> list[dict]:
    """One row per file: rank 0's counts (the lowest rank that wrote XML), every rank's, whether they agree."""
    per_rank = {}
    for path in xml_dir.glob(f"{stem}.rank*.xml"):
        rank = path.name.removesuffix(".xml").rsplit(".rank", 1)[1]
        if rank.isdigit():
            per_rank[int(rank)] = parse_junit(path, files)
    rows = []
    for f in files + sorted({k for c in per_rank.values() for k in c} - set(files)):
        counts = {r: per_rank[r].get(f, dict.fromkeys((*OUTCOMES, "time_s"), 0)) for r in sorted(per_rank)}
        first = next(iter(counts.values()), None)
        rows.append({
            "file": f, **{o: (int(first[o]) if first else None) for o in OUTCOMES},
            "time_s": round(max((c["time_s"] for c in counts.values()), default=0), 1),
            "per_rank": {str(r): [int(c[o]) for o in OUTCOMES] for r, c in counts.items()},
            "ranks_agree": len({tuple(c[o] for o in OUTCOMES) for c in counts.values()}) <= 1,
            "missing_ranks": [r for r in range(ranks) if r not in per_rank],
        })
    return rows


def note(row: dict) -> str:
    parts = []
    if row["timed_out"]:
        parts.append(f"timed out ({row['wall_s']:.0f} s)")
    elif row["exit_code"] != 0:
        parts.append(f"part exit {row['exit_code']}")
    if row["missing_ranks"]:
        parts.append("no XML from rank " + ", ".join(map(str, row["missing_ranks"])))
    if not row["ranks_agree"]:
        parts.append("ranks differ (p/f/s/e): " + "; ".join(f"r{r} {'/'.join(map(str, c))}"
                                                             for r, c in row["per_rank"].items()))
    return "; ".join(parts)


def render_markdown(rows: list[dict]) -> str:
    head = ["# GPU suite: the last run of each configuration and file", "",
            "Written by `python .ci/gpu_suite.py merge` from `summary.json`; counts are rank 0's "
            "(the note says where ranks differ). See README.md here.", ""]
    if not rows:
        return "\n".join(head + ["No run yet.", ""])
    cols = ["config", "ranks", "layout", "file", "passed", "failed", "skipped", "errors", "time (s)",
            "part (wall s)", "machine", "date (UTC)", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        counts = ["-" if r[o] is None else str(r[o]) for o in OUTCOMES]
        cells = [r["config"], str(r["ranks"]), r["layout"], r["file"].removeprefix("tests/"), *counts,
                 f"{r['time_s']:.0f}", f"{r['part']} ({r['wall_s']:.0f})", r["machine"], r["date"][:10], note(r)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(head + lines + [""])


def sort_key(row: dict) -> tuple:
    return list(CONFIGS).index(row["config"]) if row["config"] in CONFIGS else len(CONFIGS), row["config"], row["file"]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Keeps every (config, file); a row replaces the one it shares that key with unless that one is newer."""
    rows = {(r["config"], r["file"]): r for r in old}
    for r in new:
        key = (r["config"], r["file"])
        if key not in rows or r["date"] >= rows[key]["date"]:
            rows[key] = r
    return sorted(rows.values(), key=sort_key)


def print_table(result: dict) -> None:
    print(f"===== {result['config']} {result['part']}: exit {result['exit_code']}, {result['wall_s']:.0f} s"
          f"{', TIMED OUT' if result['timed_out'] else ''}, {result['machine']}")
    for r in result["rows"]:
        counts = "  ".join(f"{'-' if r[o] is None else r[o]} {o}" for o in OUTCOMES)
        print(f"{r['file'].removeprefix('tests/'):32} {counts}  {note(r)}")
    for f in result["excluded"]:
        print(f"{f.removeprefix('tests/'):32} not run: one rank only")


def select_files(args: argparse.Namespace, config: Config) -> tuple[list[str], list[str]]:
    """(files to run, ONE_RANK_ONLY files left out at this rank count)."""
    files = part_files(args.part, discover()) if args.part else args.files
    for f in files:
        if not (REPO / f).is_file():
            sys.exit(f"no such test file: {f} (paths are relative to {REPO})")
    excluded = [f for f in files if config.ranks > 1 and f in ONE_RANK_ONLY]
    return [f for f in files if f not in excluded], excluded


def dry_run(config: Config, files: list[str], gpus: list[str] | None, stem: str, timeout_s: int) -> None:
    env = rank_env(config, gpus)
    prefix = [f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"] if "CUDA_VISIBLE_DEVICES" in env else []
    argv = command(config, files, gpus, f"XMLDIR/{stem}")
    print(shlex.join([*prefix, "timeout", "-k", str(KILL_AFTER_S), str(timeout_s), *argv]))


def execute(args: argparse.Namespace, files: list[str], gpus: list[str] | None, part: str, out: Path) -> dict:
    """Runs the part with its output in <out>/<config>-<part>.log; returns its result."""
    config, stem = CONFIGS[args.config], f"{args.config}-{part}"
    count, name = machine()
    if count and not args.gpus and count < config.gpus:
        sys.exit(f"--config {args.config} needs {config.gpus} GPUs; this machine has {count}")
    xml_dir = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    argv = command(config, files, gpus, str(xml_dir / stem))
    date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with open(out / f"{stem}.log", "w") as log:
        log.write(f"===== {stem}: {config.ranks} ranks, {config.layout}, GPUs {','.join(gpus or ['inherited'])}, "
                  f"{name}, {date}\n===== {shlex.join(argv)}\n")
        log.flush()
        rc, wall, timed_out = run_part(argv, rank_env(config, gpus), log, args.timeout)
        log.write(f"\n===== exit {rc} after {wall:.0f} s{' (timed out)' if timed_out else ''}\n")
    common = {"config": args.config, "ranks": config.ranks, "layout": config.layout, "part": part,
              "gpus": ",".join(gpus) if gpus else None, "machine": name, "date": date,
              "wall_s": round(wall, 1), "exit_code": rc, "timed_out": timed_out}
    rows = [{**common, **row} for row in collect(xml_dir, stem, files, config.ranks)]
    shutil.rmtree(xml_dir, ignore_errors=True)
    return {**common, "command": shlex.join(argv), "rows": rows}


def rows_json(rows: list[dict]) -> str:
    """A JSON list with one row a line (compact, and diffs show the rows that changed)."""
    return "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n" if rows else "[]\n"


def cmd_run(args: argparse.Namespace) -> int:
    config = CONFIGS[args.config]
    files, excluded = select_files(args, config)
    require_multicast_off()
    gpus = choose_gpus(args.config, args.gpus)
    part = args.part or args.name
    stem = f"{args.config}-{part}"
    if not files:
        print(f"{stem}: nothing to run at {config.ranks} ranks (one rank only: {' '.join(excluded)})")
        return 0
    if args.dry_run:
        dry_run(config, files, gpus, stem, args.timeout)
        return 0
    out = Path(args.out or os.environ.get("OUT") or "gpu_suite_out")
    out.mkdir(parents=True, exist_ok=True)
    result = {**execute(args, files, gpus, part, out), "excluded": excluded}
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return result["exit_code"]


def cmd_merge(args: argparse.Namespace) -> int:
    summary = Path(args.summary)
    rows = json.loads(summary.read_text()) if summary.exists() else []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        rows = merge_rows(rows, data["rows"] if isinstance(data, dict) else data)
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(rows_json(rows))
    summary.with_suffix(".md").write_text(render_markdown(rows))
    print(f"{summary}: {len(rows)} rows; {summary.with_suffix('.md')} written")
    return 0


def cmd_parts(args: argparse.Namespace) -> int:
    found = discover()
    for part in (*PARTS, "rest", "all"):
        files = part_files(part, found)
        print(f"{part:11} {' '.join(f.removeprefix('tests/') for f in files) or '(none)'}")
    print(f"one rank only: {' '.join(f.removeprefix('tests/') for f in ONE_RANK_ONLY)}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one part in one configuration")
    run.add_argument("--config", required=True, choices=list(CONFIGS))
    which = run.add_mutually_exclusive_group(required=True)
    which.add_argument("--part", choices=[*PARTS, "rest", "all"])
    which.add_argument("--files", nargs="+", help="test files, relative to the repository root")
    run.add_argument("--name", default="files", help="the part's name with --files (names the output files)")
    run.add_argument("--gpus", help="comma-separated CUDA_VISIBLE_DEVICES entries the part uses, e.g. 0,1")
    run.add_argument("--timeout", type=int, default=TIMEOUT_S, help=f"seconds for the part (default {TIMEOUT_S})")
    run.add_argument("--out", help="output directory (default $OUT, else ./gpu_suite_out)")
    run.add_argument("--dry-run", action="store_true", help="print the command and run nothing")
    merge = sub.add_parser("merge", help="merge run results into the committed summary")
    merge.add_argument("results", nargs="*", help="JSON files written by run (or summaries); none: re-render")
    merge.add_argument("--summary", default=str(SUMMARY), help="summary JSON; the Markdown goes beside it")
    sub.add_parser("parts", help="list the parts and their files")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"run": cmd_run, "merge": cmd_merge, "parts": cmd_parts}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
