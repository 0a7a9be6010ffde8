"""python -m ubnext.tune on the CPU: the winner / margin / row-merging rules on
synthetic timings, merging files across world sizes, and the measuring and
writing flow on a numpy stand-in for the GPU (tests/bench_fakes.py)."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import bench_fakes as fakes
import numpy as np
import pytest
from stream_fakes import fake_context

from ubnext import UbnextError, tune
from ubnext._protocol.algorithms import ALGORITHMS, MOVER_SERVES
from ubnext._protocol.constants import LL_MAX_BYTES
from ubnext._selection.select import Selector
from ubnext._selection.table import Machine
from ubnext._selection.table_format import load_table, parse_table
from ubnext._tools import dependent, tune_measure, tune_table

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
    assert tune_table.winner(times, margin) == want


def test_winner_needs_a_measurement():
    with pytest.raises(ValueError, match="no algorithm was measured"):
        tune_table.winner({"lamport": None, "nccl": None}, 3)


def test_table_rows_merge_adjacent_sizes_and_leave_the_last_open():
    sizes = [1 * KiB, 2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB]
    assert tune_table.table_rows(sizes, ["lamport", "lamport", "twoshot", "twoshot", "nccl"]) == [
        [2 * KiB, "lamport"], [8 * KiB, "twoshot"], [None, "nccl"]]
    assert tune_table.table_rows(sizes[:1], ["nccl"]) == [[None, "nccl"]]
    assert tune_table.table_rows(sizes[:3], ["lamport", "twoshot", "lamport"]) == [
        [1 * KiB, "lamport"], [2 * KiB, "twoshot"], [None, "lamport"]]
    with pytest.raises(ValueError):
        tune_table.table_rows(sizes, ["nccl"])


def test_merged_document_keeps_other_world_sizes_and_dtypes():
    four = tune_table.merged_document(None, "GPU A", 4, {"bfloat16": [[512 * KiB, "lamport"], [None, "nccl"]]},
                                {"bfloat16": {"winners": []}})
    assert four["format"] == 2 and len(four["entries"]) == 1
    a = four["entries"][0]
    assert {k: a[k] for k in ("gpu", "link", "placement", "mode")} == {
        "gpu": "GPU A", "link": "nvlink", "placement": "plain", "mode": "graph"}
    both = tune_table.merged_document(four, "GPU A", 2, {"bfloat16": [[None, "twoshot"]]}, {"bfloat16": {}})
    assert len(both["entries"]) == 1 and set(both["entries"][0]["tables"]) == {"4", "2"}
    again = tune_table.merged_document(both, "GPU A", 4, {"float32": [[None, "nccl"]]}, {"float32": {}})
    tables = again["entries"][0]["tables"]
    assert set(tables["4"]) == {"bfloat16", "float32"}      # dtype granularity
    assert tables["4"]["bfloat16"] == a["tables"]["4"]["bfloat16"]
    assert a["tables"] == {"4": {"bfloat16": [[512 * KiB, "lamport"], [None, "nccl"]]}}  # not mutated
    # another machine: its own entry; the first kept as it was
    other = tune_table.merged_document(again, "GPU B", 4, {"bfloat16": [[None, "nccl"]]}, {"bfloat16": {}})
    assert [e["gpu"] for e in other["entries"]] == ["GPU A", "GPU B"]
    assert other["entries"][0] == again["entries"][0]
    assert other["entries"][1]["tables"] == {"4": {"bfloat16": [[None, "nccl"]]}}


# Measured on 2x H100, bfloat16 sum, CUDA graphs (bench/all_reduce_perf.py, 2026-11-26;
# bench/NOTES.md): µs at 16, 64 and 256 MiB, out of place / in place; full precision's
# winner 56.7, 226.1, 903 both ways.
H100X2_SIZES = [16 * MiB, 64 * MiB, 256 * MiB]
H100X2 = {"out": {"int8": [62.6, 222.5, 890.0], "int4": [60.0, 209.8, 835.0]},
          "in": {"int8": [53.8, 198.8, 794.0], "int4": [49.3, 176.0, 703.0]}}


def _h100x2(place: str) -> list[dict]:
    return [{"twoshot": bf16, "nccl": 2 * bf16, **{f: us[i] for f, us in H100X2[place].items()}}
            for i, bf16 in enumerate([56.7, 226.1, 903.0])]


@pytest.mark.parametrize("place, margin, want", [
    ("in", 3, {"int8": 16 * MiB, "int4": 16 * MiB}),
    ("out", 0, {"int8": 64 * MiB, "int4": 64 * MiB}),
    ("out", 3, {"int8": "never", "int4": 64 * MiB}),   # int8 out of place: 1.4 % faster at 256 MiB
])
def test_quantized_thresholds_from_the_2xh100_measurements(place, margin, want):
    times = _h100x2(place)
    assert tune_table.quantized_thresholds(H100X2_SIZES, times, ["twoshot"] * 3, margin) == want


def test_a_quantized_threshold_needs_a_win_at_every_larger_size():
    sizes = [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]
    times = [{"twoshot": 10.0, "int8": q, "fp8": None, "int4": w}
             for q, w in zip([5.0, 11.0, 5.0, 5.0], [5.0, 5.0, 5.0, 11.0])]
    # int8 wins at 1 MiB, loses at 2 MiB, wins above: from 4 MiB; int4 loses at the largest:
    # never; fp8 refused everywhere: not measured, left out
    assert tune_table.quantized_thresholds(sizes, times, ["twoshot"] * 4, 3) == {"int8": 4 * MiB, "int4": "never"}
    # against the size's winner, which may be NCCL even where a kernel is a little faster
    times = [{"twoshot": 9.9, "nccl": 10.0, "int8": 9.95}]
    assert tune_table.quantized_thresholds([1 * MiB], times, ["nccl"], 0) == {"int8": 1 * MiB}
    assert tune_table.quantized_thresholds([1 * MiB], [{"twoshot": 1.0}], ["twoshot"], 0) == {}


def test_merged_document_writes_and_keeps_the_quantized_thresholds():
    rows = {"bfloat16": [[None, "twoshot"]]}
    two = tune_table.merged_document(None, "GPU A", 2, rows, {"bfloat16": {}},
                               quantized={"bfloat16": {"int8": 64 * MiB, "int4": "never"}})
    q = two["entries"][0]["quantized"]
    assert q["note"] == tune_table.QUANTIZED_NOTE and q["tables"] == {"2": {"bfloat16": {"int8": 64 * MiB,
                                                                                   "int4": "never"}}}
    # another world size, then a run that measured no format: both kept
    four = tune_table.merged_document(two, "GPU A", 4, rows, {}, quantized={"bfloat16": {"int8": 16 * MiB}})
    again = tune_table.merged_document(four, "GPU A", 2, rows, {}, quantized={"bfloat16": {}})
    assert again["entries"][0]["quantized"]["tables"] == {"2": {"bfloat16": {"int8": 64 * MiB, "int4": "never"}},
                                                          "4": {"bfloat16": {"int8": 16 * MiB}}}
    # a new measurement of a world size and dtype replaces its thresholds
    new = tune_table.merged_document(again, "GPU A", 2, rows, {}, quantized={"bfloat16": {"int4": 32 * MiB}})
    assert new["entries"][0]["quantized"]["tables"]["2"] == {"bfloat16": {"int4": 32 * MiB}}
    (entry,) = parse_table(new, "t").entries
    assert entry.quantized["4"] == {"bfloat16": {"int8": 16 * MiB}}
    assert "quantized" not in tune_table.merged_document(None, "GPU A", 2, rows, {})["entries"][0]
    # an entry added where an entry for any GPU served this machine starts from its thresholds too
    star = {**new, "entries": [{**new["entries"][0], "gpu": "*"}]}
    added = tune_table.merged_document(star, "GPU B", 4, rows, {})["entries"][1]
    assert added["gpu"] == "GPU B" and added["quantized"] == new["entries"][0]["quantized"]


def test_merged_document_writes_the_reduce_scatters_thresholds_apart():
    """The reduce-scatter's thresholds go to quantized.collectives.reduce_scatter, merged by
    world size and dtype as the all-reduce's; a run that measured the reduce-scatter alone
    writes them without all-reduce thresholds."""
    rows = {"bfloat16": [[None, "twoshot"]]}
    both = tune_table.merged_document(None, "GPU A", 2, rows, {}, quantized={"bfloat16": {"int8": 64 * MiB}},
                                quantized_rs={"bfloat16": {"int8": 16 * MiB, "int4": "never"}})
    q = both["entries"][0]["quantized"]
    assert q["tables"] == {"2": {"bfloat16": {"int8": 64 * MiB}}}
    assert q["collectives"] == {"reduce_scatter": {"tables": {"2": {"bfloat16": {"int8": 16 * MiB,
                                                                                 "int4": "never"}}}}}
    four = tune_table.merged_document(both, "GPU A", 4, rows, {}, quantized_rs={"bfloat16": {"int4": 8 * MiB}})
    (entry,) = parse_table(four, "t").entries
    assert entry.quantized == {"2": {"bfloat16": {"int8": 64 * MiB}}}
    assert entry.quantized_by_collective["reduce_scatter"] == {"2": {"bfloat16": {"int8": 16 * MiB, "int4": None}},
                                                               "4": {"bfloat16": {"int4": 8 * MiB}}}
    alone = tune_table.merged_document(None, "GPU A", 2, rows, {}, quantized_rs={"bfloat16": {"int8": 1 * MiB}})
    assert set(alone["entries"][0]["quantized"]) == {"note", "collectives"}
    assert parse_table(alone, "t").entries[0].quantized_by_collective["reduce_scatter"]["2"]["bfloat16"] == {
        "int8": 1 * MiB}


def test_merged_document_writes_each_collectives_rows_by_world_size_and_dtype():
    """The reduce-scatter's and all-gather's rows go to collectives[c].tables, merged by world
    size and dtype as the all-reduce's; a collective tune adds gets COLLECTIVE_NOTE, one
    already there keeps its note; a run without a collective leaves its rows alone."""
    ar = {"bfloat16": [[None, "twoshot"]]}
    rs4, ag4 = [[8 * MiB, "lamport_twoshot"], [None, "nccl"]], [[1 * MiB, "twoshot"], [None, "nccl"]]
    four = tune_table.merged_document(None, "GPU A", 4, ar, {}, collective_rows={
        "reduce_scatter": {"bfloat16": rs4}, "all_gather": {"bfloat16": ag4}})
    collectives = four["entries"][0]["collectives"]
    assert collectives == {"reduce_scatter": {"note": tune_table.COLLECTIVE_NOTE, "tables": {"4": {"bfloat16": rs4}}},
                           "all_gather": {"note": tune_table.COLLECTIVE_NOTE, "tables": {"4": {"bfloat16": ag4}}}}
    collectives["all_gather"]["note"] = "mine"
    two = tune_table.merged_document(four, "GPU A", 2, ar, {}, collective_rows={
        "reduce_scatter": {"float32": [[None, "nccl"]]}, "all_gather": {}})
    again = tune_table.merged_document(two, "GPU A", 4, ar, {}, collective_rows={"reduce_scatter": {
        "float32": [[None, "twoshot"]]}})
    again = tune_table.merged_document(again, "GPU A", 4, ar, {})  # the all-reduce alone
    collectives = again["entries"][0]["collectives"]
    assert collectives["reduce_scatter"]["tables"] == {"4": {"bfloat16": rs4, "float32": [[None, "twoshot"]]},
                                                       "2": {"float32": [[None, "nccl"]]}}
    assert collectives["all_gather"] == {"note": "mine", "tables": {"4": {"bfloat16": ag4}}}
    (entry,) = parse_table(again, "t").entries
    assert entry.by_collective["reduce_scatter"]["4"]["bfloat16"] == ((8 * MiB, "lamport_twoshot"), (None, "nccl"))
    # another machine's entry: its own collectives, the first entry's kept
    other = tune_table.merged_document(again, "GPU B", 4, ar, {}, collective_rows={"all_gather": {"bfloat16": ag4}})
    assert other["entries"][0] == again["entries"][0]
    assert other["entries"][1]["collectives"] == {"all_gather": {"note": tune_table.COLLECTIVE_NOTE,
                                                                 "tables": {"4": {"bfloat16": ag4}}}}
    # rows a collective cannot run are refused, as the all-reduce's
    with pytest.raises(UbnextError, match="lamport has no reduce_scatter kernel"):
        tune_table.merged_document(None, "GPU A", 4, ar, {}, collective_rows={"reduce_scatter": {
            "bfloat16": [[None, "lamport"]]}})


def test_merged_document_keeps_the_records_of_the_collectives_a_run_left_out():
    """A run of the all-reduce alone replaces its record of each dtype but keeps the
    reduce-scatter's and all-gather's records beside the rows they were measured for."""
    ar = {"bfloat16": [[None, "twoshot"]]}
    rows = {"reduce_scatter": {"bfloat16": [[None, "nccl"]]}, "all_gather": {"bfloat16": [[None, "nccl"]]}}
    full = {"bfloat16": {"winners": ["twoshot"], "reduce_scatter": {"winners": ["nccl"]},
                         "all_gather": {"winners": ["nccl"]}}}
    first = tune_table.merged_document(None, "GPU A", 4, ar, full, collective_rows=rows)
    again = tune_table.merged_document(first, "GPU A", 4, ar, {"bfloat16": {"winners": ["lamport_twoshot"]}})
    assert again["entries"][0]["measured"]["4"]["bfloat16"] == {
        "winners": ["lamport_twoshot"], "reduce_scatter": {"winners": ["nccl"]}, "all_gather": {"winners": ["nccl"]}}
    redone = tune_table.merged_document(again, "GPU A", 4, ar, {"bfloat16": {"winners": ["nccl"],
                                                                        "all_gather": {"winners": ["twoshot"]}}})
    assert redone["entries"][0]["measured"]["4"]["bfloat16"] == {
        "winners": ["nccl"], "all_gather": {"winners": ["twoshot"]}, "reduce_scatter": {"winners": ["nccl"]}}


def test_report_prints_each_collectives_table_and_rows_line():
    args = tune.parse_args(["-b", "1K", "-e", "4K"])
    sizes = [1 * KiB, 2 * KiB, 4 * KiB]
    times = [{"twoshot": 5.0, "nccl": 9.0}, {"twoshot": 8.0, "nccl": 9.0}, {"twoshot": None, "nccl": 9.0}]
    winners = [tune_table.winner(t, args.margin) for t in times]
    lines = tune_table.report(4, "bfloat16", "GPU A", sizes, times, winners, args, "all_gather")
    assert lines[1] == "# µs per all-gather (size: the whole output) (plain arrays, out of place); a kernel " \
                       "beats NCCL only when 3% faster"
    assert lines[2].split() == ["size", "twoshot", "nccl", "winner"]
    assert lines[3].split() == ["1", "KiB", "5.00", "9.00", "twoshot"] and lines[5].split()[2] == "—"
    assert lines[-1] == "# all_gather rows for 4 ranks bfloat16: ≤ 2 KiB twoshot, then nccl"
    lines = tune_table.report(4, "bfloat16", "GPU A", sizes, times, winners, args, "reduce_scatter")
    assert "reduce-scatter (size: the whole input)" in lines[1]
    assert lines[-1] == "# reduce_scatter rows for 4 ranks bfloat16: ≤ 2 KiB twoshot, then nccl"
    assert tune_table.report(4, "bfloat16", "GPU A", sizes, times, winners, args)[-1] == (
        "# rows for 4 ranks bfloat16: ≤ 2 KiB twoshot, then nccl")


def test_merged_document_refuses_what_ubnext_cannot_read():
    with pytest.raises(UbnextError, match="unknown algorithm 'ring'"):
        tune_table.merged_document(None, "GPU", 4, {"bfloat16": [[None, "ring"]]}, {})


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


def test_parse_args_collectives(capsys):
    assert tune.parse_args([]).collectives == ["all_reduce", "reduce_scatter", "all_gather"]
    assert tune.parse_args(["--collectives", "all_gather,all_reduce,all_gather,"]).collectives == [
        "all_reduce", "all_gather"]  # in COLLECTIVES' order, once each
    assert tune.parse_args(["--collectives", "all_reduce"]).collectives == ["all_reduce"]
    with pytest.raises(SystemExit):
        tune.parse_args(["--collectives", "all_reduce,gather"])
    assert ("--collectives: unknown gather; use all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, "
            "send_recv") in capsys.readouterr().err
    assert tune.parse_args(["--collectives", "broadcast,all_reduce"]).collectives == ["all_reduce", "broadcast"]
    assert tune.parse_args(["--movers"]).collectives == ["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                                         "all_to_all", "send_recv"]
    assert tune.parse_args(["--movers", "--collectives", "all_reduce,all_to_all"]).collectives == [
        "all_reduce", "broadcast", "all_to_all", "send_recv"]
    for without in ("reduce_scatter", "reduce_scatter,all_gather", ""):
        with pytest.raises(SystemExit):
            tune.parse_args(["--collectives", without])
        assert "--collectives: all_reduce is always measured" in capsys.readouterr().err


def test_run_refuses_sizes_below_one_element_per_rank_before_measuring(cupy, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "measure", lambda *a: pytest.fail("measured sizes it cannot"))
    argv = ["-o", str(tmp_path / "t.json"), "-b", "16", "-e", "32", "--dtype", "bfloat16,float32"]
    assert tune.run(FakeComm(16), tune.parse_args(argv), argv) == 2
    assert ("tune: -e 32 B is below one element per rank at 16 ranks for reduce_scatter float32, all_gather "
            "float32; raise -e or leave them out of --collectives") in capsys.readouterr().err
    monkeypatch.setattr(tune, "measure", fake_measure())
    argv += ["--collectives", "all_reduce"]
    assert tune.run(FakeComm(16), tune.parse_args(argv), argv) == 0


# --------------------------------------------------------------------------- the flow on fake GPUs


class FakeBootstrap(fakes.Bootstrap):
    def bcast_obj(self, obj, root=0):
        return obj


class FakeComm:
    """One rank pretending to be ``size`` ranks; Lamport refuses more than ``lamport_max`` bytes;
    opted in to the quantized all-reduce where ``quantized`` is a format, fp8 refused
    (a device before sm_89)."""

    def __init__(self, size=4, usable=tuple(ALL), lamport_max=1 * MiB, quantized="off"):
        self.config = SimpleNamespace(quantized=quantized)
        self._context = fake_context(0)  # the device guard, on a fake driver
        self.rank, self.size, self.device = 0, size, 0
        self.bootstrap = FakeBootstrap()
        self._usable, self._lamport_max = list(usable), lamport_max
        nccl_only = list(usable) == ["nccl"]
        self.path = "NCCL only: ranks span several nodes" if nccl_only else "kernels on the symmetric pool"
        self.calls = 0
        self.log = []  # "call" as each call runs (on the stream, or from a graph)
        self.sliced = set()  # (method, input elements, output elements) of the calls

    def algorithms(self):
        return self._usable

    def all_reduce(self, x, out=None, algorithm="auto", stream=None, precision="auto"):
        if algorithm == "lamport" and x.host.nbytes > self._lamport_max:
            raise UbnextError(f"all_reduce: algorithm 'lamport' cannot take {x.host.nbytes} bytes")
        if precision == "fp8":
            raise UbnextError("all_reduce: precision 'fp8' needs compute capability 8.9 or newer")

        def work():
            self.calls += 1
            self.log.append("call")
        stream.enqueue(work)

    def reduce_scatter(self, x, out=None, algorithm="auto", stream=None, precision="auto"):
        assert x.host.size == self.size * out.host.size
        assert algorithm == "auto" or ALGORITHMS[algorithm].serves("reduce_scatter")  # auto: a precision's
        self.sliced.add(("reduce_scatter", x.host.size, out.host.size))
        self.all_reduce(x, out, algorithm, stream, precision)

    def all_gather(self, x, out=None, algorithm="auto", stream=None):  # no precision: it stays exact
        assert out.host.size == self.size * x.host.size and ALGORITHMS[algorithm].serves("all_gather")
        self.sliced.add(("all_gather", x.host.size, out.host.size))
        self.all_reduce(x, out, algorithm, stream)


    # the data movers: each form's refusals as the communicator's (ll past LL_MAX_BYTES per
    # part, NCCL where it cannot run: ``nccl_problem``)
    nccl_problem = None

    def _mover(self, name, algorithm, part_bytes, x, out, stream):
        if algorithm == "ll" and part_bytes > LL_MAX_BYTES:
            raise UbnextError(f"{name}: algorithm 'll' takes at most {LL_MAX_BYTES} bytes")
        if algorithm == "nccl" and self.nccl_problem:
            raise UbnextError(f"{name}: algorithm 'nccl' was named, and NCCL, which runs it, cannot run here")
        self.sliced.add((name, x.host.size, out.host.size))
        self.all_reduce(x, out, "nccl", stream)

    def broadcast(self, x, root, out=None, stream=None, algorithm="auto"):
        assert root == 0 and algorithm in MOVER_SERVES["broadcast"]
        self._mover("broadcast", algorithm, x.host.nbytes, x, out, stream)

    def all_to_all(self, x, out=None, stream=None, algorithm="auto"):
        assert algorithm in MOVER_SERVES["all_to_all"] and x.host.size % self.size == 0
        self._mover("all_to_all", algorithm, x.host.nbytes // self.size, x, out, stream)


@pytest.fixture
def cupy(monkeypatch):
    fake = fakes.install(monkeypatch)
    fake.zeros = lambda shape, dtype: fakes.empty(shape, dtype)
    fake.empty_like = lambda a: fakes.empty(a.host.shape, a.host.dtype)
    # the dependent mode's GEMM operands and GEMM (run at once: the fake stream records only
    # what its engines enqueue)
    fake.full = lambda shape, value, dtype: fakes.ndarray(None, _host=np.full(shape, value, dtype=dtype))
    fake.ones = lambda shape, dtype: fakes.ndarray(None, _host=np.ones(shape, dtype=dtype))

    def matmul_into(a, b, out, stream):  # torch's GEMM on the GPU; here the host's, at once
        def launch():
            out.host[:a.host.shape[0] * b.host.shape[1]] = (a.host @ b.host).reshape(-1)
        launch()
        return launch

    monkeypatch.setattr(dependent, "matmul_into", matmul_into)
    return fake


def test_time_algorithm_captures_launches_and_agrees_on_refusals(cupy):
    comm = FakeComm(lamport_max=4)
    args = tune.parse_args(["-n", "3", "-G", "2", "--repeats", "5", "-w", "2"])
    buf = cupy.zeros((8,), np.float32)
    timed = tune_measure.time_algorithm(comm, cupy.cuda.Stream(), "twoshot", buf, buf, args)
    assert timed.us >= 0 and timed.raw_us is None and timed.gemm_us is None  # graph mode: no GEMM
    assert comm.calls == 2 + 3 * (1 + 2 * 5)  # warm-up, graph upload, launches × samples
    assert tune_measure.time_algorithm(comm, cupy.cuda.Stream(), "lamport", buf, buf, args) is None


def test_time_algorithm_raises_when_ranks_disagree(cupy):
    comm = FakeComm(lamport_max=4)
    comm.bootstrap.allgather_obj = lambda obj: [obj, None]
    args = tune.parse_args(["-n", "1", "-G", "1", "--repeats", "1"])
    buf = cupy.zeros((8,), np.float32)
    with pytest.raises(UbnextError, match="ranks disagree whether lamport"):
        tune_measure.time_algorithm(comm, cupy.cuda.Stream(), "lamport", buf, buf, args)


def synthetic_times(nbytes: int, usable) -> dict:
    """Lamport fast below 512 KiB, two-shot best to 32 MiB, NCCL 1 % faster beyond (the 4xH200 shape)."""
    nccl = 12.0 + nbytes / 8e4
    times = {"lamport": 4.0 + nbytes / 5e4 if nbytes <= 1 * MiB else None,
             "twoshot": 10.0 + nbytes / 1e5 if nbytes <= 32 * MiB else nccl * 1.01,
             "nccl": nccl}
    return {k: v for k, v in times.items() if k in usable}


def fake_measure(times_of=synthetic_times, calls=None):
    """A stand-in for tune_measure.measure: ``times_of(size, names)`` at every size, names the usable
    algorithms that serve the collective; the all-gather's at 4x the size (so it leaves the
    two-shot for NCCL at a quarter of the others' size). Each (dtype, collective) measured
    is appended to ``calls``."""
    def measure(comm, stream, dtype, collective, args, progress):
        if calls is not None:
            calls.append((dtype, collective))
        names = [n for n in comm.algorithms() if ALGORITHMS[n].serves(collective)]
        scale = 4 if collective == "all_gather" else 1
        return tune_measure.Measured(args.sizes, [times_of(n * scale, names) for n in args.sizes])
    return measure


def test_run_measures_writes_merges_and_prints_the_export_line(cupy, monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(tune, "measure", fake_measure(calls=calls))
    out = tmp_path / "tune.json"
    args = tune.parse_args(["-o", str(out)])
    assert tune.run(FakeComm(4), args, ["-o", str(out)]) == 0
    assert calls == [("bfloat16", c) for c in ("all_reduce", "reduce_scatter", "all_gather")]  # one sweep each
    text = capsys.readouterr().out
    assert f"export UBNEXT_TUNE_FILE={out}" in text
    assert "# rows for 4 ranks bfloat16: ≤ 512 KiB lamport, ≤ 32 MiB twoshot, then nccl" in text
    assert "# reduce_scatter rows for 4 ranks bfloat16: ≤ 32 MiB twoshot, then nccl" in text
    assert "# all_gather rows for 4 ranks bfloat16: ≤ 8 MiB twoshot, then nccl" in text
    assert "   256 MiB           —" in text  # lamport refused: shown as a dash
    table = load_table(str(out))
    assert table.format == 2 and len(table.entries) == 1
    entry = table.entries[0]
    assert entry.rows["4"]["bfloat16"] == ((512 * KiB, "lamport"), (32 * MiB, "twoshot"), (None, "nccl"))
    assert entry.by_collective == {"reduce_scatter": {"4": {"bfloat16": ((32 * MiB, "twoshot"), (None, "nccl"))}},
                                   "all_gather": {"4": {"bfloat16": ((8 * MiB, "twoshot"), (None, "nccl"))}}}
    assert {c: entry.entry["collectives"][c]["note"] for c in entry.by_collective} == {
        "reduce_scatter": tune_table.COLLECTIVE_NOTE, "all_gather": tune_table.COLLECTIVE_NOTE}
    record = entry.entry["measured"]["4"]["bfloat16"]
    assert record["sizes"] == args.sizes and len(record["us"]["nccl"]) == 19 and record["margin_percent"] == 3
    assert record["us"]["lamport"][0] is not None
    for collective, crossover in (("reduce_scatter", 32 * MiB), ("all_gather", 8 * MiB)):  # one record format
        kept = record[collective]
        assert set(kept) == {"sizes", "winners", "us"} and kept["sizes"] == args.sizes
        assert kept["winners"] == ["twoshot" if n <= crossover else "nccl" for n in args.sizes]
        assert set(kept["us"]) == {"twoshot", "nccl"} and len(kept["us"]["nccl"]) == 19

    # A second run at 2 ranks, another dtype, the all-gather alone beside the all-reduce,
    # lands in the same entry: the reduce-scatter's 4-rank rows kept
    argv2 = ["-o", str(out), "--dtype", "float32", "-e", "64M", "--collectives", "all_gather,all_reduce"]
    assert tune.run(FakeComm(2), tune.parse_args(argv2), argv2) == 0
    assert "reduce_scatter" not in capsys.readouterr().out
    table = load_table(str(out))
    assert len(table.entries) == 1  # the same machine's entry
    entry = table.entries[0]
    assert set(entry.rows) == {"4", "2"} and set(entry.rows["2"]) == {"float32"}
    assert entry.by_collective["reduce_scatter"] == {"4": {"bfloat16": ((32 * MiB, "twoshot"), (None, "nccl"))}}
    assert entry.by_collective["all_gather"] == {"4": {"bfloat16": ((8 * MiB, "twoshot"), (None, "nccl"))},
                                                 "2": {"float32": ((8 * MiB, "twoshot"), (None, "nccl"))}}
    assert set(entry.entry["measured"]["2"]["float32"]) >= {"all_gather", "us"}
    assert "reduce_scatter" not in entry.entry["measured"]["2"]["float32"]
    limits = {"lamport": (1 * MiB, "UBNEXT_LAMPORT_MAX_KB=1024")}
    sel = Selector(4, limits, ALL, table)
    assert sel.select(256 * KiB, "bfloat16") == "lamport" and sel.select(1 << 30, "bfloat16") == "nccl"
    assert sel.select(16 * MiB, "bfloat16", "reduce_scatter") == "twoshot"
    assert sel.select(16 * MiB, "bfloat16", "all_gather") == "nccl"
    assert sel.explain(64 * MiB, "bfloat16", "reduce_scatter")[1].startswith(
        "table row > 32 MiB for 4 ranks bfloat16 (reduce_scatter, tune file ")
    two = Selector(2, limits, ALL, table)
    assert two.explain(64, "bfloat16")[1].startswith(
        "table row ≤ 512 KiB for 2 ranks float32 (no bfloat16 rows) (tune file ")
    assert two.explain(64, "bfloat16", "all_gather")[1].startswith(
        "table row ≤ 8 MiB for 2 ranks float32 (no bfloat16 rows) (all_gather, tune file ")
    assert "(reduce_scatter, default table: " in two.explain(64, "bfloat16", "reduce_scatter")[1]  # not measured


def test_run_on_an_opted_in_communicator_measures_and_writes_the_quantized_thresholds(cupy, monkeypatch,
                                                                                         tmp_path, capsys):
    """The all-reduce's and the reduce-scatter's thresholds each come from the one sweep of
    its collective, against that sweep's full-precision winners; the reduce-scatter's rows
    come from the same sweep; the all-gather has no formats."""
    by_collective = {
        # the 2x H100 out-of-place figures at 16/64/256 MiB; the formats quantized
        "all_reduce": [{"twoshot": t["twoshot"], "nccl": t["nccl"], "int8": t["int8"], "int4": t["int4"]}
                       for t in _h100x2("out")],
        # the reduce-scatter: int8 pays from 64 MiB
        "reduce_scatter": [{"twoshot": t, "nccl": 2 * t, "int8": q, "int4": None}
                           for t, q in ((30, 31), (110, 80), (440, 300))],
        "all_gather": [{"twoshot": 2 * t, "nccl": t} for t in (20, 70, 280)],
    }
    calls = []

    def measure(comm, stream, dtype, collective, args, progress):
        assert comm.config.quantized == "int8"
        calls.append(collective)
        return tune_measure.Measured(args.sizes, by_collective[collective])

    monkeypatch.setattr(tune, "measure", measure)
    out = tmp_path / "tune.json"
    args = tune.parse_args(["-o", str(out), "-b", "16M", "-e", "256M", "-f", "4"])
    assert tune.run(FakeComm(2, quantized="int8"), args, []) == 0
    assert calls == ["all_reduce", "reduce_scatter", "all_gather"]  # the reduce-scatter measured once
    text = capsys.readouterr().out
    assert "# quantized for 2 ranks bfloat16 (against the winner, 3% faster): int8 never, int4 from 64 MiB" in text
    assert "# µs per reduce-scatter (size: the whole input) (plain arrays, out of place)" in text
    assert ("# quantized reduce_scatter for 2 ranks bfloat16 (against the winner, 3% faster): int8 from 64 MiB"
            in text)
    assert "# reduce_scatter rows for 2 ranks bfloat16: then twoshot" in text
    assert "# all_gather rows for 2 ranks bfloat16: then nccl" in text and "quantized all_gather" not in text
    (entry,) = load_table(str(out)).entries
    assert entry.quantized == {"2": {"bfloat16": {"int8": None, "int4": 64 * MiB}}}
    assert entry.quantized_by_collective == {"reduce_scatter": {"2": {"bfloat16": {"int8": 64 * MiB}}}}
    assert entry.by_collective == {"reduce_scatter": {"2": {"bfloat16": ((None, "twoshot"),)}},
                                   "all_gather": {"2": {"bfloat16": ((None, "nccl"),)}}}
    record = entry.entry["measured"]["2"]["bfloat16"]
    assert record["us"]["int4"] == [60.0, 209.8, 835.0]
    assert record["reduce_scatter"] == {"sizes": args.sizes, "winners": ["twoshot"] * 3, "us": {
        "twoshot": [30, 110, 440], "nccl": [60, 220, 880], "int8": [31, 80, 300], "int4": [None] * 3}}
    assert record["all_gather"] == {"sizes": args.sizes, "winners": ["nccl"] * 3,
                                    "us": {"twoshot": [40, 140, 560], "nccl": [20, 70, 280]}}
    sel = Selector(2, {}, ALL, load_table(str(out)), machine=Machine(entry.gpu))  # the machine it ran on
    assert sel.quantized("int4", "bfloat16")[0] == 64 * MiB and sel.quantized("int8", "bfloat16")[0] is None
    assert sel.quantized("int4", "float16")[1].startswith("from 64 MiB (2 ranks bfloat16 (no float16 rows) "
                                                          "(quantized, tune file ")
    assert sel.quantized("int8", "bfloat16", "reduce_scatter")[0] == 64 * MiB

    # the reduce-scatter left out: neither its rows nor its thresholds measured
    calls.clear()
    alone = tmp_path / "alone.json"
    argv = ["-o", str(alone), "-b", "16M", "-e", "256M", "-f", "4", "--collectives", "all_reduce"]
    assert tune.run(FakeComm(2, quantized="int8"), tune.parse_args(argv), argv) == 0
    assert calls == ["all_reduce"]
    (entry,) = json.loads(alone.read_text())["entries"]
    assert "collectives" not in entry and set(entry["quantized"]) == {"note", "tables"}


def test_measure_times_the_formats_only_where_opted_in(cupy):
    args = tune.parse_args(["-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    rows = tune_measure.measure(FakeComm(quantized="int4"), cupy.cuda.Stream(), "bfloat16", "all_reduce", args,
                        lambda _: None).times
    assert [sorted(r) for r in rows] == [sorted([*ALL, "int8", "fp8", "int4"])] * 2
    assert all(r["fp8"] is None and r["int8"] is not None for r in rows)  # fp8 refused
    for comm, dtype in ((FakeComm(), "bfloat16"), (FakeComm(quantized="int8"), "float32")):
        measured = tune_measure.measure(comm, cupy.cuda.Stream(), dtype, "all_reduce", args, lambda _: None)
        assert [sorted(r) for r in measured.times] == [sorted(ALL)] * 2 and measured.raw == measured.gemm == []
        assert measured.sizes == args.sizes
    assert tune.parse_args(["--quantized"]).quantized and not tune.parse_args([]).quantized


def test_measure_reduce_scatter_times_its_algorithms_and_the_formats_only_where_opted_in(cupy):
    """Every usable algorithm with a reduce-scatter (not the Lamport one-shot) and, where
    opted in and the dtype is quantized, every format, on the whole input rounded down to
    whole slices into k elements; a size below one element per rank is left out."""
    args = tune.parse_args(["-b", "16", "-e", "4K", "-f", "16", "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    comm = FakeComm(size=16, quantized="int4")
    found = tune_measure.measure(comm, cupy.cuda.Stream(), "bfloat16", "reduce_scatter", args, lambda _: None)
    assert found.sizes == [256, 4096]  # 16 bytes: 8 elements, not one per rank of 16
    assert [sorted(r) for r in found.times] == [sorted(["twoshot", "nccl", "int8", "fp8", "int4"])] * 2
    assert all(r["fp8"] is None and r["int8"] is not None for r in found.times)
    assert comm.sliced == {("reduce_scatter", 128, 8), ("reduce_scatter", 2048, 128)}
    for comm, dtype in ((FakeComm(), "bfloat16"), (FakeComm(quantized="int8"), "float32")):
        found = tune_measure.measure(comm, cupy.cuda.Stream(), dtype, "reduce_scatter", args, lambda _: None)
        assert [sorted(r) for r in found.times] == [["nccl", "twoshot"]] * 3  # 4 ranks: every size
        assert all(None not in r.values() for r in found.times)


def test_measure_all_gather_times_its_algorithms_into_the_whole_output_and_no_format(cupy):
    """Every usable algorithm with an all-gather, k elements in and world x k out (a size is
    the whole output, rounded down to whole slices); no format even where opted in."""
    args = tune.parse_args(["-b", "16", "-e", "4K", "-f", "16", "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    comm = FakeComm(size=3, usable=["lamport", "lamport_twoshot", "twoshot", "nccl"], quantized="int8")
    seen = []
    found = tune_measure.measure(comm, cupy.cuda.Stream(), "float32", "all_gather", args, seen.append)
    assert found.sizes == args.sizes == [16, 256, 4096]
    assert [sorted(r) for r in found.times] == [["lamport_twoshot", "nccl", "twoshot"]] * 3
    assert comm.sliced == {("all_gather", 1, 3), ("all_gather", 21, 63), ("all_gather", 341, 1023)}
    assert seen[0] == "float32     16 B all_gather lamport_twoshot"


def test_call_counts_of_each_collective():
    assert tune_measure.call_counts("all_reduce", 10, 4) == (10, 10)
    assert tune_measure.call_counts("reduce_scatter", 10, 4) == (8, 2)
    assert tune_measure.call_counts("all_gather", 10, 4) == (2, 8)
    assert tune_measure.call_counts("all_gather", 3, 4) == (0, 0)


def test_run_refuses_an_invalid_existing_file_before_measuring(cupy, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "measure", lambda *a: pytest.fail("measured despite a bad output file"))
    out = tmp_path / "tune.json"
    out.write_text(json.dumps({"4": [[1, "lamport"]]}))
    assert tune.run(FakeComm(4), tune.parse_args(["-o", str(out)]), []) == 2
    assert "exists and is not a valid table" in capsys.readouterr().err
    assert json.loads(out.read_text()) == {"4": [[1, "lamport"]]}  # untouched


def test_run_refuses_an_nccl_only_communicator(cupy, tmp_path, capsys):
    assert tune.run(FakeComm(4, usable=["nccl"]), tune.parse_args(["-o", str(tmp_path / "t.json")]), []) == 2
    assert "runs NCCL only: ranks span several nodes" in capsys.readouterr().err


def test_measure_on_fake_gpus_covers_every_size_and_algorithm(cupy):
    comm = FakeComm(lamport_max=4 * KiB)
    args = tune.parse_args(["-b", "1K", "-e", "16K", "-f", "4", "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    seen = []
    start = time.perf_counter()
    rows = tune_measure.measure(comm, cupy.cuda.Stream(), "float32", "all_reduce", args, seen.append).times
    assert time.perf_counter() - start < 10
    assert [sorted(r) for r in rows] == [sorted(ALL)] * 3
    assert [r["lamport"] is None for r in rows] == [False, False, True]
    assert seen[0] == "float32    1 KiB lamport"
    assert comm.sliced == set()  # all-reduces only


# --------------------------------------------------------------------------- the dependent mode


def test_parse_args_mode_and_gemm(capsys):
    graph = tune.parse_args([])
    assert (graph.mode, graph.gemm) == ("graph", None)
    dependent = tune.parse_args(["--mode", "dependent"])
    assert (dependent.mode, dependent.gemm) == ("dependent", (64, 4096, 4096))  # the benchmarks' default
    assert tune.parse_args(["--mode", "dependent", "--gemm", "8,16,32"]).gemm == (8, 16, 32)
    for bad in (["--mode", "eager"], ["--mode", "dependent", "--gemm", "8,16"], ["--gemm", "8,16,32"]):
        with pytest.raises(SystemExit):
            tune.parse_args(bad)
    assert "--gemm shapes the GEMM of --mode dependent; the graph mode has none" in capsys.readouterr().err


def test_time_algorithm_in_the_dependent_mode_puts_the_gemm_before_each_call(cupy):
    """Warm-up and graph alike: (GEMM, call) pairs on the stream; a graph of the GEMMs alone
    is captured beside and sampled right after each sample of the pairs."""
    comm, stream = FakeComm(), cupy.cuda.Stream()

    def gemm():
        stream.enqueue(lambda: comm.log.append("gemm"))

    args = tune.parse_args(["--mode", "dependent", "-n", "3", "-G", "2", "--repeats", "2", "-w", "2"])
    buf = cupy.zeros((8,), np.float32)
    timed = tune_measure.time_algorithm(comm, stream, "twoshot", buf, buf, args, gemm=gemm)
    pairs, alone = ["gemm", "call"] * 3, ["gemm"] * 3
    # warm-up, the two graphs' uploads, then per sample 2 launches of the pairs, 2 of the GEMMs
    assert comm.log == ["gemm", "call"] * 2 + pairs + alone + (pairs * 2 + alone * 2) * 2
    assert None not in timed
    # a refused size is refused with its GEMM before it too
    assert tune_measure.time_algorithm(FakeComm(lamport_max=4), stream, "lamport", buf, buf, args, gemm=gemm) is None


def test_the_dependent_mode_ranks_each_pair_sample_less_the_gemm_sample_after_it(cupy, monkeypatch):
    from ubnext._tools import timing

    comm, stream = FakeComm(), cupy.cuda.Stream()

    def gemm():
        pass

    # seconds per launch of each sample: the pairs' and, right after each, the GEMMs' alone
    pairs, alone = iter([10e-6, 12e-6, 11e-6]), iter([6e-6, 6.5e-6, 7e-6])
    monkeypatch.setattr(timing, "timer", lambda fn, *a: (lambda: next(alone if fn is gemm else pairs)))
    comm.bootstrap.allgather_obj = lambda x: [x, None if x is None else x / 2]  # rank 1 faster: rank 0's max
    args = tune.parse_args(["--mode", "dependent", "--repeats", "3", "-w", "1"])
    buf = cupy.zeros((8,), np.float32)
    timed = tune_measure.time_algorithm(comm, stream, "twoshot", buf, buf, args, gemm=gemm)
    # differences 4, 5.5, 4 µs: their median, not the difference of the medians (11 - 6.5)
    assert timed == pytest.approx(tune_measure.Timed(4.0, 11.0, 6.5))


def test_measured_splits_the_dependent_times_and_the_winners_come_from_the_differences():
    rows = [{"lamport": tune_measure.Timed(4.0, 14.0, 10.0), "nccl": tune_measure.Timed(7.0, 13.0, 6.0)},
            {"lamport": None, "nccl": tune_measure.Timed(9.0, 15.5, 6.5)}]
    m = tune_measure.Measured.of([1 * KiB, 2 * KiB], rows, dependent=True)
    assert m.times == [{"lamport": 4.0, "nccl": 7.0}, {"lamport": None, "nccl": 9.0}]
    assert m.raw == [{"lamport": 14.0, "nccl": 13.0}, {"lamport": None, "nccl": 15.5}]
    assert m.gemm == [{"lamport": 10.0, "nccl": 6.0}, {"lamport": None, "nccl": 6.5}]
    winners = [tune_table.winner(t, 3) for t in m.times]
    assert winners == ["lamport", "nccl"] and tune_table.winner(m.raw[0], 3) == "nccl"  # the raw pairs would rank otherwise
    assert m.record(winners) == {"sizes": [1 * KiB, 2 * KiB], "winners": ["lamport", "nccl"],
                                 "us": {"lamport": [4.0, None], "nccl": [7.0, 9.0]},
                                 "raw_us": {"lamport": [14.0, None], "nccl": [13.0, 15.5]},
                                 "gemm_us": {"lamport": [10.0, None], "nccl": [6.0, 6.5]}}
    graph = tune_measure.Measured.of([16], [{"nccl": tune_measure.Timed(3.0)}], dependent=False)
    assert graph == tune_measure.Measured([16], [{"nccl": 3.0}])
    assert graph.record(["nccl"]) == {"sizes": [16], "winners": ["nccl"], "us": {"nccl": [3.0]}}


def test_merged_document_keeps_each_modes_entry_apart():
    """A dependent entry is added beside the graph entry of the same machine, neither
    starting from nor changing it; a later graph run leaves the dependent entry alone."""
    graph = tune_table.merged_document(None, "GPU A", 4, {"bfloat16": [[None, "twoshot"]]}, {"bfloat16": {}})
    both = tune_table.merged_document(graph, "GPU A", 4, {"bfloat16": [[None, "lamport"]]},
                                {"bfloat16": {"gemm_mnk": [64, 4096, 4096]}}, mode="dependent")
    assert [(e["gpu"], e["mode"]) for e in both["entries"]] == [("GPU A", "graph"), ("GPU A", "dependent")]
    assert both["entries"][0] == graph["entries"][0]
    dependent = both["entries"][1]
    assert dependent["tables"] == {"4": {"bfloat16": [[None, "lamport"]]}} and "note" not in dependent
    again = tune_table.merged_document(both, "GPU A", 2, {"bfloat16": [[None, "nccl"]]}, {"bfloat16": {}})
    assert again["entries"][1] == dependent and set(again["entries"][0]["tables"]) == {"4", "2"}
    assert tune_table.entry_of(again, {"gpu": "GPU A", "mode": "dependent"}) is again["entries"][1]


#: µs of the GEMMs alone sampled beside each algorithm: unequal (as samples may be), so the
#: raw pairs would rank otherwise than their differences
GEMM_ALONE = {"lamport": 12.0, "twoshot": 10.0, "nccl": 2.0}


def dependent_times(nbytes: int, usable) -> dict:
    """After a GEMM: synthetic_times with the two-shot 50 % slower (it never wins)."""
    return {k: None if t is None else t * (1.5 if k == "twoshot" else 1.0)
            for k, t in synthetic_times(nbytes, usable).items()}


def test_run_in_the_dependent_mode_writes_its_entry_beside_the_graph_entry(cupy, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune, "measure", fake_measure())
    out = tmp_path / "tune.json"
    argv = ["-o", str(out), "-e", "64M"]
    assert tune.run(FakeComm(4), tune.parse_args(argv), argv) == 0
    assert "export UBNEXT_TABLE_MODE" not in capsys.readouterr().out  # graph: the default
    (graph_entry,) = json.loads(out.read_text())["entries"]

    def measure(comm, stream, dtype, collective, args, progress):
        assert args.mode == "dependent" and args.gemm == (8, 16, 32)
        names = [n for n in comm.algorithms() if ALGORITHMS[n].serves(collective)]
        return tune_measure.Measured.of(args.sizes, [{k: None if t is None else tune_measure.Timed(t, t + GEMM_ALONE[k], GEMM_ALONE[k])
                                              for k, t in dependent_times(n, names).items()} for n in args.sizes],
                                dependent=True)

    monkeypatch.setattr(tune, "measure", measure)
    argv = ["-o", str(out), "-e", "64M", "--mode", "dependent", "--gemm", "8,16,32"]
    args = tune.parse_args(argv)
    assert tune.run(FakeComm(4), args, argv) == 0
    text = capsys.readouterr().out
    assert ("# ubnext.tune: 4 ranks, bfloat16, Fake GPU; dependent mode: CUDA graphs of 20 (GEMM 8x16x32 writing "
            "the call's input, call) pairs, 5 launches per sample, each less a sample of the GEMMs alone taken right "
            "after it, median of 7 samples, max over ranks") in text
    assert ("# µs per all-reduce less the GEMM before it (plain arrays, out of place; raw and GEMM-alone times: "
            "the entry's measured record)") in text
    assert f"# wrote {out} (entry Fake GPU nvlink plain dependent: world sizes 4)" in text
    assert text.rstrip().endswith(f"export UBNEXT_TUNE_FILE={out}\nexport UBNEXT_TABLE_MODE=dependent")

    doc = json.loads(out.read_text())
    assert [e["mode"] for e in doc["entries"]] == ["graph", "dependent"]
    assert doc["entries"][0] == graph_entry  # not clobbered
    winners = [tune_table.winner(dependent_times(n, ALL), 3) for n in args.sizes]
    rows = tune_table.table_rows(args.sizes, winners)
    assert "twoshot" not in winners and doc["entries"][1]["tables"] == {"4": {"bfloat16": rows}}
    record = doc["entries"][1]["measured"]["4"]["bfloat16"]
    assert record["gemm_mnk"] == [8, 16, 32] and record["winners"] == winners and record["sizes"] == args.sizes
    assert record["gemm_us"]["nccl"] == [2.0] * len(args.sizes)
    assert record["raw_us"]["lamport"][0] == pytest.approx(record["us"]["lamport"][0] + 12.0)
    assert "--mode dependent --gemm 8,16,32" in record["command"]
    assert "# µs per reduce-scatter (size: the whole input) less the GEMM before it" in text
    assert "# µs per all-gather (size: the whole output) less the GEMM before it" in text
    for collective in ("reduce_scatter", "all_gather"):  # the two-shot never wins after a GEMM here
        assert doc["entries"][1]["collectives"][collective]["tables"] == {"4": {"bfloat16": [[None, "nccl"]]}}
        kept = record[collective]
        assert set(kept) == {"sizes", "winners", "us", "raw_us", "gemm_us"}
        assert kept["gemm_us"]["twoshot"] == [10.0] * len(args.sizes) and "lamport" not in kept["us"]

    # each mode's communicator takes its entry
    table = load_table(str(out))
    for mode, want in (("graph", graph_entry["tables"]["4"]["bfloat16"]), ("dependent", rows)):
        sel = Selector(4, {}, ALL, table, machine=Machine("Fake GPU", mode=mode))
        assert sel.tables[0].mode == mode and sel.tables[0].why == "exact match"
        assert [list(r) for r in sel.tables[0].rows["4"]["bfloat16"]] == want


def test_measure_in_the_dependent_mode_runs_the_gemm_into_each_calls_input(cupy, monkeypatch):
    """The input holds the GEMM's whole output (M x N elements, here more than the largest
    size), which the GEMM writes (A = 1/K, B = 1: ones); every algorithm is timed with the
    raw and GEMM-alone times beside."""
    comm = FakeComm(lamport_max=1 * KiB)
    args = tune.parse_args(["--mode", "dependent", "--gemm", "4,8,512", "-b", "1K", "-e", "4K", "-f", "4",
                            "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    inputs, empty = [], cupy.empty

    def recorded_empty(shape, dtype):
        inputs.append(empty(shape, dtype))
        return inputs[-1]

    monkeypatch.setattr(cupy, "empty", recorded_empty)
    m = tune_measure.measure(comm, cupy.cuda.Stream(), "float32", "all_reduce", args, lambda _: None)
    (send,) = inputs
    assert send.size == 4 * 512 and (send.host == 1).all()
    assert [sorted(r) for r in m.times] == [sorted(ALL)] * 2 and len(m.raw) == len(m.gemm) == 2
    assert m.times[1]["lamport"] is None and m.raw[1]["lamport"] is None  # refused above 1 KiB
    assert all(t is not None for rows in (m.raw, m.gemm) for t in rows[0].values())


@pytest.mark.parametrize("collective, sliced", [
    ("reduce_scatter", {("reduce_scatter", 256, 128), ("reduce_scatter", 1024, 512)}),
    ("all_gather", {("all_gather", 128, 256), ("all_gather", 512, 1024)}),
])
def test_measure_in_the_dependent_mode_puts_the_gemm_before_each_reduce_scatter_and_all_gather(
        cupy, monkeypatch, collective, sliced):
    """The GEMM writes the head of the buffer whose head is the call's input (the
    reduce-scatter's whole input, the all-gather's k elements), and runs before every call:
    in the warm-up and in the graphs of (GEMM, call) pairs; the raw and GEMM-alone times kept."""
    comm, stream = FakeComm(size=2, quantized="int8"), cupy.cuda.Stream()

    def matmul_into(a, b, out, on):  # the GEMM as a launch on the stream (recorded while captured)
        def launch():
            def work():
                out.host[:a.host.shape[0] * b.host.shape[1]] = (a.host @ b.host).reshape(-1)
                comm.log.append("gemm")
            on.enqueue(work)
        launch()
        return launch

    monkeypatch.setattr(dependent, "matmul_into", matmul_into)
    inputs, empty = [], cupy.empty
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype: inputs.append(empty(shape, dtype)) or inputs[-1])
    args = tune.parse_args(["--mode", "dependent", "--gemm", "4,8,512", "-b", "1K", "-e", "4K", "-f", "4",
                            "-n", "2", "-G", "1", "--repeats", "1", "-w", "2"])
    found = tune_measure.measure(comm, stream, "float32", collective, args, lambda _: None)
    (send,) = inputs
    assert send.size == 4 * 512 and (send.host == 1).all()  # M x N elements, all written by the GEMM
    assert comm.sliced == sliced
    assert [sorted(r) for r in found.times] == [["nccl", "twoshot"]] * 2  # float32: no formats
    assert len(found.raw) == len(found.gemm) == 2 and None not in found.raw[0].values()
    calls = [i for i, what in enumerate(comm.log) if what == "call"]
    assert calls and all(comm.log[i - 1] == "gemm" for i in calls)


def test_the_dependent_modes_gemm_without_torch_says_what_it_needs(monkeypatch):
    """cupy cannot call cuBLAS while a graph is captured, so the GEMM is torch's: without
    torch the dependent mode stops with what to do, before anything is launched."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(UbnextError, match="needs torch .* or measure in the graph mode"):
        dependent.matmul_into(None, None, None, None)


