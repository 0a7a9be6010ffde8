"""The collectives of NCCL's set beyond the reductions (ubnext/_api/collectives) without a
GPU: argument checks and layouts (the communicator's validation run on stand-in buffers),
what each call hands the NCCL rung (addresses, byte counts, peers), the refusal where NCCL
cannot run, the all-to-all's split checks across ranks, and the NCCL engine's new calls
against the recording stand-in of cupy.cuda.nccl (tests/test_nccl_comm.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
from stream_fakes import bare_communicator, fake_order
from test_nccl_comm import Boot, install_nccl

from ubnext._api.collectives import all_to_all as _a2a
from ubnext._engine.nccl import NcclComm
from ubnext._environment.config import Config
from ubnext._interop import arrays as _arrays
from ubnext._interop import streams as _streams
from ubnext._interop.arrays import Buffer
from ubnext._protocol.algorithms import ALGORITHMS, DTYPES
from ubnext._protocol.errors import BrokenCommunicatorError, UbnextError
from ubnext._selection.select import Selector, buffer_limits

RANKS = 4


class Rung:
    """Stands in for the NCCL communicator: records each call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


class Dispatch:
    """Stands in for the Dispatcher: ``nccl_for`` records the stream and gives the Rung."""

    def __init__(self):
        self.rung, self.streams = Rung(), []

    def nccl_for(self, stream, owner):
        self.streams.append(stream)
        return self.rung


def buffer(count, dtype="bfloat16", ptr=1 << 20, shape=None):
    width = DTYPES[dtype][1]
    shape = (count,) if shape is None else shape
    return Buffer(SimpleNamespace(count=count, ptr=ptr), "cupy", ptr, count, dtype, 0, shape, count * width)


def make_comm(monkeypatch, rank=1, nccl_problem=None, debug=False, views=None):
    """A 4-rank Communicator (rank ``rank``) without devices: buffers are Buffer tuples;
    ``made`` lists the shapes of the new outputs."""
    monkeypatch.setattr(_arrays, "as_buffer", lambda x, op, stream: x)
    monkeypatch.setattr(_arrays, "launch_stream", lambda stream, x, device: (0x77, None, False))
    made = []
    monkeypatch.setattr(_arrays, "empty_like", lambda x, s, o, side, shape=None: made.append(shape) or
                        buffer(x.count if shape is None else int(np.prod(shape)), x.dtype, 1 << 30,
                               x.shape if shape is None else shape))
    cfg = Config.from_env(debug=debug)
    local = SimpleNamespace(rank=rank, size=RANKS)
    boot = SimpleNamespace(allgather_obj=lambda obj: views(obj) if views else [obj] * RANKS,
                           allgather=lambda data: [data] * RANKS)
    c = bare_communicator(fake_order(), config=cfg, _dispatch=Dispatch(), rank=rank, size=RANKS, _local=local,
                          bootstrap=boot, _nccl_reason="UBNEXT_ALGO=nccl",
                          _selector=Selector(RANKS, buffer_limits(cfg), list(ALGORITHMS), None, "", False,
                                             nccl_problem))
    c.made = made
    return c


@pytest.fixture(autouse=True)
def device_uuids(monkeypatch):
    """Device ordinal d is GPU-d (no driver on this machine)."""
    monkeypatch.setattr("ubnext._environment.devices.device_uuid", lambda ordinal: f"GPU-{ordinal}")


@pytest.fixture
def comm(monkeypatch):
    return make_comm(monkeypatch)


def calls(comm):
    return comm._dispatch.rung.calls


# ---- broadcast -------------------------------------------------------------------------------
def test_broadcast_new_out_in_place_and_given(comm):
    x = buffer(6, shape=(2, 3))
    out = comm.broadcast(x, root=2)
    assert comm.made == [None] and out.count == 6  # x's shape (empty_like without a shape)
    assert calls(comm)[-1] == ("broadcast", x.ptr, out.ptr, 6, "bfloat16", 2, 0x77)
    assert comm.broadcast(x, 0, out=x) is x.obj
    assert calls(comm)[-1] == ("broadcast", x.ptr, x.ptr, 6, "bfloat16", 0, 0x77)
    o = buffer(6, ptr=1 << 25)
    comm.broadcast(x, 3, out=o)
    assert calls(comm)[-1][1:3] == (x.ptr, o.ptr)
    assert comm._dispatch.streams == [0x77] * 3


