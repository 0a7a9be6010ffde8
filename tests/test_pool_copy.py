"""The pool's copy form of the data movers (ubnext/_api/collectives/pool_copy.py) without a
GPU: its plans run on a simulated node (every rank's area, input and output in one byte
array; the steps between two barriers of every rank form one phase, which the barriers
order: a rank passes barrier k only once every rank has issued, and so finished, its
steps before barrier k), checked byte for byte, over several rounds and calls, with no
two ranks touching the same bytes in one phase where one of them writes; and the choice
between the copy form and NCCL, and what a call issues."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_collectives import buffer, calls, make_comm

from ubnext._api.collectives import pool_copy as pc
from ubnext._protocol.algorithms import ALGORITHMS
from ubnext._selection.select import Selector
from ubnext._selection.table_format import parse_table
from ubnext._interop import streams
from ubnext._protocol import signature as _signature
from ubnext._protocol.errors import UbnextError

STRIDE = 1 << 14
HALF = 96  # small halves: several rounds, slots of 96 // n bytes rounded down to 16


class Node:
    """``n`` ranks: rank r's area at r * STRIDE (2 * HALF bytes), its x at r * STRIDE + 4096,
    its out at r * STRIDE + 8192; random bytes everywhere. A copy (a row of a 2-D copy
    too) must stay within one rank's memory."""

    def __init__(self, n: int, seed: int = 0):
        self.n = n
        self.mem = np.random.default_rng(seed).integers(0, 256, n * STRIDE, dtype=np.uint8)
        self.area = tuple(r * STRIDE for r in range(n))

    def x(self, r):
        return r * STRIDE + 4096

    def out(self, r):
        return r * STRIDE + 8192

    def run(self, plans: list) -> None:
        """Runs every rank's plan, phase by phase; fails where two ranks conflict in a phase."""
        phases = [_phases(p) for p in plans]
        assert len({len(p) for p in phases}) == 1, "ranks wait at different barrier counts"
        for k in range(len(phases[0])):
            touched = [_accesses(steps) for steps in (p[k] for p in phases)]
            for a in range(self.n):
                for b in range(self.n):
                    if a != b:
                        for w in touched[a][1]:
                            for r in touched[b][0] + touched[b][1]:
                                assert not _overlap(w, r), f"phase {k}: rank {a} writes {w} while rank {b} uses {r}"
            for p in phases:
                for step in p[k]:
                    self._do(step)

    def _do(self, step):
        if step[0] == "copy":
            _, dst, src, n = step
            for a in (dst, src):
                assert a // STRIDE == (a + n - 1) // STRIDE, f"a copy of {n} bytes at {a} crosses ranks' memory"
            self.mem[dst:dst + n] = self.mem[src:src + n].copy()
        else:
            _, dst, dp, src, sp, w, rows = step
            assert dp >= w and sp >= w
            for a, pitch in ((dst, dp), (src, sp)):  # one 2-D copy reads or writes one rank's memory
                assert a // STRIDE == (a + (rows - 1) * pitch + w - 1) // STRIDE, "a 2-D copy spans ranks' memory"
            for i in range(rows):
                self._do(("copy", dst + i * dp, src + i * sp, w))


def _phases(plan):
    out = [[]]
    for step in plan:
        if step is pc.WAIT:
            out.append([])
        else:
            out[-1].append(step)
    return out


def _accesses(steps):
    reads, writes = [], []
    for step in steps:
        if step[0] == "copy":
            _, dst, src, n = step
            writes.append((dst, dst + n))
            reads.append((src, src + n))
        else:
            _, dst, dp, src, sp, w, rows = step
            writes += [(dst + i * dp, dst + i * dp + w) for i in range(rows)]
            reads += [(src + i * sp, src + i * sp + w) for i in range(rows)]
    return reads, writes


