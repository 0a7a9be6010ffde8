"""What holds a node's memory (CPU only, a recording fake driver; ranks as threads): arrays
from ``empty()`` keep this rank's segment and the address range, captured CUDA graphs the
whole pool and the failure words, until the last holder is gone (``_engine.holders``).

The graphs' user objects are the fake's (``GraphFakeDriver``); their destructor is the real
one, libc's ``sem_post`` on ubnext's semaphore, called through ctypes from a thread of the
fake as CUDA's internal thread would.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
from fake_driver import GraphFakeDriver
from stream_fakes import FakeContexts, fake_context
from test_gate import StubDevice, StubEngine, StubFailureRecords, StubStream
from thread_ranks import raise_first, run_ranks

from ubnext._environment.config import Config
from ubnext._environment.nvls_gate import NvlsDecision
from ubnext._protocol.errors import CudaError

STREAM = 0x5000  # rank r captures on STREAM + r
WAIT_S = 5.0


class Records(StubFailureRecords):
    """Failure words that say whether they were freed."""

    def __init__(self, names):
        super().__init__(names)
        self.freed = False

    def close(self):
        self.freed = True

    def error(self, op, timeout_s):
        return None


@pytest.fixture
def make_nodes(monkeypatch):
    """``make_nodes(fake, body, n=2, nvls=False)``: a Node per thread rank on ``fake``, each
    rank then running ``body(node, rank)`` (collective parts go there); returns
    ``[(node, contexts, what body returned)]``."""
    import cupy

    import ubnext._engine.node as node_module
    from ubnext._interop import streams as _streams

    monkeypatch.setattr(node_module, "Engine", StubEngine)
    monkeypatch.setattr(node_module, "FailureRecords", Records)
    monkeypatch.setattr(cupy.cuda, "Device", StubDevice)
    monkeypatch.setattr(cupy.cuda, "Stream", StubStream)
    config = Config(nvls="1", pool_mb=16, staging_mb=1, lamport_max_kb=64, lamport_twoshot_max_kb=512)

    def make(fake, body=lambda node, rank: None, n=2, nvls=False):
        monkeypatch.setattr(_streams, "CUDA", type("Capture", (), {"capture": staticmethod(fake.capture_id)})())

        def rank(boot):
            contexts = FakeContexts()
            node = node_module.Node(boot, fake_context(boot.rank, contexts), config,
                                    NvlsDecision(nvls, "test"), driver=fake)
            return node, contexts, body(node, boot.rank)

        return raise_first(run_ranks(n, rank))

    return make


def segment(node, rank: int) -> int:
    return node.pool._base + rank * node.pool.stride


def mapped(fake, node) -> list[int]:
    """The local ranks whose segments ``node``'s range maps."""
    return [r for r in range(node.pool.local_size) if segment(node, r) in fake.mappings]


def reserved(fake, node) -> bool:
    return node.pool._base in fake.reservations


def eventually(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)


def test_close_without_holders_releases_everything_at_once(make_nodes):
    fake = GraphFakeDriver()
    nodes = make_nodes(fake)
    for node, contexts, _ in nodes:
        node.close(local=True)
        assert not node.holds_memory and node.failures.freed
        released = []
        node.on_release(lambda: released.append(True))
        assert released  # at once: the communicator gives its context's retain back now
    assert fake.leaks() == []


def test_close_with_a_live_array_unmaps_the_peers_and_keeps_the_own_segment(make_nodes):
    """An array of the pool outlives close: this rank's segment stays mapped and the address
    range reserved (no later reservation can take it), the peers' segments go at once; the
    rest goes when the array does."""
    fake = GraphFakeDriver()
    nodes = make_nodes(fake, lambda node, rank: node.alloc(4096))
    released = []
    for rank, (node, contexts, block) in enumerate(nodes):
        node.close(local=True)
        assert mapped(fake, node) == [rank] and reserved(fake, node)
        assert node.holds_memory and node.failures.freed
        node.on_release(lambda rank=rank: released.append(rank))
        assert released == []
    assert len(fake.handles) == 2  # each rank's own; the imported ones released
    blocks = [block for _, _, block in nodes]
    nodes = [(node, contexts) for node, contexts, _ in nodes]
    del block
    blocks.pop(0)
    gc.collect()
    (node0, contexts0), (node1, _) = nodes
    assert mapped(fake, node0) == [] and not reserved(fake, node0) and not node0.holds_memory
    assert released == [0]
    assert mapped(fake, node1) == [1]
    blocks.clear()
    gc.collect()
    assert fake.leaks() == []


