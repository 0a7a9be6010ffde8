"""python -m ubnext.tune on the CPU: the winner / margin / row-merging rules on
synthetic timings, merging files across world sizes, and the measuring and
writing flow on a numpy stand-in for the GPU (tests/bench_fakes.py)."""

from __future__ import annotations

import json
import time

import bench_fakes as fakes
import numpy as np
import pytest
from stream_fakes import fake_context

from ubnext import UbnextError, tune
from ubnext._selection.select import Selector
from ubnext._selection.table import load_table

KiB, MiB = 1 << 10, 1 << 20
ALL = ["lamport", "twoshot", "nccl"]


# --------------------------------------------------------------------------- winners and rows


@pytest.mark.parametrize("times, margin, want", [
    ({"lamport": 4.0, "twoshot": 8.0, "nccl": 9.0}, 3, "lamport"),
    ({"lamport": None, "twoshot": 8.0, "nccl": 9.0}, 3, "twoshot"),       # lamport refused the size
    ({"lamport": None, "twoshot": 97.0, "nccl": 100.0}, 3, "twoshot"),    # 97 * 1.03 <= 100
    ({"lamport": None, "twoshot": 97.5, "nccl": 100.0}, 3, "nccl"),       # not 3 % faster
    ({"lamport": None, "twoshot": 97.5, "nccl": 100.0}, 0, "twoshot"),
    ({"lamport": None, "twoshot": 101.0, "nccl": 100.0}, 0, "nccl"),
    ({"lamport": 5.0, "twoshot": 5.0, "nccl": 9.0}, 3, "lamport"),        # tie: table order
    ({"nccl": 3.0}, 3, "nccl"),
    ({"twoshot": 3.0}, 3, "twoshot"),                                     # no NCCL measured
])
def test_winner_prefers_nccl_unless_a_kernel_beats_it_by_the_margin(times, margin, want):
    assert tune.winner(times, margin) == want


def test_winner_needs_a_measurement():
    with pytest.raises(ValueError, match="no algorithm was measured"):
        tune.winner({"lamport": None, "nccl": None}, 3)


def test_table_rows_merge_adjacent_sizes_and_leave_the_last_open():
    sizes = [1 * KiB, 2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB]
    assert tune.table_rows(sizes, ["lamport", "lamport", "twoshot", "twoshot", "nccl"]) == [
        [2 * KiB, "lamport"], [8 * KiB, "twoshot"], [None, "nccl"]]
    assert tune.table_rows(sizes[:1], ["nccl"]) == [[None, "nccl"]]
    assert tune.table_rows(sizes[:3], ["lamport", "twoshot", "lamport"]) == [
        [1 * KiB, "lamport"], [2 * KiB, "twoshot"], [None, "lamport"]]
    with pytest.raises(ValueError):
        tune.table_rows(sizes, ["nccl"])


def test_merged_document_keeps_other_world_sizes_and_dtypes():
    four = tune.merged_document(None, "GPU A", 4, {"bfloat16": [[512 * KiB, "lamport"], [None, "nccl"]]},
                                {"bfloat16": {"winners": []}})
    assert four["format"] == 2 and len(four["entries"]) == 1
    a = four["entries"][0]
    assert {k: a[k] for k in ("gpu", "link", "placement", "mode")} == {
        "gpu": "GPU A", "link": "nvlink", "placement": "plain", "mode": "graph"}
    both = tune.merged_document(four, "GPU A", 2, {"bfloat16": [[None, "twoshot"]]}, {"bfloat16": {}})
    assert len(both["entries"]) == 1 and set(both["entries"][0]["tables"]) == {"4", "2"}
    again = tune.merged_document(both, "GPU A", 4, {"float32": [[None, "nccl"]]}, {"float32": {}})
    tables = again["entries"][0]["tables"]
    assert set(tables["4"]) == {"bfloat16", "float32"}      # dtype granularity
    assert tables["4"]["bfloat16"] == a["tables"]["4"]["bfloat16"]
    assert a["tables"] == {"4": {"bfloat16": [[512 * KiB, "lamport"], [None, "nccl"]]}}  # not mutated
    # another machine: its own entry; the first kept as it was
    other = tune.merged_document(again, "GPU B", 4, {"bfloat16": [[None, "nccl"]]}, {"bfloat16": {}})
    assert [e["gpu"] for e in other["entries"]] == ["GPU A", "GPU B"]
    assert other["entries"][0] == again["entries"][0]
    assert other["entries"][1]["tables"] == {"4": {"bfloat16": [[None, "nccl"]]}}


