"""Point-to-point on the pool (kernels/p2p.cu, ubnext/_api/collectives/p2p.py) without a GPU:
the kernel compiles through NVRTC for sm_90a at every world size with both entry points, its
lines are 64-bit flag-and-data words and its credits release/acquire words at system scope,
its work is the 512-byte last parameter that the engine packs word by word; its area is
planned with its launch state; and the calls' choice between it and NCCL, and what they
launch (groups, byte counts, peers, the signature head), on the communicator stand-ins."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from test_collectives import RANKS, buffer, calls, make_comm
from test_pool_copy import pooled

from ubnext._api.collectives import all_to_all as _a2a
from ubnext._api.collectives import p2p as _p2p
from ubnext._engine import engine as _engine
from ubnext._engine import kernels as _kernels
from ubnext._memory.heap import STATES, ll_slot_bytes, p2p_bytes, plan_layout
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import P2P_ENTRIES, P2P_SOURCE, ll_defines
from ubnext._protocol.constants import (HEADER_BYTES, LL_MAX_BYTES, MAX_RANKS, P2P_BULK_BLOCKS, P2P_BULK_CHUNK,
                                        P2P_BULK_DEPTH, P2P_BULK_MIN_BYTES, P2P_MAX_ENTRIES)
from ubnext._protocol.errors import UbnextError

SHARED = "local ranks 0, 1 share one GPU"


# ---- the kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
def test_both_entry_points_compile_at_every_world_size(nranks):
    cubin = _kernels.compile_cubin(P2P_SOURCE, ll_defines(nranks), fast=True)
    for entry in P2P_ENTRIES:
        assert entry.encode() + b"\0" in cubin


def test_compiles_with_full_optimization():
    """What ubnext launches (Engine.p2p: compile_module's options), at the largest world size."""
    cubin = _kernels.compile_cubin(P2P_SOURCE, ll_defines(8))
    assert all(entry.encode() + b"\0" in cubin for entry in P2P_ENTRIES)


def entry_ptx(entry: str, nranks: int = 4) -> str:
    ptx = _kernels.compile_cubin(P2P_SOURCE, ll_defines(nranks), arch="compute_90a").decode()
    body = ptx[ptx.index(f".entry {entry}("):]
    return body[:body.find(".entry ", 1) if ".entry " in body[1:] else None]


@pytest.mark.parametrize("entry", P2P_ENTRIES)
def test_lines_are_64_bit_words_and_credits_release_acquire(entry):
    body = entry_ptx(entry)
    assert re.search(r"st\.relaxed\.sys\.global\.v2\.u64", body)  # LL lines: flag in each 64-bit word
    assert re.search(r"ld\.volatile\.global\.v2\.u64", body)
    assert re.search(r"st\.release\.sys\.global\.u32", body)  # the receiver's credit
    assert re.search(r"ld\.acquire\.sys\.global\.u32", body)  # the sender's wait for it
    assert "trap" not in body and ".local" not in body


@pytest.mark.parametrize("entry", P2P_ENTRIES)
def test_the_grid_dependency_wait_comes_before_every_access(entry):
    """Programmatic dependent launch: nothing but the parameters and block 0's entry stamp
    is touched before the wait for the kernel before (which wrote the pairs' counters, the
    splits, the sends' data), and the trigger for dependents follows it."""
    body = entry_ptx(entry)
    body = body[body.index("{"):]
    wait = body.index("griddepcontrol.wait;")
    assert body.index("griddepcontrol.launch_dependents;") > wait
    before = [line.split()[0] for line in body[:wait].splitlines()
              if re.match(r"\s*(ld|st|atom|red|cp|prefetch)\.", line)]
    assert [i for i in before if not i.startswith("ld.param")] == ["st.relaxed.gpu.global.u64"], before


def test_the_work_is_the_last_parameter_of_the_engines_words():
    """ub_p2p's work is one 512-byte parameter after nine scalars; the engine's launcher
    packs it as 2 * P2P_MAX_ENTRIES 8-byte slots after theirs (a parameter is copied from
    the address of its slot: the struct's bytes are those slots in order)."""
    head = entry_ptx("ub_p2p")[:2000]
    params = re.findall(r"\.param (?:\.align 8 )?\.(\w+) ub_p2p_param_(\d+)(\[\d+\])?", head)
    assert [p[1] for p in params] == [str(i) for i in range(10)]
    assert params[-1][2] == f"[{16 * P2P_MAX_ENTRIES}]"
    width = {_engine.U64: "u64", _engine.I32: "u32"}
    assert [p[0] for p in params[:9]] == [width[t] for t in _engine._PARAMS["ub_p2p"][:9]]
    assert len(_engine._PARAMS["ub_p2p"]) == 9 + 2 * P2P_MAX_ENTRIES
    alltoallv = re.findall(r"ub_p2p_alltoallv_param_\d+", entry_ptx("ub_p2p_alltoallv")[:2000])
    assert len(set(alltoallv)) == len(_engine._PARAMS["ub_p2p_alltoallv"])


@pytest.mark.parametrize("entry", P2P_ENTRIES)
def test_the_bulk_form_stores_vectors_then_a_fenced_flag_and_reads_them_past_l1(entry):
    """Bulk chunks (kernels/p2p_bulk.cuh): 16-byte stores into the receiver's slot, a
    system-scope fence before the chunk's flag line (and after the receiver sees it), 16-byte relaxed system-scope loads
    (never a stale L1 line of an earlier use of the slot), the group's arrival counted
    with an atomic add."""
    body = entry_ptx(entry)
    assert re.search(r"st\.global\.v4\.u32", body)
    assert "fence.acq_rel.sys;" in body
    # no flag line (an LL line's 64-bit words) follows vector stores without a fence between
    stored = False
    for op in (line.split()[0] for line in body.splitlines() if line.split()):
        if op.startswith("st.global.v4"):
            stored = True
        elif op == "fence.acq_rel.sys;":
            stored = False
        assert not (stored and op.startswith("st.relaxed.sys.global.v2.u64")), "a flag line without a fence"
    assert re.search(r"ld\.relaxed\.sys\.global\.v4\.u32", body)
    assert re.search(r"atom\.global\.add\.u32", body)


def test_the_area_is_planned_with_its_state():
    plan = plan_layout(8, 1 << 20, 1 << 20, 8 << 20)
    assert "p2p.state" in STATES
    lines = 2 * HEADER_BYTES + 2 * 8 * (HEADER_BYTES + 2 * LL_MAX_BYTES)
    # bulk: a counters line, 4-byte credits and 16-byte flag lines per rank and slot, 16-byte
    # verdict lines per rank and entry, the chunk slots
    bulk = (HEADER_BYTES + (4 + 16) * MAX_RANKS * P2P_BULK_DEPTH + 16 * MAX_RANKS * P2P_MAX_ENTRIES
            + 8 * P2P_BULK_DEPTH * P2P_BULK_CHUNK)
    assert plan.nbytes("p2p") == p2p_bytes(8) == lines + bulk
    assert p2p_bytes(8) - p2p_bytes(4) == 4 * (2 * (HEADER_BYTES + 2 * LL_MAX_BYTES) + P2P_BULK_DEPTH * P2P_BULK_CHUNK)
    assert plan.offset("p2p") % HEADER_BYTES == 0 and ll_slot_bytes() % HEADER_BYTES == 0
    assert plan.offset("p2p") + plan.nbytes("p2p") <= plan.offset("staging")  # zeroed by Engine.initialize


def test_the_bulk_constants_keep_lines_aligned_and_the_rotation_whole():
    """The bulk part's flag lines and chunk slots start on whole lines, chunks are whole
    16-byte vectors, and the slot rotation q % depth stays consistent when the 32-bit chunk
    count wraps (a power of two); a bulk message is past one LL line's chunk of data."""
    assert (4 * MAX_RANKS * P2P_BULK_DEPTH) % HEADER_BYTES == 0
    assert (20 * MAX_RANKS * P2P_BULK_DEPTH) % HEADER_BYTES == 0
    assert (16 * MAX_RANKS * P2P_MAX_ENTRIES) % HEADER_BYTES == 0
    assert P2P_BULK_CHUNK % HEADER_BYTES == 0
    assert P2P_BULK_DEPTH & (P2P_BULK_DEPTH - 1) == 0 and P2P_BULK_DEPTH >= 2 * P2P_BULK_BLOCKS
    assert P2P_BULK_MIN_BYTES >= P2P_BULK_CHUNK


# ---- the engine's launch ---------------------------------------------------------------------
def engine_stub(max_blocks=132):
    return SimpleNamespace(_p2p_launcher=lambda entry: entry, nranks=4, _blocks=max_blocks)


def test_the_engine_packs_groups_in_order_one_block_each():
    launch = _engine.Engine.p2p(engine_stub(), [("send", 3, [(0x1000, 7), (0x2000, 0)]), ("recv", 0, [(0x3000, 9)])],
                                0xAB << 52)
    entry, blocks, threads, values = launch
    assert (entry, blocks, threads) == ("ub_p2p", 2, 512)
    assert values[:2] == (3, 0xAB << 52)
    words = list(values[2:])
    assert words[:6] == [0x1000, 7 | 3 << 48 | 1 << 56, 0x2000, 0 | 3 << 48 | 1 << 56, 0x3000, 9]
    assert words[6:] == [0] * (2 * P2P_MAX_ENTRIES - 6) and len(words) == 2 * P2P_MAX_ENTRIES
    with pytest.raises(AssertionError, match="takes 1 to 32 entries, not 33"):
        _engine.Engine.p2p(engine_stub(), [("send", 1, [(0x10, 1)] * 33)], 0)


def test_the_engines_alltoallv_runs_a_block_per_send_and_receive():
    launch = _engine.Engine.p2p_alltoallv(engine_stub(), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert launch == ("ub_p2p_alltoallv", 8, 512, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10))


def test_a_launch_that_may_move_a_bulk_message_runs_several_blocks_per_group():
    """A batch with a message of P2P_BULK_MIN_BYTES or more: P2P_BULK_BLOCKS blocks per
    group (one byte less: one), within the engine's blocks; the all-to-all with device
    splits by the largest part its arrays could hold (x's rows or out's)."""
    big = [("send", 3, [(0x1000, 7), (0x2000, P2P_BULK_MIN_BYTES)]), ("recv", 0, [(0x3000, 9)])]
    assert _engine.Engine.p2p(engine_stub(), big, 0)[1] == 2 * P2P_BULK_BLOCKS
    assert _engine.Engine.p2p(engine_stub(3), big, 0)[1] == 2
    assert _engine.Engine.p2p(engine_stub(2 * P2P_BULK_BLOCKS - 1), big, 0)[1] == 2 * (P2P_BULK_BLOCKS - 1)
    small = [("send", 3, [(0x1000, P2P_BULK_MIN_BYTES - 1)]), ("recv", 0, [(0x3000, P2P_BULK_MIN_BYTES - 1)])]
    assert _engine.Engine.p2p(engine_stub(), small, 0)[1] == 2
    rows = P2P_BULK_MIN_BYTES // 16
    assert _engine.Engine.p2p_alltoallv(engine_stub(), 1, 2, rows, 1, 16, 6, 4, 8, 4, 0)[1] == 8 * P2P_BULK_BLOCKS
    assert _engine.Engine.p2p_alltoallv(engine_stub(), 1, 2, 1, rows, 16, 6, 4, 8, 4, 0)[1] == 8 * P2P_BULK_BLOCKS
    assert _engine.Engine.p2p_alltoallv(engine_stub(), 1, 2, rows - 1, rows - 1, 16, 6, 4, 8, 4, 0)[1] == 8
    assert _engine.Engine.p2p_alltoallv(engine_stub(20), 1, 2, rows, rows, 16, 6, 4, 8, 4, 0)[1] == 16


def test_groups_keep_each_pairs_order():
    items = [("recv", 10, 1, 2), ("send", 11, 2, 3), ("recv", 12, 3, 2), ("send", 13, 4, 2), ("send", 14, 5, 3)]
    assert _p2p.groups(items) == [("recv", 2, [(10, 1), (12, 3)]), ("send", 3, [(11, 2), (14, 5)]),
                                  ("send", 2, [(13, 4)])]


# ---- the calls' choice and launch -----------------------------------------------------------------
def p2p_comm(monkeypatch, nccl_problem=SHARED, rank=1):
    """``pooled``'s communicator whose engine records the point-to-point launches."""
    c = pooled(monkeypatch, nccl_problem=nccl_problem, rank=rank)
    c.launches = []
    c._node.engine = SimpleNamespace(p2p=lambda groups, head: c.launches.append(("p2p", groups, head)) or "L",
                                     p2p_alltoallv=lambda *a: c.launches.append(("alltoallv", *a)) or "L")
    monkeypatch.setattr(_p2p, "issue", lambda launch, stream: c.launches.append(("issue", launch, stream)))
    return c


SEND_RECV = _signature.encode("send_recv", "uint8", "sum", 0)


def test_where_nccl_cannot_run_auto_takes_the_kernel(monkeypatch):
    c = p2p_comm(monkeypatch)
    x, out = buffer(5, "float32"), buffer(3, "int8", ptr=1 << 22)
    c.send(x, 3)
    assert c.recv(out, 0) is out.obj
    c.batch_isend_irecv([("recv", out, 2), ("send", x, 1), ("send", buffer(2, "int64", ptr=1 << 23), 1)])
    assert c.launches == [("p2p", [("send", 3, [(x.ptr, 20)])], SEND_RECV), ("issue", "L", 0x77),
                          ("p2p", [("recv", 0, [(out.ptr, 3)])], SEND_RECV), ("issue", "L", 0x77),
                          ("p2p", [("recv", 2, [(out.ptr, 3)]), ("send", 1, [(x.ptr, 20), (1 << 23, 16)])], SEND_RECV),
                          ("issue", "L", 0x77)]
    assert calls(c) == []


def test_where_nccl_runs_auto_takes_it_and_ll_is_named(monkeypatch):
    c = p2p_comm(monkeypatch, nccl_problem=None)
    x = buffer(5, "float32")
    c.send(x, 3)
    assert calls(c) == [("exchange", [(x.ptr, 20, 3)], [], 0x77, "send")] and c.launches == []
    c.send(x, 3, algorithm="ll")
    c.batch_isend_irecv([("send", x, 1)], algorithm="ll")
    assert [launch[0] for launch in c.launches] == ["p2p", "issue"] * 2


@pytest.mark.parametrize("call, message", [
    (lambda c, x: c.send(x, 0, algorithm="copy"), "^send: unknown algorithm 'copy'; use auto or one of ll, nccl"),
    (lambda c, x: c.recv(x, 0, algorithm="nccl"), "^recv: algorithm 'nccl' was named, and NCCL, which runs it, "
                                                  "cannot run here"),
    (lambda c, x: c.batch_isend_irecv([("send", x, 0)] * (P2P_MAX_ENTRIES + 1)),
     f"^batch_isend_irecv: the pool's point-to-point kernel takes at most {P2P_MAX_ENTRIES} sends and receives "
     f"per call, not {P2P_MAX_ENTRIES + 1} \\(and NCCL cannot run here"),
    (lambda c, x: c.send(x, 1), "^send: peer 1 is this rank"),
])
def test_bad_calls_raise_before_anything(monkeypatch, call, message):
    c = p2p_comm(monkeypatch)
    with pytest.raises(UbnextError, match=message):
        call(c, buffer(4))
    assert c.launches == [] and calls(c) == []


def test_ll_needs_the_pool(monkeypatch):
    c = make_comm(monkeypatch)
    with pytest.raises(UbnextError, match=r"^send: algorithm 'll' needs the symmetric pool \(NCCL only"):
        c.send(buffer(4), 0, algorithm="ll")
    with pytest.raises(UbnextError, match=r"^all_to_all: algorithm 'll' needs the symmetric pool"):
        c.all_to_all(buffer(4), in_splits=[1, 1, 1, 1], out_splits=[1, 1, 1, 1], algorithm="ll")


def test_a_rank_without_rows_still_receives_whole_rows(monkeypatch):
    """A rank whose x has no rows sends empty parts and receives rows of x's row length."""
    c = p2p_comm(monkeypatch)
    x = buffer(0, "float32", shape=(0, 3))
    out = c.all_to_all(x, in_splits=[0, 0, 0, 0], out_splits=[1, 0, 2, 0])
    recvs = c.launches[0][1][4:]
    assert recvs == [("recv", 0, [(out.ptr, 12)]), ("recv", 1, [(out.ptr + 12, 0)]), ("recv", 2, [(out.ptr + 12, 24)]),
                     ("recv", 3, [(out.ptr + 36, 0)])]


def test_uneven_host_splits_send_one_message_per_pair(monkeypatch):
    """Every pair's part is a message, empty ones too (their headers carry the counts the
    receiver checks); parts start at the rows before them."""
    c = p2p_comm(monkeypatch)
    x = buffer(7 * 2, "int8", shape=(7, 2))
    out = c.all_to_all(x, in_splits=[3, 0, 4, 0], out_splits=[1, 2, 0, 5])
    assert c.made == [(8, 2)]
    head = _signature.encode("all_to_all", "uint8", "sum", 0)
    sends = [(x.ptr, 6), (x.ptr + 6, 0), (x.ptr + 6, 8), (x.ptr + 14, 0)]
    recvs = [(out.ptr, 2), (out.ptr + 2, 4), (out.ptr + 6, 0), (out.ptr + 6, 10)]
    assert c.launches[0] == ("p2p", [("send", r, [sends[r]]) for r in range(RANKS)] +
                             [("recv", r, [recvs[r]]) for r in range(RANKS)], head)
    assert calls(c) == []
    with pytest.raises(UbnextError, match="^all_to_all: algorithm 'copy' needs even splits"):
        c.all_to_all(x, in_splits=[3, 0, 4, 0], out_splits=[1, 2, 0, 5], algorithm="copy")


def test_device_splits_go_to_the_kernel_without_a_host_read(monkeypatch):
    """No device-to-host copy, no exchange: the kernel reads the counts; a capture may take it."""
    c = p2p_comm(monkeypatch)
    monkeypatch.setattr(_a2a.AllToAll, "_read", lambda *a: pytest.fail("the splits were read on the host"))
    c.bootstrap.allgather_obj = lambda obj: pytest.fail("the splits were exchanged")
    monkeypatch.setattr(_a2a.CUDA, "capture", lambda stream: 5)
    x = buffer(10 * 3, "float64", shape=(10, 3))
    out = buffer(12 * 3, "float64", ptr=1 << 25, shape=(12, 3))
    ins, outs = buffer(4, "int64", ptr=1 << 26), buffer(4, "int32", ptr=1 << 27)
    assert c.all_to_all(x, out, ins, outs) is out.obj
    assert c.launches == [("alltoallv", x.ptr, out.ptr, 10, 12, 24, ins.ptr, 8, outs.ptr, 4,
                           _signature.encode("all_to_all", "uint8", "sum", 0)), ("issue", "L", 0x77)]
    with pytest.raises(UbnextError, match="^all_to_all: out_splits must hold 4 int32 or int64 elements"):
        c.all_to_all(x, out, ins, buffer(4, "float32", ptr=1 << 27))
    inside = buffer(4, "int32", ptr=out.ptr + out.nbytes - 8)  # its last 8 bytes: out's last row's
    with pytest.raises(UbnextError, match="^all_to_all: in_splits overlaps out; the counts are read while out is"):
        c.all_to_all(x, out, inside, outs)
    with pytest.raises(UbnextError, match="^all_to_all: out_splits overlaps out"):
        c.all_to_all(x, out, ins, inside)
    assert len(c.launches) == 2


def test_where_nccl_runs_uneven_splits_stay_on_it(monkeypatch):
    c = p2p_comm(monkeypatch, nccl_problem=None)
    x = buffer(7 * 2, "int8", shape=(7, 2))
    c.all_to_all(x, in_splits=[3, 0, 4, 0], out_splits=[1, 2, 0, 5])
    assert calls(c)[0][0] == "exchange" and c.launches == []
    c.all_to_all(x, in_splits=[3, 0, 4, 0], out_splits=[1, 2, 0, 5], algorithm="ll")
    assert c.launches[0][0] == "p2p"


# ---- the launch's arguments as the kernel reads them ---------------------------------------------
def kernel_params(entry: str) -> list:
    """``entry``'s parameter names in kernels/p2p.cu, in order."""
    text = _kernels.source(P2P_SOURCE)
    params = re.search(rf"\b{entry}\(([^)]*)\)\s*{{", text).group(1)
    return [re.sub(r"\W", "", p.split()[-1]) for p in params.split(",")]


def launched_args(monkeypatch, c, call) -> list:
    """The arguments of the ``ub_p2p_alltoallv`` launches that ``call()`` makes on ``c``,
    through the real Engine and Launcher (an argument pack the driver reads slot by slot),
    each as ``{kernel parameter name: value}``: the driver is CuPy's binding's fake, the
    module a stand-in."""
    from stream_fakes import FakeDriver, fake_kernel

    from ubnext._engine import launch as _launch

    names = kernel_params("ub_p2p_alltoallv")
    assert len(names) == len(_engine._PARAMS["ub_p2p_alltoallv"]), names
    launches = []
    monkeypatch.setattr(_launch, "_cupy_driver",
                        FakeDriver(len(names), lambda stream, read: launches.append(dict(zip(names, read())))))
    monkeypatch.setattr(_engine, "compile_module",
                        lambda source, defines, device: SimpleNamespace(get_function=lambda entry: fake_kernel()))
    engine = object.__new__(_engine.Engine)
    engine.nranks, engine.pool, engine.dependent = RANKS, SimpleNamespace(device=0), False
    engine._launchers, engine._modules, engine._blocks = {}, {}, 132
    engine._fixed, engine._p2p = (0xBA5E, 0x10000, c.rank, 0), (0xA4EA, ll_slot_bytes(), 0x57A7E)
    c._node.engine = engine
    call()
    return launches


@pytest.mark.parametrize("in_dtype, out_dtype", [("int64", "int32"), ("int32", "int64"), ("int32", "int32")])
def test_each_split_array_reaches_the_kernel_with_its_own_width(monkeypatch, in_dtype, out_dtype):
    """Device splits of two dtypes (torch.tensor's int64 default for one, int32 named for
    the other): the kernel reads each array at its own width (one width for both read an
    int32 out_splits as int64: counts of 2**32 and more, a SplitError naming a count the
    caller never wrote, or a part left unwritten)."""
    c = pooled(monkeypatch, nccl_problem=SHARED)
    x = buffer(10 * 3, "float64", shape=(10, 3))
    out = buffer(12 * 3, "float64", ptr=1 << 25, shape=(12, 3))
    ins, outs = buffer(RANKS, in_dtype, ptr=1 << 26), buffer(RANKS, out_dtype, ptr=1 << 27)
    args = launched_args(monkeypatch, c, lambda: c.all_to_all(x, out, ins, outs))
    width = {"int32": 4, "int64": 8}
    assert len(args) == 1
    assert {k: args[0][k] for k in ("x", "out", "x_rows", "out_rows", "row_bytes")} == {
        "x": x.ptr, "out": out.ptr, "x_rows": 10, "out_rows": 12, "row_bytes": 24}
    assert (args[0]["in_splits"], args[0]["in_width"]) == (ins.ptr, width[in_dtype])
    assert (args[0]["out_splits"], args[0]["out_width"]) == (outs.ptr, width[out_dtype])
    assert args[0]["head"] == _signature.encode("all_to_all", "uint8", "sum", 0)
    assert (args[0]["base"], args[0]["rank"], args[0]["area_off"], args[0]["state"]) == (0xBA5E, 1, 0xA4EA, 0x57A7E)