def test_the_arrays_own_segment_goes_with_the_last_of_them(make_nodes):
    fake = GraphFakeDriver()
    nodes = make_nodes(fake, lambda node, rank: [node.alloc(4096), node.alloc(256)], n=1)
    node, _, blocks = nodes[0]
    node.close(local=True)
    blocks.pop()
    gc.collect()
    assert mapped(fake, node) == [0]
    blocks.pop()
    gc.collect()
    assert fake.leaks() == []


def test_a_failed_release_at_close_is_raised_after_every_step(make_nodes):
    fake = GraphFakeDriver()
    node = make_nodes(fake, n=1)[0][0]
    fake.fail_on("cuMemAddressFree")
    with pytest.raises(CudaError, match="^cuMemAddressFree"):
        node.close(local=True)
    assert [leak.split()[0] for leak in fake.leaks()] == ["reservation"]


def capture(fake, node, rank: int, calls: int = 2) -> int:
    """Rank ``rank`` captures ``calls`` calls of its node into a new graph; returns it."""
    stream = STREAM + rank
    graph = fake.begin_capture(stream)
    for _ in range(calls):
        node.hold(stream)
    fake.end_capture(stream)
    return graph


def test_a_captured_graph_holds_the_whole_pool_until_it_is_destroyed(make_nodes):
    """One user object per capture however many calls it joined; after close the graph
    keeps every segment, the multicast range and the failure words mapped; destroying it
    releases all (on the graphs' thread, woken by the destructor's post)."""
    fake = GraphFakeDriver()
    nodes = make_nodes(fake, lambda node, rank: capture(fake, node, rank), nvls=True)
    assert fake.names().count("cuUserObjectCreate") == 2 and fake.live_objects() == 2
    for node, _, _ in nodes:
        node.hold(STREAM + 7)  # not being captured: nothing held
        node.close(local=True)
        assert mapped(fake, node) == [0, 1] and not node.failures.freed and node.holds_memory
        assert any(b for mc in fake.multicast.values() for b in mc.bindings)
    for node, contexts, graph in nodes:
        fake.destroy_graph(graph)
        eventually(lambda: not node.holds_memory, "the graph's memory released")
        assert node.failures.freed
        assert node.graphs.live == 0
        eventually(lambda: node.graphs._signal is None, "the graphs' thread ended, its semaphore freed")
    eventually(lambda: fake.leaks() == [], f"no leak: {fake.leaks()}")


def test_the_last_of_several_graphs_releases_after_close(make_nodes):
    fake = GraphFakeDriver()
    nodes = make_nodes(fake, lambda node, rank: [capture(fake, node, rank) for _ in range(3)])
    for rank, (node, _, graphs) in enumerate(nodes):
        node.close(local=True)
        for graph in graphs[:-1]:
            fake.destroy_graph(graph)
        eventually(lambda: node.graphs.live == 1, "two graphs counted gone")
        time.sleep(0.05)
        assert mapped(fake, node) == [0, 1] and not node.failures.freed and node.holds_memory
        fake.destroy_graph(graphs[-1])
        eventually(lambda: not node.holds_memory, "released with the last graph")
        assert node.failures.freed
    eventually(lambda: fake.leaks() == [], f"no leak: {fake.leaks()}")


def test_a_graph_destroyed_before_the_arrays_go_leaves_them_their_segment(make_nodes):
    fake = GraphFakeDriver()
    nodes = make_nodes(fake, lambda node, rank: (capture(fake, node, rank, 1), node.alloc(4096)))
    held = []
    for rank, (node, _, (graph, block)) in enumerate(nodes):
        node.close(local=True)
        fake.destroy_graph(graph)
        eventually(lambda: node.failures.freed, "the peers' part released")
        assert mapped(fake, node) == [rank] and reserved(fake, node)
        held.append(block)
    del block
    nodes = [n for n, _, _ in nodes]
    held.clear()
    gc.collect()
    assert fake.leaks() == [] and not any(n.holds_memory for n in nodes)


def test_graphs_destroyed_while_the_node_is_open_hold_nothing_at_close(make_nodes):
    fake = GraphFakeDriver()
    nodes = make_nodes(fake, lambda node, rank: [capture(fake, node, rank) for _ in range(3)])
    for node, _, graphs in nodes:
        assert node.graphs.live == 3
        for graph in graphs:
            fake.destroy_graph(graph)
        eventually(lambda: node.graphs.live == 0, "every graph counted")
        node.close(local=True)
        assert not node.holds_memory
        eventually(lambda: node.graphs._signal is None, "the graphs' thread woken by close, ended")
    assert fake.leaks() == [] and fake.names().count("cuUserObjectCreate") == 6


