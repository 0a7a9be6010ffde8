"""CPU tests of the ubnext torch.distributed backend (ubnext.torch.backend), with fake
communicators (backend_fakes.StoreComm) on thread ranks: registration, the c10d op ->
Communicator call of every op under both torch versions' names, reductions (every
ReduceOp), the raises instead of fall-throughs, pending send/recv, work objects, lazy
communicators and their closing. test_torch_backend_procs.py runs the group under
init_process_group in processes (new_group, device meshes, DTensor, functional
collectives eager and compiled, the Gloo route)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from backend_fakes import LimitedComm, StoreComm, factory
from thread_ranks import run_threads

import ubnext.torch  # noqa: F401 (registers "ubnext")
from ubnext import UbnextError
from ubnext.torch import backend
from ubnext.torch.backend import _cpu, _group
from ubnext.torch.backend._work import PendingWork, Work

R = dist.ReduceOp
AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions


def ranks(n: int, fn, kind=None, device_type: str = "cpu"):
    """``[fn(pg, log) for each of n thread ranks]``: each a ProcessGroupUbnext over one
    shared HashStore, its communicators (fakes) appended to its own ``log``."""
    store = dist.HashStore()
    out: list = [None] * n

    def body(rank):
        log: list = []
        make = factory(log) if kind is None else factory(log, kind)
        pg = backend.ProcessGroupUbnext(store, rank, n, timedelta(seconds=30), "g", backend.Options(), make,
                                        device_type)
        out[rank] = fn(pg, log)

    run_threads(n, body)
    return out


def opts(cls, **kw):
    o = cls()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def data(rank: int, n: int = 8, dtype=torch.float32):
    """Rank-dependent values with -0.0, inf and NaN among them (never all zeros)."""
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(n, generator=g).to(dtype)
    x[0], x[1] = -0.0, float("inf") if rank == 0 else 1.5
    x[2] = float("nan") if rank == 1 else 2.0
    return x


def calls(log):
    return [name for comm in log for name, _ in comm.calls]


# -- registration and the op surface --

def test_import_registers_the_backend_for_cuda_and_cpu():
    assert dist.Backend.UBNEXT == "ubnext"
    assert dist.Backend.backend_capability["ubnext"] == ["cuda", "cpu"]
    assert dist.Backend._plugins["UBNEXT"].extended_api


# every c10d op a ProcessGroup has, under 2.13's names and 2.11's
C10D_OPS = ["allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "allgather_coalesced",
            "all_gather_single", "_allgather_base", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
            "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_single_coalesced",
            "reduce_scatter_tensor_coalesced", "all_to_all_single", "alltoall_base", "alltoall", "gather", "scatter",
            "send", "recv", "recv_anysource", "barrier", "monitored_barrier"]


def test_every_c10d_op_is_overridden_under_both_versions_names():
    """Nothing reaches torch's base ProcessGroup (whose ops would run on a registered
    inner backend): every op is the group's own, 2.11's names the same functions as 2.13's."""
    cls = backend.ProcessGroupUbnext
    assert [n for n in C10D_OPS if n not in vars(cls)] == []
    base_ops = [n for n in dir(dist.ProcessGroup) if n in C10D_OPS]
    assert base_ops and all(n in vars(cls) for n in base_ops)
    for old, new in _group._ALIASES.items():
        assert getattr(cls, old) is getattr(cls, new)


def test_the_name_is_the_groups_own_on_this_torch():
    assert _group.NAME_OVERRIDABLE  # torch 2.13 calls a Python getGroupName
    (pg,) = ranks(1, lambda pg, log: pg)
    pg._set_group_name("7")
    pg._set_group_desc("dp")
    assert (pg.group_name, pg.group_desc, pg.name()) == ("7", "dp", "ubnext")


def test_where_python_cannot_keep_the_name_gloo_holds_it(monkeypatch):
    """torch 2.11's way: the CPU route's Gloo backend is registered for CPU only."""
    monkeypatch.setattr(_group, "NAME_OVERRIDABLE", False)
    (got,) = ranks(1, lambda pg, log: (dist.ProcessGroup._get_backend(pg, torch.device("cpu")), pg._cpu.backend, log),
                   device_type="cuda")
    registered, gloo, log = got
    assert gloo is not None and registered.name() == "gloo" and log == []


