"""Failure reports and call signatures on the host (CPU only): what a kernel's
ErrorRecord turns into, and what a signature says."""

from __future__ import annotations

import pytest

from ubnext._engine.failures import broken_word, error_of
from ubnext._protocol import signature as _signature
from ubnext._protocol.constants import ANY_PEER, FAIL_KINDS, WAIT_SITES
from ubnext._protocol.errors import (
    BrokenCommunicatorError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConcurrentUseError,
    UbnextError,
)

KIND = {name: code for code, (name, _) in FAIL_KINDS.items()}
SITE = {name: code for code, (name, _) in WAIT_SITES.items()}


def test_a_timeout_names_the_rank_that_waited_and_the_one_it_waited_for():
    e = error_of("all_reduce", KIND["kFailTimeout"], 0, 3, SITE["kSiteLamportPoll"], 7, 0, 0, 600.0)
    assert isinstance(e, CollectiveTimeoutError) and isinstance(e, BrokenCommunicatorError)
    assert (e.rank, e.peer) == (0, 3)
    assert str(e).startswith("all_reduce: rank 0 waited more than 600 s for rank 3 (Lamport poll, launch 7)")
    assert "create a new one" in str(e)
    counting = error_of("all_reduce", KIND["kFailTimeout"], 1, ANY_PEER, SITE["kSiteEntryBarrier"], 0, 0, 0, 2)
    assert counting.peer is None and "another rank" in str(counting)


def test_a_mismatch_names_both_calls():
    mine = _signature.encode("all_reduce", "bfloat16", "sum", 4096)
    theirs = _signature.encode("all_reduce", "bfloat16", "sum", 8192)
    e = error_of("synchronize", KIND["kFailMismatch"], 0, 1, 0, 3, mine, theirs, 600.0)
    assert isinstance(e, CollectiveMismatchError) and (e.rank, e.peer, e.mine, e.theirs) == (0, 1, mine, theirs)
    assert ("rank 0 called all_reduce of 4096 bfloat16 (sum) but rank 1 called all_reduce of 8192 bfloat16 (sum)"
            in str(e))


def test_concurrent_use_and_a_peers_failure():
    assert isinstance(error_of("all_reduce", KIND["kFailConcurrent"], 2, 0, 0, 0, 0, 0, 1), ConcurrentUseError)
    e = error_of("all_reduce", KIND["kFailPeer"], 1, 3, KIND["kFailTimeout"], 0, 0, 0, 1)
    assert type(e) is BrokenCommunicatorError and e.rank == 3
    assert "rank 3 failed first (a wait timed out)" in str(e)
    aborted = error_of("all_reduce", KIND["kFailPeer"], 1, 0, KIND["kFailAborted"], 0, 0, 0, 1)
    assert "rank 0 failed first (the communicator was aborted)" in str(aborted)


def test_broken_word_keeps_kind_and_rank():
    word = broken_word(KIND["kFailMismatch"], 5)
    assert word >> 8 == KIND["kFailMismatch"] and (word & 0xFF) - 1 == 5 and word != 0
    assert broken_word(KIND["kFailTimeout"], 0) != 0  # rank 0 too: 0 means "not broken"


@pytest.mark.parametrize("collective", _signature.COLLECTIVES[:1])
def test_signatures_differ_in_every_field(collective):
    base = _signature.encode(collective, "bfloat16", "sum", 4096)
    others = [_signature.encode(collective, "float16", "sum", 4096),   # same width
              _signature.encode(collective, "float32", "sum", 4096),   # other width
              _signature.encode(collective, "bfloat16", "max", 4096),
              _signature.encode(collective, "bfloat16", "sum", 4097),
              _signature.encode_fused("bfloat16", 1, 4096)]
    assert len({base, *others}) == 6 and all(s != 0 for s in (base, *others))
    assert _signature.text(base) == "all_reduce of 4096 bfloat16 (sum)"
    assert _signature.text(_signature.encode_fused("float32", 16, 8192)) == \
        "all_reduce_add_rmsnorm of 16 x 8192 float32"
    assert "unknown call" in _signature.text(0)


