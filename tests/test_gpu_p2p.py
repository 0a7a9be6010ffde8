"""Point-to-point on the pool on GPUs (kernels/p2p.cu, ``algorithm="ll"``): send, recv,
batch_isend_irecv and the all-to-all with uneven splits (host lists and device arrays;
the batch ring and the all-to-all of every dtype and size are test_gpu_collectives.py's,
on this kernel too), byte for byte against the host reference on random bits of every
dtype (-0.0, NaNs with payloads, every integer pattern), outputs poisoned and bordered by
canary bytes, inputs unchanged; messages of the bulk form (P2P_BULK_MIN_BYTES and more:
chunks shared by several blocks, past the chunk slots, beside LL ones in one batch, of any
alignment, in uneven all-to-alls, a receive timing out, split errors), several messages of
a pair in one batch and back to back (the matching rule, the pair's counters), CUDA-graph replay (the counters advanced by the
kernel), ``auto`` taking the kernel where NCCL cannot run, and the failures: a receive
with no send times out on the waiting rank, device split counts that do not fit or agree
raise after the call with nothing written out of bounds.

Run at 1 rank (plain pytest: a batch's self-send), at 2 and 4 ranks one per GPU, and with
ranks sharing one GPU: ``mpirun --oversubscribe -n 4 python -m pytest -q
tests/test_gpu_p2p.py``; skipped without a GPU.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from gpu_support import collected, require_gpu_and_torch, seed_of
from test_gpu_collectives import (POISON, WIDTH, Bordered, assert_bytes, host_bytes, on_device, rank_bytes,
                                  renewed_after_failure)

from ubnext._protocol.algorithms import DTYPES
from ubnext._protocol.constants import LL_MAX_BYTES, P2P_BULK_CHUNK, P2P_BULK_DEPTH, P2P_BULK_MIN_BYTES

pytestmark = pytest.mark.gpu

#: a communicator of the module's: a small pool, a timeout that a slow shared GPU never trips
SETTINGS = dict(pool_mb=128, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)
#: the failure tests' communicators: a short timeout
TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def world():
    """mpi4py's COMM_WORLD, to line the ranks up around failures."""
    require_gpu_and_torch()
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(scope="module")
def holder(world):
    """Where the module's communicator lives between tests (``comm``)."""
    kept = SimpleNamespace(comm=None)
    yield kept
    if kept.comm is not None:
        kept.comm.close()


@pytest.fixture
def comm(holder, world):
    """The module's communicator (a small pool, a timeout that a slow shared GPU never
    trips) with torch's device set to its own, renewed after a test that broke it
    (test_gpu_collectives.renewed_after_failure; the ranks agree over MPI)."""
    import torch

    import ubnext

    def make():
        c = ubnext.Communicator(**SETTINGS, timeout_s=60)
        torch.cuda.set_device(c.device)
        return c

    yield from renewed_after_failure(holder, make, world.allgather)


@pytest.fixture
def fresh(world, comm):
    """A new communicator with a short timeout on the module's device; closed afterwards."""
    import ubnext

    made = []

    def make():
        made.append(ubnext.Communicator(**SETTINGS, timeout_s=TIMEOUT_S, device=comm.device))
        return made[-1]

    yield make
    world.Barrier()  # every rank's failure is passed on before any rank closes
    for c in made:
        c.close()
    world.Barrier()


