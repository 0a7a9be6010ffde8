"""Stream order and thread safety of a communicator's launches, on a recording fake of
the CUDA runtime (no GPU): ``ubnext._interop.streams`` and the argument packs of ``ubnext._engine.launch``."""

from __future__ import annotations

import gc
import threading
import time
import types
import weakref

import pytest
from stream_fakes import FakeContexts, FakeCuda, FakeDriver, bare_communicator, fake_context, fake_kernel, fake_order
from thread_ranks import run_threads

from ubnext import UbnextError
from ubnext._engine import launch as _launch
from ubnext._engine.launch import U64, Launcher, Packed
from ubnext._interop import context as _context
from ubnext._interop import streams as _streams
from ubnext._interop.streams import LEGACY, PER_THREAD, LaunchOrder, order_after

DEVICE = 3
A, B, C = 0x7A00, 0x7B00, 0x7C00  # stream handles


def enter(order, stream, owner=None):
    """One call's section (without launches) on ``stream``."""
    with order:
        order.follow(stream, owner)


def test_calls_on_one_stream_make_no_cuda_call():
    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)
    for _ in range(5):
        enter(order, A)
    assert cuda.calls == []


def test_a_call_on_another_stream_waits_for_the_previous_stream():
    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)
    enter(order, A)
    enter(order, B)
    (event,) = [c[1] for c in cuda.calls if c[0] == "event"]
    assert cuda.calls == [("event", event), ("record", event, A), ("wait", B, event), ("destroy", event)]
    cuda.calls.clear()
    enter(order, B)
    assert cuda.calls == []
    enter(order, A)
    assert [c[0] for c in cuda.calls] == ["event", "record", "wait", "destroy"]
    assert cuda.calls[1][2] == B and cuda.calls[2][1] == A
    assert not cuda.live


def test_both_handles_of_the_legacy_default_stream_are_one_stream():
    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)
    enter(order, 0)
    enter(order, LEGACY)
    enter(order, 0)
    assert cuda.calls == []


def test_no_wait_crosses_the_border_of_a_graph_capture():
    """A capturing stream cannot wait for eager work (nor the reverse) without
    invalidating the capture; within one capture the wait is a graph edge."""
    cuda = FakeCuda(captures={B: 5, C: 5})
    order = LaunchOrder(fake_context(DEVICE), cuda)
    enter(order, A)
    enter(order, B)  # eager -> capturing: left out
    assert cuda.calls == []
    enter(order, C)  # same capture: ordered
    assert [c[0] for c in cuda.calls] == ["event", "record", "wait", "destroy"]
    assert cuda.calls[1][2] == B and cuda.calls[2][1] == C
    cuda.calls.clear()
    cuda.captures[A] = 6
    enter(order, A)  # another capture
    cuda.captures[B] = -1
    enter(order, B)  # invalidated capture
    assert cuda.calls == []


def test_order_after_reports_whether_it_waited():
    cuda = FakeCuda(captures={C: 9})
    assert order_after(A, B, cuda) is True
    assert order_after(A, A, cuda) is False
    assert order_after(0, LEGACY, cuda) is False
    assert order_after(A, C, cuda) is False
    assert [c[0] for c in cuda.calls] == ["event", "record", "wait", "destroy"]


def test_a_failed_record_destroys_its_event_and_leaves_the_section():
    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)
    enter(order, A)
    cuda.fail_record = True
    with pytest.raises(RuntimeError, match="record failed"):
        enter(order, B)
    assert not cuda.live
    cuda.fail_record = False
    done = threading.Event()
    threading.Thread(target=lambda: (enter(order, B), done.set())).start()
    assert done.wait(10), "the section stayed locked after an error"
    assert [c for c in cuda.calls if c[0] == "record"][-1][2] == A  # the wait for A is retried


def order_after_a_call_with_a_stream_object():
    """``(cuda, order, ref)``: a launch order on a recording fake whose last call came on
    stream A with a stream object that only the order holds now, and a weak reference to
    that object."""

    class Stream:
        pass

    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)
    stream = Stream()
    enter(order, A, stream)
    return cuda, order, weakref.ref(stream)


def test_the_previous_stream_object_is_kept_until_the_stream_changes():
    """Its event is recorded when the next call comes on another stream, so the stream
    must not be destroyed meanwhile (CuPy destroys a Stream when it is collected)."""
    cuda, order, ref = order_after_a_call_with_a_stream_object()
    gc.collect()
    assert ref() is not None
    enter(order, B)
    gc.collect()
    assert ref() is None