@pytest.mark.parametrize("root, message", [(4, "root 4 is not a rank of this communicator"),
                                           (-1, "root -1 is not a rank"), (True, "root must be an int rank"),
                                           ("0", "root must be an int rank")])
def test_a_root_that_is_not_a_rank_raises(comm, root, message):
    x = buffer(4)
    for call in (lambda: comm.broadcast(x, root), lambda: comm.reduce(x, root), lambda: comm.gather(x, root),
                 lambda: comm.scatter(x, root, out=buffer(1, ptr=1 << 25))):
        with pytest.raises(UbnextError, match=f"^[a-z_]+: {message}"):
            call()
    assert calls(comm) == [] and comm.made == []


def test_broadcast_outputs_are_checked(comm):
    x = buffer(8)
    with pytest.raises(UbnextError, match="^broadcast: out has 7 bfloat16 elements, input has 8"):
        comm.broadcast(x, out=buffer(7, ptr=1 << 25))
    with pytest.raises(UbnextError, match="^broadcast: out partially overlaps the input"):
        comm.broadcast(x, out=buffer(8, ptr=x.ptr + 2))
    assert calls(comm) == []


def test_empty_arrays_move_nothing(comm):
    comm.broadcast(buffer(0))
    comm.reduce(buffer(0), root=1)
    comm.gather(buffer(0))
    comm.all_to_all(buffer(0, shape=(0, 3)))
    assert calls(comm) == []


# ---- reduce ----------------------------------------------------------------------------------
def test_reduce_writes_on_the_root_only(monkeypatch):
    root = make_comm(monkeypatch, rank=2)
    x = buffer(5, "float32")
    out = root.reduce(x, root=2, op="max")
    assert root.made == [None] and calls(root) == [("reduce", x.ptr, out.ptr, 5, "float32", "max", 2, 0x77)]
    other = make_comm(monkeypatch, rank=1)
    assert other.reduce(x, root=2) is None
    assert other.made == []  # nothing allocated on a rank that receives nothing
    assert calls(other) == [("reduce", x.ptr, x.ptr, 5, "float32", "sum", 2, 0x77)]  # not written there
    assert other.reduce(x, root=2, out=buffer(5, "float32", ptr=1 << 25)) is None


def test_reduce_checks_its_op(comm):
    with pytest.raises(UbnextError, match="^reduce: unsupported op 'prod'"):
        comm.reduce(buffer(4), op="prod")
    with pytest.raises(UbnextError, match="^reduce: op 'avg' takes floating-point dtypes"):
        comm.reduce(buffer(4, "int32"), op="avg")
    with pytest.raises(UbnextError, match="^reduce: out has 4 float32 elements, input has 4 bfloat16"):
        comm.reduce(buffer(4), root=1, out=buffer(4, "float32", ptr=1 << 25))
    assert calls(comm) == []


# ---- gather and scatter ----------------------------------------------------------------------
def test_gather_on_the_root_receives_every_rank_in_order(monkeypatch):
    c = make_comm(monkeypatch, rank=1)
    x = buffer(6, "float32", shape=(2, 3))
    out = c.gather(x, root=1)
    assert c.made == [(RANKS, 2, 3)]
    nbytes = 24
    assert calls(c) == [("exchange", [(x.ptr, nbytes, 1)], [(out.ptr + r * nbytes, nbytes, r) for r in range(RANKS)],
                         0x77, "gather")]


def test_gather_elsewhere_sends_and_returns_none(monkeypatch):
    c = make_comm(monkeypatch, rank=3)
    x = buffer(6, "float32")
    assert c.gather(x, root=1, out=buffer(1, ptr=1 << 25)) is None  # out ignored off the root
    assert c.made == [] and calls(c) == [("exchange", [(x.ptr, 24, 1)], [], 0x77, "gather")]


