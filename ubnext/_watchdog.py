"""The watchdog: notices a failed collective where no ubnext call runs.

Launches replayed from a CUDA graph run no host code of ubnext, so a failure they
record would only be noticed at the next ubnext call. A daemon thread per communicator
polls the failure records (host memory: no device call, no synchronization) every
``interval`` seconds; on a failure it lets the node mark every rank's kernels broken
(so that theirs give up too) and logs the error once. It raises nothing: the user's
next ubnext call or ``synchronize()`` raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


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