def test_close_drops_the_previous_stream_object_and_destroys_the_pending_event():
    """After ``close`` the order holds no CUDA object: a closed communicator's objects are
    freed by the garbage collector on any thread, where destroying a stream or an event
    makes a CUDA call on that thread's device (device 0: a context on another rank's GPU)."""
    cuda, order, ref = order_after_a_call_with_a_stream_object()
    order.close()
    gc.collect()
    assert ref() is None
    threading.Thread(target=lambda: enter(order, PER_THREAD)).run()  # leaves an event recorded
    assert cuda.live
    order.close()
    order.close()  # idempotent
    assert not cuda.live


def test_per_thread_default_streams_of_two_threads_are_ordered():
    """cudaStreamPerThread names another stream in each thread: a thread cannot record on
    the previous thread's one, so an event is recorded after each such call."""
    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)

    def in_thread(fn):
        t = threading.Thread(target=fn)
        t.start()
        t.join(10)

    in_thread(lambda: enter(order, PER_THREAD))
    first = cuda.calls[:]
    assert [c[0] for c in first] == ["event", "record"] and first[1][2] == PER_THREAD
    cuda.calls.clear()
    in_thread(lambda: enter(order, PER_THREAD))
    assert cuda.calls[:2] == [("wait", PER_THREAD, first[0][1]), ("destroy", first[0][1])]
    assert [c[0] for c in cuda.calls[2:]] == ["event", "record"]
    cuda.calls.clear()
    enter(order, A)  # this thread names A: it waits for the event of the other thread's last call
    assert [c[0] for c in cuda.calls] == ["wait", "destroy"] and cuda.calls[0][1] == A
    assert not cuda.live


# -- argument packs under contention ------------------------------------------------------

NPARAMS = 6  # (prefix, 4 varying, suffix), all 64-bit
PREFIX, SUFFIX = 0x1111, 0x9999


def values_of(stream: int) -> tuple[int, ...]:
    """The varying arguments a launch on ``stream`` passes (so the launch can check them)."""
    return tuple(stream * 16 + i for i in range(NPARAMS - 2))


def launches_from_threads(monkeypatch, on_launch, section, threads=2, calls=300):
    """``threads`` threads launch one Launcher ``calls`` times each, inside ``section``
    (a LaunchOrder) if given."""
    monkeypatch.setattr(_launch, "_cupy_driver", FakeDriver(NPARAMS, on_launch))
    launcher = Launcher(fake_kernel(), (U64,) * NPARAMS, prefix=(PREFIX,), suffix=(SUFFIX,))

    def run(t):
        for i in range(calls):
            stream = (t + 1) * 100_000 + i
            if section is None:
                launcher(1, 32, stream, *values_of(stream))
            else:
                with section:
                    section.follow(stream)
                    launcher(1, 32, stream, *values_of(stream))

    run_threads(threads, run)


def test_launches_from_two_threads_interleave_without_the_section(monkeypatch):
    """The control: two threads pack the one argument buffer, then both launch; the fake
    launch reads after both packed (a barrier), so one launch sees the other's values."""
    barrier = threading.Barrier(2, timeout=10)
    wrong = []

    def on_launch(stream, read):
        barrier.wait()
        args = read()
        if args != [PREFIX, *values_of(stream), SUFFIX]:
            wrong.append(stream)

    launches_from_threads(monkeypatch, on_launch, None, calls=1)
    assert wrong, "both launches read their own arguments: the check cannot see an interleaving"


def test_launches_in_the_section_keep_their_arguments(monkeypatch):
    cuda = FakeCuda()
    order = LaunchOrder(fake_context(DEVICE), cuda)
    seen, wrong = [], []
    inside = threading.Lock()  # taken by a launch; never contended if the section serializes

    def on_launch(stream, read):
        if not inside.acquire(blocking=False):
            wrong.append(("overlap", stream))
            return
        try:
            time.sleep(0)  # invite a thread switch between pack and launch
            args = read()
            if args != [PREFIX, *values_of(stream), SUFFIX]:
                wrong.append(stream)
            seen.append(stream)
        finally:
            inside.release()

    launches_from_threads(monkeypatch, on_launch, order, threads=4)
    assert not wrong
    assert len(seen) == 4 * 300
    assert not cuda.live
    # every change of stream (every call here) waited for the previous stream
    assert cuda.names().count("wait") == len(seen) - 1