def test_merged_document_refuses_what_ubnext_cannot_read():
    with pytest.raises(UbnextError, match="unknown algorithm 'ring'"):
        tune.merged_document(None, "GPU", 4, {"bfloat16": [[None, "ring"]]}, {})


# --------------------------------------------------------------------------- arguments


def test_parse_args_defaults_and_checks(tmp_path, capsys):
    args = tune.parse_args(["-o", str(tmp_path / "t.json")])
    assert args.dtypes == ["bfloat16"] and args.sizes[0] == 1 * KiB and args.sizes[-1] == 256 * MiB
    assert len(args.sizes) == 19 and args.margin == 3.0
    assert tune.parse_args(["--dtype", "all"]).dtypes == ["bfloat16", "float16", "float32"]
    assert tune.parse_args(["--dtype", "float32,bfloat16", "-b", "4K", "-e", "64K", "-f", "4"]).sizes == [
        4 * KiB, 16 * KiB, 64 * KiB]
    for bad in (["--dtype", "int8"], ["-f", "1"], ["-b", "8"], ["-n", "0"], ["-o", "/no/such/dir/t.json"]):
        with pytest.raises(SystemExit):
            tune.parse_args(bad)
    assert "-o: the directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- the flow on fake GPUs


class FakeBootstrap(fakes.Bootstrap):
    def bcast_obj(self, obj, root=0):
        return obj


class FakeComm:
    """One rank pretending to be ``size`` ranks; Lamport refuses more than ``lamport_max`` bytes."""

    def __init__(self, size=4, usable=tuple(ALL), lamport_max=1 * MiB):
        self._context = fake_context(0)  # the device guard, on a fake driver
        self.rank, self.size, self.device = 0, size, 0
        self.bootstrap = FakeBootstrap()
        self._usable, self._lamport_max = list(usable), lamport_max
        nccl_only = list(usable) == ["nccl"]
        self.path = "NCCL only: ranks span several nodes" if nccl_only else "kernels on the symmetric pool"
        self.calls = 0

    def algorithms(self):
        return self._usable

    def all_reduce(self, x, out=None, algorithm="auto", stream=None):
        if algorithm == "lamport" and x.host.nbytes > self._lamport_max:
            raise UbnextError(f"all_reduce: algorithm 'lamport' cannot take {x.host.nbytes} bytes")

        def work():
            self.calls += 1
        stream.enqueue(work)


@pytest.fixture
def cupy(monkeypatch):
    fake = fakes.install(monkeypatch)
    fake.zeros = lambda shape, dtype: fakes.empty(shape, dtype)
    fake.empty_like = lambda a: fakes.empty(a.host.shape, a.host.dtype)
    return fake


def test_time_algorithm_captures_launches_and_agrees_on_refusals(cupy):
    comm = FakeComm(lamport_max=4)
    args = tune.parse_args(["-n", "3", "-G", "2", "--repeats", "5", "-w", "2"])
    buf = cupy.zeros((8,), np.float32)
    us = tune.time_algorithm(comm, cupy.cuda.Stream(), "twoshot", buf, buf, args)
    assert us is not None and us >= 0
    assert comm.calls == 2 + 3 * (1 + 2 * 5)  # warm-up, graph upload, launches × samples
    assert tune.time_algorithm(comm, cupy.cuda.Stream(), "lamport", buf, buf, args) is None


def test_time_algorithm_raises_when_ranks_disagree(cupy):
    comm = FakeComm(lamport_max=4)
    comm.bootstrap.allgather_obj = lambda obj: [obj, None]
    args = tune.parse_args(["-n", "1", "-G", "1", "--repeats", "1"])
    buf = cupy.zeros((8,), np.float32)
    with pytest.raises(UbnextError, match="ranks disagree whether lamport"):
        tune.time_algorithm(comm, cupy.cuda.Stream(), "lamport", buf, buf, args)