def test_a_failed_retain_holds_nothing_and_leaves_the_count_right(make_nodes):
    fake = GraphFakeDriver()
    fake.fail_on("cuGraphRetainUserObject")
    node = make_nodes(fake, n=1)[0][0]
    graph = fake.begin_capture(STREAM)
    with pytest.raises(CudaError, match="^cuGraphRetainUserObject"):
        node.hold(STREAM)
    assert fake.live_objects() == 0  # released again: its destructor posted
    eventually(lambda: node.graphs.live == 0, "the released object counted")
    node.hold(STREAM)  # the same capture, tried again
    fake.end_capture(STREAM)
    node.close(local=True)
    assert node.holds_memory
    fake.destroy_graph(graph)
    eventually(lambda: fake.leaks() == [], "released with the graph")


class FakeNccl:
    """Stands in for ``_engine.nccl.NcclComm``: records its work and how it ended (destroyed
    by ``close``, aborted), on which thread, with which context current."""

    made: list = []
    contexts: FakeContexts | None = None  # the fixture's

    def __init__(self, bootstrap, device):
        self.work, self.ended = [], None
        FakeNccl.made.append(self)

    def connect(self, op="nccl.connect"):
        pass

    def broadcast(self, *args):
        assert self.ended is None, "work on an ended NCCL communicator"
        self.work.append(args)

    def _end(self, how):
        self.ended = (how, threading.current_thread().name, FakeNccl.contexts.current())

    def close(self):
        self._end("destroyed")

    def abort(self):
        self._end("aborted")


@pytest.fixture
def nccl_comm(monkeypatch):
    """``(comm, dispatch, fake, contexts)``: a bare communicator without a node (NCCL only)
    on a fake context of device 0, its Dispatcher's graphs on ``fake`` (a GraphFakeDriver),
    its NCCL communicator a FakeNccl."""
    from stream_fakes import bare_communicator, fake_order

    from ubnext._engine import nccl as _nccl
    from ubnext._engine.dispatch import Dispatcher
    from ubnext._interop import streams as _streams

    fake = GraphFakeDriver()
    monkeypatch.setattr(_streams, "CUDA", type("Capture", (), {"capture": staticmethod(fake.capture_id)})())
    monkeypatch.setattr(_nccl, "NcclComm", FakeNccl)
    contexts = FakeNccl.contexts = FakeContexts()
    order = fake_order(0, contexts)
    dispatch = Dispatcher(None, {}, order, None, 0, driver=fake)
    return bare_communicator(order, _dispatch=dispatch), dispatch, fake, contexts


def broadcast(dispatch, order, stream: int = STREAM) -> None:
    """What ``broadcast(algorithm="nccl")`` does in its section."""
    with order:
        dispatch.nccl_for(stream, None).broadcast(1, 2, 3, "float32", 0, stream)


def test_a_graph_of_nccl_work_keeps_the_nccl_communicator_until_it_is_destroyed(nccl_comm):
    """A graph that captured NCCL work (one user object per capture) replays on the NCCL
    communicator after close(): close leaves it, and the context's retain, to the graph; the
    graph destroyed, it is aborted (local) on the graphs' thread with the context current,
    then the retain goes."""
    comm, dispatch, fake, contexts = nccl_comm
    broadcast(dispatch, comm._order)  # eager: connects NCCL, no graph
    graph = fake.begin_capture(STREAM)
    broadcast(dispatch, comm._order)
    broadcast(dispatch, comm._order)
    fake.end_capture(STREAM)
    nccl = FakeNccl.made[-1]
    assert len(nccl.work) == 3 and fake.names().count("cuUserObjectCreate") == 1
    comm.close()
    time.sleep(0.05)
    assert nccl.ended is None, "a graph replaying NCCL work would use a destroyed communicator"
    assert contexts.retained[0] == 1
    fake.destroy_graph(graph)
    eventually(lambda: nccl.ended is not None, "the NCCL communicator released with the graph")
    assert nccl.ended == ("aborted", "ubnext-graphs", FakeContexts.of(0))
    eventually(lambda: contexts.retained[0] == 0, "the context's retain given back after NCCL's")
    eventually(lambda: dispatch.graphs._signal is None, "the graphs' thread ended, its semaphore freed")
    assert fake.leaks() == []