def test_the_dependent_mode_without_torch_stops_at_parsing(monkeypatch, capsys):
    """Every rank stops before any communicator is built, saying what is needed."""
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit):
        tune.parse_args(["--mode", "dependent"])
    assert "--mode dependent needs torch" in capsys.readouterr().err
    assert tune.parse_args([]).mode == "graph"  # the graph mode needs no torch


# --------------------------------------------------------------------------- the data movers


def test_measure_a_mover_times_each_of_its_forms_and_nccl_in_one_sweep(cupy):
    """Every algorithm of the mover (MOVER_SERVES) and NCCL at every size, out of place: the
    broadcast from root 0 on the whole message, the all-to-all on whole parts; a form that
    refuses a size (ll past its bound; NCCL where it cannot run) is measured as None."""
    args = tune.parse_args(["-b", "16K", "-e", "1M", "-f", "16", "-n", "1", "-G", "1", "--repeats", "1", "-w", "1"])
    comm = FakeComm(size=3)
    found = tune_measure.measure(comm, cupy.cuda.Stream(), "bfloat16", "broadcast", args, lambda _: None)
    assert found.sizes == [16 * KiB, 256 * KiB]
    assert [sorted(r) for r in found.times] == [["copy", "ll", "nccl", "scatter_allgather"]] * 2
    assert [[n for n, t in r.items() if t is None] for r in found.times] == [[], ["ll"]]
    assert comm.sliced == {("broadcast", 8 * KiB, 8 * KiB), ("broadcast", 128 * KiB, 128 * KiB)}
    comm = FakeComm(size=3)
    comm.nccl_problem = "local ranks 0, 1 share one GPU"
    found = tune_measure.measure(comm, cupy.cuda.Stream(), "bfloat16", "all_to_all", args, lambda _: None)
    assert [sorted(r) for r in found.times] == [["copy", "ll", "nccl"]] * 2
    assert [[n for n, t in r.items() if t is None] for r in found.times] == [["nccl"], ["ll", "nccl"]]  # 85 KiB/part
    assert comm.sliced == {("all_to_all", 8190, 8190), ("all_to_all", 131070, 131070)}  # whole parts
    assert tune_measure.call_counts("all_to_all", 10, 4) == (8, 8)
    assert tune_measure.call_counts("broadcast", 10, 4) == tune_measure.call_counts("send_recv", 10, 4) == (10, 10)