def test_what_torch_asks_of_the_groups_backend():
    """init_process_group(device_id=...), split_group, batch_isend_irecv, device meshes and
    FSDP2 ask pg._get_backend(device) what it supports: splitting (binding the device it
    is given), nothing else a C++ backend may offer."""
    def body(pg, log):
        view = pg._get_backend(torch.device("cuda", 0))
        view.eager_connect_single_device(torch.device("cuda", 0))
        view.perform_nocolor_split(torch.device("cuda", 0))
        view._set_sequence_number_for_group()
        return view, pg.bound_device_id, log

    ((view, bound, log),) = ranks(1, body, device_type="cuda")
    assert (view.name(), view.rank(), view.size(), view.options) == ("ubnext", 0, 1, backend.Options())
    assert view.supports_splitting and bound == torch.device("cuda", 0) and log == []
    assert not (view.supports_coalescing or view.supports_time_estimate)
    assert not view.supports_tensor_alloc(torch.device("cuda", 0))


def test_split_group_makes_groups_of_their_own():
    def body(pg, log):
        r = pg.rank()
        child = pg.split_group([1, 2] if r else [1, 2], group_name="c", group_desc="tp",
                               opts=backend.Options(pool_mb=8))
        if child is None:
            return None
        t = torch.full((2,), r + 1.0)
        child.allreduce([t], dist.AllreduceOptions()).wait()
        return child.rank(), child.size(), child.group_name, child.group_desc, child._options, t.tolist(), len(log)

    got = ranks(3, body)
    assert got[0] is None
    assert got[1] == (0, 2, "c", "tp", backend.Options(pool_mb=8), [5.0, 5.0], 1)
    assert got[2][:2] == (1, 2) and got[2][5] == [5.0, 5.0]


# -- the communicator: lazy, one per group, closed with it --

def test_the_communicator_comes_at_the_first_op_and_shutdown_closes_it():
    def body(pg, log):
        before = list(log)
        pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        made = list(log)
        pg.shutdown()
        return before, made, pg.communicator, log[0].closed

    for before, made, comm, closed in ranks(2, body):
        assert before == [] and len(made) == 1 and comm is None and closed == "close"


def test_abort_aborts_the_communicator():
    def body(pg, log):
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
        pg.abort()
        return log[0].closed

    assert ranks(2, body) == ["abort", "abort"]