def _out_of(rank, plans) -> int:
    """Bytes that the steps of ``plans`` copy from ``rank``'s memory into another rank's."""
    return sum(s[3] for p in plans for s in p
               if s is not pc.WAIT and s[0] == "copy" and s[2] // STRIDE == rank and s[1] // STRIDE != rank)


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("nbytes", [1, 16, 95, 96, 97, 300])
def test_broadcast_plan(n, nbytes):
    node = Node(n, nbytes)
    root = nbytes % n
    want = node.mem[node.x(root):node.x(root) + nbytes].copy()
    mine = [node.mem[node.x(r):node.x(r) + nbytes].copy() for r in range(n)]
    node.run([pc.broadcast_plan(r, root, node.area, node.x(r), node.out(r), nbytes, HALF) for r in range(n)] * 1)
    for r in range(n):
        assert (node.mem[node.out(r):node.out(r) + nbytes] == want).all()
        assert (node.mem[node.x(r):node.x(r) + nbytes] == mine[r]).all()
    # in place, twice in a row (the second call's writes after every read of the first)
    plans = [pc.broadcast_plan(r, root, node.area, node.x(r), node.x(r), nbytes, HALF) for r in range(n)]
    node.run([p + p for p in plans])
    for r in range(n):
        assert (node.mem[node.x(r):node.x(r) + nbytes] == want).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("nbytes", [1, 16, 17, 95, 96, 97, 191, 300, 4 * HALF + 1, 9 * HALF + 7])
def test_scatter_allgather_plan(n, nbytes):
    """Broadcast's bandwidth form: the root's bytes on every rank (out of place, then in
    place twice in a row), x unchanged out of place; the root sends each byte of a round
    once to a peer's area, where the copy form's plan has every peer pull the whole message
    from the root."""
    node = Node(n, nbytes + 1)
    root = (nbytes + 1) % n
    want = node.mem[node.x(root):node.x(root) + nbytes].copy()
    mine = [node.mem[node.x(r):node.x(r) + nbytes].copy() for r in range(n)]
    plans = [pc.scatter_allgather_plan(r, root, node.area, node.x(r), node.out(r), nbytes, HALF) for r in range(n)]
    node.run(plans)
    for r in range(n):
        assert (node.mem[node.out(r):node.out(r) + nbytes] == want).all()
        assert (node.mem[node.x(r):node.x(r) + nbytes] == mine[r]).all()
    rounds = -(-nbytes // (n * HALF))
    assert _out_of(root, plans) <= 2 * nbytes + rounds * n * 16  # the copy form's: (n - 1) x nbytes
    plans = [pc.scatter_allgather_plan(r, root, node.area, node.x(r), node.x(r), nbytes, HALF) for r in range(n)]
    node.run([p + p for p in plans])
    for r in range(n):
        assert (node.mem[node.x(r):node.x(r) + nbytes] == want).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("part", [1, 15, 16, 17, 50])
def test_all_to_all_plan(n, part):
    node = Node(n, part)
    x = [node.mem[node.x(r):node.x(r) + n * part].copy() for r in range(n)]
    plans = [pc.all_to_all_plan(r, node.area, node.x(r), node.out(r), part, HALF) for r in range(n)]
    node.run([p + p for p in plans])
    for r in range(n):
        want = np.concatenate([x[j][r * part:(r + 1) * part] for j in range(n)])
        assert (node.mem[node.out(r):node.out(r) + n * part] == want).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("in_place", [False, True])
def test_gather_plan(n, k, in_place):
    node = Node(n, k)
    root = (k + 1) % n
    x = [node.out(r) + r * k if in_place and r == root else node.x(r) for r in range(n)]
    data = [node.mem[x[r]:x[r] + k].copy() for r in range(n)]
    plans = [pc.gather_plan(r, root, node.area, x[r], node.out(r), k, HALF) for r in range(n)]
    outs = [node.mem[node.out(r):node.out(r) + n * k].copy() for r in range(n)]
    node.run([p + p for p in plans])
    for r in range(n):
        got = node.mem[node.out(r):node.out(r) + n * k]
        assert (got == (np.concatenate(data) if r == root else outs[r])).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 16, 95, 200])
def test_scatter_plan(n, k):
    node = Node(n, k)
    root = k % n
    whole = node.mem[node.x(root):node.x(root) + n * k].copy()
    plans = [pc.scatter_plan(r, root, node.area, node.x(r), node.out(r), k, HALF) for r in range(n)]
    node.run([p + p for p in plans])
    for r in range(n):
        assert (node.mem[node.out(r):node.out(r) + k] == whole[r * k:(r + 1) * k]).all()