def test_packed_launches_from_two_threads_keep_their_arguments_without_the_section(monkeypatch):
    """A call plan's launch (``Packed``) has a pack of its own, written once: the
    control's interleaving (both threads inside a launch at once) changes nothing, and
    its pack is the one the launcher packs for the same values."""
    barrier = threading.Barrier(2, timeout=10)
    seen, wrong = [], []

    def on_launch(stream, read):
        barrier.wait()
        args = read()
        seen.append(args)
        if args != [PREFIX, *values_of(stream), SUFFIX]:
            wrong.append(stream)

    monkeypatch.setattr(_launch, "_cupy_driver", FakeDriver(NPARAMS, on_launch))
    launcher = Launcher(fake_kernel(), (U64,) * NPARAMS, prefix=(PREFIX,), suffix=(SUFFIX,))
    packed = {t: Packed(launcher, 1, 32, values_of(t)) for t in (A, B)}
    workers = [threading.Thread(target=lambda t=t: [packed[t](t) for _ in range(100)]) for t in (A, B)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert len(seen) == 200 and not wrong
    monkeypatch.setattr(_launch, "_cupy_driver", FakeDriver(NPARAMS, lambda stream, read: seen.append(read())))
    launcher(1, 32, C, *values_of(C))
    Packed(launcher, 1, 32, values_of(C))(C)
    assert seen[-1] == seen[-2] == [PREFIX, *values_of(C), SUFFIX]


# -- the Communicator's wiring ---------------------------------------------------------------


class RecordingNccl:
    """The NCCL engine of a communicator, recording the stream of each all-reduce, and
    whether it was called inside the launch section."""

    def __init__(self, order):
        self.order, self.calls, self.contexts = order, [], []

    def all_reduce(self, src, dst, count, dtype, op, stream):
        self.calls.append((src, dst, count, stream, in_section(self.order)))
        self.contexts.append(self.order.context._driver.current())  # current at the launch


@pytest.fixture
def nccl_comm(monkeypatch):
    """A Communicator of one rank that runs everything on a recording NCCL engine, built
    without a GPU: only what ``all_reduce`` reads is set. Arrays of other frameworks are
    viewed over pointers taken to be device 0's."""
    import cupy

    from ubnext._engine.dispatch import Dispatcher
    from ubnext._environment.config import Config
    from ubnext._interop import arrays as _arrays
    from ubnext._selection.select import Selector, buffer_limits

    cuda = FakeCuda()
    monkeypatch.setattr(_streams, "CUDA", cuda)
    monkeypatch.setattr(_arrays, "_pointer_device", lambda ptr, op, kind: 0)

    def capsule_array(capsule):
        mem = cupy.cuda.UnownedMemory(capsule.ptr, 64, capsule, device_id=0)
        return cupy.ndarray((16,), "float32", memptr=cupy.cuda.MemoryPointer(mem, 0))

    monkeypatch.setattr(_arrays, "_capsule_array", capsule_array)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device=-1: types.SimpleNamespace(ptr=0))
    config = Config.from_env()
    selector = Selector(1, buffer_limits(config), ["nccl"], None, "test")
    order = fake_order()
    monkeypatch.setattr(_context, "_DRIVER", [order.context._driver])  # the section's contexts
    comm = bare_communicator(order, config=config, _selector=selector,
                             _dispatch=Dispatcher(None, selector.limits, order, None, 0))
    comm._dispatch.nccl = RecordingNccl(order)
    yield comm, cuda
    comm._closed = True


def in_section(order) -> bool:
    """Whether ``order``'s section is held (by the caller, in these single-thread tests)."""
    if order._acquire(blocking=False):
        order._release()
        return False
    return True


class Capsule:
    def __init__(self, ptr):
        self.ptr = ptr


class Producer:
    """A DLPack producer recording the stream it is handed."""

    def __init__(self, ptr):
        self.ptr, self.streams = ptr, []

    def __dlpack_device__(self):
        return 2, 0

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        return Capsule(self.ptr)


class Interface:
    """An array with ``__cuda_array_interface__`` produced on ``stream``."""

    def __init__(self, ptr, stream):
        self.__cuda_array_interface__ = {"shape": (16,), "typestr": "<f4", "data": (ptr, False),
                                         "version": 3, "stream": stream}