def gloo_threads() -> set[int]:
    """The ids of this process's Gloo threads (a Gloo backend's workers and its transport's loop)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() in ("pt_gloo_runloop", "gloo_tcp_loop"):
                    found.add(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return found


def gloo_threads_until(done, timeout_s: float = 5.0) -> set[int]:
    """``gloo_threads()`` once ``done(threads)`` holds or ``timeout_s`` passed (a thread
    takes its name a moment after it starts, and leaves /proc a moment after its join)."""
    deadline = time.monotonic() + timeout_s
    while not done(threads := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def test_shutdown_destroys_the_gloo_backend_and_joins_its_threads():
    """destroy_process_group's shutdown destroys the CPU route's Gloo backend there and
    then, its threads joined, though the group itself lives on (FSDP2, device meshes and
    torch's default arguments keep it): torch's ProcessGroupGloo.shutdown() does nothing,
    its destructor joins the threads, so a backend still referenced would run until the
    interpreter's exit and be torn down with it (docs/pytorch.md)."""
    def body(pg, log):
        before = gloo_threads()
        pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        # its 2 workers, and its transport's loop where that thread is named (torch 2.13's
        # "gloo_tcp_loop"; 2.11 names only the workers)
        ours = gloo_threads_until(lambda now: len(now - before) >= 3, timeout_s=2.0) - before
        pg.shutdown()
        return ours, ours & gloo_threads_until(lambda now: not now & ours), pg._cpu.backend, log

    ((ours, left, gloo, log),) = ranks(1, body, device_type="cuda")
    assert len(ours) >= 2 and left == set() and gloo is None and log == []


def test_a_cpu_op_after_shutdown_opens_a_new_gloo_backend():
    """As the communicator, the CPU route's backend comes again at the next op."""
    def body(pg, log):
        t = torch.ones(2)
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        first = pg._cpu.backend
        pg.shutdown()
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        second = pg._cpu.backend
        pg.shutdown()
        return first is not None and second is not None and second is not first, t.tolist()

    assert ranks(2, body, device_type="cuda") == [(True, [4.0, 4.0])] * 2


def test_abort_leaves_the_gloo_backend_undestroyed_and_unused():
    """abort must return at once: the Gloo backend's destructor would wait for its ops in
    flight (a dead peer's: up to the group's timeout), so the backend is kept, its threads
    idle, and the group's next CPU op opens a new one."""
    def body(pg, log):
        pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        aborted = pg._cpu.backend
        pg.abort()
        return aborted, pg._cpu.backend, "allreduce" in vars(pg._cpu)

    ((aborted, now, bound),) = ranks(1, body, device_type="cuda")
    assert aborted is not None and now is None and not bound
    assert any(kept is aborted for kept in _cpu._ABORTED)


def test_tensors_of_another_device_raise():
    def body(pg, log):
        with pytest.raises(UbnextError, match="tensors on meta are not served"):
            pg.allreduce([torch.empty(2, device="meta")], dist.AllreduceOptions())
        return log

    assert ranks(1, body) == [[]]


# -- reductions --

@pytest.mark.parametrize("op,name", [(R.SUM, "sum"), (R.AVG, "avg"), (R.MAX, "max"), (R.MIN, "min")])
def test_allreduce_every_served_op(op, name):
    a, b = data(0), data(1)
    wide = torch.stack([a.double(), b.double()])
    want = {"sum": wide.sum(0), "avg": wide.sum(0) / 2, "max": torch.fmax(wide[0], wide[1]),
            "min": torch.fmin(wide[0], wide[1])}[name].float()

    def body(pg, log):
        t = data(pg.rank())
        work = pg.allreduce([t], opts(dist.AllreduceOptions, reduceOp=op))
        assert work.wait() and work.is_completed()
        return t, log[0].calls

    for t, made in ranks(2, body):
        torch.testing.assert_close(t, want, equal_nan=True, rtol=0, atol=0)
        assert made == [("all_reduce", {"op": name, "precision": "exact", "inplace": True})]


def test_premul_sum_prescales_then_sums():
    f = 0.75
    want = ((data(0) * f).double() + (data(1) * f).double()).float()

    def body(pg, log):
        t = data(pg.rank())
        pg.allreduce([t], opts(dist.AllreduceOptions, reduceOp=dist._make_nccl_premul_sum(f)))
        return t, log[0].calls[0]

    for t, call in ranks(2, body):
        torch.testing.assert_close(t, want, equal_nan=True, rtol=0, atol=0)
        assert call[1]["op"] == "sum"


class RefusingComm(StoreComm):
    """A StoreComm whose all_reduce refuses every call (as bad arguments would), having run nothing."""

    def all_reduce(self, x, **kw):
        self.calls.append(("all_reduce", kw))
        raise UbnextError("all_reduce: refused")


def test_a_refused_premul_sum_leaves_the_tensor_unscaled():
    def body(pg, log):
        t = data(pg.rank())
        before = t.clone()
        with pytest.raises(UbnextError, match="^all_reduce: refused"):
            pg.allreduce([t], opts(dist.AllreduceOptions, reduceOp=dist._make_nccl_premul_sum(0.75)))
        torch.testing.assert_close(t, before, equal_nan=True, rtol=0, atol=0)
        return calls(log)

    assert ranks(1, body, kind=RefusingComm) == [["all_reduce"]]


def test_premul_sums_factor_is_read_where_torch_gives_no_attribute():
    """torch 2.11's ReduceOp has no ``factor``; its pickled state is (type, factor)."""
    from ubnext.torch.backend._collectives import reduction

    class Op211:  # torch 2.11's PREMUL_SUM as the backend sees it
        op = R.PREMUL_SUM

        def __getstate__(self):
            return (R.PREMUL_SUM, 0.25)

    class Opts:
        reduceOp = Op211()

    assert reduction(Opts(), "allreduce") == ("sum", 0.25)


@pytest.mark.parametrize("op", [R.PRODUCT, R.BAND, R.BOR, R.BXOR])
def test_reductions_ubnext_does_not_serve_raise_before_anything_runs(op):
    def body(pg, log):
        t = torch.ones(2)
        for call in (lambda: pg.allreduce([t], opts(dist.AllreduceOptions, reduceOp=op)),
                     lambda: pg.reduce_scatter_single(torch.ones(1), torch.ones(2), opts(dist.ReduceScatterOptions,
                                                                                         reduceOp=op))):
            with pytest.raises(UbnextError, match=f"ReduceOp.{op.name}"):
                call()
        return calls(log)

    assert ranks(2, body) == [[], []]


def test_allreduce_coalesced_reduces_each_tensor():
    def body(pg, log):
        ts = [torch.full((3,), pg.rank() + 1.0), torch.full((2, 2), 10.0 * (pg.rank() + 1))]
        pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
        return ts, calls(log)

    for ts, names in ranks(2, body):
        assert ts[0].tolist() == [3.0] * 3 and ts[1].tolist() == [[30.0, 30.0]] * 2
        assert names == ["all_reduce", "all_reduce"]


@pytest.mark.parametrize("method", ["reduce_scatter_single", "_reduce_scatter_base"])
def test_reduce_scatter_tensor(method):
    n = 3
    inputs = [data(r, 6 * n) for r in range(n)]
    total = inputs[0] + inputs[1] + inputs[2]  # fp32, in rank order, as the communicator adds

    def body(pg, log):
        out = torch.full((6,), 99.0)
        getattr(pg, method)(out, inputs[pg.rank()].clone(), dist.ReduceScatterOptions()).wait()
        return out, log[0].calls

    for r, (out, made) in enumerate(ranks(n, body)):
        torch.testing.assert_close(out, total[6 * r:6 * r + 6], equal_nan=True, rtol=0, atol=0)
        assert made == [("reduce_scatter", {"op": "sum", "precision": "exact"})]


def test_reduce_scatter_list_and_coalesced_forms():
    def body(pg, log):
        r = pg.rank()
        out = torch.zeros(2)
        pg.reduce_scatter([out], [[torch.full((2,), 1.0 + r), torch.full((2,), 10.0 + r)]],
                          dist.ReduceScatterOptions()).wait()
        outs = [torch.zeros(1), torch.zeros(2)]
        pg.reduce_scatter_tensor_coalesced(outs, [torch.tensor([1.0, 2.0]) * (r + 1), torch.arange(4.0)],
                                           dist.ReduceScatterOptions()).wait()
        return out, outs, calls(log)

    (o0, c0, n0), (o1, c1, n1) = ranks(2, body)
    assert o0.tolist() == [3.0, 3.0] and o1.tolist() == [21.0, 21.0]
    assert [c.tolist() for c in c0] == [[3.0], [0.0, 2.0]] and [c.tolist() for c in c1] == [[6.0], [4.0, 6.0]]
    assert n0 == ["reduce_scatter"] * 3


def test_reduce_to_a_root_and_premul_leaves_the_input_of_others():
    def body(pg, log):
        t = torch.full((2,), pg.rank() + 1.0)
        pg.reduce([t], opts(dist.ReduceOptions, rootRank=1, reduceOp=dist._make_nccl_premul_sum(2.0))).wait()
        return t, log[0].calls

    (t0, c0), (t1, _) = ranks(2, body)
    assert t1.tolist() == [6.0, 6.0] and t0.tolist() == [1.0, 1.0]
    assert c0 == [("reduce", {"root": 1, "op": "sum"})]


# -- gathers, broadcast, all-to-all --

@pytest.mark.parametrize("method", ["all_gather_single", "_allgather_base"])
def test_all_gather_into_tensor(method):
    def body(pg, log):
        out = torch.full((3, 4), -1.0)
        getattr(pg, method)(out, data(pg.rank(), 4), AllgatherOptions()).wait()
        return out, calls(log)

    want = torch.stack([data(0, 4), data(1, 4), data(2, 4)])
    for out, names in ranks(3, body):
        torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)
        assert names == ["all_gather"]


