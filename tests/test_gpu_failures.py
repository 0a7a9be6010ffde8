"""Failed collectives on GPUs: a missing or late peer, mismatched calls, overlapping
launches. Each must raise on every rank that takes part, leave poison (NaN) instead of a
plausible result, keep the CUDA context (torch goes on working), and let the process
build a new communicator.

Run at 2 or more ranks with ``mpirun -n 2 python -m pytest -q tests/test_gpu_failures.py``
(ranks may share one GPU); the tests that need a peer skip at 1 rank. A dead peer is
tested in test_gpu_dead_peer.py, outside MPI.
"""

from __future__ import annotations

import time

import pytest
from gpu_support import require_gpu_and_torch

pytestmark = pytest.mark.gpu

TIMEOUT_S = 4.0
#: small buffers: a communicator per test is cheap, and 64K elements of bfloat16 go to the
#: Lamport one-shot while 1M go to the Lamport two-shot
SMALL = dict(timeout_s=TIMEOUT_S, pool_mb=256, staging_mb=16, lamport_max_kb=256, lamport_twoshot_max_kb=4096)


@pytest.fixture(scope="module")
def world():
    """mpi4py's COMM_WORLD, to line the ranks up between failures (a failed
    communicator's own bootstrap is released with it)."""
    require_gpu_and_torch()
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def fresh(world):
    """A new communicator with a short timeout; closed (locally, if broken) afterwards."""
    import ubnext

    comms = []

    def make(**overrides):
        comm = ubnext.Communicator(**{**SMALL, **overrides})
        comms.append(comm)
        return comm

    yield make
    world.Barrier()  # every rank's failure is passed on before any rank decides how to close
    for comm in comms:
        comm.close()
    world.Barrier()


def need_peers(world):
    if world.Get_size() < 2:
        pytest.skip("needs 2 or more ranks (mpirun -n 2)")


def torch_still_works():
    import torch

    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert float(t.sum().item()) == 499500.0
    torch.cuda.synchronize()


def all_nan(t) -> bool:
    import torch

    return bool(torch.isnan(t.float()).all().item())


@pytest.mark.parametrize("algo", ["lamport", "lamport_twoshot", "twoshot"])
def test_a_missing_peer_raises_names_it_and_leaves_poison(world, fresh, algo):
    """Rank 0 calls, rank 1 does not: rank 0's synchronize raises CollectiveTimeoutError
    naming rank 1 after about the timeout, its output is NaN, and every later call
    raises. The other ranks, calling late, give up at once (the failure was passed on)
    and raise BrokenCommunicatorError naming rank 0."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.ones(1 << 16, device="cuda", dtype=torch.bfloat16)
    comm.all_reduce(x, algorithm=algo)  # everyone once: compiled, in step
    comm.synchronize()
    world.Barrier()
    if comm.rank == 0:
        out = torch.zeros_like(x)
        t0 = time.monotonic()
        comm.all_reduce(x, out=out, algorithm=algo)
        with pytest.raises(ubnext.CollectiveTimeoutError) as info:
            comm.synchronize()
        waited = time.monotonic() - t0
        assert info.value.peer is not None and info.value.peer != 0 and info.value.rank == 0, str(info.value)
        assert TIMEOUT_S * 0.9 < waited < TIMEOUT_S + 30, waited
        assert all_nan(out), "a timed-out launch must leave NaN, not partial results"
        with pytest.raises(ubnext.BrokenCommunicatorError):
            comm.all_reduce(x, algorithm=algo)
    world.Barrier()  # rank 0 has failed and passed it on
    if comm.rank != 0:
        out = torch.zeros_like(x)
        t0 = time.monotonic()
        comm.all_reduce(x, out=out, algorithm=algo)
        with pytest.raises(ubnext.BrokenCommunicatorError) as info:
            comm.synchronize()
        assert time.monotonic() - t0 < TIMEOUT_S / 2, "a late rank must give up at once, not time out again"
        assert info.value.rank == 0 and "rank 0 failed first" in str(info.value)
        assert all_nan(out)
    torch_still_works()


def test_a_late_peer_gives_up_at_once(world, fresh):
    """Rank 1 arrives after rank 0 timed out (it was alive, only slow): its launch finds
    the failure passed on and gives up within a second, instead of waiting out a timeout
    of its own."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.ones(4096, device="cuda", dtype=torch.float32)
    comm.all_reduce(x, algorithm="lamport")
    comm.synchronize()
    world.Barrier()
    if comm.rank != 0:
        time.sleep(TIMEOUT_S + 2)  # "saving a checkpoint"
    t0 = time.monotonic()
    out = comm.all_reduce(x, algorithm="lamport")
    with pytest.raises(ubnext.BrokenCommunicatorError):
        comm.synchronize()
    if comm.rank != 0:
        assert time.monotonic() - t0 < 1.5
    assert all_nan(out)
    torch_still_works()