def test_gather_in_place_skips_the_roots_own_part(monkeypatch):
    c = make_comm(monkeypatch, rank=1)
    out = buffer(4 * 5, ptr=1 << 25)
    x = buffer(5, ptr=out.ptr + 1 * 10)  # the root's slice of out
    c.gather(x, root=1, out=out)
    assert calls(c) == [("exchange", [], [(out.ptr + r * 10, 10, r) for r in (0, 2, 3)], 0x77, "gather")]
    with pytest.raises(UbnextError, match="^gather: out overlaps the input other than in place"):
        c.gather(buffer(5, ptr=out.ptr), root=1, out=out)
    with pytest.raises(UbnextError, match="^gather: out has 19 bfloat16 elements; it must have 20"):
        c.gather(buffer(5), root=1, out=buffer(19, ptr=1 << 26))


def test_scatter_on_the_root_sends_each_rank_its_part(monkeypatch):
    c = make_comm(monkeypatch, rank=0)
    x = buffer(RANKS * 6, "float16", shape=(RANKS, 2, 3))
    out = c.scatter(x, root=0)
    assert c.made == [(2, 3)]
    assert calls(c) == [("exchange", [(x.ptr + r * 12, 12, r) for r in range(RANKS)], [(out.ptr, 12, 0)], 0x77,
                         "scatter")]
    c.scatter(buffer(RANKS * 5, shape=(5, RANKS)), root=0)
    assert c.made[-1] == (5,)  # rows other than the world size: a flat part
    with pytest.raises(UbnextError, match="^scatter: x has 10 elements, which 4 ranks do not divide"):
        c.scatter(buffer(10), root=0)
    with pytest.raises(UbnextError, match=r"^scatter: the root \(rank 0\) must pass x"):
        c.scatter(None, root=0, out=buffer(3))


def test_scatter_elsewhere_needs_out_and_ignores_x(monkeypatch):
    c = make_comm(monkeypatch, rank=2)
    with pytest.raises(UbnextError, match=r"^scatter: out is required on the ranks other than the root \(0\)"):
        c.scatter(buffer(8), root=0)
    out = buffer(3, "int64", ptr=1 << 25)
    assert c.scatter(None, root=0, out=out) is out.obj
    assert calls(c) == [("exchange", [], [(out.ptr, 24, 0)], 0x77, "scatter")]


def test_scatter_in_place_keeps_the_roots_part(monkeypatch):
    c = make_comm(monkeypatch, rank=1)
    x = buffer(RANKS * 4)
    c.scatter(x, root=1, out=buffer(4, ptr=x.ptr + 8))
    assert calls(c) == [("exchange", [(x.ptr + r * 8, 8, r) for r in (0, 2, 3)], [], 0x77, "scatter")]


# ---- all-to-all --------------------------------------------------------------------------------
def test_all_to_all_even_splits(comm):
    x = buffer(RANKS * 2 * 3, "float32", shape=(RANKS * 2, 3))
    out = comm.all_to_all(x)
    assert comm.made == [(RANKS * 2, 3)]
    part = 2 * 3 * 4
    assert calls(comm) == [("exchange", [(x.ptr + r * part, part, r) for r in range(RANKS)],
                            [(out.ptr + r * part, part, r) for r in range(RANKS)], 0x77, "all_to_all")]
    with pytest.raises(UbnextError, match="^all_to_all: 6 rows, which 4 ranks do not divide; give in_splits"):
        comm.all_to_all(buffer(6))


def test_all_to_all_uneven_host_splits(comm):
    x = buffer(7 * 2, "int8", shape=(7, 2))
    out = comm.all_to_all(x, in_splits=[3, 0, 4, 0], out_splits=[1, 2, 0, 5])
    assert comm.made == [(8, 2)]
    assert calls(comm) == [("exchange", [(x.ptr, 6, 0), (x.ptr + 6, 8, 2)],
                            [(out.ptr, 2, 0), (out.ptr + 2, 4, 1), (out.ptr + 6, 10, 3)], 0x77, "all_to_all")]
    given = buffer(8 * 2, "int8", ptr=1 << 25)
    comm.all_to_all(x, given, [3, 0, 4, 0])  # out_splits None: out's rows evenly
    assert calls(comm)[-1][2] == [(given.ptr + r * 4, 4, r) for r in range(RANKS)]