def synthetic_times(nbytes: int, usable) -> dict:
    """Lamport fast below 512 KiB, two-shot best to 32 MiB, NCCL 1 % faster beyond (the 4xH200 shape)."""
    nccl = 12.0 + nbytes / 8e4
    times = {"lamport": 4.0 + nbytes / 5e4 if nbytes <= 1 * MiB else None,
             "twoshot": 10.0 + nbytes / 1e5 if nbytes <= 32 * MiB else nccl * 1.01,
             "nccl": nccl}
    return {k: v for k, v in times.items() if k in usable}


def test_run_measures_writes_merges_and_prints_the_export_line(cupy, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "measure_dtype", lambda comm, stream, dtype, args, progress: [
        synthetic_times(n, comm.algorithms()) for n in args.sizes])
    out = tmp_path / "tune.json"
    args = tune.parse_args(["-o", str(out)])
    assert tune.run(FakeComm(4), args, ["-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"export UBNEXT_TUNE_FILE={out}" in text
    assert "# rows for 4 ranks bfloat16: ≤ 512 KiB lamport, ≤ 32 MiB twoshot, then nccl" in text
    assert "   256 MiB           —" in text  # lamport refused: shown as a dash
    table = load_table(str(out))
    assert table.format == 2 and len(table.entries) == 1
    entry = table.entries[0]
    assert entry.rows["4"]["bfloat16"] == ((512 * KiB, "lamport"), (32 * MiB, "twoshot"), (None, "nccl"))
    record = entry.entry["measured"]["4"]["bfloat16"]
    assert record["sizes"] == args.sizes and len(record["us"]["nccl"]) == 19 and record["margin_percent"] == 3

    # A second run at 2 ranks, other dtypes, lands in the same file.
    args2 = tune.parse_args(["-o", str(out), "--dtype", "float32", "-e", "64M"])
    assert tune.run(FakeComm(2), args2, []) == 0
    table = load_table(str(out))
    assert len(table.entries) == 1  # the same machine's entry
    rows = table.entries[0].rows
    assert set(rows) == {"4", "2"} and set(rows["2"]) == {"float32"}
    limits = {"lamport": (1 * MiB, "UBNEXT_LAMPORT_MAX_KB=1024")}
    sel = Selector(4, limits, ALL, table)
    assert sel.select(256 * KiB, "bfloat16") == "lamport" and sel.select(1 << 30, "bfloat16") == "nccl"
    assert Selector(2, limits, ALL, table).explain(64, "bfloat16")[1].startswith(
        "table row ≤ 512 KiB for 2 ranks float32 (no bfloat16 rows) (tune file ")


def test_run_refuses_an_invalid_existing_file_before_measuring(cupy, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "measure_dtype", lambda *a: pytest.fail("measured despite a bad output file"))
    out = tmp_path / "tune.json"
    out.write_text(json.dumps({"4": [[1, "lamport"]]}))
    assert tune.run(FakeComm(4), tune.parse_args(["-o", str(out)]), []) == 2
    assert "exists and is not a valid table" in capsys.readouterr().err
    assert json.loads(out.read_text()) == {"4": [[1, "lamport"]]}  # untouched


def test_run_refuses_an_nccl_only_communicator(cupy, tmp_path, capsys):
    assert tune.run(FakeComm(4, usable=["nccl"]), tune.parse_args(["-o", str(tmp_path / "t.json")]), []) == 2
    assert "runs NCCL only: ranks span several nodes" in capsys.readouterr().err


def test_measure_dtype_on_fake_gpus_covers_every_size_and_algorithm(cupy):
    comm = FakeComm(lamport_max=4 * KiB)
    args = tune.parse_args(["-b", "1K", "-e", "16K", "-f", "4", "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    seen = []
    start = time.perf_counter()
    rows = tune.measure_dtype(comm, cupy.cuda.Stream(), "float32", args, seen.append)
    assert time.perf_counter() - start < 10
    assert [sorted(r) for r in rows] == [sorted(ALL)] * 3
    assert [r["lamport"] is None for r in rows] == [False, False, True]
    assert seen[0] == "float32    1 KiB lamport"