def test_all_reduce_hands_producers_the_stream_it_launches_on(nccl_comm):
    comm, cuda = nccl_comm
    x, out = Producer(0x10000), Producer(0x20000)
    comm.all_reduce(x, out=out, algorithm="nccl", stream=A)
    assert x.streams == [A] and out.streams == [A]
    assert comm._dispatch.nccl.calls == [(0x10000, 0x20000, 16, A, True)]
    comm.all_reduce(Interface(0x30000, stream=C), out=out, algorithm="nccl", stream=B)
    waits = [c for c in cuda.calls if c[0] == "wait"]
    records = [c for c in cuda.calls if c[0] == "record"]
    # the producer's stream C, then the previous call's stream A, both before the launch on B
    assert [r[2] for r in records] == [C, A] and all(w[1] == B for w in waits)
    assert comm._dispatch.nccl.calls[-1] == (0x30000, 0x20000, 16, B, True)


# -- the device guard: the communicator's context in the section, the caller's given back --------


def test_the_section_makes_the_communicators_context_current_and_gives_the_callers_back():
    contexts = FakeContexts()
    order = fake_order(DEVICE, contexts, FakeCuda())
    mine, other = contexts.of(DEVICE), contexts.of(DEVICE + 1)
    for caller in (other, 0):  # another device's context; none (a thread that never set a device)
        contexts.make_current(caller)
        contexts.changes.clear()
        with order:
            assert contexts.current() == mine
        assert contexts.current() == caller
        assert [c[1] for c in contexts.changes] == [mine, caller]
    contexts.make_current(mine)
    contexts.changes.clear()
    with order:
        order.follow(A)
    assert contexts.changes == [] and contexts.current() == mine  # already current: no switch


def test_a_failed_switch_leaves_the_section():
    contexts = FakeContexts()

    def refuse(handle):
        raise RuntimeError("cuCtxSetCurrent failed")

    contexts.make_current = refuse
    order = fake_order(DEVICE, contexts, FakeCuda())
    with pytest.raises(RuntimeError, match="cuCtxSetCurrent"):
        with order:
            pass
    assert order._acquire(blocking=False), "the section stayed locked after a failed switch"
    order._release()


@pytest.mark.parametrize("caller", ["the communicator's", "another device's", "none"])
@pytest.mark.parametrize("composite", [False, True])
def test_leaving_the_section_gives_the_callers_context_back_whatever_switched_it_inside(caller, composite):
    """Code run in the section (torch's guard exit: cudaSetDevice of torch's idea of the
    device; a library's export) makes another context current: leaving the section makes
    the caller's current again, also where the caller's was the communicator's own (the
    section then switched nothing on entry), and after a composite section's inner calls."""
    contexts = FakeContexts()
    order = fake_order(DEVICE, contexts, FakeCuda())
    mine, foreign = contexts.of(DEVICE), contexts.of(0)
    before = {"the communicator's": mine, "another device's": contexts.of(DEVICE + 1), "none": 0}[caller]
    contexts.make_current(before)
    with (order.composite() if composite else order):
        if composite:
            with order:
                contexts.make_current(foreign)  # inside a call of the composite section
                order.follow(A)  # before its launches: the communicator's again
                assert contexts.current() == mine
                contexts.make_current(foreign)
            assert contexts.current() == foreign  # an inner call's exit leaves the section's state alone
            with order:  # the next call of the composite section: the communicator's again
                assert contexts.current() == mine
                contexts.make_current(foreign)
        else:
            contexts.make_current(foreign)
            order.follow(A)
            assert contexts.current() == mine
            contexts.make_current(foreign)
    assert contexts.current() == before


def test_a_composite_section_takes_its_own_calls_and_keeps_other_threads_out():
    """Its holder's calls enter at once (as often as they come, nested too); another
    thread's call waits until the composite section is left; an ordinary call's section
    still refuses a call from inside it."""
    order = fake_order(DEVICE, FakeContexts(), FakeCuda())
    entered = threading.Event()
    log = []

    def other():
        with order:
            log.append("other")
        entered.set()

    with order.composite():
        with order:
            order.follow(A)
        with order.composite():
            with order:
                order.follow(B)
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.2), "another thread's call came inside the composite section"
        log.append("composite")
    assert entered.wait(10) and log == ["composite", "other"]
    thread.join(10)
    with pytest.raises(UbnextError, match="from inside one of its own calls"):
        with order:
            with order:
                pass
    assert order._depth == 0 and order._acquire(blocking=False)
    order._release()