def test_allgather_list_and_coalesced_forms():
    def body(pg, log):
        r = pg.rank()
        outs = [torch.zeros(2, 2) for _ in range(2)]
        pg.allgather([outs], [torch.full((2, 2), r + 1.0)], AllgatherOptions()).wait()
        co = [[torch.zeros(1), torch.zeros(3)] for _ in range(2)]  # co[rank][i]
        pg.allgather_coalesced(co, [torch.full((1,), 5.0 + r), torch.full((3,), 7.0 + r)],
                               AllgatherOptions()).wait()
        tc = [torch.zeros(2), torch.zeros(4)]
        pg.allgather_into_tensor_coalesced(tc, [torch.full((1,), r + 0.5), torch.full((2,), r + 2.0)],
                                           AllgatherOptions()).wait()
        with pytest.raises(UbnextError, match="allgather"):
            pg.allgather([[torch.zeros(1), torch.zeros(2)]], [torch.zeros(1)], AllgatherOptions())
        return outs, co, tc

    for outs, co, tc in ranks(2, body):
        assert [o[0, 0].item() for o in outs] == [1.0, 2.0]
        assert [[t.tolist() for t in row] for row in co] == [[[5.0], [7.0] * 3], [[6.0], [8.0] * 3]]
        assert [t.tolist() for t in tc] == [[0.5, 1.5], [2.0, 2.0, 3.0, 3.0]]


