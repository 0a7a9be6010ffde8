"""A communicator's lifetime: what it owns and gives back, and who watches it between calls.

* :class:`Owned` holds everything a communicator releases (node, NCCL communicator,
  launch order, watchdog, bootstraps, the retain of its CUDA context) and no reference to
  the communicator, so that one dropped without ``close()`` becomes garbage and its
  finalizer releases it locally, as ``abort()`` does.
* :class:`Watchdog` notices a failed collective where no ubnext call runs: launches
  replayed from a CUDA graph run no host code of ubnext, so a failure they record would
  only be noticed at the next call. A daemon thread per communicator polls the failure
  records (host memory: no device call, no synchronization); on a failure it lets the
  node mark every rank's kernels broken (so that theirs give up too) and logs the error
  once. It raises nothing: the user's next call or ``synchronize()`` raises.
* :class:`Exchanges` runs the host exchanges a call makes with its peers (the heap's
  allgather of ``empty()`` and of the overlapped ops' area, the debug-mode comparison,
  NCCL's first connect, close's barrier), so that ``abort()`` never waits behind one: it
  abandons them, and an exchange that returns afterwards raises.
* At exit, communicators still open (:data:`OPEN`) are only named in a warning.
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections.abc import Callable

from ubnext._engine.captures import RELEASES
from ubnext._environment.log import log_once
from ubnext._protocol.errors import BrokenCommunicatorError

#: the communicators not yet closed (for the warning at exit)
OPEN: weakref.WeakSet = weakref.WeakSet()


class Watchdog:
    """Calls ``poll()`` every ``interval`` seconds on a daemon thread until ``poll``
    returns a failure (then ``on_failure(failure)`` once) or until :meth:`stop`.

    Args:
        poll: returns None while all is well; must be safe to call from this thread.
        on_failure: called once with what ``poll`` returned.
        interval: seconds between polls.
        name: the thread's name.
        start: called first on the thread, if given (the communicator makes its context
            current there: a new thread has none, and a CUDA object the garbage collector
            frees on this thread would otherwise create a context on device 0, another
            rank's GPU).
    """

    def __init__(self, poll: Callable[[], object], on_failure: Callable[[object], None], interval: float,
                 name: str, start: Callable[[], None] | None = None):
        self._poll, self._on_failure, self._interval, self._start = poll, on_failure, interval, start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._start is not None:
            self._start()
        while not self._stop.wait(self._interval):
            failure = self._poll()
            if failure is not None:
                self._on_failure(failure)
                return

    def on_its_thread(self) -> bool:
        """Whether the calling thread is the watchdog's."""
        return self._thread is threading.current_thread()

    def stop(self) -> None:
        """Stops the thread and waits for it (at most one poll). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class Exchanges:
    """The host exchanges of one communicator's calls, which ``abort()`` abandons.

    An exchange with the peers (a bootstrap's allgather or barrier, NCCL's connect) may wait
    for ever where a peer died (MPI has no timeout). The call that runs it holds the
    launch section, so an abort that waited for the section would wait as long: instead
    it calls :meth:`abandon`, after which an exchange that starts raises at once, and one in
    progress raises when it returns (if ever), before its caller launches anything.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._abandoned = False

    def run(self, op: str, fn: Callable, *args):
        """``fn(*args)``, an exchange of the call ``op``.

        Raises:
            BrokenCommunicatorError: the communicator was aborted before or during it.
            What ``fn`` raises.
        """
        with self._lock:
            self._check(op)
            self._active += 1
        try:
            result = fn(*args)
        except BaseException as e:
            with self._lock:
                self._active -= 1
                abandoned = self._abandoned
            if abandoned and isinstance(e, Exception):  # e.g. the dead peer's timeout: the abort is the cause
                raise self._error(op) from e
            raise
        with self._lock:  # one step with the check: abort sees the call either waiting or checked
            self._active -= 1
            self._check(op)
        return result

    def abandon(self) -> None:
        """From now on every exchange raises (those in progress when they return)."""
        with self._lock:
            self._abandoned = True

    @property
    def waiting(self) -> bool:
        """Whether a call is in an exchange now (so it launches nothing until it raises)."""
        return self._active > 0

    def _check(self, op: str) -> None:
        if self._abandoned:
            raise self._error(op)

    @staticmethod
    def _error(op: str) -> BrokenCommunicatorError:
        return BrokenCommunicatorError(op, None, "the communicator was aborted (abort()) before or while this "
                                                 "call exchanged with its peers; nothing was launched")


def abort_release(order, exchanges: Exchanges, release: Callable[..., None], poll_s: float = 0.01) -> None:
    """``release(local=True)`` for ``abort()``, in the launch section ``order`` once the
    call of another thread that holds it leaves, or at once outside it where that call
    waits in a host exchange (``exchanges.waiting``: abandoned, it raises before it
    launches anything when the exchange returns, if ever). Waits for the section on a
    thread of its own (it may never be given back), polling every ``poll_s`` seconds.
    Called from inside a call of this thread (a signal handler, a hook; the communicator
    is closed already, so the call's next part raises), the release waits for that call:
    it runs when the call leaves its outermost section (``LaunchOrder.at_exit``).

    Raises:
        What the release raised.
    """
    if getattr(order, "_holder", None) == threading.get_ident():  # inside a call of this thread
        order.at_exit(functools.partial(release, local=True))
        return
    done, errors = threading.Event(), []

    def in_section() -> None:
        try:
            release(local=True)
        except BaseException as e:  # handed to abort's thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=in_section, name="ubnext-abort", daemon=True).start()
    while not done.wait(poll_s):
        if exchanges.waiting:
            release(local=True, in_section=False)
            return
    if errors:
        raise errors[0]


def close_bootstraps(local_boot, owned, local: bool = False) -> None:
    """Closes the node's view ``local_boot``, then ``owned`` (the bootstrap ``default()``
    made, or None); ``local``: without waiting for any rank (Bootstrap.abort)."""
    try:
        if local_boot is not None:
            local_boot.abort() if local else local_boot.close()
    finally:
        if owned is not None:
            owned.abort() if local else owned.close()


class Owned:
    """What a communicator releases: its node, NCCL communicator, launch order, watchdog,
    bootstraps and the retain of its CUDA context. It holds no reference to the
    communicator (nor does anything it holds), so that a communicator dropped without
    ``close()`` becomes garbage and its finalizer (:meth:`drop`) gives everything back.

    Args:
        order: the communicator's LaunchOrder (its section, and its context).
        node, dispatch, watchdog: the communicator's (node and watchdog may be None).
        local_boot: the bootstrap of the node's ranks.
        owned_boot: the bootstrap ``default()`` made for the communicator, or None.
        local_rank: this rank's place on the node.
        exchanges: the communicator's host exchanges (close's barrier is one), or None.
    """

    def __init__(self, order, node, dispatch, watchdog, local_boot, owned_boot, local_rank: int,
                 exchanges: Exchanges | None = None):
        self.order, self.node, self.dispatch, self.watchdog = order, node, dispatch, watchdog
        self.exchanges = exchanges
        self.local_boot, self.owned_boot, self.local_rank = local_boot, owned_boot, local_rank
        self.released = False
        self._lock = threading.Lock()

    def release(self, local: bool) -> None:
        """Stops the watchdog, closes the node (``local``: waiting for no rank; a broken
        communicator closes locally too), the NCCL communicator and the bootstraps, then
        releases the context's retain (where arrays or graphs still hold the node's memory,
        or graphs the NCCL communicator, their last release does, after theirs); each step
        runs even where one before it failed.
        In the launch section. Idempotent.

        Raises:
            The first error of a release step.
        """
        with self._lock:  # abort may release outside the section while a close waits for it
            if self.released:
                return
            self.released = True
        node, self.node = self.node, None
        try:
            if self.watchdog is not None:
                self.watchdog.stop()
            if node is not None:
                exchange = None if self.exchanges is None else functools.partial(self.exchanges.run, "close")
                local = node.close(local=local, exchange=exchange)
        except BaseException:
            local = True  # what follows waits for no rank after a failed step
            raise
        finally:
            try:
                self.dispatch.close(local)
            finally:
                try:
                    close_bootstraps(self.local_boot, self.owned_boot, local)
                finally:
                    release = self.order.context.release
                    if node is not None:  # once the node's memory is released: at once, or by its last holder
                        release = functools.partial(node.on_release, release)
                    if self.dispatch.graphs.close(release):  # and once no graph uses the NCCL communicator
                        RELEASES.run(release)  # behind releases queued for a capture in progress

    def drop(self) -> None:
        """The finalizer of a communicator that became garbage without ``close()``: released
        as ``abort()`` releases (its peers cannot be met from here: no collective, no rank
        waited for), with the communicator's context current whatever thread collects it,
        and a warning (once per process); while a capture that ubnext knows of is in
        progress (a collection inside one, or on another thread), after its end, on
        ubnext's release thread (``captures.RELEASES``): the release waits on the device."""
        log_once("dropped", "ubnext.Communicator was dropped without close(): released locally, as abort() "
                            "does (peers are not waited for); call close() on every rank, or use `with`")
        if self.watchdog is not None and self.watchdog.on_its_thread():
            # collected on its own watchdog's thread, which may be inside the node's announce
            # and which cannot wait for itself: released on a thread of its own
            threading.Thread(target=self._drop, name="ubnext-dropped", daemon=True).start()
        else:  # the node's close and NCCL's abort wait on the device: not inside a capture in progress
            RELEASES.run(self._drop, self.order.context)

    def _drop(self) -> None:
        if self.node is not None:
            self.node.announce_abort(self.local_rank)
        with self.order:
            self.release(local=True)


@atexit.register
def _warn_open() -> None:
    """At exit, communicators still open are only named in a warning: releasing them then
    would make driver calls while CUDA and the interpreter shut down."""
    count = len(OPEN)
    if count:
        log_once("open-at-exit", f"{count} ubnext.Communicator(s) were not closed before exit; call close() "
                                 f"on every rank (or use `with`)")