@pytest.mark.parametrize("where", ["another device current", "new thread without a context",
                                   "new thread, its runtime device without a context"])
def test_a_call_runs_in_the_communicators_context_and_gives_the_callers_back(nccl_comm, where):
    """Also a thread without a context: none afterwards, and the runtime's device for its
    next call as it was (CUDA's runtime takes the device of a context it saw current),
    where setting it back creates no context."""
    comm, _ = nccl_comm
    contexts = comm._order.context._driver
    mine = contexts.of(comm.device)
    caller = contexts.of(comm.device + 2) if where == "another device current" else 0
    runtime = 3 if "runtime device" in where else 0
    contexts.primary.add(runtime)
    after = []

    def call():
        if caller:
            contexts.make_current(caller)
        elif runtime:
            contexts._current.device = runtime
        comm.all_reduce(Producer(0x10000), out=Producer(0x20000), algorithm="nccl", stream=A)
        after.append((contexts.current(), contexts.runtime_device()))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    assert comm._dispatch.nccl.contexts == [mine]
    assert after == [(caller, comm.device + 2 if caller else runtime)]


def test_a_producer_that_switches_contexts_gives_the_section_its_context_back(nccl_comm):
    """XLA's DLPack export makes its own device current on the calling thread: the call's
    section takes its context back before anything is allocated or launched."""
    comm, _ = nccl_comm
    contexts = comm._order.context._driver

    class Switching(Producer):
        def __dlpack__(self, stream=None, max_version=None):
            contexts.make_current(contexts.of(7))
            return super().__dlpack__(stream, max_version)

    comm.all_reduce(Switching(0x10000), out=Producer(0x20000), algorithm="nccl", stream=A)
    assert comm._dispatch.nccl.contexts == [contexts.of(comm.device)]


def test_a_stream_of_another_context_raises_before_anything_is_launched(nccl_comm):
    comm, cuda = nccl_comm
    contexts = comm._order.context._driver
    contexts.streams[B] = contexts.of(comm.device + 1)
    out = Producer(0x20000)
    with pytest.raises(UbnextError, match=r"all_reduce: stream 0x7b00 belongs to another device.*device 0"):
        comm.all_reduce(Producer(0x10000), out=out, algorithm="nccl", stream=B)
    assert comm._dispatch.nccl.calls == [] and out.streams == [] and cuda.calls == []
    for handle in (0, LEGACY, PER_THREAD):  # the current context's default streams: the communicator's
        comm.all_reduce(Producer(0x10000), out=out, algorithm="nccl", stream=handle)
    assert [c[3] for c in comm._dispatch.nccl.calls] == [0, LEGACY, PER_THREAD]


def test_a_call_from_inside_a_call_of_the_same_communicator_raises_instead_of_waiting_for_itself(nccl_comm):
    """Code that a call runs (a producer's export here; a finalizer, a torch subclass)
    calling the same communicator: one clear error, not a thread waiting for itself."""
    comm, _ = nccl_comm

    class Reentrant(Producer):
        def __dlpack__(self, stream=None, max_version=None):
            comm.close()
            return super().__dlpack__(stream, max_version)

    raised = []

    def call():
        try:
            comm.all_reduce(Reentrant(0x10000), out=Producer(0x20000), algorithm="nccl", stream=A)
        except UbnextError as e:
            raised.append(str(e))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the call waited for itself"
    assert len(raised) == 1 and "from inside one of its own calls" in raised[0] and not comm._closed
    comm.all_reduce(Producer(0x10000), out=Producer(0x20000), algorithm="nccl", stream=A)  # the section was left


@pytest.mark.parametrize("size", [1, 2, 5])
def test_the_gpu_tests_small_integer_inputs_sum_exactly(size):
    """gpu_support.small_integers (tests/test_gpu_pdl.py's and test_gpu_streams.py's
    inputs): every rank's float32 input, summed in any order, is the expected sum."""
    import numpy as np
    from gpu_support import small_integers

    for seed in (1, 7, 17):
        parts = [small_integers(types.SimpleNamespace(rank=r, size=size), 1000, seed) for r in range(size)]
        assert all(np.array_equal(p[1], parts[0][1]) and p[0].dtype == np.float32 for p in parts)
        assert np.array_equal(sum(p[0] for p in parts), parts[0][1])
        assert np.array_equal(sum(p[0] for p in reversed(parts)), parts[0][1])
        assert np.array_equal(parts[0][0], (np.arange(1000) * (seed + 3)) % 61 + seed)