def test_broadcast_from_a_root():
    def body(pg, log):
        t = data(pg.rank())
        pg.broadcast([t], opts(dist.BroadcastOptions, rootRank=1)).wait()
        return t, log[0].calls

    for t, made in ranks(3, body):
        torch.testing.assert_close(t, data(1), equal_nan=True, rtol=0, atol=0)
        assert made == [("broadcast", {"root": 1})]


@pytest.mark.parametrize("method", ["all_to_all_single", "alltoall_base"])
def test_all_to_all_single_even_and_uneven(method):
    def body(pg, log):
        r = pg.rank()
        even = torch.arange(4.0) + 10 * r
        out = torch.zeros(4)
        getattr(pg, method)(out, even, [], [], dist.AllToAllOptions()).wait()
        ins = [1, 2] if r == 0 else [3, 1]  # rows this rank sends to rank 0, 1
        outs = [1, 3] if r == 0 else [2, 1]
        x = torch.arange(3.0 * 2).view(3, 2) + 100 * r if r == 0 else torch.arange(4.0 * 2).view(4, 2) + 100 * r
        y = torch.zeros(sum(outs), 2)
        getattr(pg, method)(y, x, outs, ins, dist.AllToAllOptions()).wait()
        return out, y, log[0].calls

    (o0, y0, c0), (o1, y1, _) = ranks(2, body)
    assert o0.tolist() == [0.0, 1.0, 10.0, 11.0] and o1.tolist() == [2.0, 3.0, 12.0, 13.0]
    assert y0[:, 0].tolist() == [0.0, 100.0, 102.0, 104.0] and y1[:, 0].tolist() == [2.0, 4.0, 106.0]
    assert c0[0] == ("all_to_all", {"in_splits": None, "out_splits": None})
    assert c0[1] == ("all_to_all", {"in_splits": [1, 2], "out_splits": [1, 3]})


def test_alltoall_list_form():
    def body(pg, log):
        r = pg.rank()
        outs = [torch.zeros(r + 1), torch.zeros(r + 1)]  # rank s sends rank d d+1 elements
        pg.alltoall(outs, [torch.full((d + 1,), 10.0 * r + d) for d in range(2)], dist.AllToAllOptions()).wait()
        return [o.tolist() for o in outs]

    assert ranks(2, body) == [[[0.0], [10.0]], [[1.0, 1.0], [11.0, 11.0]]]