def raised(call):
    """The exception ``call()`` raised, or None (decided after every rank took its part)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 (returned to the test, which asserts on it)
        return e
    return None


# ---- send, recv, batches -------------------------------------------------------------------------
#: past LL_MAX_BYTES: a message of the bulk form, five chunks (the last a partial one)
CHUNKED = 2 * LL_MAX_BYTES + 24
#: the bulk form's messages past its chunk slots: each slot used three times (credits), the
#: last chunk partial and of an odd length
LONG = 2 * P2P_BULK_DEPTH * P2P_BULK_CHUNK + 12345
#: the largest LL message and the smallest bulk one: the two forms side by side
EDGES = (P2P_BULK_MIN_BYTES - 1, P2P_BULK_MIN_BYTES)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_send_recv_pairs(comm, dtype):
    """Even ranks send four arrays (two of the bulk form, one past its chunk slots) to the
    next odd rank, which receives them in order (the k-th send matches the k-th receive;
    each call its own launch on both sides, whose blocks per pair need not match); a last
    rank without a partner takes no part."""
    import torch

    if comm.size < 2:
        pytest.skip("a send needs another rank")
    me = comm.rank
    seed = seed_of("p2p-sendrecv", dtype)
    counts = (4099, 1, CHUNKED // WIDTH[dtype] + 1, LONG // WIDTH[dtype])
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer < comm.size:
        sent = [rank_bytes(k, dtype, min(me, peer), seed + i) for i, k in enumerate(counts)]
        if me % 2 == 0:
            for b in sent:
                comm.send(on_device(b, dtype), peer, algorithm="ll")
        else:
            outs = [Bordered(k, dtype, seed + 10 + i) for i, k in enumerate(counts)]
            for o in outs:
                assert comm.recv(o.view, peer, algorithm="ll") is o.view
            torch.cuda.synchronize()
            for i, (o, want) in enumerate(zip(outs, sent)):
                assert_bytes(host_bytes(o.view), want, f"recv {i}")
                o.assert_intact(f"recv {i}")
    torch.cuda.synchronize()
    comm.synchronize()


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32", "float64"])
def test_several_messages_of_a_pair_in_one_batch_keep_their_order(comm, dtype):
    """Sends to the next rank and receives from the previous one in one batch, of both
    forms: 0 bytes, the largest LL message, the smallest bulk one, 5 elements, one past the
    bulk chunk slots three times over, CHUNKED: each bit for bit in its own bordered output,
    matched in order within the launch (the third message waits for an LL credit the
    receiving block of the same launch gives; a bulk message is one of the pair's messages,
    its chunks shared by the group's blocks)."""
    import torch

    n, me = comm.size, comm.rank
    nxt, prev = (me + 1) % n, (me - 1) % n
    w = WIDTH[dtype]
    counts = [0] + [b // w for b in EDGES] + [5, LONG // w, CHUNKED // w + 1]
    seed = seed_of("p2p-order", dtype)
    data = [[rank_bytes(k, dtype, r, seed + i) for i, k in enumerate(counts)] for r in range(n)]
    outs = [Bordered(k, dtype, seed + 50 + i) for i, k in enumerate(counts)]
    entries = []
    for i, k in enumerate(counts):
        entries += [("send", on_device(data[me][i], dtype, (k,)), nxt), ("recv", outs[i].view, prev)]
    comm.batch_isend_irecv(entries, algorithm="ll")
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert_bytes(host_bytes(o.view), data[prev][i], f"message {i} ({counts[i]} x {dtype})")
        o.assert_intact(f"message {i}")
    comm.synchronize()


#: float32 counts of the back-to-back rounds: mostly LL (a bulk one in six), mostly bulk
#: (past the chunk slots, the smallest, partial chunks; an LL one between)
ROUNDS = {"ll": (40, (1, 7, 4099, 8192, 33, CHUNKED // 4)),
          "bulk": (12, (LONG // 4, 10, P2P_BULK_MIN_BYTES // 4, CHUNKED // 4, 1024,
                        (P2P_BULK_MIN_BYTES + P2P_BULK_CHUNK) // 4 + 1))}


@pytest.mark.parametrize("mix", ROUNDS)
def test_back_to_back_rounds_alternate_buffers(comm, mix):
    """Ring rounds of changing sizes queued without a wait, each into an output of its
    own: every one bit for bit (a pair's buffers alternate by its count; lines of older
    messages carry older flags; the credits let no sender overwrite an unread buffer; the
    bulk form's chunk count carried from launch to launch by the kernel, its chunk slots'
    credits across launches, LL and bulk messages counted as one sequence)."""
    import torch

    n, me = comm.size, comm.rank
    nxt, prev = (me + 1) % n, (me - 1) % n
    made = []
    rounds, counts = ROUNDS[mix]
    for k in range(rounds):
        count = counts[k % 6]
        seed = seed_of("p2p-b2b", mix, k)
        out = torch.empty(count, dtype=torch.float32, device="cuda")
        comm.batch_isend_irecv([("send", on_device(rank_bytes(count, "float32", me, seed), "float32"), nxt),
                                ("recv", out, prev)], algorithm="ll")
        made.append((k, out, rank_bytes(count, "float32", prev, seed)))
    torch.cuda.synchronize()
    for k, out, want in made:
        assert_bytes(host_bytes(out), want, f"round {k}")
    comm.synchronize()


def test_a_repeated_batch_takes_its_plan(comm):
    """The same ring batch (same arrays) five times, new data before each: the calls after
    the first launch the first call's plan, and each delivers its own round's data (the
    kernel advances the pairs' counters, the plan's arguments stay)."""
    import torch

    n, me = comm.size, comm.rank
    x = torch.empty(1000, dtype=torch.float32, device="cuda")
    r = torch.empty_like(x)
    for k in range(5):
        x.copy_(torch.arange(1000, dtype=torch.float32, device="cuda") + 10000 * k + 100 * me)
        comm.batch_isend_irecv([("send", x, (me + 1) % n), ("recv", r, (me - 1) % n)], algorithm="ll")
        comm.synchronize()
        want = torch.arange(1000, dtype=torch.float32, device="cuda") + 10000 * k + 100 * ((me - 1) % n)
        assert torch.equal(r, want), f"round {k}"
    assert len(comm._plans) >= 1  # this call's (or an earlier test's with arrays at the same addresses)


def test_a_repeated_all_to_all_with_device_splits_reads_the_counts_each_call(comm):
    """The same arrays three times (the calls after the first launch its plan), the device
    splits rewritten before each (int64 in_splits, int32 out_splits): each call moves its
    own round's counts and data, the rows past them untouched."""
    import torch

    n, me = comm.size, comm.rank
    x = torch.empty(2 * n, 3, dtype=torch.float32, device="cuda")
    out = torch.empty(2 * n, 3, dtype=torch.float32, device="cuda")
    ins = torch.empty(n, dtype=torch.int64, device="cuda")
    outs = torch.empty(n, dtype=torch.int32, device="cuda")
    for k, rows in enumerate((2, 1, 2)):  # rows every rank sends every rank this round
        x.copy_(torch.arange(6 * n, dtype=torch.float32, device="cuda").view(2 * n, 3) + 1000 * k + 100 * me)
        out.fill_(-1)
        ins.fill_(rows)
        outs.fill_(rows)
        comm.all_to_all(x, out, ins, outs, algorithm="ll")
        comm.synchronize()
        base = torch.arange(6 * n, dtype=torch.float32, device="cuda").view(2 * n, 3) + 1000 * k
        want = torch.cat([base[rows * me:rows * me + rows] + 100 * j for j in range(n)])
        assert torch.equal(out[:rows * n], want), f"round {k}"
        assert bool((out[rows * n:] == -1).all().item()), f"round {k}: rows past the counts were written"


def test_graph_replay(comm):
    """A ring batch and an all-to-all with device splits captured after an eager call,
    replayed on new inputs: the kernel advances the pairs' counters itself."""
    import torch

    from test_gpu_collectives import captured, replayed

    n, me = comm.size, comm.rank
    x = torch.zeros(n * 4, dtype=torch.float32, device="cuda")
    r, a = torch.empty_like(x), torch.empty_like(x)
    splits = torch.full((n,), 4, dtype=torch.int64, device="cuda")

    def calls():
        comm.batch_isend_irecv([("send", x, (me + 1) % n), ("recv", r, (me - 1) % n)], algorithm="ll")
        comm.all_to_all(x, a, splits, splits, algorithm="ll")

    failures = []
    for base in replayed(captured(calls), x, me, 4):
        with collected(failures):
            assert torch.equal(r, base + 100 * ((me - 1) % n))
            assert torch.equal(a, torch.cat([base[4 * me:4 * me + 4] + 100 * j for j in range(n)]))
    assert not failures, failures
    comm.synchronize()


def test_auto_takes_the_kernel_where_nccl_cannot_run(comm):
    """Ranks sharing a GPU: send, recv, batches and uneven all-to-alls run on the kernel
    (``auto``); where NCCL runs, on NCCL."""
    import torch

    n, me = comm.size, comm.rank
    x = torch.arange(n * 2, dtype=torch.float32, device="cuda") + 10 * me
    out = torch.empty_like(x)
    comm.batch_isend_irecv([("send", x, (me + 1) % n), ("recv", out, (me - 1) % n)])
    got = comm.all_to_all(x, in_splits=[2] * n, out_splits=[2] * n)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(n * 2, dtype=torch.float32, device="cuda") + 10 * ((me - 1) % n))
    assert torch.equal(got, torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32, device="cuda") + 10 * j
                                       for j in range(n)]))
    comm.synchronize()


# ---- the bulk form --------------------------------------------------------------------------------
def test_bulk_messages_of_any_alignment(comm):
    """Bulk messages from addresses 1, 8 and 15 bytes past 16-byte alignment into addresses
    15, 8 and 1 bytes past it (the vectors' byte-wise edges on both ends, each apart from
    the other's): bit for bit, the bytes around the output in its buffer still poisoned."""
    import torch

    n, me = comm.size, comm.rank
    nxt, prev = (me + 1) % n, (me - 1) % n
    nbytes = P2P_BULK_MIN_BYTES + 3 * P2P_BULK_CHUNK + 7
    seed = seed_of("p2p-bulk-align")
    for i, skew in enumerate((1, 8, 15)):
        into = 16 - skew
        data = [rank_bytes(nbytes + 16, "uint8", r, seed + i) for r in range(n)]
        out = Bordered(nbytes + 16, "uint8", seed + 10 + i)
        comm.batch_isend_irecv([("send", on_device(data[me], "uint8")[skew:skew + nbytes], nxt),
                                ("recv", out.view[into:into + nbytes], prev)], algorithm="ll")
        torch.cuda.synchronize()
        got = host_bytes(out.view)
        assert_bytes(got[:into], np.full(into, POISON, np.uint8), f"skew {skew}: the bytes before the output")
        assert_bytes(got[into:into + nbytes], data[prev][skew:skew + nbytes], f"skew {skew}")
        assert_bytes(got[into + nbytes:], np.full(16 - into, POISON, np.uint8), f"skew {skew}: the bytes after it")
        out.assert_intact(f"skew {skew}")
    comm.synchronize()


@pytest.mark.parametrize("device_splits", [False, True], ids=["host-splits", "device-splits"])
def test_uneven_all_to_all_with_bulk_parts(comm, device_splits):
    """An all-to-all of rows of 1 KiB whose parts are of both forms (rank s sends rank d
    ``rows(s, d)`` rows: 1 to 3 * 64 + 1, the bulk form from 64 rows; at one rank, 64 then
    193), two rounds: each part bit for bit at its place, the rows past the counts and the
    canaries untouched."""
    import torch

    n, me = comm.size, comm.rank
    row = 256  # float32 elements: 1 KiB
    assert row * 4 * 64 == P2P_BULK_MIN_BYTES
    spare = 3
    for rnd in range(2):
        def rows(s, d, rnd=rnd):
            return (64, 3 * 64 + 1, 1, 63)[(s + 3 * d + rnd) % 4]

        ins = [rows(me, d) for d in range(n)]
        outs_rows = [rows(s, me) for s in range(n)]
        seed = seed_of("p2p-bulk-a2a", rnd)
        data = [rank_bytes(sum(rows(r, d) for d in range(n)) * row, "float32", r, seed) for r in range(n)]
        x = on_device(data[me], "float32", (sum(ins), row))
        out = Bordered((sum(outs_rows) + spare) * row, "float32", seed + 1, shape=(sum(outs_rows) + spare, row))
        if device_splits:
            comm.all_to_all(x, out.view, torch.tensor(ins, device="cuda"),
                            torch.tensor(outs_rows, dtype=torch.int32, device="cuda"), algorithm="ll")
        else:
            comm.all_to_all(x, out.view[:sum(outs_rows)], in_splits=ins, out_splits=outs_rows, algorithm="ll")
        torch.cuda.synchronize()
        got = host_bytes(out.view).reshape(-1, row * 4)
        at = 0
        for s in range(n):
            start = sum(rows(s, d) for d in range(me))
            want = data[s].reshape(-1, row * 4)[start:start + rows(s, me)]
            assert_bytes(got[at:at + rows(s, me)], want, f"round {rnd}: the part from rank {s}")
            at += rows(s, me)
        assert_bytes(got[at:].reshape(-1), np.full(spare * row * 4, POISON, np.uint8), f"round {rnd}: rows past")
        out.assert_intact(f"round {rnd}")
    comm.synchronize()


def test_bulk_graph_replay(comm):
    """A ring batch of a bulk message and an LL one and an all-to-all with device splits of
    bulk parts, captured after an eager call, replayed on new inputs: the kernel advances
    the pairs' message and chunk counts itself."""
    import torch

    from test_gpu_collectives import captured, replayed

    n, me = comm.size, comm.rank
    per = P2P_BULK_MIN_BYTES // 4 + P2P_BULK_CHUNK // 4 + 3  # float32 per part: three chunks
    x = torch.zeros(n * per, dtype=torch.float32, device="cuda")
    r, a, small = torch.empty_like(x), torch.empty_like(x), torch.empty(5, dtype=torch.float32, device="cuda")
    splits = torch.full((n,), per, dtype=torch.int64, device="cuda")

    def calls():
        comm.batch_isend_irecv([("send", x, (me + 1) % n), ("send", x[:5], (me + 1) % n), ("recv", r, (me - 1) % n),
                                ("recv", small, (me - 1) % n)], algorithm="ll")
        comm.all_to_all(x, a, splits, splits, algorithm="ll")

    failures = []
    for base in replayed(captured(calls), x, me, 4):
        with collected(failures):
            assert torch.equal(r, base + 100 * ((me - 1) % n))
            assert torch.equal(small, base[:5] + 100 * ((me - 1) % n))
            assert torch.equal(a, torch.cat([base[per * me:per * me + per] + 100 * j for j in range(n)]))
    assert not failures, failures
    comm.synchronize()


# ---- failures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [64, (P2P_BULK_MIN_BYTES + 3 * P2P_BULK_CHUNK) // 4 + 1], ids=["ll", "bulk"])
def test_a_receive_without_a_send_times_out_and_names_the_peer(world, fresh, count):
    """Every rank posts a receive from the next rank, which sends nothing: every rank raises
    (a timeout naming its peer where its own wait timed out first, the failure passed on
    elsewhere) after about the timeout, its out is poisoned (all-ones bytes; the bulk form:
    every block's chunks), and the CUDA context goes on."""
    import torch

    import ubnext

    c = fresh()
    n, me = c.size, c.rank
    out = torch.zeros(count, dtype=torch.int32, device="cuda")
    t0 = time.monotonic()
    c.batch_isend_irecv([("recv", out, (me + 1) % n)], algorithm="ll")
    caught = raised(c.synchronize)
    waited = time.monotonic() - t0
    # this rank's timeout, or (the bulk form: the group's other blocks wait for its first
    # one, which timed out) another block of the launch that saw the mark first and claimed
    # the record in between the mark and the first block's record (sync.cuh: report)
    timeouts = world.allgather(isinstance(caught, ubnext.CollectiveTimeoutError) and caught.peer == (me + 1) % n
                               or count > 64 and type(caught) is ubnext.BrokenCommunicatorError and caught.rank == me
                               and "a wait timed out" in str(caught))
    assert isinstance(caught, ubnext.BrokenCommunicatorError), caught
    assert any(timeouts), timeouts
    assert waited < TIMEOUT_S + 30, waited
    assert bool((out == -1).all().item()), "a receive that timed out must leave all-ones bytes"
    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert float(t.sum().item()) == 499500.0


def assert_found_by_the_kernel(found, words: str) -> None:
    """SplitError naming ``words`` or, where another block of the same launch saw the
    failure mark and claimed the record in between the kernel's mark and its record
    (sync.cuh: report), the failure passed on, naming the invalid input."""
    import ubnext

    assert isinstance(found, ubnext.BrokenCommunicatorError), found
    if isinstance(found, ubnext.SplitError):
        assert words in str(found), found
    else:
        assert "a call's input was invalid" in str(found), found


#: float32 per row of the split-error tests: 8-byte rows (LL), 64 KiB rows (every part of the bulk form)
ROW_WIDTHS = pytest.mark.parametrize("width", [2, P2P_BULK_MIN_BYTES // 4], ids=["ll", "bulk"])


@ROW_WIDTHS
def test_device_split_errors_raise_after_the_call_and_write_nothing_out_of_bounds(world, fresh, width):
    """Rank 0's in_splits sum past its rows: rank 0 sends every rank a header marking it
    and no data, every wait completes (the bulk form: no receiving block waits for chunks
    never sent), the parts from rank 0 stay poisoned on every other rank (the others' parts
    arrive), no canary changes; rank 0 raises SplitError after the call, the others
    BrokenCommunicatorError at their next call."""
    import torch

    import ubnext

    c = fresh()
    n, me = c.size, c.rank
    x = torch.arange(n * width, dtype=torch.float32, device="cuda").view(n, width) + 100 * me
    out = Bordered(n * width, "float32", 7, shape=(n, width))
    ins = [1] * n
    if me == 0:
        ins[-1] = 1 + n  # past rank 0's n rows
    c.all_to_all(x, out.view, torch.tensor(ins, device="cuda"), torch.ones(n, dtype=torch.int64, device="cuda"),
                 algorithm="ll")
    torch.cuda.synchronize()
    out.assert_intact("a refused all_to_all")
    got = host_bytes(out.view).reshape(n, 4 * width)
    if me != 0:
        assert_bytes(got[0], np.full(4 * width, POISON, np.uint8), "the part of the rank whose splits were wrong")
        for j in range(1, n):
            assert_bytes(got[j], host_bytes(x[me] - 100 * me + 100 * j), f"the part of rank {j}")
    found = raised(c.synchronize) if me == 0 else None
    world.Barrier()  # rank 0 has passed the failure on
    if me != 0:
        def again():
            c.batch_isend_irecv([("send", x, me), ("recv", torch.empty_like(x), me)], algorithm="ll")
            c.synchronize()
        found = raised(again)
    if me == 0:
        assert_found_by_the_kernel(found, "in_splits")
        # the first count past the rows: rank n - 1's (the rows before it leave it 1 of x's n)
        assert not isinstance(found, ubnext.SplitError) or (found.where, found.value) == (n - 1, n + 1), found
    else:
        assert isinstance(found, ubnext.BrokenCommunicatorError), found


@ROW_WIDTHS
def test_disagreeing_device_splits_raise_where_found(world, fresh, width):
    """Rank 0 expects one row more from the last rank than it sends: rank 0 writes nothing
    of that part and raises SplitError naming the rank and the rows sent (the bulk form:
    after reading every chunk sent, of the sender's count, so the sender finishes); at one
    rank, its own part."""
    import torch

    import ubnext

    c = fresh()
    n, me = c.size, c.rank
    x = torch.arange(n * 2 * width, dtype=torch.float32, device="cuda").view(2 * n, width) + 1000 * me
    out = Bordered((2 * n + 1) * width, "float32", 8, shape=(2 * n + 1, width))
    outs = [2] * n
    if me == 0:
        outs[-1] = 3
    c.all_to_all(x, out.view, torch.full((n,), 2, device="cuda"), torch.tensor(outs, device="cuda"), algorithm="ll")
    torch.cuda.synchronize()
    out.assert_intact("a disagreeing all_to_all")
    found = raised(c.synchronize) if me == 0 else None
    world.Barrier()
    if me == 0:
        assert_found_by_the_kernel(found, "other than its out_splits expect")
        assert not isinstance(found, ubnext.SplitError) or (found.where, found.value) == (n - 1, 2), found
        got = host_bytes(out.view).reshape(2 * n + 1, 4 * width)
        assert_bytes(got[2 * (n - 1):].reshape(-1), np.full(3 * 4 * width, POISON, np.uint8), "the disagreeing part")