def drop_wait(plan, k):
    """``plan`` without its k-th barrier (from 0)."""
    at = [i for i, s in enumerate(plan) if s is pc.WAIT][k]
    return plan[:at] + plan[at + 1:]


def test_a_plan_that_reuses_a_half_too_early_is_caught():
    """The checker itself: without the barrier between a round's pulls and the round after
    next, the root's staging write meets a peer's pull."""
    node = Node(2)
    plans = [pc.broadcast_plan(r, 0, node.area, node.x(r), node.out(r), 3 * HALF, HALF) for r in range(2)]
    broken = [drop_wait(p, 2) for p in plans]
    with pytest.raises(AssertionError, match="phase"):
        node.run(broken)


# ---- the choice and the issue ---------------------------------------------------------------------
class Dispatch:
    def __init__(self):
        self.rung = SimpleNamespace(calls=[])
        self.barriers = []

    def nccl_for(self, stream, owner):
        return SimpleNamespace(**{n: (lambda *a, _n=n: self.rung.calls.append((_n, *a)))
                                  for n in ("broadcast", "exchange")})

    def all_reduce(self, algo, xb, ob, op, stream, owner, sig):
        self.barriers.append((algo, xb, ob, op, stream, sig))


def pooled(monkeypatch, nccl_problem=None, rank=1):
    """A 4-rank communicator with a pool stand-in: its area at 0x100000 + r * 0x10000."""
    c = make_comm(monkeypatch, rank=rank, nccl_problem=nccl_problem)
    c._dispatch, c._nccl_reason = Dispatch(), None
    c._node = SimpleNamespace(pool=SimpleNamespace(stride=0x10000), failure=lambda name, timeout: None,
                              hold=lambda stream: None)
    c._selector.fits = lambda name, nbytes: name == "lamport"
    areas = []

    def area(key, nbytes):
        areas.append((key, nbytes))
        c._areas[key] = (None, tuple(0x100000 + r * 0x10000 for r in range(4)))

    c._symmetric_area = area
    c.areas = areas
    c._copy_flag_buffer = buffer(4, "float32", ptr=0xF1A6)
    steps = []
    monkeypatch.setattr(pc, "_copy", lambda dst, src, n, stream: steps.append(("copy", dst, src, n, stream)))
    monkeypatch.setattr(pc, "_copy_rows", lambda *a: steps.append(("rows", *a)))
    c.steps = steps
    return c


def test_auto_takes_nccl_where_it_runs_and_the_copy_form_where_not(monkeypatch):
    c = pooled(monkeypatch)
    x = buffer(8)
    c.broadcast(x)
    assert calls(c)[0][0] == "broadcast" and c.steps == [] and c.areas == []
    shared = pooled(monkeypatch, nccl_problem="local ranks 0, 1 share one GPU")
    out = shared.broadcast(x, root=2)
    assert shared.areas == [(pc.AREA_KEY, pc.AREA_BYTES)] and calls(shared) == []
    sig = _signature.encode_rooted("broadcast", "bfloat16", 8, 2)
    flag = shared._copy_flag_buffer
    assert shared._dispatch.barriers == [("lamport", flag, flag, "sum", 0x77, sig)] * 2
    assert shared.steps == [("copy", out.ptr, 0x100000 + 2 * 0x10000, 16, 0x77)]  # rank 1 pulls the root's half


def with_rows(monkeypatch, collectives, nccl_problem=None):
    """``pooled``'s communicator whose selector has a tune file with the movers' rows
    ``collectives`` (an entry's ``collectives``) for any machine."""
    c = pooled(monkeypatch, nccl_problem)
    doc = {"format": 2, "entries": [{"gpu": "*", "link": "*", "placement": "*", "mode": "*",
                                     "tables": {"*": {"bfloat16": [[None, "nccl"]]}}, "collectives": collectives}]}
    fits = c._selector.fits
    c._selector = Selector(4, c._selector.limits, list(ALGORITHMS), parse_table(doc, "tune file t.json"), "",
                           False, nccl_problem)
    c._selector.fits = fits
    launches = []
    c._node.engine = SimpleNamespace(ll_move=lambda *a: launches.append(a) or ("launch", a))
    monkeypatch.setattr(pc, "issue", lambda launch, stream: None)
    c.launches = launches
    return c