def test_all_to_all_split_exchange_is_abandoned_by_abort(monkeypatch):
    """The splits' allgather (debug mode's, device splits') is a host exchange: abort()
    abandons it, and the call raises before it exchanges or moves anything."""
    comm = make_comm(monkeypatch, debug=True)
    comm.bootstrap.allgather_obj = lambda obj: pytest.fail("the splits were exchanged after abort")
    comm._exchanges.abandon()
    with pytest.raises(BrokenCommunicatorError, match="^all_to_all: the communicator was aborted"):
        comm.all_to_all(buffer(7 * 2, "int8", shape=(7, 2)), in_splits=[3, 0, 4, 0], out_splits=[1, 2, 0, 5])
    assert calls(comm) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"in_splits": [1, 2, 3]}, "in_splits must be 4 non-negative ints"),
    ({"in_splits": [1, 2, 3, -1]}, "in_splits must be 4 non-negative ints"),
    ({"in_splits": [1, 2, 3, 1.0]}, "in_splits must be 4 non-negative ints"),
    ({"in_splits": [1, 2, 3, 3]}, "in_splits sum to 9 rows, but the array has 8"),
    ({"out_splits": [1, 1, 1, 1], "out": "given"}, "out_splits sum to 4 rows, but the array has 8"),
    ({"out": "float32"}, "out is float32, x is bfloat16"),
    ({"out": "ragged"}, "out has 15 elements, not whole rows of x's 2"),
    ({"out": "overlap"}, "out overlaps x"),
    ({"in_splits": "device"}, "give both splits as device arrays, or both as host lists"),
    ({"in_splits": "device", "out_splits": "device"}, "device splits need an out sized by the caller"),
])
def test_all_to_all_bad_arguments_raise_before_anything(comm, kwargs, message):
    x = buffer(16, shape=(8, 2))
    outs = {"given": buffer(16, ptr=1 << 25), "float32": buffer(16, "float32", ptr=1 << 25),
            "ragged": buffer(15, ptr=1 << 25), "overlap": buffer(16, ptr=x.ptr + 2)}
    kwargs = {k: (outs[v] if k == "out" else buffer(4, "int64", ptr=1 << 26) if v == "device" else v)
              for k, v in kwargs.items()}
    with pytest.raises(UbnextError, match=f"^all_to_all: {message}"):
        comm.all_to_all(x, **kwargs)
    assert calls(comm) == [] and comm.made == []


def views_of(rows):
    """Every rank's (in_splits, out_splits, x rows, out rows) of a consistent exchange of
    ``rows[i][j]`` rows from rank i to rank j."""
    n = len(rows)
    return [([rows[i][j] for j in range(n)], [rows[j][i] for j in range(n)], 10, 10) for i in range(n)]


def test_split_disagreements_are_named_alike_for_every_rank():
    rows = [[1, 2, 0, 3], [0, 0, 4, 1], [2, 2, 2, 2], [5, 0, 0, 0]]
    assert _a2a._disagreement(views_of(rows), exact=False) is None
    bad = views_of(rows)
    bad[2][1][1] = 1  # rank 2 expects 1 row from rank 1, which sends 4
    assert _a2a._disagreement(bad, exact=False) == "rank 1 sends 4 rows to rank 2, which expects 1"
    past = views_of(rows)
    past[0] = (past[0][0], past[0][1], 5, 10)  # rank 0's x has 5 rows, it sends 6
    assert _a2a._disagreement(past, exact=False) == "rank 0's in_splits [1, 2, 0, 3] sum to 6 rows, past its 5"
    assert "not its 10" in _a2a._disagreement(views_of(rows), exact=True)  # host lists must fill out
    neg = views_of(rows)
    neg[3][0][0] = -5
    assert _a2a._disagreement(neg, exact=False) == "rank 3's in_splits [-5, 0, 0, 0] hold a negative count"