def mover_times(nbytes: int, names) -> dict:
    """ll fast to 64 KiB, NCCL between, scatter_allgather from 1 MiB; the copy form never wins."""
    times = {"ll": 2.0 if nbytes <= 64 * KiB else None, "copy": 50.0 + nbytes / 1e4, "nccl": 10.0 + nbytes / 5e4,
             "scatter_allgather": 25.0 + nbytes / 2e5}
    return {k: v for k, v in times.items() if k in names}


def test_run_with_movers_writes_their_rows_and_auto_follows_them(cupy, monkeypatch, tmp_path, capsys):
    """--movers: the broadcast's and the all-to-all's rows from one sweep each (all their
    forms and NCCL), under the entry's collectives with MOVER_NOTE and their measured record;
    send/recv, which only NCCL serves, is not measured; the selector's mover rows then choose
    by size."""
    calls = []
    reductions = fake_measure(calls=calls)

    def measure(comm, stream, dtype, collective, args, progress):
        if collective not in MOVER_SERVES:
            return reductions(comm, stream, dtype, collective, args, progress)
        calls.append((dtype, collective))
        names = tune_measure.candidates(comm, collective)
        return tune_measure.Measured(args.sizes, [mover_times(n, names) for n in args.sizes])

    monkeypatch.setattr(tune, "measure", measure)
    out = tmp_path / "tune.json"
    argv = ["-o", str(out), "--movers", "--collectives", "all_reduce", "-b", "16K", "-e", "16M", "-f", "4"]
    assert tune.run(FakeComm(4), tune.parse_args(argv), argv) == 0
    assert calls == [("bfloat16", c) for c in ("all_reduce", "broadcast", "all_to_all")]
    text = capsys.readouterr().out
    assert "# send_recv: only NCCL serves it; nothing to choose, not measured" in text
    assert "# broadcast rows for 4 ranks bfloat16: ≤ 64 KiB ll, ≤ 1 MiB nccl, then scatter_allgather" in text
    assert "# µs per broadcast (size: the message, root 0) (plain arrays, out of place)" in text
    (entry,) = load_table(str(out)).entries
    rows = ((64 * KiB, "ll"), (1 * MiB, "nccl"), (None, "scatter_allgather"))
    assert entry.by_collective["broadcast"] == {"4": {"bfloat16": rows}}
    assert entry.by_collective["all_to_all"] == {"4": {"bfloat16": ((64 * KiB, "ll"), (None, "nccl"))}}
    assert "send_recv" not in entry.by_collective
    assert {c: entry.entry["collectives"][c]["note"] for c in ("broadcast", "all_to_all")} == {
        "broadcast": tune_table.MOVER_NOTE, "all_to_all": tune_table.MOVER_NOTE}
    record = entry.entry["measured"]["4"]["bfloat16"]["broadcast"]
    assert set(record["us"]) == {"ll", "copy", "nccl", "scatter_allgather"} and record["us"]["ll"][-1] is None
    sel = Selector(4, {}, ALL, load_table(str(out)), machine=Machine(entry.gpu))  # the machine it ran on
    every = lambda name: True  # noqa: E731
    assert [sel.mover("broadcast", n, "float32", every)[0] for n in (KiB, 256 * KiB, 64 * MiB)] == [
        "ll", "nccl", "scatter_allgather"]
    # a later run without --movers keeps the movers' rows and records
    argv = ["-o", str(out), "--collectives", "all_reduce", "-b", "16K", "-e", "16M", "-f", "4"]
    assert tune.run(FakeComm(4), tune.parse_args(argv), argv) == 0
    (entry,) = load_table(str(out)).entries
    assert entry.by_collective["broadcast"] == {"4": {"bfloat16": rows}}
    assert set(entry.entry["measured"]["4"]["bfloat16"]) >= {"broadcast", "all_to_all"}