BCAST_ROWS = {"broadcast": {"tables": {"4": {"bfloat16": [[64, "ll"], [1024, "nccl"], [None, "scatter_allgather"]]}}},
              "all_to_all": {"tables": {"4": {"bfloat16": [[None, "ll"]]}}}}


def test_auto_hands_each_size_to_the_rows_algorithm(monkeypatch):
    """With selector rows for a mover, auto takes, at each size, the first row that covers it
    and whose algorithm runs here; the area is allocated at the first call where a row names
    a form on it; a row that cannot take the size (ll past its bound) is passed over, and
    where none takes it, today's rule (NCCL where it runs)."""
    c = with_rows(monkeypatch, BCAST_ROWS)
    x = buffer(32)  # 64 bytes
    got = c.broadcast(x, root=0)
    assert c.launches == [("ub_ll_broadcast", x.ptr, got.ptr, 64, _signature.encode_rooted("broadcast", "bfloat16",
                                                                                           32, 0), 0)]
    assert c.areas == [(pc.AREA_KEY, pc.AREA_BYTES)] and calls(c) == [] and c.steps == []
    c.broadcast(buffer(33), root=0)
    assert calls(c)[0][0] == "broadcast" and c.steps == [] and len(c.launches) == 1
    big = buffer(513, ptr=1 << 22)
    got = c.broadcast(big, root=2)
    area = c._copy_area()
    assert c.steps == [(*s, 0x77) for s in pc.scatter_allgather_plan(1, 2, area, big.ptr, got.ptr, 1026,
                                                                      pc.AREA_BYTES // 2) if s is not pc.WAIT]
    assert c.steps == [("copy", got.ptr + 272 * d, area[d], 272 if d < 3 else 210, 0x77) for d in range(4)]
    assert len(c._dispatch.barriers) == 2 and len(calls(c)) == 1
    a2a = buffer(4 * 4, shape=(4, 4))  # 8 bytes per part: ll
    c.all_to_all(a2a)
    assert c.launches[-1][:1] == ("ub_ll_alltoall",) and c.launches[-1][3] == 8
    part = pc.LL_MAX_BYTES + 2
    c.all_to_all(buffer(2 * part, shape=(4, part // 2)))  # past ll's bound: no row takes it, NCCL
    assert calls(c)[-1][0] == "exchange" and len(c.launches) == 2


def test_where_nccl_cannot_run_its_rows_are_passed_over(monkeypatch):
    """Ranks sharing a GPU: a row giving NCCL is passed over for the next that runs here, and
    where none does, the copy form serves the call."""
    c = with_rows(monkeypatch, BCAST_ROWS, nccl_problem="local ranks 0, 1 share one GPU")
    x = buffer(100, ptr=1 << 22)  # 200 bytes: NCCL's row, then scatter_allgather's
    got = c.broadcast(x, root=1)
    assert c.steps[:4] == [("copy", c._copy_area()[d] , x.ptr + 64 * d, 64 if d < 3 else 8, 0x77) for d in range(4)]
    assert calls(c) == []
    c.steps.clear()
    c.all_to_all(buffer(2 * (pc.LL_MAX_BYTES + 2), shape=(4, pc.LL_MAX_BYTES // 2 + 1)))
    assert c.steps and c.steps[-1][0] == "rows" and calls(c) == [] and got is not None


def test_rows_for_other_movers_leave_a_mover_without_rows_to_todays_rule(monkeypatch):
    """A mover without rows (the shipped table has none) takes today's rule before its
    section: NCCL where it runs (no area allocated), whatever other movers' rows say."""
    c = with_rows(monkeypatch, {"all_to_all": BCAST_ROWS["all_to_all"]})
    c.broadcast(buffer(8))
    assert calls(c)[0][0] == "broadcast" and c.areas == [] and c.launches == []


def test_the_copy_forms_first_call_refuses_a_capture_before_anything(monkeypatch):
    """The copy form's first call allocates and zeroes its barrier's flag and waits on the
    host: under a CUDA graph capture it raises, queuing nothing (the capture stays valid)."""
    c = pooled(monkeypatch, nccl_problem="local ranks 0, 1 share one GPU")
    del c._copy_flag_buffer
    monkeypatch.setattr(streams.CUDA, "capture", lambda stream: 7)
    with pytest.raises(UbnextError, match="^gather: the first such call on a communicator cannot be captured in "
                                          "a CUDA graph .*make one eager call first"):
        c.gather(buffer(8), root=1)
    assert c.steps == [] and c._dispatch.barriers == [] and "_copy_flag_buffer" not in c.__dict__
    c._copy_flag_buffer = buffer(4, "float32", ptr=0xF1A6)  # what the eager call left: captured alike
    c.gather(buffer(8), root=1)
    assert c.steps and len(c._dispatch.barriers) == 2


def test_the_copy_form_is_named_or_refused(monkeypatch):
    c = pooled(monkeypatch)
    x = buffer(4 * 6, shape=(4, 6))
    out = c.all_to_all(x, algorithm="copy")
    slot = pc._slot(pc.AREA_BYTES // 2, 4)  # rank 1 pushes into slot 1 of every rank's half 0
    assert c.steps == [*(("copy", 0x100000 + d * 0x10000 + 1 * slot, x.ptr + d * 12, 12, 0x77) for d in range(4)),
                       ("rows", out.ptr, 12, 0x100000 + 0x10000, slot, 12, 4, 0x77)]
    with pytest.raises(UbnextError, match="^all_to_all: algorithm 'copy' needs even splits"):
        c.all_to_all(x, algorithm="copy", in_splits=[1, 1, 1, 1])
    with pytest.raises(UbnextError, match="^all_to_all: algorithm 'copy' takes an out of x's 24 elements"):
        c.all_to_all(x, out=buffer(48, ptr=1 << 25), algorithm="copy")
    with pytest.raises(UbnextError, match="^gather: unknown algorithm 'lamport'; use auto or one of copy, nccl"):
        c.gather(x, algorithm="lamport")
    with pytest.raises(UbnextError, match="^scatter: unknown algorithm 'll'; use auto or one of copy, nccl"):
        c.scatter(x, 1, algorithm="ll")
    bare = make_comm(monkeypatch)
    with pytest.raises(UbnextError, match=r"^scatter: algorithm 'copy' needs the symmetric pool \(NCCL only"):
        bare.scatter(x, 1, algorithm="copy")


def test_where_nccl_cannot_run_a_named_nccl_raises(monkeypatch):
    c = pooled(monkeypatch, nccl_problem="local ranks 0, 1 share one GPU")
    with pytest.raises(UbnextError, match="^gather: algorithm 'nccl' was named, and NCCL, which runs it, cannot"):
        c.gather(buffer(4), algorithm="nccl")
    assert c.areas == []  # refused before the copy form's area
    c.all_to_all(buffer(4))  # even: the copy form
    assert c.steps and calls(c) == []


def test_scatter_allgather_is_named_for_broadcast_only(monkeypatch):
    """Named, broadcast's bandwidth form issues its plan on the copy form's area (allocated
    at the first call) between its barriers; other movers and a communicator without a pool
    refuse it before anything is launched."""
    c = pooled(monkeypatch, rank=2)
    x = buffer(40, "float32", ptr=1 << 20)  # 160 bytes: parts of 48 bytes, the last of 16
    out = c.broadcast(x, root=2, algorithm="scatter_allgather")
    area = tuple(0x100000 + r * 0x10000 for r in range(4))
    assert c.areas == [(pc.AREA_KEY, pc.AREA_BYTES)] and calls(c) == []
    assert c.steps == [*(("copy", area[d], x.ptr + 48 * d, 48 if d < 3 else 16, 0x77) for d in range(4)),
                       ("copy", out.ptr, x.ptr, 160, 0x77)]
    assert len(c._dispatch.barriers) == 2
    with pytest.raises(UbnextError, match="^all_to_all: unknown algorithm 'scatter_allgather'; use auto or one of "
                                          "ll, copy, nccl"):
        c.all_to_all(buffer(8), algorithm="scatter_allgather")
    with pytest.raises(UbnextError, match=r"^broadcast: algorithm 'scatter_allgather' needs the symmetric pool"):
        make_comm(monkeypatch).broadcast(x, algorithm="scatter_allgather")


def test_gather_and_scatter_issue_their_plans(monkeypatch):
    c = pooled(monkeypatch, nccl_problem="shared", rank=0)
    x = buffer(5, "float32", ptr=1 << 20)
    out = c.gather(x, root=0)
    slot = pc._slot(pc.AREA_BYTES // 2, 4)
    assert c.steps == [("copy", 0x100000, x.ptr, 20, 0x77), ("rows", out.ptr, 20, 0x100000, slot, 20, 4, 0x77)]
    c.steps.clear()
    part = c.scatter(buffer(8, "int8", ptr=1 << 21), root=0)
    assert c.steps == [*(("copy", 0x100000 + d * 0x10000, (1 << 21) + 2 * d, 2, 0x77) for d in range(4)),
                       ("copy", part.ptr, 0x100000, 2, 0x77)]
    sigs = {b[-1] >> 60 for b in c._dispatch.barriers}
    assert sigs == {_signature.COLLECTIVES.index(n) + 1 for n in ("gather", "scatter")}


def test_ranks_naming_different_roots_sign_different_calls(monkeypatch):
    """The root is in the signature of the copy and ll forms: ranks that name different
    roots mismatch in band (CollectiveMismatchError) instead of moving the wrong data."""
    c = pooled(monkeypatch, nccl_problem="shared", rank=0)
    launches = []
    c._node.engine = SimpleNamespace(ll_move=lambda *a: launches.append(a) or ("launch", a))
    monkeypatch.setattr(pc, "issue", lambda launch, stream: None)
    x = buffer(8, "float32", ptr=1 << 20)
    for root in (1, 2):
        c.broadcast(x, root=root, algorithm="ll")
        c.broadcast(x, root=root, algorithm="copy")
        c.gather(x, root=root, out=None)
        c.scatter(buffer(32, "float32", ptr=1 << 21), root=root, out=buffer(8, "float32", ptr=1 << 22))
    assert [a[4] for a in launches] == [_signature.encode_rooted("broadcast", "float32", 8, r) for r in (1, 2)]
    copies = [b[-1] for b in c._dispatch.barriers]
    per_root = len(copies) // 2
    assert per_root == 6 and set(copies[:per_root]).isdisjoint(copies[per_root:])  # 3 calls, 2 barriers each
    assert {s >> 52 & 0xF for s in copies} == {1, 2}


# ---- the low-latency kernel's launch ----------------------------------------------------------------
def test_ll_is_named_launched_and_bounded(monkeypatch):
    c = pooled(monkeypatch)
    launches, issued = [], []
    c._node.engine = SimpleNamespace(ll_move=lambda *a: launches.append(a) or ("launch", a))
    monkeypatch.setattr(pc, "issue", lambda launch, stream: issued.append((launch, stream)))
    x = buffer(4 * 6, "int8", shape=(4, 6))
    out = c.all_to_all(x, algorithm="ll")
    y = buffer(9, "float64", ptr=1 << 22)
    got = c.broadcast(y, root=3, algorithm="ll")
    assert launches == [("ub_ll_alltoall", x.ptr, out.ptr, 6, _signature.encode("all_to_all", "int8", "sum", 24), None),
                        ("ub_ll_broadcast", y.ptr, got.ptr, 72, _signature.encode_rooted("broadcast", "float64", 9, 3), 3)]
    assert [s for _, s in issued] == [0x77, 0x77] and c.steps == [] and calls(c) == [] and c.areas == []
    with pytest.raises(UbnextError, match=f"^broadcast: algorithm 'll' takes at most {pc.LL_MAX_BYTES} bytes per "
                                          f"message, not {pc.LL_MAX_BYTES + 2}"):
        c.broadcast(buffer(pc.LL_MAX_BYTES // 2 + 1), algorithm="ll")
    with pytest.raises(UbnextError, match=r"^broadcast: algorithm 'll' needs the symmetric pool \(NCCL only"):
        make_comm(monkeypatch).broadcast(y, algorithm="ll")
    assert len(launches) == 2
