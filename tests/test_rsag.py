"""Reduce-scatter and all-gather without a GPU: argument checks and layouts (with the
communicator's validation run on stand-in buffers), the host references, the selector's
rows per collective and their explanations, the NCCL fallback through the fake NCCL of
tests/test_nccl_comm.py, the call signatures and the launches of whole slices."""

from __future__ import annotations

import json
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest
from stream_fakes import bare_communicator, fake_order

from ubnext._api.report import _choice
from ubnext._environment.config import Config
from ubnext._interop import arrays as _arrays
from ubnext._interop.arrays import Buffer
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, KERNEL_DTYPES
from ubnext._protocol.errors import UbnextError
from ubnext._selection.select import Selector, buffer_limits
from ubnext._selection.table_format import parse_table
from ubnext._tools import reference

MIB = 1 << 20


UNICAST = [name for name, alg in ALGORITHMS.items() if not alg.multicast]


TUNE_H200X2 = Path(__file__).resolve().parents[1] / "bench" / "results" / "tune_h200x2_1129.json"


def selector(nranks=4, usable=None, deterministic=False):
    """A selector of the default table; every unicast algorithm usable unless ``usable``."""
    return Selector(nranks, buffer_limits(Config.from_env()), usable or UNICAST, None, "", deterministic)


# ---- the algorithm table -----------------------------------------------------------------
def test_the_two_shot_kernels_and_nccl_serve_every_collective():
    for collective in COLLECTIVES:
        served = {name for name, alg in ALGORITHMS.items() if alg.serves(collective)}
        want = set(ALGORITHMS) if collective == "all_reduce" else {"lamport_twoshot", "twoshot", "nvls", "nccl"}
        assert served == want, collective
    assert not ALGORITHMS["lamport"].supports("bfloat16", "sum", "reduce_scatter")
    assert ALGORITHMS["nccl"].supports("int32", "sum", "all_gather")
    assert not ALGORITHMS["twoshot"].supports("float64", "sum", "reduce_scatter")  # NCCL's


# ---- selection -----------------------------------------------------------------------------
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_default_rows_follow_the_all_reduce_switch_where_not_measured(collective):
    """4 and 8 ranks: the defaults that follow the all-reduce's switch; 2 ranks: the rows
    measured on 2x H200 (bench/results/tune_h200x2_1129.json)."""
    four, two, eight = selector(4), selector(2), selector(8)
    measured = json.loads(TUNE_H200X2.read_text())["entries"][0]["collectives"][collective]["tables"]["2"]
    for dtype in KERNEL_DTYPES:
        assert four.select(16, dtype, collective) == "lamport_twoshot"
        assert four.select(32 * MIB, dtype, collective) == "lamport_twoshot"  # in launches past 16 MiB
        assert four.select(32 * MIB + 16, dtype, collective) == "nccl"
        rows = measured.get(dtype, measured["bfloat16"])  # float16: bfloat16's rows
        for limit, name in rows:
            if limit is not None:
                assert two.select(limit, dtype, collective) == name
        assert two.select(1 << 30, dtype, collective) == rows[-1][1]
        assert eight.select(256 << 10, dtype, collective) == "lamport_twoshot"
        assert eight.select(1 * MIB, dtype, collective) == "twoshot"
        assert eight.select(64 * MIB, dtype, collective) == "nccl"
    assert four.select(4096, "float64", collective) == "nccl"


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_explain_names_the_collectives_rows(collective):
    name, why = selector(4).explain(4096, "bfloat16", collective)
    assert name == "lamport_twoshot"
    assert f"4 ranks bfloat16 ({collective}, default table: NVIDIA H200 nvlink plain graph)" in why
    name, why = selector(4).explain(4096, "int8", collective)
    assert name == "nccl" and "NCCL reduces int8" in why


