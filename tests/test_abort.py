"""``abort()`` never waits behind a host exchange (CPU only: a Node on a recording fake
driver, a communicator around it without a GPU): a call of another thread waiting in
``empty()``'s allgather for a peer that died is abandoned, abort returns at once and
releases what is local, and the abandoned call raises BrokenCommunicatorError when its
exchange returns, having launched nothing.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
from fake_driver import GraphFakeDriver
from stream_fakes import fake_order
from test_ownership import make_nodes  # noqa: F401 (fixture)

from ubnext import BrokenCommunicatorError, ClosedError
from ubnext._api.lifetime import Exchanges
from ubnext._engine.dispatch import Dispatcher
from ubnext._environment.config import Config

#: abort()'s bound here: no device work, no peer waited for
BOUND_S = 2.0


class DeadPeer:
    """A node's bootstrap whose exchanges wait for a peer that never comes, until the test
    lets them go (``come``): then they answer as the one-rank group would."""

    def __init__(self, boot):
        self._boot = boot
        self.arrived = threading.Event()
        self._go = threading.Event()

    @property
    def rank(self):
        return self._boot.rank

    def come(self):
        self._go.set()

    def allgather(self, data):
        self.arrived.set()
        assert self._go.wait(30), "the test never let the exchange go"
        return self._boot.allgather(data)

    def barrier(self):
        self.allgather(b"")

    def abort(self):
        pass

    close = abort


def communicator(node, local):
    """A Communicator around ``node`` (its bootstrap ``local``), as bare_communicator makes one."""
    from stream_fakes import bare_communicator

    order = fake_order(0)
    order.context = node._context  # the node's own (fake) context
    return bare_communicator(order, _node=node, _local=local, config=Config(),
                             _dispatch=Dispatcher(node, {}, order, None, 0), _context=node._context)


def test_an_exchange_abandoned_before_or_during_it_raises():
    exchanges = Exchanges()
    assert exchanges.run("op", lambda x: x + 1, 1) == 2
    entered, go = threading.Event(), threading.Event()
    errors = []

    def wait():
        entered.set()
        go.wait(10)
        return "late"

    def call():
        try:
            exchanges.run("empty", wait)
        except BrokenCommunicatorError as e:
            errors.append(str(e))

    t = threading.Thread(target=call)
    t.start()
    assert entered.wait(10) and exchanges.waiting
    exchanges.abandon()
    go.set()
    t.join(10)
    assert errors and errors[0].startswith("empty: the communicator was aborted") and not exchanges.waiting
    with pytest.raises(BrokenCommunicatorError, match="^debug"):
        exchanges.run("debug", lambda: pytest.fail("an exchange ran after abort"))

    failing = Exchanges()

    def timed_out():
        failing.abandon()
        raise TimeoutError("the peer never came")

    with pytest.raises(BrokenCommunicatorError) as info:
        failing.run("empty", timed_out)
    assert isinstance(info.value.__cause__, TimeoutError)


def test_abort_returns_while_another_thread_waits_in_empty_for_a_dead_peer(make_nodes):  # noqa: F811
    fake = GraphFakeDriver()
    node = make_nodes(fake, n=1)[0][0]
    local = DeadPeer(node._local)
    node._local = local
    comm = communicator(node, local)
    got = []

    def user():
        try:
            got.append(comm.empty(1024))
        except BaseException as e:
            got.append(e)

    caller = threading.Thread(target=user, name="user")
    caller.start()
    assert local.arrived.wait(10), "empty() never reached its exchange"
    start = time.monotonic()
    comm.abort()
    took = time.monotonic() - start
    assert took < BOUND_S, f"abort took {took:.2f} s behind a host exchange"
    assert comm._owned.released and not node.holds_memory and fake.leaks() == []
    start = time.monotonic()
    comm.close()  # released already: it does not wait for the section the abandoned call holds
    assert time.monotonic() - start < BOUND_S
    local.come()  # the dead peer's exchange returns at last
    caller.join(10)
    with pytest.raises(ClosedError):
        comm.empty(16)
    assert not caller.is_alive()
    assert len(got) == 1 and isinstance(got[0], BrokenCommunicatorError), got
    assert str(got[0]).startswith("empty: the communicator was aborted")
    assert node.heap.used == 0  # nothing was allocated
    deadline = time.monotonic() + 10
    while any(t.name == "ubnext-abort" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "abort's waiter never ended"
        time.sleep(0.01)
    comm.abort()  # idempotent
    comm.close()
    del comm
    gc.collect()
    assert fake.leaks() == []


def test_abort_without_a_call_in_progress_releases_in_the_section(make_nodes):  # noqa: F811
    fake = GraphFakeDriver()
    node = make_nodes(fake, n=1)[0][0]
    comm = communicator(node, node._local)
    array = comm.empty(256)
    comm.abort()
    assert comm._owned.released and node.holds_memory  # the array keeps this rank's segment
    with pytest.raises(ClosedError):
        comm.empty(16)
    del array
    gc.collect()
    assert fake.leaks() == []


class NcclPeerNeverComes:
    """The world bootstrap of NCCL's first connect: its allgather (``_refuse_shared_gpus``)
    waits for a peer that never comes; let go (``come``), the peer's loss surfaces as an error."""

    rank, size = 0, 2

    def __init__(self):
        self.arrived, self._go = threading.Event(), threading.Event()

    def come(self):
        self._go.set()

    def allgather_obj(self, obj):
        self.arrived.set()
        assert self._go.wait(30), "the test never let the exchange go"
        raise ConnectionError("the peer is gone")