def test_gather_and_scatter():
    def body(pg, log):
        r = pg.rank()
        outs = [torch.zeros(2) for _ in range(3)] if r == 0 else []
        pg.gather([outs] if r == 0 else [], [torch.full((2,), r + 1.0)], opts(dist.GatherOptions, rootRank=0)).wait()
        got = torch.zeros(2)
        parts = [torch.full((2,), 10.0 + d) for d in range(3)] if r == 2 else []
        pg.scatter([got], [parts] if r == 2 else [], opts(dist.ScatterOptions, rootRank=2)).wait()
        return [o.tolist() for o in outs], got.tolist(), calls(log)

    res = ranks(3, body)
    assert res[0][0] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert [got for _, got, _ in res] == [[10.0, 10.0], [11.0, 11.0], [12.0, 12.0]]
    assert res[1][2] == ["gather", "scatter"]


def test_barrier_is_the_communicators_and_its_work_waits():
    def body(pg, log):
        w = pg.barrier(dist.BarrierOptions())
        return w.wait(), calls(log)

    assert ranks(2, body) == [(True, ["barrier"])] * 2


# -- point to point: pending until a wait, issued together --

def test_send_recv_pair_issued_at_wait():
    def body(pg, log):
        if pg.rank() == 0:
            w = pg.send([torch.arange(3.0)], 1, 0)
            assert isinstance(w, PendingWork) and log == []  # pending: nothing ran yet
            w.wait()
            return calls(log)
        t = torch.zeros(3)
        pg.recv([t], 0, tag=0).wait()  # torch's checkpoint transport names the tag
        return t.tolist(), calls(log)

    assert ranks(2, body) == [["send"], ([0.0, 1.0, 2.0], ["recv"])]


def test_exchange_is_one_batch_and_any_wait_or_next_op_issues_it():
    def body(pg, log):
        r, peer = pg.rank(), 1 - pg.rank()
        got = torch.zeros(2)
        works = [pg.send([torch.full((2,), r + 1.0)], peer, 0), pg.recv([got], peer, 0)]
        works[1].wait()
        assert works[0].is_completed()
        late = torch.zeros(1)
        pg.recv([late], peer, 0) if r else pg.send([torch.ones(1) * 7], peer, 0)
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions())  # issues the pending op first
        return got.tolist(), late.tolist(), log[0].calls

    (g0, _, c0), (g1, l1, c1) = ranks(2, body)
    assert g0 == [2.0, 2.0] and g1 == [1.0, 1.0] and l1 == [7.0]
    assert c0[0] == ("batch_isend_irecv", {"ops": [("send", 1), ("recv", 1)]})
    assert [n for n, _ in c1] == ["batch_isend_irecv", "recv", "all_reduce"]


def test_polling_is_completed_issues_the_pending_ops():
    """``while not req.is_completed()`` after isend/irecv finishes: the query issues them."""
    def body(pg, log):
        peer = 1 - pg.rank()
        t = torch.arange(3.0) if pg.rank() == 0 else torch.zeros(3)
        w = pg.send([t], peer, 0) if pg.rank() == 0 else pg.recv([t], peer, 0)
        deadline = time.monotonic() + 10
        while not w.is_completed():
            assert time.monotonic() < deadline, "is_completed() never became True"
            time.sleep(1e-3)
        return t.tolist(), calls(log)

    assert ranks(2, body) == [([0.0, 1.0, 2.0], ["send"]), ([0.0, 1.0, 2.0], ["recv"])]


def test_a_batch_that_fails_to_issue_fails_every_work_of_it():
    def body(pg, log):
        got = torch.full((2,), -7.0)
        works = [pg.send([torch.ones(2)], 0, 0), pg.recv([got], 0, 0)]
        with pytest.raises(UbnextError, match="has no batch_isend_irecv") as info:
            works[0].wait()
        for w in works:  # the other work too: none says it finished well with its buffer unwritten
            with pytest.raises(UbnextError, match="has no batch_isend_irecv"):
                w.wait()
            assert w.is_completed() and not w.is_success() and w.exception() is info.value
        assert got.tolist() == [-7.0, -7.0]

    ranks(1, body, kind=LimitedComm)