def test_multicast_and_deterministic_replacements_serve_the_collective():
    mc = selector(4, list(ALGORITHMS))  # multicast usable too
    assert mc.select(4096, "bfloat16", "reduce_scatter") == "nvls"  # the Lamport two-shot's replacement
    assert mc.select(4096, "bfloat16", "all_gather") == "nvls"
    det = selector(4, deterministic=True)
    assert det.select(64 * MIB, "bfloat16", "reduce_scatter") == "twoshot"


def test_table_rows_of_a_collective_are_checked():
    doc = {"format": 1, "machine": "m", "tables": {"*": {"bfloat16": [[None, "nccl"]]}}}
    table = parse_table({**doc, "collectives": {"all_gather": {"tables": {"4": {"float32": [[None, "twoshot"]]}}}}},
                        "t").entries[0]
    assert table.lookup(4, "bfloat16", "all_gather")[0] == ((None, "twoshot"),)
    assert table.lookup(4, "bfloat16", "reduce_scatter") is None  # left to the next table
    with pytest.raises(UbnextError, match=r"collectives\['reduce_scatter'\].tables\['4'\]\['bfloat16'\]: row 1: "
                                          r"lamport has no reduce_scatter kernel"):
        parse_table({**doc, "collectives": {"reduce_scatter": {"tables": {"4": {"bfloat16": [[None, "lamport"]]}}}}},
                    "t")
    with pytest.raises(UbnextError, match="collectives must be an object whose keys are among"):
        parse_table({**doc, "collectives": {"all_reduce": {"tables": {}}}}, "t")
    with pytest.raises(UbnextError, match=r"collectives\['all_gather'\] must be an object"):
        parse_table({**doc, "collectives": {"all_gather": {"rows": {}}}}, "t")


def test_a_tune_file_without_collective_rows_leaves_them_to_the_default_table():
    tune = parse_table({"format": 1, "machine": "m", "tables": {"4": {"bfloat16": [[None, "twoshot"]]}}}, "tune")
    sel = Selector(4, buffer_limits(Config.from_env()), UNICAST, tune)
    assert sel.select(4096, "bfloat16") == "twoshot"
    assert sel.select(4096, "bfloat16", "reduce_scatter") == "lamport_twoshot"