def test_device_splits_are_read_checked_across_ranks_and_moved(monkeypatch):
    rows = [[1, 2, 0, 3], [0, 0, 4, 1], [2, 2, 2, 2], [5, 0, 0, 0]]
    others = views_of(rows)

    def views(mine):
        return [mine if r == 1 else (o[0], o[1], 10, 10) for r, o in enumerate(others)]

    c = make_comm(monkeypatch, rank=1, views=views)
    read = {"in_splits": rows[1], "out_splits": [rows[j][1] for j in range(RANKS)]}
    x = buffer(10 * 2, "float32", shape=(10, 2))
    out = buffer(10 * 2, "float32", ptr=1 << 25)
    dev, dev_out = buffer(4, "int64", ptr=1 << 26), buffer(4, "int64", ptr=1 << 27)
    monkeypatch.setattr(_a2a.AllToAll, "_read",
                        lambda self, name, b, handle: read["in_splits" if b is dev else "out_splits"])
    c.all_to_all(x, out, dev, dev_out)
    assert calls(c) == [("exchange", [(x.ptr + 0, 32, 2), (x.ptr + 32, 8, 3)],
                         [(out.ptr, 16, 0), (out.ptr + 16, 16, 2)], 0x77, "all_to_all")]
    read["out_splits"] = [2, 0, 2, 0]  # rank 1 expects 2 rows from rank 0, which sends 2... and from 2 again
    read["in_splits"] = [0, 0, 4, 9]  # 13 rows of 10
    with pytest.raises(UbnextError, match=r"^all_to_all: rank 1's in_splits \[0, 0, 4, 9\] sum to 13 rows, past "
                                          r"its 10; nothing was moved"):
        c.all_to_all(x, out, dev, dev_out)
    assert len(calls(c)) == 1


def test_device_splits_are_checked_before_the_host_reads_them(monkeypatch):
    c = make_comm(monkeypatch)
    x, out = buffer(8, shape=(8,)), buffer(8, ptr=1 << 25)
    for splits, message in ((buffer(3, "int64", ptr=1 << 26), "in_splits must hold 4 int32 or int64 elements"),
                            (buffer(4, "float32", ptr=1 << 26), "in_splits must hold 4 int32 or int64 elements")):
        with pytest.raises(UbnextError, match=f"^all_to_all: {message}"):
            c.all_to_all(x, out, splits, buffer(4, "int64", ptr=1 << 27))
    monkeypatch.setattr(_a2a.CUDA, "capture", lambda stream: 5)
    with pytest.raises(UbnextError, match="^all_to_all: device splits are read on the host .* CUDA graph capture"):
        c.all_to_all(x, out, buffer(4, "int32", ptr=1 << 26), buffer(4, "int32", ptr=1 << 27))
    assert calls(c) == []


def test_debug_mode_checks_host_splits_across_ranks(monkeypatch):
    c = make_comm(monkeypatch, rank=0, debug=True, views=lambda mine: [mine] * RANKS)
    with pytest.raises(UbnextError, match="^all_to_all: rank 0 sends 0 rows to rank 2, which expects 1; nothing was "
                                          "moved"):
        c.all_to_all(buffer(2, shape=(2,)), in_splits=[1, 1, 0, 0], out_splits=[1, 1, 1, 1])
    assert calls(c) == []


# ---- point-to-point --------------------------------------------------------------------------
def test_send_and_recv_are_one_entry_groups(comm):
    x, out = buffer(5, "float64"), buffer(5, "float64", ptr=1 << 25)
    assert comm.send(x, 3) is None
    assert comm.recv(out, 0) is out.obj
    assert calls(comm) == [("exchange", [(x.ptr, 40, 3)], [], 0x77, "send"),
                           ("exchange", [], [(out.ptr, 40, 0)], 0x77, "recv")]


@pytest.mark.parametrize("peer, message", [(1, "peer 1 is this rank; a lone send to itself has no match"),
                                           (4, "peer 4 is not a rank"), (None, "peer must be an int rank")])