def test_recv_anysource_and_monitored_barrier_raise():
    def body(pg, log):
        with pytest.raises(UbnextError, match="recv_anysource"):
            pg.recv_anysource([torch.zeros(1)], 0)
        with pytest.raises(UbnextError, match="monitored_barrier"):
            pg.monitored_barrier(dist.BarrierOptions())

    ranks(1, body)


# -- a communicator without the rest of NCCL's set yet: raises, nothing runs --

@pytest.mark.parametrize("op", ["broadcast", "reduce", "all_to_all_single", "gather", "scatter", "send",
                                "barrier"])
def test_ops_the_communicator_lacks_raise_naming_them(op):
    t = torch.ones(2)
    call = {
        "broadcast": lambda pg: pg.broadcast([t], dist.BroadcastOptions()),
        "reduce": lambda pg: pg.reduce([t], dist.ReduceOptions()),
        "all_to_all_single": lambda pg: pg.all_to_all_single(torch.ones(2), t, [], [], dist.AllToAllOptions()),
        "gather": lambda pg: pg.gather([[torch.ones(2)]], [t], dist.GatherOptions()),
        "scatter": lambda pg: pg.scatter([torch.ones(2)], [[t]], dist.ScatterOptions()),
        "send": lambda pg: pg.send([t], 0, 0).wait(),
        "barrier": lambda pg: pg.barrier(dist.BarrierOptions()),
    }[op]
    name = {"all_to_all_single": "all_to_all", "send": "send"}.get(op, op)

    def body(pg, log):
        with pytest.raises(UbnextError, match=f"ProcessGroupUbnext.{name}: .* has no {name}") as info:
            call(pg)
        assert f"rank 0 of 1, group 'g'" in info.value.__notes__[-1]  # the rank named
        return log[0].calls

    assert ranks(1, body, kind=LimitedComm) == [[]]


# -- work objects --

def test_cpu_work_and_its_future():
    t = torch.ones(2)
    w = Work([t])
    fut = w.get_future()
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert fut.done() and fut.value()[0] is t and w.get_future() is fut and w.result() == [t]


class _Stream:
    """Stands for a CUDA stream whose work finishes after ``polls`` queries (or never)."""

    device = "cuda:0"

    def __init__(self, polls=None):
        self.polls, self.synced = polls, 0

    def query(self):
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def synchronize(self):
        self.synced += 1


def test_wait_with_a_timeout_waits_on_the_host_and_raises_past_it():
    from datetime import timedelta

    slow = _Stream(polls=3)
    assert Work([], slow, None, blocking=True).wait(timedelta(seconds=5)) and slow.polls < 0 and slow.synced == 1
    with pytest.raises(UbnextError, match="Work.wait: the op did not finish within 0.05 s"):
        Work([], _Stream(), None, blocking=True).wait(timedelta(seconds=0.05))
    assert Work([], _Stream(), None, blocking=True).wait(timedelta(0))  # torch's "no timeout"


def test_a_blocking_op_returns_the_shared_finished_work():
    """async_op=False: torch waits on the work at once, on the op's stream: nothing to
    record (the dispatch stays lean); async_op=True: a work of the op's own."""
    from ubnext.torch.backend._work import DONE

    def body(pg, log):
        t = torch.ones(2)
        blocking = pg.allreduce([t], opts(dist.AllreduceOptions, asyncOp=False))
        asynchronous = pg.allreduce([t], opts(dist.AllreduceOptions, asyncOp=True))
        return blocking, asynchronous, t

    for blocking, asynchronous, t in ranks(2, body):
        assert blocking is DONE and blocking.wait() and blocking.is_completed()
        assert asynchronous is not DONE and asynchronous.result() == [t] and t.tolist() == [4.0, 4.0]