def test_a_broken_communicator_closes_locally_and_a_new_one_works(world, fresh):
    """After a failure close() waits for no rank (rank 0 closes while the others are still
    busy elsewhere), and a new communicator all-reduces exactly."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.ones(4096, device="cuda", dtype=torch.float32)
    comm.all_reduce(x, algorithm="lamport")  # everyone once: compiled, in step
    comm.synchronize()
    world.Barrier()
    if comm.rank == 0:
        comm.all_reduce(x, algorithm="lamport")
        with pytest.raises(ubnext.CollectiveTimeoutError):
            comm.synchronize()
        t0 = time.monotonic()
        comm.close()
        assert time.monotonic() - t0 < 5
    world.Barrier()
    if comm.rank != 0:
        comm.abort()
    world.Barrier()
    again = fresh()
    y = torch.full((4096,), float(again.rank + 1), device="cuda", dtype=torch.float32)
    again.all_reduce(y, out=y)
    again.synchronize()
    assert torch.equal(y, torch.full_like(y, again.size * (again.size + 1) / 2))
    torch_still_works()


MISMATCHES = {
    # case: (what rank 1 changes, whether the kernels can tell it in band)
    "count": (dict(count=(1 << 15) + 8), True),
    "dtype of the same width": (dict(dtype="float16"), True),
    "op": (dict(op="max"), True),
    "dtype of another width": (dict(dtype="float32"), False),  # other Lamport buffers: a timeout
}


@pytest.mark.parametrize("algo", ["lamport", "lamport_twoshot", "twoshot"])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_calls_raise_on_every_rank(world, fresh, algo, case):
    """Rank 1 calls with another count, dtype or op than the others: every rank raises
    (CollectiveMismatchError naming both calls where the kernels compare signatures; a
    timeout where the calls never meet), and no rank gets a plausible result."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    change, in_band = MISMATCHES[case]
    if not in_band and algo == "twoshot":
        in_band = True  # the barrier two-shot's flags do not depend on the dtype
    call = dict(count=1 << 15, dtype="bfloat16", op="sum")
    # every rank compiles both calls' kernels first, with matched calls: a rank that
    # compiles its kernel on the mismatched call alone (seconds) keeps the others waiting
    # past TIMEOUT_S, and they time out before its signature arrives
    for warm in (call, {**call, **change}):
        w = torch.ones(warm["count"], device="cuda", dtype=getattr(torch, warm["dtype"]))
        comm.all_reduce(w, out=w, op=warm["op"], algorithm=algo)
    comm.synchronize()
    if comm.rank == 1:
        call.update(change)
    x = torch.ones(call["count"], device="cuda", dtype=getattr(torch, call["dtype"]))
    out = torch.zeros_like(x)
    comm.all_reduce(x, out=out, op=call["op"], algorithm=algo)
    with pytest.raises(ubnext.BrokenCommunicatorError) as info:
        comm.synchronize()
    if in_band:
        assert isinstance(info.value, ubnext.CollectiveMismatchError) or "failed first" in str(info.value), \
            str(info.value)
    assert all_nan(out), f"rank {comm.rank} got a result from mismatched calls"
    torch_still_works()