def test_send_peers_are_checked(comm, peer, message):
    with pytest.raises(UbnextError, match=f"^send: {message}"):
        comm.send(buffer(4), peer)
    with pytest.raises(UbnextError, match=f"^recv: {message.replace('send', 'recv')}"):
        comm.recv(buffer(4), peer)
    assert calls(comm) == []


def isend():
    pass


def irecv():
    pass


def test_batch_takes_tuples_and_p2pops_as_one_group(comm):
    a, b, c = buffer(4), buffer(8, "uint8", ptr=1 << 25), buffer(2, "int32", ptr=1 << 26)
    ops = [("send", a, 0), SimpleNamespace(op=irecv, tensor=b, peer=2), SimpleNamespace(op=isend, tensor=c, peer=1),
           ("irecv", buffer(1, "int32", ptr=1 << 27), 1)]
    assert comm.batch_isend_irecv(ops) is None
    assert calls(comm) == [("exchange", [(a.ptr, 8, 0), (c.ptr, 8, 1)], [(b.ptr, 8, 2), (1 << 27, 4, 1)], 0x77,
                            "batch_isend_irecv")]


@pytest.mark.parametrize("ops, message", [
    ([], "ops is empty"),
    ("send", "ops must be a list"),
    ([("put", "a", 0)], r"ops\[0\] is not a \('send' \| 'recv', array, peer\) tuple"),
    ([("send", "a", 0), SimpleNamespace(op=print, tensor="a", peer=0)], r"ops\[1\] is not a"),
    ([("send", "a", 5)], r"ops\[0\] peer 5 is not a rank"),
    ([("send", "a", 0), ("recv", "o", 1)], r"ops\[1\]'s receive buffer overlaps another entry's array"),
])
def test_bad_batches_raise_before_anything(comm, ops, message):
    arrays = {"a": buffer(8), "o": buffer(8, ptr=(1 << 20) + 4)}
    ops = ops if isinstance(ops, str) else [(o[0], arrays.get(o[1], o[1]), o[2]) if isinstance(o, tuple) else o
                                            for o in ops]
    with pytest.raises(UbnextError, match=f"^batch_isend_irecv: {message}"):
        comm.batch_isend_irecv(ops)
    assert calls(comm) == []


# ---- where NCCL cannot run, and the barrier ------------------------------------------------------
def test_where_nccl_cannot_run_every_call_raises_before_anything(monkeypatch):
    c = make_comm(monkeypatch, nccl_problem="local ranks 0, 1 share one GPU, which NCCL refuses")
    x = buffer(8)
    for name, call in (("broadcast", lambda: c.broadcast(x)), ("reduce", lambda: c.reduce(x, root=1)),
                       ("gather", lambda: c.gather(x, root=1)), ("scatter", lambda: c.scatter(x, root=1)),
                       ("all_to_all", lambda: c.all_to_all(x)), ("send", lambda: c.send(x, 0)),
                       ("recv", lambda: c.recv(x, 0)), ("batch_isend_irecv", lambda: c.batch_isend_irecv([("send", x, 0)]))):
        with pytest.raises(UbnextError, match=f"^{name}: [^,]+, and NCCL, which runs it, "
                                              f"cannot run here \\(local ranks 0, 1 share one GPU"):
            call()
    assert calls(c) == [] and c.made == []


def test_barrier_is_an_all_reduce_of_one_element_on_the_stream(comm):
    flag = buffer(1, "float32")
    comm._barrier_flag = flag
    seen = []
    comm.all_reduce = lambda x, out=None, stream=None: seen.append((x, out, stream))
    assert comm.barrier(stream=0x55) is None
    comm.barrier()
    assert seen == [(flag, flag, 0x55), (flag, flag, None)]