def test_future_of_a_c10d_op_chains_like_a_comm_hook():
    def body(pg, log):
        t = torch.full((2,), pg.rank() + 1.0)
        fut = pg.allreduce([t], dist.AllreduceOptions()).get_future().then(lambda f: f.value()[0] / 2)
        return fut.wait().tolist()

    assert ranks(2, body) == [[1.5, 1.5]] * 2


# -- the default communicator maker --

class _RecordingCommunicator:
    """Stands for ubnext.Communicator: records its arguments, exchanges once over the bootstrap."""

    made: list = []
    fail = False

    def __init__(self, bootstrap=None, device=None, **overrides):
        if self.fail:
            raise UbnextError("Communicator: no GPU")
        self.bootstrap, self.device, self.overrides = bootstrap, device, overrides
        self.peers = bootstrap.allgather(str(bootstrap.rank).encode())
        self.made.append(self)


def test_the_default_maker_builds_a_communicator_over_the_groups_store(monkeypatch):
    import ubnext._api.communicator as api

    monkeypatch.setattr(api, "Communicator", _RecordingCommunicator)
    _RecordingCommunicator.made = []
    store = dist.HashStore()

    def body(rank):
        make = backend.ubnext_communicator(store, rank, 2, backend.Options(pool_mb=48))
        comm, on_close = make(rank + 3)
        on_close("close")  # the bootstrap's close: collective over the store
        assert comm.bootstrap.closed

    run_threads(2, body)
    by_rank = sorted(_RecordingCommunicator.made, key=lambda c: c.bootstrap.rank)
    assert [(c.bootstrap.rank, c.bootstrap.size, c.device, c.overrides) for c in by_rank] == [
        (0, 2, 3, {"pool_mb": 48}), (1, 2, 4, {"pool_mb": 48})]
    assert by_rank[0].peers == [b"0", b"1"]
    assert type(by_rank[0].bootstrap).__name__ == "StoreBootstrap"


def test_the_default_maker_aborts_its_bootstrap_when_the_communicator_fails(monkeypatch):
    import ubnext._api.communicator as api
    from ubnext.bootstrap import StoreBootstrap

    aborted = []
    monkeypatch.setattr(api, "Communicator", type("Failing", (_RecordingCommunicator,), {"fail": True}))
    monkeypatch.setattr(StoreBootstrap, "abort", lambda self: aborted.append(self.rank))
    make = backend.ubnext_communicator(dist.HashStore(), 0, 1, backend.Options())
    with pytest.raises(UbnextError, match="no GPU"):
        make(0)
    assert aborted == [0]


def test_an_all_gather_no_kernel_takes_goes_through_the_copy_forms_all_to_all_where_nccl_cannot_run():
    """Ranks sharing a GPU (no NCCL): DDP's int64 metadata all-gather is an all-to-all of the
    input repeated once per rank, which the pool's copy form serves for every dtype."""
    from types import SimpleNamespace

    from ubnext.torch._gather import all_gather_any as _all_gather

    calls = []

    def all_to_all(x, out):  # what an all-to-all gives rank 1 of 3, whose peers send 10 r + i
        calls.append(("all_to_all", x.clone()))
        out.copy_(torch.stack([torch.arange(4, dtype=x.dtype) + 10 * r for r in range(3)]))

    def comm(problem):
        return SimpleNamespace(size=3, selector=SimpleNamespace(nccl_problem=problem), all_to_all=all_to_all,
                               all_gather=lambda x, out=None: calls.append(("all_gather", x)) or out)

    x = torch.arange(4, dtype=torch.int64) + 10
    out = _all_gather(comm("local ranks 0, 1, 2 share one GPU"), x)
    assert [name for name, _ in calls] == ["all_to_all"]
    assert torch.equal(calls[0][1], x.repeat(3, 1))  # every rank gets this rank's x
    assert torch.equal(out, torch.cat([torch.arange(4) + 10 * r for r in range(3)]))
    calls.clear()
    _all_gather(comm(None), x)  # NCCL can run: the communicator's all-gather (its NCCL rung)
    _all_gather(comm("shared"), x.float())  # a kernel dtype: the kernels
    assert [name for name, _ in calls] == ["all_gather", "all_gather"]