@pytest.mark.parametrize("algo", ["ll", "copy"])
def test_ranks_naming_different_roots_raise_on_every_rank(world, fresh, algo):
    """Rank 1 names itself the root of a broadcast, the others rank 0: the root is in the
    call's signature, so every rank raises (CollectiveMismatchError where it compared the
    signatures itself) instead of keeping data of the wrong root."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.full((1024,), float(comm.rank + 1), device="cuda", dtype=torch.float32)
    out = torch.zeros_like(x)
    comm.broadcast(x, root=0, out=out, algorithm=algo)  # matched first: compiles, makes the copy form's area
    comm.synchronize()
    assert torch.equal(out, torch.ones_like(x))
    with pytest.raises(ubnext.BrokenCommunicatorError) as info:
        comm.broadcast(x, root=1 if comm.rank == 1 else 0, out=out, algorithm=algo)
        comm.synchronize()
    assert isinstance(info.value, ubnext.CollectiveMismatchError) or "failed first" in str(info.value), \
        str(info.value)
    torch_still_works()


@pytest.mark.parametrize("algo", ["lamport_twoshot", "twoshot"])
def test_reduce_scatter_against_all_reduce_raises_on_every_rank(world, fresh, algo):
    """Rank 0 reduce-scatters what the others all-reduce (the same bytes, the same kernel
    family and buffers): the in-band signatures differ, every rank raises and holds NaN."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.ones(comm.size * 4096, device="cuda", dtype=torch.bfloat16)
    if comm.rank == 0:
        out = comm.reduce_scatter(x, algorithm=algo)
    else:
        out = comm.all_reduce(x, algorithm=algo)
    with pytest.raises(ubnext.BrokenCommunicatorError) as info:
        comm.synchronize()
    assert isinstance(info.value, ubnext.CollectiveMismatchError) or "failed first" in str(info.value), \
        str(info.value)
    assert all_nan(out), f"rank {comm.rank} got a result from mismatched calls"
    torch_still_works()


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("algo", ["lamport_twoshot", "twoshot"])
def test_a_missing_peer_of_a_reduce_scatter_or_all_gather_times_out(world, fresh, algo, collective):
    """Rank 0 calls, the others do not: rank 0 raises CollectiveTimeoutError after about
    the timeout; the others, calling late, give up at once."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.ones(comm.size * 4096, device="cuda", dtype=torch.bfloat16)
    call = getattr(comm, collective)
    call(x, algorithm=algo)  # everyone once: compiled, in step
    comm.synchronize()
    world.Barrier()
    if comm.rank == 0:
        t0 = time.monotonic()
        out = call(x, algorithm=algo)
        with pytest.raises(ubnext.CollectiveTimeoutError):
            comm.synchronize()
        assert TIMEOUT_S * 0.9 < time.monotonic() - t0 < TIMEOUT_S + 30
        if collective == "reduce_scatter":  # the all-gather's own slice is this rank's input
            assert all_nan(out), "a timed-out launch must leave NaN, not partial results"
    world.Barrier()
    if comm.rank != 0:
        t0 = time.monotonic()
        call(x, algorithm=algo)
        with pytest.raises(ubnext.BrokenCommunicatorError):
            comm.synchronize()
        assert time.monotonic() - t0 < TIMEOUT_S / 2, "a late rank must give up at once, not time out again"
    torch_still_works()


def test_a_late_rank_gives_up_though_the_watchdog_announced_the_failure(world, fresh, monkeypatch):
    """Rank 0's watchdog sees the timeout first and announces it slowly; rank 0's
    synchronize must not raise before that announce is done: the late ranks' Lamport
    all-gather finds every slice present (rank 0's failed launch pushed its own) and would
    complete without failing if it did not find its families marked broken."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    x = torch.ones(comm.size * 4096, device="cuda", dtype=torch.bfloat16)
    comm.all_gather(x, algorithm="lamport_twoshot")
    comm.synchronize()
    world.Barrier()
    if comm.rank == 0:
        node = comm._node
        announce = node.announce

        def slow(kind, rank):
            time.sleep(3.0)
            announce(kind, rank)

        monkeypatch.setattr(node, "announce", slow)
        t0 = time.monotonic()
        comm.all_gather(x, algorithm="lamport_twoshot")
        time.sleep(TIMEOUT_S + 1.5)  # the watchdog (a look every 0.5 s) sees the failure first
        with pytest.raises(ubnext.CollectiveTimeoutError):
            comm.synchronize()  # during the watchdog's announce
        assert time.monotonic() - t0 < TIMEOUT_S + 30
    world.Barrier()
    if comm.rank != 0:
        t0 = time.monotonic()
        comm.all_gather(x, algorithm="lamport_twoshot")
        with pytest.raises(ubnext.BrokenCommunicatorError):
            comm.synchronize()
        assert time.monotonic() - t0 < TIMEOUT_S / 2, "a late rank must give up at once, not time out again"
    torch_still_works()


def test_mismatched_counts_on_different_algorithms_raise_on_every_rank(world, fresh):
    """Counts on either side of the one-shot's limit put the ranks on different kernels,
    which never meet: every rank raises (a timeout, or the failure passed on)."""
    import torch

    import ubnext

    need_peers(world)
    comm = fresh()
    count = 1 << 10 if comm.rank == 0 else 1 << 20
    assert comm.select(2 << 10, "bfloat16") != comm.select(2 << 20, "bfloat16")
    x = torch.ones(count, device="cuda", dtype=torch.bfloat16)
    out = comm.all_reduce(x)
    with pytest.raises(ubnext.BrokenCommunicatorError):
        comm.synchronize()
    assert all_nan(out)
    torch_still_works()


def test_mismatch_costs_nothing_when_calls_agree(world, fresh):
    """The in-band check does not get in the way: agreeing calls of every kind give exact
    results on every rank (the signature differs per call, never per rank)."""
    import torch

    comm = fresh()
    for algo in ("lamport", "lamport_twoshot", "twoshot"):
        for count in (1, 7, 4096, (1 << 15) + 3):
            x = torch.full((count,), float(comm.rank + 1), device="cuda", dtype=torch.float32)
            comm.all_reduce(x, out=x, algorithm=algo)
            comm.synchronize()
            assert torch.equal(x, torch.full_like(x, comm.size * (comm.size + 1) / 2)), (algo, count)


def test_a_graph_replayed_beside_eager_calls_is_detected(world, fresh):
    """A CUDA graph of an all-reduce replayed on one stream while an eager call of the same
    communicator runs on another (the host cannot order a replay): the two launches
    overlap on the GPU, and that is reported as ConcurrentUseError instead of passing
    silently. The replayed launch is long (64 MiB through the barrier two-shot) and the
    eager call is issued right behind it, on the stream of the previous eager call (so
    that the communicator adds no wait): they overlap."""
    import torch

    import ubnext

    comm = fresh()
    x = torch.ones(1 << 25, device="cuda", dtype=torch.bfloat16)
    y = torch.ones(1 << 25, device="cuda", dtype=torch.bfloat16)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    comm.all_reduce(x, out=x, algorithm="twoshot", stream=a)  # compiled before the capture
    comm.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=a):
        comm.all_reduce(x, out=x, algorithm="twoshot")
    comm.all_reduce(y, out=y, algorithm="twoshot", stream=b)  # the last eager call: on b
    comm.synchronize()
    world.Barrier()
    with torch.cuda.stream(a):
        graph.replay()
    comm.all_reduce(y, out=y, algorithm="twoshot", stream=b)
    with pytest.raises(ubnext.BrokenCommunicatorError) as info:
        comm.synchronize()
    if world.Get_size() == 1:
        assert isinstance(info.value, ubnext.ConcurrentUseError), str(info.value)
    torch_still_works()
