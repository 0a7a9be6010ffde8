"""When a holder's release may run: never while a CUDA graph capture that ubnext knows of
is in progress.

A release of device memory (the device wait before unmapping this rank's segment, the
unmaps, the pinned failure words' free, NCCL's abort) is a call that a capture forbids: on
the capturing thread, whatever its mode, and on any thread while a capture of the same
device runs in CUDA's global mode (torch's default); the capture is then invalidated.
Relaxing the releasing thread's capture mode (``cudaThreadExchangeStreamCaptureMode``)
does not help: a device-wide wait from any thread invalidates a capture of its device
in every mode. The releases of holders (the last array of a closed communicator
collected, the last graph destroyed) happen when the garbage collector or CUDA decides,
so they wait instead:

* :class:`Captures`: the captures in progress that ubnext knows of, process-wide: each
  one a call of a communicator joined on the current stream (torch's, CuPy's) of its
  thread (``holders.Graphs.hold``), and the one on the current stream of the thread that
  drops a holder. Each is kept with what keeps its stream's handle valid (CuPy's stream
  object; torch keeps its streams for the process) and queried on that stream (with its
  context current) until it ends. A capture on a stream passed to a call but not current
  is not tracked: nothing guarantees that its handle outlives the capture.
* :class:`Releases`: runs a release at once where none is in progress, else queues it (in
  order) for a thread of ubnext (``ubnext-release``) that runs the queue once none is,
  polling. A capture ubnext does not know of (on another thread, with no ubnext call in
  it) can still be invalidated by a release.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any, Callable

from ubnext._environment.log import log_once
from ubnext._interop import streams as _streams

#: tracked captures past which those that ended are forgotten at the next one's arrival
_PRUNE_AT = 16
#: seconds between the release thread's looks at the captures in progress
_POLL_S = 0.01


class Captures:
    """CUDA graph captures in progress that ubnext knows of (see the module docstring)."""

    def __init__(self):
        # re-entered where a collection inside a step drops a holder (whose release asks here)
        self._lock = threading.RLock()
        self._entries: dict[int, tuple] = {}  # capture id -> (stream, what keeps it valid, context)

    def add(self, capture: int, stream: int, keep: Any, context) -> None:
        """Tracks capture ``capture`` (its id, > 0) on ``stream`` until it ends; ``keep``
        keeps the stream's handle valid meanwhile; ``context`` is the stream's."""
        with self._lock:
            self._entries.setdefault(capture, (stream, keep, context))
            crowded = len(self._entries) > _PRUNE_AT
        if crowded:
            self.busy()

    def track(self, capture: int, stream: int, context) -> None:
        """Tracks capture ``capture`` on ``stream`` where that is the calling thread's
        current stream of ``context``'s device in torch or CuPy, whose handle is known to
        stay valid (torch keeps its streams for the process; CuPy's current stream object
        is kept); a stream passed by its handle alone is not tracked."""
        for current, keep in _current_streams(context.device):
            if current == stream:
                self.add(capture, stream, keep, context)
                return

    def note_current(self, context) -> None:
        """Tracks the capture on the calling thread's current stream of ``context``'s
        device, in torch (where its CUDA is initialized) and CuPy (where imported), if any.
        Never raises (a stream that cannot be queried is taken as not capturing)."""
        for stream, keep in _current_streams(context.device):
            capture = _capture_of(stream, context)
            if capture > 0:
                self.add(capture, stream, keep, context)

    def busy(self) -> bool:
        """Whether a tracked capture is still in progress (each queried on its stream);
        forgets those that ended."""
        with self._lock:
            entries = list(self._entries.items())
        ended = [capture for capture, (stream, _, context) in entries if _capture_of(stream, context) != capture]
        for capture in ended:
            self._forget(capture)
        return len(ended) < len(entries)

    def _forget(self, capture: int) -> None:
        """Drops capture ``capture``'s entry, with its context current: the stream's owner
        may go with it, and a stream destroyed on a thread without that context current
        would create a context on another device."""
        with self._lock:
            entry = self._entries.pop(capture, None)
        if entry is None:
            return
        context = entry[2]
        try:
            with context.current():
                del entry
        except Exception:  # the context is gone: so is the stream
            pass


class Releases:
    """Runs releases in order: at once where no capture of ``captures`` is in progress,
    else on the ``ubnext-release`` thread once none is (see the module docstring).

    Args:
        captures: the captures in progress that ubnext knows of.
        poll_s: seconds between the thread's looks at them.
    """

    def __init__(self, captures: Captures, poll_s: float = _POLL_S):
        self._captures, self._poll_s = captures, poll_s
        # the captures' own lock: a collection inside either's step (it allocates) drops a
        # holder whose release takes the other's; with two locks, two threads taking them in
        # opposite orders deadlocked. One re-entrant lock: re-entered on its own thread only.
        self._lock = captures._lock
        self._queue: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None

    def run(self, release: Callable, context=None) -> None:
        """``release()`` now or, behind those queued, once no known capture is in progress;
        what it raises, or the list of errors it returns, is logged (it runs where nobody
        can be raised to). ``context``: the released memory's, whose current stream of the
        calling thread is checked for a capture first (a collection inside a capture)."""
        if context is not None:
            self._captures.note_current(context)
        with self._lock:
            if self._queue or self._captures.busy():
                self._queue.append(release)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._drain, name="ubnext-release", daemon=True)
                    self._thread.start()
                return
        _logged(release)

    @property
    def pending(self) -> int:
        """Releases queued behind a capture in progress (the one running included)."""
        return len(self._queue)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
            if self._captures.busy():
                time.sleep(self._poll_s)
                continue
            with self._lock:
                release = self._queue[0]
            _logged(release)  # still queued while it runs: a release arriving meanwhile waits behind it
            with self._lock:
                self._queue.popleft()


def _logged(release: Callable) -> None:
    try:
        errors = release() or []
    except Exception as e:  # a release of a holder: nobody to raise to
        errors = [e]
    for e in errors:
        log_once(f"release:{e}", f"ubnext: releasing a closed communicator's resources failed: {e}")


def _capture_of(stream: int, context) -> int:
    """The id of the capture in progress on ``stream`` (0: none, -1: invalidated), queried
    with ``context`` current; 0 where the stream cannot be queried (gone)."""
    try:
        with context.current():
            return _streams.CUDA.capture(stream)
    except Exception:  # a stream destroyed, a context gone: no capture there any more
        return 0


def _current_streams(device: int) -> list[tuple[int, Any]]:
    """``(handle, what keeps it valid)`` of the calling thread's current streams of
    ``device`` in torch (where its CUDA is initialized) and CuPy (where imported)."""
    streams = []
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    try:
        if torch is not None and torch.cuda.is_initialized():
            streams.append((torch._C._cuda_getCurrentRawStream(device), True))  # torch keeps its streams
    except Exception:  # torch without this device: nothing current to capture on
        pass
    try:
        if cupy is not None:
            stream = cupy.cuda.get_current_stream(device)
            streams.append((stream.ptr, stream))
    except Exception:  # no usable device (a machine without a GPU)
        pass
    return streams


#: the process's captures and releases
CAPTURES = Captures()
RELEASES = Releases(CAPTURES)