# ---- the communicator's checks, on stand-in buffers ------------------------------------------
class Recorder:
    """A Dispatcher stand-in that records the calls it would issue."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def buffer(count, dtype="bfloat16", ptr=1 << 20, shape=None):
    width = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4}[dtype]
    return Buffer(SimpleNamespace(count=count, ptr=ptr), "cupy", ptr, count, dtype, 0, shape or (count,),
                  count * width)


@pytest.fixture
def comm(monkeypatch):
    """A 4-rank Communicator (local rank 1) without devices: buffers are Buffer tuples."""
    monkeypatch.setattr(_arrays, "as_buffer", lambda x, op, stream: x)
    monkeypatch.setattr(_arrays, "launch_stream", lambda stream, x, device: (0, None, False))
    made = []
    monkeypatch.setattr(_arrays, "empty_like", lambda x, s, o, side, shape=None: made.append(shape) or
                        buffer(int(np.prod(shape)), x.dtype, 1 << 30, shape))
    cfg = Config.from_env()
    local = type("Local", (), {"rank": 1, "size": 4})()
    c = bare_communicator(fake_order(), config=cfg, _dispatch=Recorder(), rank=1, size=4, _local=local,
                          _selector=Selector(4, buffer_limits(cfg), list(ALGORITHMS), None, ""))
    c.made = made
    return c


def test_reduce_scatter_layout_and_default_out(comm):
    x = buffer(4 * 6, shape=(8, 3))
    out = comm.reduce_scatter(x, op="max")
    assert comm.made == [(2, 3)] and out.count == 6
    name, algo, xb, ob, k, op, *_ = comm._dispatch.calls[-1]
    assert (name, algo, xb, k, op) == ("reduce_scatter", "nvls", x, 6, "max")
    comm.reduce_scatter(buffer(4 * 5, shape=(4 * 5,)))
    assert comm.made[-1] == (5,)
    comm.reduce_scatter(buffer(4 * 5, shape=(2, 10)))  # 4 ranks do not divide 2 rows
    assert comm.made[-1] == (5,)


def test_all_gather_layout_and_default_out(comm):
    comm.all_gather(buffer(6, shape=(2, 3)), algorithm="twoshot")
    assert comm.made == [(8, 3)]
    name, algo, xb, ob, k, *_ = comm._dispatch.calls[-1]
    assert (name, algo, k, ob.count) == ("all_gather", "twoshot", 6, 24)


def test_counts_the_world_does_not_divide_raise(comm):
    with pytest.raises(UbnextError, match="^reduce_scatter: x has 10 elements, which 4 ranks do not divide"):
        comm.reduce_scatter(buffer(10))
    with pytest.raises(UbnextError, match="^all_gather: out has 10 elements, which 4 ranks do not divide"):
        comm.all_gather(buffer(3), out=buffer(10, ptr=1 << 25))
    with pytest.raises(UbnextError, match="^reduce_scatter_add_rmsnorm: x has 6 rows, which 4 ranks do not divide"):
        comm.reduce_scatter_add_rmsnorm(buffer(12, shape=(6, 2)), None, buffer(2, ptr=1 << 25))
    assert comm._dispatch.calls == []


def test_outputs_are_checked(comm):
    x = buffer(16)
    with pytest.raises(UbnextError, match="^reduce_scatter: out has 5 bfloat16 elements; it must have 4 bfloat16"):
        comm.reduce_scatter(x, out=buffer(5, ptr=1 << 25))
    with pytest.raises(UbnextError, match="^reduce_scatter: out has 4 float32 elements; it must have 4 bfloat16"):
        comm.reduce_scatter(x, out=buffer(4, "float32", ptr=1 << 25))
    with pytest.raises(UbnextError, match="^reduce_scatter: out overlaps the input other than in place"):
        comm.reduce_scatter(x, out=buffer(4, ptr=x.ptr))  # rank 1's slice starts 8 bytes in
    with pytest.raises(UbnextError, match="^all_gather: out overlaps the input other than in place"):
        comm.all_gather(buffer(4, ptr=x.ptr), out=x)
    with pytest.raises(UbnextError, match="^reduce_scatter: unsupported op 'prod'"):
        comm.reduce_scatter(x, op="prod")
    with pytest.raises(UbnextError, match="^all_gather: algorithm 'lamport' has no all_gather kernel"):
        comm.all_gather(buffer(4), algorithm="lamport")
    with pytest.raises(UbnextError, match="^reduce_scatter: algorithm 'nvls_lamport' has no reduce_scatter kernel"):
        comm.reduce_scatter(x, algorithm="nvls_lamport")
    with pytest.raises(UbnextError, match="^reduce_scatter: op 'avg' takes floating-point dtypes"):
        comm.reduce_scatter(buffer(16, "int32"), op="avg")
    assert comm._dispatch.calls == []


def test_in_place_views_are_taken(comm):
    x = buffer(16)
    comm.reduce_scatter(x, out=buffer(4, ptr=x.ptr + 1 * 4 * 2))  # rank 1's slice of x
    comm.all_gather(buffer(4, ptr=x.ptr + 1 * 4 * 2), out=x)  # x is rank 1's slice of out
    assert [c[0] for c in comm._dispatch.calls] == ["reduce_scatter", "all_gather"]


def test_in_place_is_the_global_ranks_slice(comm):
    """Across nodes NCCL runs the call over every rank: rank r's slice is that of its
    global rank, not its rank on the node (here global rank 5, local rank 1)."""
    comm.rank, comm.size = 5, 8
    x = buffer(32)
    comm.reduce_scatter(x, out=buffer(4, ptr=x.ptr + 5 * 4 * 2))
    comm.all_gather(buffer(4, ptr=x.ptr + 5 * 4 * 2), out=x)
    with pytest.raises(UbnextError, match="overlaps"):
        comm.reduce_scatter(x, out=buffer(4, ptr=x.ptr + 1 * 4 * 2))
    assert [c[0] for c in comm._dispatch.calls] == ["reduce_scatter", "all_gather"]


def test_other_dtypes_go_to_nccl(comm):
    comm.reduce_scatter(buffer(16, "float64"))
    comm.all_gather(buffer(4, "int32"))
    assert [c[1] for c in comm._dispatch.calls] == ["nccl", "nccl"]


def test_ubnext_algo_naming_a_kernel_without_the_collective_leaves_it_to_auto(comm):
    object.__setattr__(comm.config, "algorithm", "lamport")
    assert comm._resolve("reduce_scatter", "auto", 4096, "bfloat16", collective="reduce_scatter") == "nvls"
    assert comm._resolve("all_reduce", "auto", 4096, "bfloat16") == "lamport"
    assert _choice(comm, 4096, "bfloat16", "all_gather")[0] == "nvls"
    assert _choice(comm, 4096, "bfloat16") == ("lamport", "UBNEXT_ALGO=lamport")


def test_select_takes_the_collective(comm):
    assert comm.select(4096, "bfloat16", collective="all_gather") == "nvls"
    with pytest.raises(KeyError, match="unknown collective 'broadcast'"):
        comm.select(4096, "bfloat16", collective="broadcast")


def test_fused_step_checks_its_operands(comm):
    x = buffer(8 * 16, shape=(8, 16))
    w = buffer(16, ptr=1 << 26)
    with pytest.raises(UbnextError, match=r"residual_shard must be bfloat16 of shape \(2, 16\)"):
        comm.reduce_scatter_add_rmsnorm(x, buffer(8 * 16, ptr=1 << 25, shape=(8, 16)), w)
    with pytest.raises(UbnextError, match="eps must be finite"):
        comm.reduce_scatter_add_rmsnorm(x, None, w, eps=-1)
    with pytest.raises(UbnextError, match="takes bfloat16, float16, float32, not float64"):
        comm.reduce_scatter_add_rmsnorm(buffer(8 * 16, "float64", shape=(8, 16)), None, buffer(16, "float64"))
    normed, res = comm.reduce_scatter_add_rmsnorm(x, buffer(32, ptr=1 << 25, shape=(2, 16)), w, eps=1e-5)
    name, algo, xb, nb, rows, hidden, norm, eps, *_ = comm._dispatch.calls[-1]
    assert (name, rows, hidden, eps, nb.obj) == ("reduce_scatter_add_rmsnorm", 2, 16, 1e-5, normed)
    assert norm == (1 << 25, 0, w.ptr, normed.ptr, res.ptr)


# ---- signatures ------------------------------------------------------------------------------
def test_signatures_name_the_new_collectives():
    assert _signature.text(_signature.encode("reduce_scatter", "float16", "max", 64)) == \
        "reduce_scatter of 64 float16 (max)"
    assert _signature.text(_signature.encode("all_gather", "bfloat16", "sum", 64)) == "all_gather of 64 bfloat16"
    fused = _signature.encode_fused("bfloat16", 8, 1024, "reduce_scatter_add_rmsnorm")
    assert _signature.text(fused) == "reduce_scatter_add_rmsnorm of 8 x 1024 bfloat16"
    codes = {_signature.encode(c, "bfloat16", "sum", 4) >> 60 for c in _signature.COLLECTIVES}
    assert len(codes) == len(_signature.COLLECTIVES)  # every collective has its own code


# ---- host references -------------------------------------------------------------------------
def inputs(n, count, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    for x in xs:
        x[::7] = -0.0
    return xs


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_scatter_reference_is_the_all_reduce_sliced_in_each_owners_order(n):
    xs = inputs(n, n * 9)
    k = 9
    pushed = reference.reduce_scatter("lamport_twoshot", xs)
    whole = reference.lamport_twoshot(xs)
    for r in range(n):
        reference.assert_same_bits(pushed[r], whole[r * k:(r + 1) * k])
        order = reference.owner_order(r, n)
        want = reference.narrow(reference.reduce_fp32([reference.widen(x[r * k:(r + 1) * k]) for x in xs], "sum",
                                                      order), xs[0].dtype)
        reference.assert_same_bits(reference.reduce_scatter("twoshot", xs)[r], want)
    assert not any(np.signbit(s[s == 0]).any() for s in pushed)  # the Lamport kernels store no -0.0


def test_all_gather_reference_concatenates_in_rank_order():
    xs = inputs(3, 5)
    got = reference.all_gather("twoshot", xs)
    reference.assert_same_bits(got, np.concatenate(xs))
    assert np.signbit(got[got == 0]).any()
    pushed = reference.all_gather("lamport_twoshot", xs)
    assert not np.signbit(pushed[pushed == 0]).any()


# ---- launches of whole slices ----------------------------------------------------------------
class FakeEngine:
    nranks, rank, staging_bytes, staging_off, staging_ptr = 4, 1, 16 * 5 * 1000, 4096, 1 << 40

    def __init__(self):
        self.launches = []

    def lamport(self, *args):
        return ("lamport", *args)

    def twoshot(self, *args):
        return ("twoshot", *args)


class FakePool:
    def contains(self, ptr, nbytes):
        return ptr - (1 << 32) if ptr >= 1 << 32 else None


def sliced(monkeypatch, algo, dtype, k, limit=1 << 30):
    from ubnext._engine import sliced as _sliced

    copies = []
    monkeypatch.setattr(_sliced, "copy", lambda *a: copies.append(("copy", *a)))
    monkeypatch.setattr(_sliced, "copy_rows", lambda *a: copies.append(("rows", *a)))
    node = type("Node", (), {"engine": FakeEngine(), "pool": FakePool()})()
    # an issued launch, recorded with its stream before the collective it names
    monkeypatch.setattr(_sliced, "issue", lambda launch, stream: node.engine.launches.append(
        (*launch[:-1], stream, launch[-1])))
    return _sliced.Sliced(node, {"lamport_twoshot": (limit, "X")}, algo, dtype, k, 7), node.engine, copies


def test_aligned_whole_slices_go_straight_to_the_kernel(monkeypatch):
    s, eng, copies = sliced(monkeypatch, "lamport_twoshot", "bfloat16", 64)
    s.reduce_scatter(1 << 20, 1 << 21, "sum", 5)
    s.all_gather(1 << 21, 1 << 20, 5)
    assert copies == []
    assert eng.launches == [("lamport", "lamport_twoshot", "bfloat16", "sum", 1 << 20, 1 << 21, 64, 5, 7,
                             "reduce_scatter"),
                            ("lamport", "lamport_twoshot", "bfloat16", "sum", 1 << 21, 1 << 20, 64, 5, 7,
                             "all_gather")]


def test_symmetric_arrays_are_the_barrier_kernels_buffer(monkeypatch):
    s, eng, copies = sliced(monkeypatch, "twoshot", "float32", 8)
    sym = (1 << 32) + 256
    s.reduce_scatter(sym, sym + 1 * 8 * 4, "sum", 5)  # in place
    s.all_gather(sym + 1 * 8 * 4, sym, 5)  # in place: no copy-in
    s.all_gather(1 << 20, sym, 5)
    assert copies == []
    assert [launch[4:7] for launch in eng.launches] == [(256, 0, sym + 32), (256, 0, 0), (256, 1 << 20, 0)]


def test_odd_slices_are_padded_through_the_staging_slot(monkeypatch):
    s, eng, copies = sliced(monkeypatch, "twoshot", "bfloat16", 7)
    s.reduce_scatter(1 << 20, 1 << 21, "sum", 5)
    assert copies == [("rows", eng.staging_ptr, 16, 1 << 20, 14, 14, 4, 7)]
    assert eng.launches[-1][4:8] == (eng.staging_off, 0, 1 << 21, 7)
    copies.clear()
    s.all_gather(1 << 21, 1 << 20, 5)
    assert eng.launches[-1][4:8] == (eng.staging_off, 1 << 21, 0, 7)
    assert copies == [("rows", 1 << 20, 14, eng.staging_ptr, 16, 14, 4, 7)]


def test_large_messages_run_in_launches_of_every_slice(monkeypatch):
    s, eng, copies = sliced(monkeypatch, "lamport_twoshot", "float32", 1000, limit=4 * 16 * 100)
    s.reduce_scatter(1 << 20, (1 << 21) + 2, "sum", 5)  # out not aligned: through a scratch slice
    assert [launch[6] for launch in eng.launches] == [400, 400, 200]
    rows = [c for c in copies if c[0] == "rows"]
    assert [c[3] for c in rows] == [1 << 20, (1 << 20) + 1600, (1 << 20) + 3200]  # a part of every slice
    assert all(c[4] == 4000 and c[6] == 4 for c in rows)  # x's pitch, every rank's slice
    outs = [c for c in copies if c[0] == "copy"]
    assert [c[1] for c in outs] == [(1 << 21) + 2, (1 << 21) + 1602, (1 << 21) + 3202]


def test_debug_mode_compares_where_each_rank_has_its_buffers_in_the_pool(comm):
    """The kernels address the same pool offsets on every rank: in debug mode a rank with
    its out in the pool (comm.empty) beside a rank with a plain array raises on every rank
    before anything is launched, naming both."""
    import pickle

    segment = (1 << 20, 1 << 24)  # this rank's pool segment: [base, base + size)
    pool = type("Pool", (), {"contains": lambda self, ptr, n: ptr - segment[0]
                             if segment[0] <= ptr and ptr + n <= sum(segment) else None})()
    comm._node = type("Node", (), {"pool": pool, "failure": lambda self, name, timeout: None,
                                   "hold": lambda self, stream: None})()
    object.__setattr__(comm.config, "debug", True)
    others = []  # what the other ranks' calls look like: plain arrays everywhere
    comm.bootstrap = type("Boot", (), {"allgather": lambda self, b: [b, *others]})()
    x = buffer(16, ptr=1 << 30)
    others[:] = [pickle.dumps((16, "bfloat16", "sum", "lamport_twoshot", (None, 0)))] * 3
    with pytest.raises(UbnextError, match=r"ranks disagree.*symmetric offsets=\(None, None\).*symmetric offsets=\(None, 0\)"):
        comm.reduce_scatter(x, out=buffer(4, ptr=1 << 30 << 1), algorithm="lamport_twoshot")
    assert comm._dispatch.calls == []


def test_slices_past_a_2d_copys_pitch_are_copied_row_by_row(monkeypatch):
    """A 2-D copy takes pitches below 2**31: slices of 2 GiB and more (a 2-rank
    reduce-scatter of 4 GiB and up) are copied a row at a time instead of failing."""
    import sys
    import types

    from ubnext._engine import copies as _copies

    calls = []
    runtime = types.SimpleNamespace(memcpy2DAsync=lambda *a: calls.append(("2d", a)),
                                    memcpyAsync=lambda *a: calls.append(("1d", a)))
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.SimpleNamespace(runtime=runtime))
    _copies.copy_rows(0x1000, 64, 0x9000, 128, 48, 3, 7)
    assert calls == [("2d", (0x1000, 64, 0x9000, 128, 48, 3, 3, 7))]
    calls.clear()
    big = _copies.MAX_PITCH + 1
    _copies.copy_rows(0x1000, 64, 1 << 40, big, 48, 2, 7)
    assert calls == [("1d", (0x1000, 1 << 40, 48, 3, 7)), ("1d", (0x1000 + 64, (1 << 40) + big, 48, 3, 7))]
