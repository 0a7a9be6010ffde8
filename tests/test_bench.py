"""CPU tests of the benchmarks: nccl-tests sizes and table, exact data, arguments, plots,
and the whole all_reduce_perf / compare flow on a numpy stand-in for the GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # bench/ is not part of the installed package

import bench_fakes as fakes  # noqa: E402

from bench import _common as common  # noqa: E402
from bench import _torchbench, compare, plot  # noqa: E402
from bench import all_reduce_perf as arp  # noqa: E402
from bench._sliced_perf import REDUCE_SCATTER_PERF  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
BF16, HALF, FLOAT = common.DTYPES["bfloat16"], common.DTYPES["half"], common.DTYPES["float"]


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, value", [
    ("8", 8), ("1K", 1024), ("1k", 1024), ("256M", 256 << 20), ("2G", 2 << 30),
    ("1.5K", 1536), ("2KiB", 2048), ("0", 0), ("1e3", 1000), (" 4M ", 4 << 20),
])
def test_parse_size_like_nccl_tests(text, value):
    assert common.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "-1", "1T", "1 K B x", "abc"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        common.parse_size(text)


def test_size_list_factor_and_step():
    assert common.size_list(8, 64, 1 << 20, 2) == [8, 16, 32, 64]
    assert common.size_list(8, 100, 1 << 20, 2) == [8, 16, 32, 64]  # stops below maxbytes, as nccl-tests
    assert common.size_list(1 << 20, 3 << 20, 1 << 20, 1) == [1 << 20, 2 << 20, 3 << 20]
    assert common.size_list(32 << 20, 32 << 20, 1 << 20, 1) == [32 << 20]  # nccl-tests defaults: one size
    assert len(common.size_list(8, 256 << 20, 0, 2)) == 26


@pytest.mark.parametrize("args, message", [
    ((64, 8, 1, 2), "minbytes"), ((0, 64, 1, 2), "never grows"), ((8, 64, 0, 1), "stepbytes"),
])
def test_size_list_rejects(args, message):
    with pytest.raises(ValueError, match=message):
        common.size_list(*args)


def test_human_bytes():
    assert [common.human_bytes(n) for n in (8, 2048, 3 << 20, 1 << 30, 1500)] == [
        "8 B", "2 KiB", "3 MiB", "1 GiB", "1500 B"]


# --------------------------------------------------------------------------- collective record


@pytest.mark.parametrize("nranks, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_all_reduce_bus_factor(nranks, factor):
    assert arp.ALL_REDUCE.bus_factor(nranks) == pytest.approx(factor)


def test_bandwidths_and_count():
    algbw, busbw = arp.ALL_REDUCE.bandwidths(256 << 20, 1181e-6, 4)
    assert algbw == pytest.approx((256 << 20) / 1e9 / 1181e-6)
    assert busbw == pytest.approx(algbw * 1.5)
    assert arp.ALL_REDUCE.count(8, 4, 4) == 2
    assert arp.ALL_REDUCE.count(7, 2, 4) == 3  # partial elements are dropped, as nccl-tests does


# --------------------------------------------------------------------------- table


def test_header_columns_and_widths():
    lines = common.table_header()
    assert lines[0] == "#"
    assert lines[1].split() == ["#", "out-of-place", "in-place"]
    assert lines[2].split() == ["#", "size", "count", "type", "redop", "root",
                                "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"]
    assert lines[3].split() == ["#", "(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)", "(us)", "(GB/s)", "(GB/s)"]
    # Column ends line up between the names line and a data row.
    half = common.row_result(5.0, 0.2, 0.3, 0)
    row = common.row_prefix(1024, 256, "float", "sum") + half + half
    ends = [m.end() for m in re.finditer(r"\S+", row)]
    assert ends == [m.end() for m in re.finditer(r"\S+", lines[2])][1:]
    assert common.table_header("cputime")[2].split()[6] == "cputime"


def test_row_format_matches_nccl_tests():
    prefix = common.row_prefix(8, 2, "float", "sum")
    assert prefix == "           8             2     float     sum      -1"
    assert common.row_result(12.5, 0.0, 0.0, 0) == "    12.50    0.00    0.00       0"
    assert common.row_result(1234.5, 200.25, 350.5, None) == "  1234.50  200.25  350.50    N/A"
    assert len(prefix) == 52 and len(common.row_result(1.0, 1.0, 1.0, 3)) == 33


@pytest.mark.parametrize("value, width, text", [
    (0.0, 7, "   0.00"), (12.25, 7, "  12.25"), (99999.0, 7, "99999.0"), (123456.0, 7, " 123456"),
    (1e9, 7, "1.0e+09"), (341.2, 6, "341.20"), (1234.0, 6, "1234.0"), (12345.0, 6, " 12345"),
    (1e8, 6, " 1e+08"), (float("nan"), 6, "   nan"),
])
def test_format_float_like_get_float_str(value, width, text):
    assert common.format_float(value, width) == text


def test_footer():
    assert common.footer(0, 123.456, "all_reduce_perf")[:2] == [
        "# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 123.456 "]
    assert common.footer(2, 0.5, "x")[0] == "# Out of bounds values : 2 FAILED"


# --------------------------------------------------------------------------- exact data


def _reduce_in_dtype(parts: list[np.ndarray], op: str, order: list[int], premul: float | None) -> np.ndarray:
    """Reduce arrays of the dtype in a given rank order with the dtype's own arithmetic."""
    if premul is not None:  # NCCL's avg: scale every input by 1/n, then sum
        scale = np.array(premul, dtype=parts[0].dtype)
        parts = [(p * scale).astype(p.dtype) for p in parts]
    acc = parts[order[0]]
    for r in order[1:]:
        acc = {"max": np.maximum, "min": np.minimum}.get(op, np.add)(acc, parts[r]).astype(acc.dtype)
    if op == "avg" and premul is None:
        acc = (acc / np.array(len(parts), dtype=acc.dtype)).astype(acc.dtype)
    return acc