@pytest.mark.parametrize("how", ["close", "abort"])
def test_without_a_live_graph_of_nccl_work_the_nccl_communicator_goes_at_once(nccl_comm, how):
    """No graph captured NCCL work, or the one that did is gone before close: close destroys
    the NCCL communicator (abort aborts it) at once, on the closing thread (abort's)."""
    comm, dispatch, fake, contexts = nccl_comm
    broadcast(dispatch, comm._order)
    graph = fake.begin_capture(STREAM)
    broadcast(dispatch, comm._order)
    fake.end_capture(STREAM)
    fake.destroy_graph(graph)
    eventually(lambda: dispatch.graphs.live == 0, "the graph counted gone")
    nccl = FakeNccl.made[-1]
    getattr(comm, how)()
    assert nccl.ended[:2] == {"close": ("destroyed", "MainThread"), "abort": ("aborted", "ubnext-abort")}[how]
    assert contexts.retained[0] == 0
    eventually(lambda: dispatch.graphs._signal is None, "the graphs' thread woken by close, ended")


def released_on(node) -> list:
    """The name of the thread that releases ``node``'s own segment, once it does."""
    threads = []
    node.on_release(lambda: threads.append(threading.current_thread().name))
    return threads


@pytest.fixture
def current_streams(monkeypatch):
    """The list of ``(stream, what keeps it valid)`` that stands for the calling thread's
    current torch and CuPy streams (``captures._current_streams``). The fake streams it
    gets tracked are forgotten afterwards (a real query of one would be of no stream)."""
    from ubnext._engine import captures

    streams = []
    monkeypatch.setattr(captures, "_current_streams", lambda device: list(streams))
    yield streams
    with captures.CAPTURES._lock:
        captures.CAPTURES._entries.clear()
    eventually(lambda: captures.RELEASES.pending == 0, "the releases a failed test left queued ran")


def test_the_last_array_dropped_during_a_known_capture_is_released_once_it_ends(make_nodes, current_streams):
    """Rank 0's closed node loses its last array while a capture that rank 1's call joined
    on its current stream (whose handle stays valid: tracked) is in progress: the release
    (a device wait and unmaps, which the capture forbids) waits on the ubnext-release
    thread until the capture ends."""
    from ubnext._engine.captures import RELEASES

    fake = GraphFakeDriver()
    (node0, _, block0), (node1, _, block1) = make_nodes(fake, lambda node, rank: node.alloc(4096))
    graph = fake.begin_capture(STREAM + 1)
    current_streams.append((STREAM + 1, True))
    node1.hold(STREAM + 1)
    current_streams.clear()  # the array is dropped on a thread that captures nothing
    node0.close(local=True)
    threads = released_on(node0)
    del block0
    gc.collect()
    time.sleep(0.05)
    assert node0.holds_memory and mapped(fake, node0) == [0] and threads == [], "released during a capture"
    assert RELEASES.pending == 1
    fake.end_capture(STREAM + 1)
    eventually(lambda: not node0.holds_memory, "released once the capture ended")
    assert threads == ["ubnext-release"]
    eventually(lambda: RELEASES.pending == 0, "the release off the queue once it ran")
    fake.destroy_graph(graph)
    node1.close(local=True)
    del block1
    gc.collect()
    eventually(lambda: fake.leaks() == [], f"no leak: {fake.leaks()}")


def test_a_holder_collected_inside_a_capture_of_its_thread_is_released_after_it(make_nodes, current_streams):
    """The garbage collector drops a closed node's last array on a thread whose current
    stream is being captured, before any ubnext call joined the capture: that capture is
    tracked then, and the release waits for its end."""
    fake = GraphFakeDriver()
    (node, _, block), = make_nodes(fake, lambda node, rank: node.alloc(4096), n=1)
    node.close(local=True)
    threads = released_on(node)
    current_streams.append((STREAM, True))
    fake.begin_capture(STREAM)
    del block
    gc.collect()
    time.sleep(0.05)
    assert node.holds_memory and threads == [], "released inside the capture"
    fake.end_capture(STREAM)
    eventually(lambda: not node.holds_memory, "released once the capture ended")
    assert threads == ["ubnext-release"]
    assert fake.leaks() == []


def test_without_a_capture_in_progress_the_last_array_is_released_on_the_dropping_thread(make_nodes,
                                                                                       current_streams):
    fake = GraphFakeDriver()
    (node, _, block), = make_nodes(fake, lambda node, rank: node.alloc(4096), n=1)
    graph = fake.begin_capture(STREAM)
    current_streams.append((STREAM, True))
    node.hold(STREAM)  # tracked
    fake.end_capture(STREAM)  # the capture ended: it no longer holds releases back
    fake.destroy_graph(graph)
    eventually(lambda: node.graphs.live == 0, "the graph counted gone")
    node.close(local=True)
    threads = released_on(node)
    del block
    gc.collect()
    assert threads == ["MainThread"] and not node.holds_memory and fake.leaks() == []