@pytest.mark.parametrize("collective", ["broadcast", "gather", "scatter"])
def test_rooted_movers_signatures_differ_in_their_root(collective):
    sigs = [_signature.encode_rooted(collective, "float32", 96, root) for root in range(8)]
    assert len(set(sigs)) == 8  # ranks naming different roots mismatch in band
    assert _signature.encode_rooted(collective, "float32", 97, 3) != sigs[3]
    assert _signature.encode_rooted(collective, "int8", 96, 3) != sigs[3]
    assert sigs[0] >> 60 == _signature.COLLECTIVES.index(collective) + 1
    assert _signature.text(sigs[5]) == f"{collective} of 96 float32 (root 5)"
    with pytest.raises(ValueError):
        _signature.encode_rooted("all_to_all", "float32", 96, 0)  # no root
    with pytest.raises(ValueError):
        _signature.encode_rooted(collective, "float32", 96, 1 << _signature.OP_BITS)


def test_signature_fields_are_bounded():
    with pytest.raises(ValueError):
        _signature.encode("all_reduce", "bfloat16", "sum", 1 << _signature.COUNT_BITS)
    with pytest.raises(ValueError):
        _signature.encode_fused("bfloat16", 1, 1 << _signature.HIDDEN_BITS)


def test_every_error_is_a_ubnext_error():
    for cls in (BrokenCommunicatorError, CollectiveTimeoutError, CollectiveMismatchError, ConcurrentUseError):
        assert issubclass(cls, UbnextError)


def test_the_watchdog_reports_a_failure_once_and_stops():
    import threading

    from ubnext._api.lifetime import Watchdog

    polls, seen, done = [], [], threading.Event()

    def poll():
        polls.append(1)
        return "failed" if len(polls) >= 3 else None

    def on_failure(failure):
        seen.append(failure)
        done.set()

    dog = Watchdog(poll, on_failure, 0.01, "test-watchdog")
    assert done.wait(5)
    dog.stop()
    assert seen == ["failed"] and len(polls) == 3  # no poll after the failure


def test_the_watchdog_runs_its_start_on_its_thread_before_the_first_poll():
    """The communicator makes its device current there, so that an announce, and whatever
    the garbage collector frees on that thread, runs on its device, not device 0."""
    import threading

    from ubnext._api.lifetime import Watchdog

    seen, polled = [], threading.Event()

    def poll():
        seen.append(("poll", threading.current_thread().name))
        polled.set()

    dog = Watchdog(poll, lambda failure: None, 0.01, "test-watchdog",
                   start=lambda: seen.append(("start", threading.current_thread().name)))
    assert polled.wait(5)
    dog.stop()
    assert seen[:2] == [("start", "test-watchdog"), ("poll", "test-watchdog")]


def test_no_thread_gets_a_failure_before_its_announce_is_done():
    """The watchdog's thread may be announcing a failure when a call or synchronize sees
    it too: that caller waits for the announce, so that a rank that raises and then lines
    up with its peers has marked them already (else a late peer's Lamport all-gather,
    finding every pushed slice present, completed without failing)."""
    import threading

    from ubnext._engine.node import Node

    origin = (KIND["kFailTimeout"], 0)
    started, release, announced = threading.Event(), threading.Event(), []

    class Records:
        def error(self, op, timeout_s):
            return CollectiveTimeoutError(op, 0, 1, "Lamport poll, launch 1", timeout_s)

        def origin(self):
            return origin

    class SlowAnnounce(Node):
        def __init__(self):  # only what failure() uses
            self.failures, self._announced, self._failure_lock = Records(), False, threading.Lock()

        def announce(self, kind, rank):
            started.set()
            assert release.wait(10)
            announced.append((kind, rank))

    node = SlowAnnounce()
    watchdog = threading.Thread(target=node.failure, args=("watchdog", 1.0), daemon=True)
    watchdog.start()
    assert started.wait(10)
    seen = []
    caller = threading.Thread(target=lambda: seen.append((node.failure("synchronize", 1.0), list(announced))),
                              daemon=True)
    caller.start()
    caller.join(0.3)
    assert caller.is_alive(), "the caller got the error while the announce was still in progress"
    release.set()
    caller.join(10)
    watchdog.join(10)
    error, announced_then = seen[0]
    assert isinstance(error, CollectiveTimeoutError)
    assert announced_then == announced == [origin]  # done before the error was returned; once
    assert node.failure("all_reduce", 1.0) is not None and announced == [origin]


def test_the_watchdog_stops_without_a_failure():
    from ubnext._api.lifetime import Watchdog

    polls = []
    dog = Watchdog(lambda: polls.append(1), lambda failure: None, 0.01, "test-watchdog")
    dog.stop()
    dog.stop()  # idempotent
    assert not dog._thread.is_alive()