def test_abort_returns_while_another_thread_waits_in_nccls_first_connect(make_nodes, monkeypatch):  # noqa: F811
    from ubnext._engine import nccl as _nccl

    monkeypatch.setattr(_nccl.NcclComm, "_module", lambda self, op: object())  # NCCL "loads"; no GPU asked
    monkeypatch.setattr(_nccl._devices, "device_uuid", lambda device: "GPU-fake")
    fake = GraphFakeDriver()
    node = make_nodes(fake, n=1)[0][0]
    comm = communicator(node, node._local)
    world = NcclPeerNeverComes()
    comm._dispatch = comm._owned.dispatch = Dispatcher(node, {}, comm._order, world, 0, exchange=comm._exchanges.run)
    got = []

    def user():  # what broadcast(algorithm="nccl") does in its section
        try:
            with comm._order:
                comm._dispatch.nccl_for(0, None).connect("broadcast")
            got.append("connected")
        except BaseException as e:
            got.append(e)

    caller = threading.Thread(target=user, name="user")
    caller.start()
    assert world.arrived.wait(10), "the call never reached NCCL's connect"
    aborter = threading.Thread(target=comm.abort, name="aborter")
    start = time.monotonic()
    aborter.start()
    aborter.join(BOUND_S)
    took = time.monotonic() - start
    world.come()  # let everything unwind, pass or fail
    caller.join(10)
    aborter.join(10)
    assert took < BOUND_S, f"abort took {took:.2f} s behind NCCL's first connect"
    assert len(got) == 1 and isinstance(got[0], BrokenCommunicatorError), got
    assert str(got[0]).startswith("NCCL's setup: the communicator was aborted")
    assert comm._dispatch.nccl is None  # the connect never succeeded: no NCCL communicator was published
    with pytest.raises(ClosedError):
        comm.empty(16)


def test_abort_from_inside_a_call_of_its_thread_releases_when_the_call_leaves(make_nodes):  # noqa: F811
    """abort() from the thread in the section (a signal handler, a hook inside a call):
    it closes the communicator at once and leaves the release to the call's exit, which
    it neither waits for nor raises into."""
    fake = GraphFakeDriver()
    node = make_nodes(fake, n=1)[0][0]
    comm = communicator(node, node._local)
    with comm._order:  # what a call holds
        comm.abort()
        assert comm._closed and not comm._owned.released  # closed at once, nothing released under the call
    assert comm._owned.released and not node.holds_memory
    with pytest.raises(ClosedError):
        comm.empty(16)
    comm.abort()  # idempotent
    gc.collect()
    assert fake.leaks() == []


def test_abort_inside_a_composite_operation_releases_at_its_end(make_nodes):  # noqa: F811
    """Inside a composite section (an overlapped op: its calls, copies and joins), abort()
    from one of its calls releases nothing until the operation ends: its copies still read
    the peers' segments, which stay mapped until then."""
    fake = GraphFakeDriver()
    node = make_nodes(fake, n=1)[0][0]
    comm = communicator(node, node._local)
    array = comm.empty(64)
    with comm._order.composite():
        with comm._order:  # one of the op's calls, from which a hook aborts
            comm.abort()
        assert not comm._owned.released  # the op's next copies still find the pool mapped
        with pytest.raises(ClosedError):
            with comm._order:  # its next call
                comm._check_open("op")
    assert comm._owned.released and node.holds_memory  # the array keeps this rank's segment
    del array
    gc.collect()
    assert fake.leaks() == []