def test_a_holder_dropped_while_the_releases_decide_does_not_wait_for_itself(monkeypatch):
    """A collection inside the releases' own step (RELEASES and CAPTURES holding their
    locks: it allocates) drops another holder, whose release asks them again on the same
    thread: it runs, and so does the first."""
    from ubnext._engine import captures

    ran, busy = [], captures.CAPTURES.busy

    def collecting():
        monkeypatch.setattr(captures.CAPTURES, "busy", busy)
        with captures.CAPTURES._lock:
            captures.RELEASES.run(lambda: ran.append("dropped meanwhile"))
        return busy()

    monkeypatch.setattr(captures.CAPTURES, "busy", collecting)
    done = threading.Event()
    threading.Thread(target=lambda: (captures.RELEASES.run(lambda: ran.append("first")), done.set()),
                     daemon=True).start()
    assert done.wait(WAIT_S), "the release waited for itself"
    assert ran == ["dropped meanwhile", "first"]


def test_a_release_arriving_while_the_thread_runs_a_queued_one_waits_for_it():
    """The ubnext-release thread runs a release queued behind a capture; another arrives on
    another thread once the capture ended: it runs after the first (in order), not beside it."""
    from ubnext._engine.captures import Releases

    class Known:
        capturing = True
        _lock = threading.RLock()

        def note_current(self, context):
            pass

        def busy(self):
            return self.capturing

    known, ran = Known(), []
    releases = Releases(known, poll_s=0.001)
    started, go = threading.Event(), threading.Event()

    def first():
        started.set()
        assert go.wait(WAIT_S)
        ran.append("first")

    releases.run(first)  # queued: a capture is in progress
    known.capturing = False
    assert started.wait(WAIT_S), "the queued release never ran"
    releases.run(lambda: ran.append("second"))
    time.sleep(0.05)
    assert ran == [], "the second release ran while the first was still running"
    go.set()
    eventually(lambda: ran == ["first", "second"], f"both, in order: {ran}")
    eventually(lambda: releases.pending == 0, "the queue drained")


def test_a_holder_dropped_under_the_captures_lock_while_another_thread_releases_does_not_deadlock():
    """Thread B holds the captures' lock (a collection inside their step drops a holder: its
    release asks the releases) while thread A's release asks the captures whether one is in
    progress: neither waits for the other's lock."""
    from ubnext._engine.captures import Captures, Releases

    captures, ran = Captures(), []
    releases = Releases(captures, poll_s=0.001)
    asking, done = threading.Event(), threading.Event()

    def a():
        asking.set()
        releases.run(lambda: ran.append("A"))

    def b():
        with captures._lock:
            threading.Thread(target=a, name="A", daemon=True).start()
            assert asking.wait(WAIT_S)
            time.sleep(0.05)  # A now waits for a lock B holds
            releases.run(lambda: ran.append("B"))
        done.set()

    threading.Thread(target=b, name="B", daemon=True).start()
    assert done.wait(WAIT_S), "the two releases deadlocked on the captures' and the releases' locks"
    eventually(lambda: sorted(ran) == ["A", "B"], f"both ran: {ran}")


def test_a_holder_dropped_under_the_releases_lock_while_another_thread_holds_the_captures_lock_does_not_deadlock():
    """Thread A holds the releases' lock (queueing a release: it allocates) when a collection
    there drops a holder, whose release asks the captures; thread B holds the captures' lock
    (a collection inside their step) and its release asks for the releases' lock: the two
    locks are one, so one thread waits for the other's step to end instead of both waiting."""
    from ubnext._engine.captures import Captures, Releases

    captures, ran = Captures(), []
    releases = Releases(captures, poll_s=0.001)
    holding, a_done, b_done = threading.Event(), threading.Event(), threading.Event()

    def a():
        with releases._lock:
            holding.set()
            time.sleep(0.05)  # B takes the captures' lock meanwhile, where it is another
            captures.busy()  # the dropped holder's release asking
        a_done.set()

    def b():
        assert holding.wait(WAIT_S)
        with captures._lock:
            releases.run(lambda: ran.append("B"))
        b_done.set()

    threading.Thread(target=a, name="A", daemon=True).start()
    threading.Thread(target=b, name="B", daemon=True).start()
    assert a_done.wait(WAIT_S) and b_done.wait(WAIT_S), "the releases' and the captures' locks deadlocked"
    assert ran == ["B"]