def test_the_first_barrier_refuses_a_capture_before_anything(comm, monkeypatch):
    """The first barrier allocates and zeroes its element, and waits on the host: under a
    CUDA graph capture it raises, queuing nothing; after an eager call it is captured."""
    monkeypatch.setattr(_streams.CUDA, "capture", lambda stream: 7)
    seen = []
    comm.all_reduce = lambda x, out=None, stream=None: seen.append((x, out, stream))
    with pytest.raises(UbnextError, match="^barrier: the first such call on a communicator cannot be captured in "
                                          "a CUDA graph .*make one eager call first"):
        comm.barrier(stream=0x55)
    assert seen == [] and "_barrier_flag" not in comm.__dict__
    comm._barrier_flag = flag = buffer(1, "float32")  # what the eager call left
    comm.barrier(stream=0x55)
    assert seen == [(flag, flag, 0x55)]


def test_closed_communicator_refuses_the_new_calls(comm):
    comm._closed = True
    for call in (lambda: comm.broadcast(buffer(1)), lambda: comm.scatter(None, out=buffer(1)), comm.barrier,
                 lambda: comm.batch_isend_irecv([("send", buffer(1), 0)])):
        with pytest.raises(UbnextError, match="the communicator is closed"):
            call()


# ---- the NCCL engine's calls ---------------------------------------------------------------------
def test_nccl_broadcast_reduce_and_grouped_exchange(monkeypatch):
    nccl = install_nccl(monkeypatch)
    cls = nccl.NcclCommunicator
    for call in ("broadcast", "reduce", "send", "recv"):
        setattr(cls, call, lambda self, *a, _c=call: self.calls.append((_c, *a)))
    groups = []
    nccl.groupStart, nccl.groupEnd = (lambda: groups.append("start")), (lambda: groups.append("end"))
    comm = NcclComm(Boot(rank=1), 1)
    comm.broadcast(0x1000, 0x2000, 5, "bfloat16", 3, 0x99)
    comm.reduce(0x1000, 0x2000, 7, "float16", "avg", 0, 0x99)
    comm.exchange([(0x1000, 16, 2), (0x1010, 8, 1)], [(0x2000, 4, 0)], 0x99, "all_to_all")
    assert cls.created[0].calls == [("broadcast", 0x1000, 0x2000, 5, 9, 3, 0x99),
                                    ("reduce", 0x1000, 0x2000, 7, 6, 4, 0, 0x99),
                                    ("send", 0x1000, 16, 1, 2, 0x99), ("send", 0x1010, 8, 1, 1, 0x99),
                                    ("recv", 0x2000, 4, 1, 0, 0x99)]
    assert groups == ["start", "end"]
    with pytest.raises(ValueError, match="^nccl.broadcast: root 4 is not a rank of 4"):
        comm.broadcast(1, 1, 1, "float32", 4, 0)
    with pytest.raises(ValueError, match="^all_to_all: peer -1 is not a rank of 4"):
        comm.exchange([(1, 1, -1)], [], 0, "all_to_all")
    with pytest.raises(ValueError, match="^nccl.reduce: unsupported op 'prod'"):
        comm.reduce(1, 1, 1, "float32", "prod", 0, 0)


def test_nccl_group_ends_when_a_call_fails(monkeypatch):
    nccl = install_nccl(monkeypatch)

    def send(self, *a):
        raise nccl.NcclError("NCCL_ERROR_INVALID_USAGE")

    nccl.NcclCommunicator.send = send
    groups = []
    nccl.groupStart, nccl.groupEnd = (lambda: groups.append("start")), (lambda: groups.append("end"))
    with pytest.raises(UbnextError, match="^send: NCCL_ERROR_INVALID_USAGE"):
        NcclComm(Boot(rank=0), 0).exchange([(1, 4, 1)], [], 0, "send")
    assert groups == ["start", "end"]


def test_nccl_one_rank_average_reduce_is_a_copy(monkeypatch):
    nccl = install_nccl(monkeypatch)
    copies = []
    monkeypatch.setattr(sys.modules["cupy.cuda"].runtime, "memcpyAsync", lambda *a: copies.append(a), raising=False)
    NcclComm(Boot(rank=0, size=1), 0).reduce(0x1000, 0x2000, 9, "float32", "avg", 0, 0x99)
    assert copies == [(0x2000, 0x1000, 36, 3, 0x99)] and not nccl.NcclCommunicator.created