def _tree_sum(parts: list[np.ndarray]) -> np.ndarray:
    while len(parts) > 1:
        parts = [(parts[i] + parts[i + 1]).astype(parts[i].dtype) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


@pytest.mark.parametrize("dtype", [BF16, HALF, FLOAT], ids=lambda d: d.name)
@pytest.mark.parametrize("nranks", [2, 4, 8])
@pytest.mark.parametrize("op", common.OPS)
def test_reductions_are_bit_exact_in_every_order(dtype, nranks, op):
    count, seed = 4099, 7
    parts = [common.encode(common.make_input(r, nranks, count, seed), dtype).view(dtype.numpy)
             for r in range(nranks)]
    want = common.encode(common.expected_output(nranks, count, seed, op), dtype)
    orders = [list(range(nranks)), list(reversed(range(nranks))), [(r * 3 + 1) % nranks for r in range(nranks)]]
    if nranks == 8:
        orders = [o for o in orders if sorted(o) == list(range(8))]
    results = [_reduce_in_dtype(parts, op, o, None) for o in orders]
    if op == "sum":
        results.append(_tree_sum(parts))
    if op == "avg":
        results += [_reduce_in_dtype(parts, op, o, 1.0 / nranks) for o in orders]
    assert common.tolerance(op, nranks, dtype) == 0.0
    for got in results:
        assert common.count_wrong(got.view(dtype.bits), want, dtype) == 0


def test_inputs_are_small_distinct_and_never_negative_zero():
    for nranks in (2, 4, 8):
        m = common.value_range(nranks)
        assert nranks * m <= 256
        xs = [common.make_input(r, nranks, 10000, seed=3) for r in range(nranks)]
        for x in xs:
            assert x.min() >= -m and x.max() <= m
            assert len(np.unique(x)) == 2 * m + 1
            for dtype in (BF16, HALF):
                assert not np.any(common.encode(x, dtype) == 0x8000)  # no -0.0: the Lamport sentinel
        assert not np.array_equal(xs[0], xs[1])
    assert not np.array_equal(common.make_input(0, 4, 100, 1), common.make_input(0, 4, 100, 2))


def test_avg_over_three_ranks_is_within_tolerance():
    dtype, nranks, count = BF16, 3, 2000
    parts = [common.encode(common.make_input(r, nranks, count, 5), dtype).view(dtype.numpy) for r in range(nranks)]
    want = common.encode(common.expected_output(nranks, count, 5, "avg"), dtype)
    got = _reduce_in_dtype(parts, "avg", [0, 1, 2], 1.0 / nranks).view(dtype.bits)
    tol = common.tolerance("avg", nranks, dtype)
    assert tol > 0 and common.count_wrong(got, want, dtype, tol) == 0


def test_count_wrong_is_bitwise():
    want = common.encode(np.array([0.0, 1.0, -2.0, 3.0]), BF16)
    got = want.copy()
    assert common.count_wrong(got, want, BF16) == 0
    got[0] = common.encode(np.array([-0.0]), BF16)[0]  # -0.0 == 0.0 as floats, not as bits
    got[3] = BF16.nan
    assert common.count_wrong(got, want, BF16) == 2
    assert common.count_wrong(got, want, BF16, tol=0.5) == 1  # NaN is wrong under any tolerance


def test_nan_patterns_are_nan():
    for dtype in common.DTYPES.values():
        value = np.array([dtype.nan], dtype=dtype.bits).view(dtype.numpy).astype(np.float64)
        assert np.isnan(value[0]), dtype.name
    assert BF16.numpy == np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- arguments


def test_all_reduce_perf_defaults_are_nccl_tests_defaults():
    a = arp.parse_args([])
    assert (a.minbytes, a.maxbytes, a.stepbytes, a.stepfactor) == (32 << 20, 32 << 20, 1 << 20, 1)
    assert (a.iters, a.warmup_iters, a.check, a.cudagraph, a.average) == (20, 5, 1, 0, 1)
    assert (a.datatype, a.op, a.output_file) == ("float", "sum", "")
    assert (a.backend, a.algo, a.symmetric) == ("ubnext", "auto", 1)
    assert [d.name for d in a.dtypes] == ["float"] and a.ops == ["sum"] and a.sizes == [32 << 20]


def test_all_reduce_perf_flags():
    a = arp.parse_args(["-b", "8", "-e", "256M", "-f", "2", "-d", "all", "-o", "all", "-G", "10",
                        "-a", "3", "-J", "out.json", "--backend", "nccl", "-n", "50", "-w", "1", "-c", "0"])
    assert a.sizes[0] == 8 and a.sizes[-1] == 256 << 20
    assert [d.name for d in a.dtypes] == ["half", "float", "bfloat16"]
    assert a.ops == ["sum", "max", "min", "avg"]
    assert (a.cudagraph, a.average, a.output_file, a.symmetric) == (10, 3, "out.json", 0)
    assert arp.parse_args(["-d", "bf16"]).dtypes == [BF16]


@pytest.mark.parametrize("argv", [
    ["-b", "1M", "-e", "1K"], ["-d", "double"], ["-o", "prod"], ["-o", "mulsum"], ["-a", "4"],
    ["--backend", "nccl", "--algo", "lamport"], ["-n", "0"], ["-b", "huge"], ["--algo", "fast"],
    ["-J", "/nonexistent-dir/out.json"],
])
def test_all_reduce_perf_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        arp.parse_args(argv)


def test_compare_defaults():
    a = compare.parse_args([])
    assert (a.minbytes, a.maxbytes, a.stepfactor, a.dtype, a.op) == (2 << 10, 256 << 20, 2, BF16, "sum")
    assert (a.average, a.mode_list, a.iters, a.repeats, a.torch) == (3, ["eager", "graph", "dependent"], 20, 5, "auto")
    assert (a.gemm, a.nccl_symmetric) == ((64, 4096, 4096), "auto")
    with pytest.raises(SystemExit):
        compare.parse_args(["-d", "all"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--modes", "eager,fast"])


def test_dependent_mode_and_gemm_arguments():
    a = compare.parse_args(["--modes", "dependent", "--gemm", "8,16,32", "--nccl-symmetric", "0"])
    assert (a.mode_list, a.gemm, a.nccl_symmetric) == (["dependent"], (8, 16, 32), "0")
    from bench import fused_perf, tp_block

    f = fused_perf.parse_args(["--modes", "graph,dependent", "--gemm", "1,2,3"])
    assert (f.modes, f.gemm) == ("graph,dependent", (1, 2, 3))
    assert fused_perf.parse_args([]).modes.split(",") == ["eager", "graph", "dependent"]
    assert tp_block.parse_args(["--modes", "dependent"]).modes == "dependent"
    for bad in (["--gemm", "1,2"], ["--gemm", "0,4,4"], ["--gemm", "a,b,c"], ["--gemm", "1,2,3,4"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)
        with pytest.raises(SystemExit):
            fused_perf.parse_args(bad)
    for parse in (fused_perf.parse_args, tp_block.parse_args):
        with pytest.raises(SystemExit):
            parse(["--modes", "graph,dependant"])
    assert common.parse_gemm(" 64, 4096,4096") == (64, 4096, 4096)
    with pytest.raises(ValueError, match="M,K,N"):
        common.parse_gemm("64x4096x4096")


def test_all_reduce_perf_nccl_symmetric_arguments():
    a = arp.parse_args(["--backend", "nccl_symmetric", "-d", "bfloat16"])
    assert (a.backend, a.symmetric, a.algo) == ("nccl_symmetric", 0, "auto")
    for bad in (["--algo", "lamport"], ["--symmetric", "1"], ["--precision", "int8"]):
        with pytest.raises(SystemExit):
            arp.parse_args(["--backend", "nccl_symmetric", "-d", "bfloat16", *bad])


def test_combine_over_ranks():
    times = [3.0, 1.0, 2.0, 6.0]
    assert [common.combine(times, m) for m in (0, 1, 2, 3)] == [3.0, 3.0, 1.0, 6.0]
    with pytest.raises(ValueError):
        common.combine(times, 4)


def test_multicast_opt_outs():
    assert _torchbench.multicast_disabled({"NCCL_NVLS_ENABLE": "0"})
    assert _torchbench.multicast_disabled({"UBNEXT_NVLS": "0"})
    assert not _torchbench.multicast_disabled({"NCCL_NVLS_ENABLE": "1"})
    env = {"NCCL_NVLS_ENABLE": "0"}
    _torchbench.keep_multicast_off(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    env = {}
    _torchbench.keep_multicast_off(env)
    assert env == {}


# --------------------------------------------------------------------------- JSON


def test_write_json_never_overwrites(tmp_path):
    path = str(tmp_path / "r.json")
    assert common.write_json(path, {"a": 1}) == path
    assert common.write_json(path, {"a": 2}) == path + ".0"
    assert common.write_json(path, {"a": 3}) == path + ".1"
    assert json.loads(Path(path).read_text()) == {"a": 1}


def test_environment_subset_keeps_only_run_settings():
    env = {"NCCL_NVLS_ENABLE": "0", "UBNEXT_POOL_MB": "64", "HOME": "/root", "SECRET_TOKEN": "x",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    assert common.environment_subset(env) == ["CUDA_VISIBLE_DEVICES=0,1", "NCCL_NVLS_ENABLE=0", "UBNEXT_POOL_MB=64"]


def test_device_line_round_trip(monkeypatch):
    fakes.install(monkeypatch)
    line = common.device_line(3, 2)
    assert re.fullmatch(r"#  Rank  3 Group  0 Pid +\d+ on +\S+ device  2 \[0000:1a:00\] Fake GPU", line)
    record = common.parse_device_line(line)
    assert (record["rank"], record["device"], record["device_hex"], record["device_info"]) == (
        3, 2, "0000:1a:00", "Fake GPU")


# --------------------------------------------------------------------------- whole runs on the fake GPU


def _world(args, faults=False):
    boot = fakes.Bootstrap()
    import cupy  # the fake, installed by the caller

    return arp.World(fakes.Comm(boot), fakes.ReduceEngine(boot, faults), cupy.cuda.Stream(),
                     lambda count, dtype: cupy.empty((count,), dtype.numpy), ["# Buffers: fake"])


@pytest.mark.parametrize("graph", ["0", "2"])
def test_all_reduce_perf_run_on_fake_gpu(monkeypatch, tmp_path, capsys, graph):
    fakes.install(monkeypatch)
    out = str(tmp_path / "r.json")
    argv = ["-b", "8", "-e", "64K", "-f", "8", "-d", "all", "-o", "all", "-n", "3", "-w", "1",
            "-G", graph, "-J", out]
    args = arp.parse_args(argv)
    assert arp.run(args, _world(args), argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if not line.startswith("#")]
    assert len(rows) == 3 * 4 * len(args.sizes)
    for row in rows:
        cells = row.split()
        assert len(cells) == 13 and cells[4] == "-1" and cells[8] == "0" and cells[12] == "0"
    assert "# Out of bounds values : 0 OK" in lines
    assert any(line.startswith("#  Rank  0 Group  0 Pid") for line in lines)
    doc = json.loads(Path(out).read_text())
    assert doc["version"] == 2 and len(doc["results"]) == len(rows)
    first = doc["results"][0]
    assert (first["size"], first["count"], first["type"], first["redop"]) == (8, 4, "half", "sum")
    assert set(first["out_of_place"]) == {"time", "alg_bw", "bus_bw", "nwrong"}
    assert doc["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert doc["config"]["devices"][0]["device_info"] == "Fake GPU"


@pytest.mark.parametrize("script", ["reduce_scatter_perf", "all_gather_perf"])
def test_reduce_scatter_and_all_gather_perf_run_on_fake_gpu(monkeypatch, capsys, script):
    """Their layouts (nccl-tests': sizes of the whole message, in place at rank r's slice)
    checked bit for bit, on one rank of the fake GPU; redop "none" for the all-gather."""
    import importlib

    from bench import _sliced_perf

    fakes.install(monkeypatch)
    importlib.import_module(f"bench.{script}")  # the script imports
    program = {"reduce_scatter_perf": _sliced_perf.REDUCE_SCATTER_PERF,
               "all_gather_perf": _sliced_perf.ALL_GATHER_PERF}[script]
    argv = ["-b", "8", "-e", "64K", "-f", "8", "-d", "all", "-n", "2", "-w", "1"]
    args = arp.parse_args(argv, program)
    world = _world(args)
    world.collective = program.collective
    assert arp.run(args, world, argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert len(rows) == 3 * len(args.sizes) and all(r[8] == "0" and r[12] == "0" for r in rows)
    assert f"# Collective test starting: {script}" in out
    assert program.collective.bus_factor(4) == pytest.approx(0.75)
    if not program.collective.reduces:
        assert {r[3] for r in rows} == {"none"}


def test_collective_layouts_at_four_ranks():
    from bench._sliced_perf import ALL_GATHER, REDUCE_SCATTER

    assert REDUCE_SCATTER.count(100, 2, 4) == 48 and ALL_GATHER.count(100, 2, 4) == 48
    assert REDUCE_SCATTER.buffers(48, 4) == (48, 12) and REDUCE_SCATTER.in_place(48, 4, 3) == (0, 36)
    assert ALL_GATHER.buffers(48, 4) == (12, 48) and ALL_GATHER.in_place(48, 4, 3) == (36, 0)
    values, want = REDUCE_SCATTER.data(4, 2, 48, 7, "sum")
    assert values.size == 48 and want.size == 12
    values, want = ALL_GATHER.data(4, 2, 48, 7, "none")
    assert values.size == 12 and want.size == 48 and (want[24:36] == values).all()


def test_all_reduce_perf_counts_wrong_elements(monkeypatch, capsys):
    fakes.install(monkeypatch)
    argv = ["-b", "1K", "-e", "2K", "-f", "2", "-n", "1", "-c", "2", "-G", "1"]
    args = arp.parse_args(argv)
    assert arp.run(args, _world(args, faults=True), argv) == 1
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [(r[8], r[12]) for r in rows] == [("1", "1"), ("1", "1")]
    assert "# Out of bounds values : 4 FAILED" in out


def test_all_reduce_perf_without_check_prints_na(monkeypatch, capsys):
    fakes.install(monkeypatch)
    args = arp.parse_args(["-b", "64", "-e", "64", "-c", "0", "-n", "1"])
    assert arp.run(args, _world(args, faults=True), []) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")][0]
    assert row.split()[8] == "N/A" and row.split()[12] == "N/A"


def _compare_session(args, engine=None):
    """Candidates ubnext-auto, ubnext-lamport (refuses above 4 KiB) and nccl on the fake
    GPU, with the dependent mode's GEMM (``args.gemm``) as a host copy of its exact product."""
    import cupy

    boot = fakes.Bootstrap()
    engine = engine or fakes.ReduceEngine(boot)
    data = common.GemmData(args.gemm, 1)
    count = max(args.maxbytes // args.dtype.itemsize, data.elements)

    class Limited:
        def __init__(self, limit):
            self.limit = limit

        def all_reduce(self, send, recv, dtype, op, stream):
            if self.limit is not None and send.size * dtype.itemsize > self.limit:
                raise ValueError("too large")
            engine.all_reduce(send, recv, dtype, op, stream)

    def candidate(name, limit=None):
        buf = cupy.empty((count,), dtype=args.dtype.numpy)
        return compare.Candidate(name, "in-place", buf, buf, Limited(limit), lambda e: isinstance(e, ValueError))

    class Nccl:
        def close(self):
            pass

    session = compare.Session(fakes.Comm(boot), Nccl(), cupy.cuda.Stream(),
                              [candidate("ubnext-auto"), candidate("ubnext-lamport", 4096), candidate("nccl")],
                              False, gemm_data=data)
    for cand in session.candidates:
        session.gemms[cand.name] = _fake_gemm(data, cand.send, session.stream)
    return session


def _fake_gemm(data, buf, stream):
    """A launch that writes rank 0's exact GEMM product into ``buf``'s head, on ``stream``."""
    product = data.product(0).astype(np.float32).astype(buf.host.dtype)

    def launch():
        stream.enqueue(lambda: buf.host[:product.size].__setitem__(slice(None), product))

    return launch


def test_compare_run_on_fake_gpu(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="compare's plots need matplotlib")
    fakes.install(monkeypatch)
    argv = ["-b", "1K", "-e", "16K", "-n", "2", "--repeats", "3", "-G", "2", "--outdir", str(tmp_path),
            "--name", "t", "--gemm", "4,8,256"]  # the GEMM writes 1024 elements: more than 1 KiB, less than 16 KiB
    args = compare.parse_args(argv)
    session = _compare_session(args)
    session.left_out["nccl-symmetric"] = "no torch here"
    compare.sweep(session, args, lambda text: None)
    compare.report(session, args, argv)
    out = capsys.readouterr().out
    assert "# eager: median us per all-reduce" in out and "# graph: median us" in out
    assert "# dependent: median us per all-reduce after a GEMM on its input" in out
    assert "# dependent: raw: median us per GEMM + all-reduce" in out
    assert "# nccl-symmetric left out: no torch here" in out
    lamport_cells = [line for line in out.splitlines() if line.strip().startswith("16 KiB")]
    assert all("—" in line for line in lamport_cells)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["world_size"] == 1 and doc["dtype"] == "bfloat16" and doc["machine"]["gpu"] == "Fake GPU"
    skipped = [r for r in doc["results"] if r["status"] == "skipped"]
    assert {(r["candidate"], r["bytes"]) for r in skipped} == {("ubnext-lamport", 8192), ("ubnext-lamport", 16384)}
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    assert all(r["wrong"] == 0 and len(r["times_us"]) == 3 for r in ok)
    dependent = [r for r in ok if r["mode"] == "dependent"]
    assert len(dependent) == 5 + 5 + 3  # ubnext-auto and nccl at 1-16 KiB, ubnext-lamport up to 4 KiB
    for r in dependent:  # the JSON keeps the raw numbers; the reported time is their difference
        assert r["times_us"] == [a - b for a, b in zip(r["raw_us"], r["gemm_us"])]
        assert r["median_us"] == pytest.approx(np.median(r["times_us"]))
    assert doc["left_out"] == {"nccl-symmetric": "no torch here"} and doc["config"]["gemm_mnk"] == [4, 8, 256]
    assert (tmp_path / "t_latency.png").stat().st_size > 0 and (tmp_path / "t_busbw.png").stat().st_size > 0


@pytest.mark.parametrize("shape", [(4, 8, 16), (8, 4, 1024)], ids=["gemm-smaller", "gemm-larger"])
def test_dependent_mode_checks_bit_for_bit_and_catches_wrong_results(monkeypatch, capsys, shape):
    """The dependent mode's check on the fake GPU: right where the engine is right, whether the
    message is larger than the GEMM's output (64 elements: zeros after it) or smaller (8192:
    a prefix); wrong where the engine corrupts an element, and wrong where the all-reduce
    reads its input before the GEMM before it ran (a consumer without a real dependency),
    though that engine passes the eager check."""
    fakes.install(monkeypatch)
    argv = ["-b", "1K", "-e", "4K", "-n", "2", "--repeats", "2", "-G", "1", "--modes", "eager,dependent",
            "--gemm", ",".join(map(str, shape))]
    args = compare.parse_args(argv)
    boot = fakes.Bootstrap()

    class Early(fakes.ReduceEngine):
        """Reads the input when the call is enqueued, not when it runs."""

        def all_reduce(self, send, recv, dtype, op, stream):
            early = send.host.astype(np.float64)
            stream.enqueue(lambda: recv.host.__setitem__(slice(None), early.astype(recv.host.dtype)))

    for engine, wrong in ((fakes.ReduceEngine(boot), False), (fakes.ReduceEngine(boot, faults=True), True),
                          (Early(boot), True)):
        session = _compare_session(args, engine)
        compare.sweep(session, args, lambda text: None)
        by_mode = {}
        for r in session.records:
            if r["status"] == "ok":
                by_mode.setdefault(r["mode"], []).append(r["wrong"])
        assert all(w > 0 for w in by_mode["dependent"]) == wrong and any(by_mode["dependent"]) == wrong
        assert any(by_mode["eager"]) == (engine.faults is True)  # the early reader passes without a producer
        if wrong:
            lines = compare.table(session.records, "dependent", [c.name for c in session.candidates])
            assert all("WRONG" in line for line in lines[2:])


def test_gemm_operands_give_exact_known_products():
    data = common.GemmData((6, 32, 40), nranks=4, seed=3)
    assert data.elements == 240 and np.abs(data.b).max() <= common.value_range(5)
    for rank in range(4):
        a = data.a(rank)
        assert (a.sum(axis=1) == 1).all() and set(np.unique(a)) == {0, 1}
        product = a.astype(np.float64) @ data.b.astype(np.float64)  # what the GPU's GEMM computes
        assert (product.reshape(-1) == data.product(rank)).all()
    assert not (data.product(0) == data.product(1)).all()  # ranks' inputs differ
    assert (data.inputs(2, 100) == data.product(2)[:100]).all()  # message smaller: a prefix
    longer = data.inputs(2, 300)
    assert (longer[:240] == data.product(2)).all() and not longer[240:].any()  # larger: zeros after
    total = data.expected(300, "sum")
    assert (total[:240] == sum(data.product(r).astype(np.float64) for r in range(4))).all()
    assert (common.encode(total, BF16).view(BF16.numpy).astype(np.float64) == total).all()  # exact in bf16
    assert (data.expected(240, "max") == np.max([data.product(r) for r in range(4)], axis=0)).all()


def test_dependent_samples_subtract_the_gemm_measured_right_after():
    calls = []
    raw, gemm = iter([10.0, 11.0, 12.5]), iter([6.0, 6.5, 7.0])

    def pair():
        calls.append("pair")
        return next(raw)

    def alone():
        calls.append("gemm")
        return next(gemm)

    d = common.dependent_samples(pair, alone, 3)
    assert d == {"times_us": [4.0, 4.5, 5.5], "raw_us": [10.0, 11.0, 12.5], "gemm_us": [6.0, 6.5, 7.0]}
    assert calls == ["pair", "gemm"] * 3


def test_the_dependent_modes_pieces_are_the_packages():
    """One source: the benchmarks use the shape, parsing and subtraction that python -m
    ubnext.tune --mode dependent uses."""
    from ubnext._tools import dependent

    assert common.GEMM_SHAPE == dependent.GEMM_SHAPE == (64, 4096, 4096)
    for name in ("parse_gemm", "gemm_arg", "dependent_samples"):
        assert getattr(common, name) is getattr(dependent, name), name


def _record(candidate, nbytes, us, wrong=0, mode="graph"):
    return {"candidate": candidate, "mode": mode, "bytes": nbytes, "status": "ok", "wrong": wrong,
            "median_us": us, "raw_median_us": us + 10}


def test_ratios_are_against_the_faster_nccl_at_each_size():
    records = [
        _record("ubnext-auto", 2048, 2.5), _record("nccl", 2048, 10.0), _record("nccl-symmetric", 2048, 5.0),
        _record("ubnext-auto", 1 << 20, 8.0), _record("nccl", 1 << 20, 16.0), _record("nccl-symmetric", 1 << 20, 20.0),
        # a wrong NCCL result is no reference: plain NCCL at 4 MiB is skipped
        _record("ubnext-auto", 4 << 20, 30.0), _record("nccl", 4 << 20, 15.0, wrong=3),
        _record("nccl-symmetric", 4 << 20, 60.0), _record("torch-nccl", 4 << 20, 45.0),
    ]
    at = {}
    for r in records:
        at.setdefault(r["bytes"], {})[r["candidate"]] = r
    assert compare.faster_nccl(at[2048]) == ("nccl-symmetric", 5.0)
    assert compare.faster_nccl(at[1 << 20]) == ("nccl", 16.0)
    assert compare.faster_nccl(at[4 << 20]) == ("torch-nccl", 45.0)
    assert compare.faster_nccl({"ubnext-auto": records[0]}) is None
    names = ["ubnext-auto", "nccl", "nccl-symmetric", "torch-nccl"]
    rows = {line.split()[0] + line.split()[1]: line.split() for line in compare.table(records, "graph", names)[2:]}
    assert rows["2KiB"][2:6] == ["nccl-symmetric", "2.50", "(2.00x)", "10.00"]
    assert rows["1MiB"][2:5] == ["nccl", "8.00", "(2.00x)"]
    assert rows["4MiB"][2:5] == ["torch-nccl", "30.00", "(1.50x)"]
    raw = compare.table(records, "graph", names, "raw_median_us", "raw")  # the raw table: raw against raw
    assert raw[2].split()[2:5] == ["nccl-symmetric", "12.50", "(1.20x)"] and "raw;" in raw[0]


def test_nccl_symmetric_left_out_with_a_reason(monkeypatch):
    import types

    from bench import _torchbench as tb

    assert "NCCL_NVLS_ENABLE=0" in tb.nccl_symmetric_blocker({})  # multicast not switched off: never tried
    assert "NCCL_NVLS_ENABLE=0" in tb.nccl_symmetric_blocker({"NCCL_NVLS_ENABLE": "1"})

    def fake_torch(symm, version):
        """torch, torch.cuda.nccl and torch.distributed._symmetric_memory as the blocker sees them."""
        mods = {n: types.ModuleType(n) for n in ("torch", "torch.cuda", "torch.cuda.nccl", "torch.distributed")}
        mods["torch.cuda.nccl"].version = lambda: version
        mods["torch"].cuda, mods["torch.cuda"].nccl = mods["torch.cuda"], mods["torch.cuda.nccl"]
        mods["torch"].distributed = mods["torch.distributed"]
        mods["torch.distributed._symmetric_memory"] = symm
        if symm is not None:
            mods["torch.distributed"]._symmetric_memory = symm
        for name, module in mods.items():
            monkeypatch.setitem(sys.modules, name, module)

    env = {"NCCL_NVLS_ENABLE": "0"}
    fake_torch(None, (2, 28, 9))  # torch without symmetric memory
    assert "does not import" in tb.nccl_symmetric_blocker(env)
    fake_torch(types.ModuleType("torch.distributed._symmetric_memory"), (2, 28, 9))  # no NCCL backend
    assert "no NCCL backend" in tb.nccl_symmetric_blocker(env)
    symm = types.ModuleType("torch.distributed._symmetric_memory")
    symm.set_backend = lambda name: None
    fake_torch(symm, (2, 26, 2))
    assert "2.26.2 has no symmetric kernels" in tb.nccl_symmetric_blocker(env)
    fake_torch(symm, (2, 28, 9))
    assert tb.nccl_symmetric_blocker(env) is None


def test_symmetric_kernel_names():
    from bench import _torchbench as tb

    plain = ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "aten::empty"]
    assert "no NCCL symmetric kernel ran" in tb.symmetric_kernel_problem(plain)
    assert "ncclDevKernel_AllReduce_Sum_bf16_RING_LL" in tb.symmetric_kernel_problem(plain)
    assert tb.symmetric_kernel_problem(plain + ["ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16"]) is None  # 2.28
    assert tb.symmetric_kernel_problem(["ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_f32"]) is None  # 2.27
    for multicast in ("ncclSymkDevKernel_AllReduce_AGxLLMC_R_sum_bf16", "ncclSymkDevKernel_AllReduce_RSxLDMC_AGxSTMC_sum_bf16",
                      "ncclSymkDevKernel_AllGather_STMC"):
        with pytest.raises(RuntimeError, match="multicast"):
            tb.symmetric_kernel_problem([multicast])


def test_all_reduce_perf_in_place_only_backend(monkeypatch, tmp_path, capsys):
    """A backend with no out-of-place call (nccl_symmetric) prints N/A there, keeps null in
    the JSON, and its file still plots."""
    fakes.install(monkeypatch)

    class InPlace(fakes.ReduceEngine):
        in_place_only = True

        def all_reduce(self, send, recv, dtype, op, stream):
            assert send.data.ptr == recv.data.ptr, "in place only"
            super().all_reduce(send, recv, dtype, op, stream)

    out = str(tmp_path / "r.json")
    argv = ["-b", "1K", "-e", "4K", "-f", "2", "-d", "bfloat16", "-n", "2", "-w", "1", "-G", "1", "-J", out]
    args = arp.parse_args(argv)
    world = _world(args)
    world.engine = InPlace(world.comm.bootstrap)
    assert arp.run(args, world, argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(rows) == 3 and all(r[5:9] == ["N/A"] * 4 and r[12] == "0" for r in rows)
    doc = json.loads(Path(out).read_text())
    assert all(r["out_of_place"] is None and r["in_place"]["nwrong"] == 0 for r in doc["results"])
    if pytest.importorskip("matplotlib"):
        assert plot.main(["--perf", str(tmp_path / "p.png"), out]) == 0


# --------------------------------------------------------------------------- plots from JSON


def _synthetic_report() -> dict:
    sizes = [2 << 10 << i for i in range(8)]
    results = []
    for cand, base in (("ubnext-auto", 5.0), ("nccl", 14.0), ("torch-twoshot", 7.0)):
        for mode in ("eager", "graph"):
            for n in sizes:
                us = base + n / 2e5
                results.append({"candidate": cand, "placement": "in-place", "mode": mode, "bytes": n,
                                "count": n // 2, "status": "ok", "wrong": 0, "reason": "",
                                "times_us": [us, us * 1.1], "median_us": us,
                                "busbw_GBps": n / us / 1e3 * 1.5})
    results.append({**results[0], "bytes": 1 << 30, "status": "skipped", "reason": "too large", "times_us": []})
    return {"kind": "ubnext.compare", "version": 1, "date": "2026-01-01T12:00:00+0000",
            "machine": {"hostname": "h", "gpu": "NVIDIA H200"}, "world_size": 4, "dtype": "bfloat16",
            "op": "sum", "config": {"modes": ["eager", "graph"]},
            "candidates": [{"name": n, "placement": "in-place"} for n in ("ubnext-auto", "nccl", "torch-twoshot")],
            "results": results}


def test_plot_series_skips_refused_sizes():
    series = plot.series(_synthetic_report(), "eager", "median_us")
    assert list(series) == ["ubnext-auto", "nccl", "torch-twoshot"]
    assert series["ubnext-auto"][0] == sorted(series["ubnext-auto"][0]) and (1 << 30) not in series["ubnext-auto"][0]


def test_plot_png_from_synthetic_json(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    report = tmp_path / "synthetic.json"
    report.write_text(json.dumps(_synthetic_report()))
    (tmp_path / "png").mkdir()
    assert plot.main([str(report), "-o", str(tmp_path / "png")]) == 0
    for suffix in ("latency", "busbw"):
        png = tmp_path / "png" / f"synthetic_{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_perf_draws_nccl_tests_json(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install matplotlib)")
    paths = []
    for k, precision in enumerate(("int8", "exact")):
        doc = {"args": ["all_reduce_perf", "-b", "1M", "--precision", precision, "-J", "x.json"],
               "results": [{"size": 1 << (20 + 2 * i), "out_of_place": {"time": 10.0 * (i + 1) + k}}
                           for i in (2, 0, 1)]}
        paths.append(tmp_path / f"{precision}.json")
        paths[-1].write_text(json.dumps(doc))
    assert plot.perf_label(json.loads(paths[0].read_text())) == "all_reduce_perf --precision int8"
    png = tmp_path / "perf.png"
    assert plot.main(["--perf", str(png), *map(str, paths)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- several ranks


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_all_reduce_perf_over_mpi_on_fake_gpus(run_mpi, nranks):
    result = run_mpi(SCRIPTS / "bench_fake_gpus.py", nranks, timeout=240)
    lines = result.stdout.splitlines()
    assert sum(line.startswith("#  Rank ") for line in lines) == nranks
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert len(rows) == 3 * 4 * 8 and all(r[8] == "0" and r[12] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in lines


def test_benchmarks_import_without_gpu_modules():
    """Importing the benchmarks must not import cupy, torch, mpi4py or matplotlib (CPU-only use).

    They do import ubnext, for the size and timing helpers they share with ``ubnext.tune``.
    """
    code = ("import sys; import bench._common, bench.all_reduce_perf, bench.compare, bench.plot, bench.link_ceiling; "
            "print(sorted(m for m in ('cupy', 'torch', 'mpi4py', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_link_ceiling_defaults_and_kernels_compile():
    from bench import link_ceiling
    from ubnext._environment.cuda import nvrtc_compile

    args = link_ceiling.parse_args([])
    assert args.bytes == [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    assert link_ceiling.parse_args(["--bytes", "2M,8M"]).bytes == [2 << 20, 8 << 20]
    cubin = nvrtc_compile(link_ceiling._SOURCE, "link_ceiling.cu", ["--gpu-architecture=sm_90a"])
    assert b"push" in cubin and b"pull" in cubin


def test_plot_candidates_draws_one_line_per_candidate(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    records = [{"bytes": b, "candidate": c, "time_us": t} for c, t0 in (("a", 1.0), ("b", 2.0))
               for b, t in ((1024, t0), (4096, 3 * t0))]
    path = tmp_path / "p.png"
    _torchbench.plot_candidates(str(path), "title", records, ("a", "b"), (("time", "time_us"),), "bytes", "µs")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"# wrote {path}\n"


def test_quant_training_summarises_each_format_against_full_precision():
    """bench/quant_training.py's summary: the last steps' mean loss, the held-out figures,
    and the final weights' relative distance from the exact run (none for exact itself)."""
    torch = pytest.importorskip("torch")
    from bench import quant_training

    args = quant_training.parse_args(["--formats", "exact,int4"])
    assert args.formats == "exact,int4" and args.steps == 300
    losses = [float(i) for i in range(100)]
    runs = {"exact": {"losses": losses, "held_out_loss": 0.5, "held_out_accuracy": 0.9,
                      "weights": torch.tensor([3.0, 4.0])},
            "int4": {"losses": losses[::-1], "held_out_loss": 0.6, "held_out_accuracy": 0.8,
                     "weights": torch.tensor([3.0, 4.5])}}
    exact, int4 = quant_training.summary(runs)
    assert exact == {"format": "exact", "final_train_loss": sum(range(80, 100)) / 20, "held_out_loss": 0.5,
                     "held_out_accuracy": 0.9, "weights_rel_drift_vs_exact": None}
    assert int4["final_train_loss"] == sum(range(20)) / 20
    assert int4["weights_rel_drift_vs_exact"] == pytest.approx(0.5 / 5.0)


# --------------------------------------------------------------------------- tp_block --precision


def test_tp_block_precision_arguments_and_opt_in(monkeypatch):
    """``--precision`` takes distinct quantized formats; full precision comes first as the
    path they are measured against; the communicator is opted in only with the flag, and a
    UBNEXT_QUANTIZED already set stays."""
    import os

    from bench import tp_block

    assert tp_block.parse_args([]).precision == [] and tp_block.precision_paths([]) == {}
    args = tp_block.parse_args(["--precision", "int4,int8", "--modes", "graph"])
    assert args.precision == ["int4", "int8"]
    assert tp_block.precision_paths(args.precision) == {"ubnext exact": "exact", "ubnext int4": "int4",
                                                        "ubnext int8": "int8"}
    for bad in ("int2", "int8,int8", "exact", "auto", "", "int8,"):
        with pytest.raises(SystemExit):
            tp_block.parse_args(["--precision", bad])
    monkeypatch.setenv("UBNEXT_QUANTIZED", "off")
    monkeypatch.delenv("UBNEXT_QUANTIZED")  # restored (unset) after the test, whatever the calls below set
    tp_block.parse_and_opt_in(["--modes", "graph"])
    assert "UBNEXT_QUANTIZED" not in os.environ
    tp_block.parse_and_opt_in(["--precision", "fp8,int8"])
    assert os.environ["UBNEXT_QUANTIZED"] == "fp8"
    monkeypatch.setenv("UBNEXT_QUANTIZED", "int4")
    tp_block.parse_and_opt_in(["--precision", "int8"])
    assert os.environ["UBNEXT_QUANTIZED"] == "int4"


def test_tp_block_deviation_of_both_outputs():
    torch = pytest.importorskip("torch")
    from bench import tp_block

    ref = (torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16), torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16))
    out = (torch.tensor([[3.0, 4.5]], dtype=torch.bfloat16), torch.tensor([[1.0, -0.25]], dtype=torch.bfloat16))
    assert tp_block.deviation(out, ref) == {"max_abs_out": 0.5, "rel_out": 0.1, "max_abs_residual": 0.25,
                                            "rel_residual": 0.25}
    assert set(tp_block.deviation(ref, ref).values()) == {0.0}
    nan = float("nan")
    assert tp_block.nan_max([1.0, 3.0, 2.0]) == 3.0
    assert all(tp_block.nan_max(v) != tp_block.nan_max(v) for v in ([1.0, nan, 2.0], [nan, 1.0], [2.0, nan]))


def test_tp_block_precision_paths_force_the_format_on_the_all_reduce(monkeypatch):
    """Each --precision path is the unfused block (the NCCL path's arithmetic) with ubnext's
    all-reduce in place on the down GEMM's output and ``precision=`` forced (a CPU block of
    two ranks holding the same partial sums)."""
    torch = pytest.importorskip("torch")
    import types

    import torch.distributed as dist
    import torch.nn.functional as F

    from bench import tp_block

    calls = []

    class Comm:
        def all_reduce(self, x, out=None, precision="auto"):
            calls.append((out is x, precision))
            return out.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", lambda y: y.mul_(2))
    g = torch.Generator().manual_seed(0)
    gate_up, down, norm = (torch.randn(*s, generator=g) for s in ((24, 8), (8, 12), (8,)))
    block = object.__new__(tp_block.Block)  # no GPU: the attributes steps() uses
    block.mlp = types.SimpleNamespace(gate_up=types.SimpleNamespace(weight=gate_up),
                                      down=types.SimpleNamespace(weight=down, partial=lambda a: F.linear(a, down)),
                                      norm=types.SimpleNamespace(weight=norm))
    block.comm, block.epilogue, block.eps = Comm(), tp_block.add_rmsnorm, 1e-6
    h, residual = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    fns = block.steps(h, residual, tp_block.precision_paths(["int8", "int4"]))
    assert list(fns) == ["ubnext", "nccl+torch", "ubnext exact", "ubnext int8", "ubnext int4"]
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    want = tp_block.add_rmsnorm(2 * F.linear(F.silu(gate) * up, down), residual, norm, 1e-6)
    for path in ("nccl+torch", "ubnext exact", "ubnext int8", "ubnext int4"):
        assert all(torch.equal(a, b) for a, b in zip(fns[path](), want)), path
    assert calls == [(True, "exact"), (True, "int8"), (True, "int4")]
    assert list(block.steps(h, residual)) == list(tp_block.PATHS)


def _tp_block_records(args) -> list[dict]:
    """Records as tp_block.run makes them: µs per path (times the tokens), the formats'
    differences from full precision growing with their step."""
    from bench import tp_block

    us = {"ubnext": 10.0, "nccl+torch": 20.0, "ubnext exact": 16.0, "ubnext int8": 8.0, "ubnext int4": 4.0}
    step = {"exact": 0.0, "int8": 1e-3, "int4": 2e-2}
    precisions = tp_block.precision_paths(args.precision)
    records = []
    for t in args.tokens:
        for path in (*tp_block.PATHS, *precisions):
            for mode in args.modes.split(","):
                rec = {"path": path, "mode": mode, "tokens": t, "rel_err_vs_1gpu": 2e-3, "times_us": [us[path] * t],
                       "median_us": us[path] * t, "peak_torch_bytes": 1 << 20,
                       "ubnext_pool_bytes": 0 if path == "nccl+torch" else 1 << 30}
                if mode == "dependent":
                    rec.update(raw_median_us=100.0, gemm_median_us=90.0)
                if path in precisions:
                    e = step[precisions[path]]
                    rec.update(precision=precisions[path], vs_exact={"max_abs_out": 4 * e, "rel_out": e,
                                                                     "max_abs_residual": 8 * e, "rel_residual": 2 * e})
                records.append(rec)
    return records


def test_tp_block_precision_table_and_json(monkeypatch, tmp_path, capsys):
    """tp_block's report with --precision: the per-mode tables as before, then one row per
    token count and precision (exact first) with its differences from full precision, its
    error against one GPU and µs per mode beside exact's; the JSON holds the formats and
    each record's precision and vs_exact."""
    fakes.install(monkeypatch)
    from bench import tp_block

    argv = ["--tokens", "1,8", "--modes", "graph,dependent", "--precision", "int8,int4", "--name", "t",
            "--outdir", str(tmp_path)]
    args = tp_block.parse_args(argv)
    tp_block.report(fakes.Comm(fakes.Bootstrap()), args, argv, _tp_block_records(args))
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# precision:"))
    assert lines[at + 1].split() == ["tokens", "format", "max|d|", "out", "rel", "out", "max|d|", "res", "rel",
                                     "res", "vs", "1", "GPU", "graph", "µs", "x", "exact", "dependent", "µs", "x",
                                     "exact"]
    rows = [line.split() for line in lines[at + 2:at + 8]]
    assert [r[:2] for r in rows] == [[t, f] for t in ("1", "8") for f in ("exact", "int8", "int4")]
    assert rows[0][2:] == ["0.00e+00"] * 4 + ["2.0e-03", "16.0", "1.00", "16.0", "1.00"]
    assert rows[5][2:] == ["8.00e-02", "2.00e-02", "1.60e-01", "4.00e-02", "2.0e-03", "32.0", "4.00", "32.0", "4.00"]
    assert sum(line.startswith(("# graph:", "# dependent:")) for line in lines[:at]) == 2
    doc = json.loads((tmp_path / "t.json").read_text())
    assert (doc["kind"], doc["precision"], len(doc["results"])) == ("ubnext.tp_block", ["int8", "int4"], 2 * 5 * 2)
    int4 = [r for r in doc["results"] if r["path"] == "ubnext int4"]
    assert {r["precision"] for r in int4} == {"int4"} and all(r["vs_exact"]["rel_out"] == 2e-2 for r in int4)
    assert not any("vs_exact" in r for r in doc["results"] if r["path"] in tp_block.PATHS)

    plain = tp_block.parse_args(argv[:4] + argv[6:])  # without --precision: no such table, none in the JSON
    tp_block.report(fakes.Comm(fakes.Bootstrap()), plain, argv, _tp_block_records(plain))
    out = capsys.readouterr().out
    assert "# precision" not in out and json.loads((tmp_path / "t.json").read_text())["precision"] == []


@pytest.mark.parametrize("program", [arp.ALL_REDUCE_PERF, REDUCE_SCATTER_PERF], ids=["all_reduce", "reduce_scatter"])
def test_measure_times_this_ranks_data_also_on_torch_tensors(monkeypatch, program):
    """measure() uploads the rank's make_input data before timing (the quantized kernels'
    time depends on the values), counting the elements from the collective, not the array:
    torch tensors (the nccl_symmetric backend's buffers) have no element-count attribute."""
    from types import SimpleNamespace

    import torch

    count, nranks, rank = 64, 2, 1
    args = arp.parse_args(["-d", "bfloat16", "-w", "0"], program)
    send_n, recv_n = program.collective.buffers(count, nranks)
    uploaded = []
    world = SimpleNamespace(views=lambda c, in_place: (torch.zeros(send_n), torch.zeros(recv_n)),
                            collective=program.collective, size=nranks, rank=rank, stream=None,
                            comm=SimpleNamespace(bootstrap=SimpleNamespace(barrier=lambda: None)))
    monkeypatch.setattr(common, "upload", lambda array, values, dtype, stream: uploaded.append((array, values)))
    monkeypatch.setattr(arp, "_launcher", lambda *a: lambda: None)
    monkeypatch.setattr(common, "timer", lambda *a: lambda: 2e-6)
    monkeypatch.setattr(common, "allgather_float", lambda bootstrap, v: [v] * nranks)
    assert arp.measure(world, args, common.DTYPES["bfloat16"], "sum", count, False) == pytest.approx(2e-6)
    ((array, values),) = uploaded
    assert array.numel() == send_n and values.size == send_n
    np.testing.assert_array_equal(values, common.make_input(rank, nranks, send_n, 0))
    assert np.any(values != 0)
