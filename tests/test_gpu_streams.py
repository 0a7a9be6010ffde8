"""GPU: calls of one communicator on several streams and from several threads.

Every result is exact: inputs are small integers, so every sum is exact in float32 and
does not depend on the order of the reduction. Runs at any world size
(``mpirun -n N python -m pytest tests/test_gpu_streams.py``); the tests that show the
missing stream order deterministically need 2 or more ranks (see
``test_calls_on_two_streams_run_in_issue_order``).
"""

from __future__ import annotations

import threading

import pytest
from gpu_support import small_integers, small_torch_communicator

pytestmark = pytest.mark.gpu

SLEEP_MS = 200  # a delay far longer than any call here


comm = pytest.fixture(scope="module", name="comm")(small_torch_communicator)


@pytest.fixture(scope="module")
def cycles_per_ms(comm):
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured."""
    import torch

    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def sleep(ms: float, cycles_per_ms: float) -> None:
    """Delays the current torch stream by about ``ms`` milliseconds (host does not wait)."""
    import torch

    torch.cuda._sleep(int(ms * cycles_per_ms))


def inputs(comm, n: int, seed: int):
    """``gpu_support.small_integers``: this rank's input of ``n`` small integers (float32)
    and the exact sum over the ranks, as CUDA torch tensors of the current device."""
    import torch

    return tuple(torch.from_numpy(a).to("cuda") for a in small_integers(comm, n, seed))


def usable(comm, algorithm: str, nbytes: int) -> None:
    if algorithm != "auto" and not comm._selector.fits(algorithm, nbytes):
        pytest.skip(f"{algorithm} cannot take {nbytes} bytes on this communicator")


SIZES = {"lamport": 20_000, "lamport_twoshot": 300_003, "twoshot": 300_003, "auto": 300_003}


@pytest.mark.parametrize("how", ["current", "stream="])
@pytest.mark.parametrize("kind", ["plain", "symmetric"])
@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot", "auto"])
def test_calls_on_two_streams_run_in_issue_order(comm, cycles_per_ms, algorithm, kind, how):
    """Call A is issued on stream A, then call B on stream B. Even ranks delay stream A,
    odd ranks stream B, before the calls. The calls share the launch states, Lamport
    buffers and staging slot, so they must run in issue order on every rank: without a
    wait between the streams, even ranks run B first and pair it with the odd ranks' A,
    and both results are wrong (at 1 rank both calls are exact either way, since a lone
    rank pairs with nobody; ``test_overlapping_staged_calls_on_two_streams`` covers it)."""
    import torch

    n = SIZES[algorithm]
    usable(comm, algorithm, n * 4)
    xa, want_a = inputs(comm, n, seed=1)
    xb, want_b = inputs(comm, n, seed=2)
    if kind == "symmetric":  # in place on the pool: no staging
        a, b = comm.empty(n, "float32", "torch"), comm.empty(n, "float32", "torch")
        a.copy_(xa)
        b.copy_(xb)
        xa, xb, oa, ob = a, b, a, b
    else:  # separate arrays: through the staging slot where the kernel needs it
        oa = torch.full((n,), float("nan"), device="cuda")
        ob = torch.full((n,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    late = sa if comm.rank % 2 == 0 else sb
    with torch.cuda.stream(late):
        sleep(SLEEP_MS, cycles_per_ms)
    for x, out, s in ((xa, oa, sa), (xb, ob, sb)):
        if how == "current":
            with torch.cuda.stream(s):
                comm.all_reduce(x, out=out, algorithm=algorithm)
        else:
            comm.all_reduce(x, out=out, algorithm=algorithm, stream=s)
    torch.cuda.synchronize()
    assert torch.equal(oa, want_a), f"call A ({algorithm}) is wrong"
    assert torch.equal(ob, want_b), f"call B ({algorithm}) is wrong"


@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot"])
def test_fused_calls_on_two_streams_run_in_issue_order(comm, cycles_per_ms, algorithm):
    """As above for all_reduce_add_rmsnorm: each of the two calls must give the bits it
    gives when it runs alone (the kernels are deterministic)."""
    import torch

    rows, hidden = (4, 1024) if algorithm == "lamport" else (64, 4096)
    usable(comm, algorithm, rows * hidden * 4)
    cases = []
    for seed in (11, 12):
        x, _ = inputs(comm, rows * hidden, seed)
        residual = (torch.arange(rows * hidden, device="cuda", dtype=torch.float32) % (seed + 2)).view(rows, hidden)
        weight = torch.arange(hidden, device="cuda", dtype=torch.float32) % 3 + 1
        cases.append((x.view(rows, hidden), residual, weight))
    alone = []
    for x, residual, weight in cases:
        normed, summed = comm.all_reduce_add_rmsnorm(x, residual, weight, algorithm=algorithm)
        torch.cuda.synchronize()
        alone.append((normed, summed))
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(sa if comm.rank % 2 == 0 else sb):
        sleep(SLEEP_MS, cycles_per_ms)
    together = []
    for (x, residual, weight), s in zip(cases, (sa, sb), strict=True):
        with torch.cuda.stream(s):
            together.append(comm.all_reduce_add_rmsnorm(x, residual, weight, algorithm=algorithm))
    torch.cuda.synchronize()
    for call, ((n1, r1), (n2, r2)) in enumerate(zip(alone, together, strict=True)):
        assert torch.equal(r1, r2) and torch.equal(n1, n2), f"call {call} ({algorithm}) differs from its result alone"


def test_overlapping_staged_calls_on_two_streams(comm, cycles_per_ms):
    """At any world size: two calls of several staging chunks each, on two streams, the
    first one delayed by half a call. Without a wait between the streams, the second
    half of call B runs while call A copies its chunks into the same staging slot."""
    import torch

    n = 8 << 20  # 32 MiB of float32: 4 chunks of the 8 MiB staging slot
    usable(comm, "twoshot", n * 4)
    xa, want_a = inputs(comm, n, seed=3)
    xb, want_b = inputs(comm, n, seed=4)
    oa, ob = torch.empty_like(xa), torch.empty_like(xb)
    comm.all_reduce(xa, out=oa, algorithm="twoshot")  # first use compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    comm.all_reduce(xa, out=oa, algorithm="twoshot")
    end.record()
    end.synchronize()
    half_ms = start.elapsed_time(end) / 2
    for _ in range(5):
        oa.fill_(float("nan"))
        ob.fill_(float("nan"))
        torch.cuda.synchronize()
        sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(sa):
            sleep(half_ms, cycles_per_ms)
            comm.all_reduce(xa, out=oa, algorithm="twoshot")
        with torch.cuda.stream(sb):
            comm.all_reduce(xb, out=ob, algorithm="twoshot")
        torch.cuda.synchronize()
        assert torch.equal(oa, want_a) and torch.equal(ob, want_b)


# -- stream= and the caching allocator -------------------------------------------------------
#
# torch's caching allocator hands a freed block to the next allocation on the stream that
# allocated it, in that stream's order only. Blocks above 10 MiB have segments of their own
# and are reused whole: after empty_cache(), a freed 16 MiB block is the only one a new 16
# MiB tensor can take, so these tests see exactly whether a block was reused too early.

BIG = 4 << 20  # float32 elements: 16 MiB; the two-shot takes it through the staging slot


def test_an_input_dropped_at_once_is_not_reused_before_the_call_reads_it(comm, cycles_per_ms):
    """A call on stream S (delayed) reads x; the caller drops x and allocates on its
    current stream at once. Unless x is recorded on S, the new tensor takes x's memory
    and is written before S reads it."""
    import torch

    x, want = inputs(comm, BIG, seed=5)
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        sleep(SLEEP_MS, cycles_per_ms)
    comm.all_reduce(x, out=out, algorithm="twoshot", stream=s)
    del x
    y = torch.full((BIG,), 1000.0, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(y, torch.full_like(y, 1000.0))


def test_an_out_dropped_at_once_is_not_reused_before_the_call_writes_it(comm, cycles_per_ms):
    import torch

    x, _ = inputs(comm, BIG, seed=6)
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        sleep(SLEEP_MS, cycles_per_ms)
    comm.all_reduce(x, out=out, algorithm="twoshot", stream=s)
    del out
    y = torch.full((BIG,), 7.0, device="cuda")  # must not be where the delayed call writes
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 7.0))


def test_a_new_out_does_not_take_memory_still_read_on_the_current_stream(comm, cycles_per_ms):
    """The current stream is delayed, then reads z, which the caller drops at once; a
    call on stream S (not delayed) allocates its out. Allocated on the current stream,
    the out would take z's memory and be written before the current stream reads z."""
    import torch

    x, want = inputs(comm, BIG, seed=7)
    z = torch.full((BIG,), 5.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    sleep(SLEEP_MS, cycles_per_ms)
    w = z.clone()  # runs after the delay
    del z
    s = torch.cuda.Stream()
    got = comm.all_reduce(x, algorithm="twoshot", stream=s)
    torch.cuda.synchronize()
    assert torch.equal(w, torch.full_like(w, 5.0))
    assert torch.equal(got, want)


# -- CUDA graphs among eager calls on other streams --------------------------------------------


def test_capture_between_eager_calls_on_another_stream(comm):
    """The stream order must not break a capture: the wait for the previous (eager)
    stream is left out while capturing, and a replay is ordered by the caller."""
    import torch

    n = 20_000
    x, want = inputs(comm, n, seed=8)
    out = torch.empty_like(x)
    eager = torch.cuda.Stream()
    eager.wait_stream(torch.cuda.current_stream())  # x, want and out were made on the current stream
    with torch.cuda.stream(eager):
        comm.all_reduce(x, out=out)  # first use compiles; the last stream is `eager`
    eager.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(x, out=out)
    for i in range(10):
        out.fill_(float("nan"))
        g.replay()
        eager.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(eager):
            assert torch.equal(out, want), f"replay {i}"
            out2 = comm.all_reduce(x)
        torch.cuda.current_stream().wait_stream(eager)
        torch.cuda.synchronize()
        assert torch.equal(out2, want), f"eager call after replay {i}"


# -- threads ---------------------------------------------------------------------------------


def test_calls_from_two_threads_in_turns(comm):
    """Two threads (as PyTorch's backward threads) call all_reduce on their own tensors
    and streams. Ranks must issue collectives in the same order, so the threads take
    turns (the user's convention); each call's launches then run as one section and in
    issue order across the threads' streams."""
    import torch

    calls = 200
    sizes = [7, 4096, 20_000, 300_003]
    turn = threading.Condition()
    state = {"next": 0}
    errors = []

    def worker(t: int):
        try:
            torch.cuda.set_device(comm.device)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                cases = [inputs(comm, n, seed=10 + t * 10 + i) for i, n in enumerate(sizes)]
                outs = [torch.empty_like(x) for x, _ in cases]
            stream.synchronize()
            for k in range(calls):
                with turn:
                    if not turn.wait_for(lambda: state["next"] % 2 == t or errors, timeout=300):
                        raise TimeoutError(f"thread {t} waited 300 s for its turn")
                    if errors:
                        return
                    (x, want), out = cases[k % len(sizes)], outs[k % len(sizes)]
                    with torch.cuda.stream(stream):
                        out.fill_(float("nan"))
                        comm.all_reduce(x, out=out)
                    state["next"] += 1
                    turn.notify_all()
                if k % 16 == 15:  # every size has been reduced: each out holds its latest result
                    stream.synchronize()
                    for (x, want), o in zip(cases, outs, strict=True):
                        if not torch.equal(o, want):
                            raise AssertionError(f"thread {t}, calls up to {k}: wrong result for {x.numel()} elements")
            stream.synchronize()
        except BaseException as e:  # reported by the test
            with turn:
                errors.append(e)
                turn.notify_all()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    assert not errors, errors
    assert state["next"] == 2 * calls
