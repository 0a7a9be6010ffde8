"""Stream order of a communicator's launches, and waits for a foreign producer's stream.

A communicator is one ordered queue, as in NCCL: its calls share the launch states, the
Lamport receive buffers and the staging slot, so no call may run before a call issued
ahead of it, whatever stream each is issued on. :class:`LaunchOrder` keeps that order:
it remembers the stream of the last launch and, when a call comes on another stream,
makes the new stream wait for an event recorded on the previous one. Nothing is done
while the stream stays the same, and the host never waits. It is also the call's
section: its lock makes each call one section, so calls may come from several host
threads (the argument packs of the launchers and the staging slot are shared by all
calls), and entering it makes the communicator's CUDA context current (``_context``).

:func:`order_after` is the one wait: an event recorded on one stream and waited for by
another. It serves the cross-stream order and arrays whose ``__cuda_array_interface__``
names the stream that produces them.

A stream being captured into a CUDA graph can only wait for work of its own capture,
and an eager stream cannot wait for captured work: waits between streams that are not
in the same capture are left out, so that a capture is never invalidated. Ordering a
replayed graph against eager calls of the same communicator is the caller's contract,
as in NCCL.
"""

from __future__ import annotations

import threading
from threading import get_ident

#: cudaStreamLegacy; handle 0 also means the legacy default stream (CuPy's and torch's null stream)
LEGACY = 1
#: cudaStreamPerThread: in every host thread another stream
PER_THREAD = 2


class Cuda:
    """The CUDA runtime calls of stream ordering (through CuPy's bindings; the capture
    sequence id through cuda.bindings). Tests pass a recording fake with these methods.
    None of them blocks the host."""

    def event(self) -> int:
        """A new event (no timing) of the current context: in a launch section, the
        communicator's (no context is switched to make it)."""
        from cupy.cuda import runtime

        return runtime.eventCreateWithFlags(runtime.eventDisableTiming)

    def record(self, event: int, stream: int) -> None:
        from cupy.cuda import runtime

        runtime.eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        from cupy.cuda import runtime

        runtime.streamWaitEvent(stream, event, 0)

    def destroy(self, event: int) -> None:
        """Releases ``event``; a wait already queued on it still holds (CUDA releases the
        event once it has completed)."""
        from cupy.cuda import runtime

        runtime.eventDestroy(event)

    def capture(self, stream: int) -> int:
        """0 when ``stream`` is not being captured, else the id of its capture sequence
        (-1: a capture that was invalidated)."""
        if stream in (0, LEGACY):  # never captures, and may not be queried while another stream does
            return 0
        from cupy.cuda import runtime

        try:
            if not runtime.streamIsCapturing(stream):  # CuPy's query is the fast one
                return 0
        except runtime.CUDARuntimeError:
            raise
        except RuntimeError:  # CuPy raises this for an invalidated capture
            return -1
        from cuda.bindings import driver

        from ubnext._environment.cuda import drv

        return int(drv("cuStreamGetCaptureInfo", driver.CUstream(stream))[1])


#: the runtime calls used by default (a module attribute, so that tests can replace it)
CUDA = Cuda()


def refuse_capture(name: str, stream: int, what: str, call: str = "such call") -> None:
    """Raises where ``stream`` is being captured into a CUDA graph, for a call whose first
    use of a communicator sets something up on the host (``what``), which a graph cannot
    hold (the capture would break, or replay a call that set nothing up). Local; raised
    before anything is queued, so that the capture stays valid.

    Args:
        call: what the message calls the first call ("such call", "overlapped call").

    Raises:
        UbnextError: ``stream`` is capturing.
    """
    if CUDA.capture(stream):
        from ubnext._protocol.errors import UbnextError

        raise UbnextError(f"{name}: the first {call} on a communicator cannot be captured in a CUDA graph "
                          f"({what}); make one eager call first, on every rank, then capture")


_THREAD = threading.local()


def _this_thread() -> object:
    """An object of the calling thread, alive while it is: unlike a thread id, which
    Python reuses for a later thread, it names no other thread while it is kept."""
    token = getattr(_THREAD, "token", None)
    if token is None:
        token = _THREAD.token = object()
    return token


def same_stream(a: int, b: int) -> bool:
    """Whether handles ``a`` and ``b`` name the same stream of the calling thread (0 and
    LEGACY both name the legacy default stream)."""
    return a == b or (a in (0, LEGACY) and b in (0, LEGACY))


def order_after(producer: int, consumer: int, cuda: Cuda | None = None) -> bool:
    """Makes the work queued later on ``consumer`` wait for the work queued so far on
    ``producer``: an event recorded on ``producer`` and waited for by ``consumer``. The
    host does not wait. Not collective. Only where ``producer``'s context is current (in
    a launch section: a stream of the communicator's device).

    Args:
        producer: raw cudaStream_t whose queued work must come first.
        consumer: raw cudaStream_t of the work that follows.
        cuda: the runtime calls; default ``CUDA``.

    Returns:
        Whether a wait was queued: not for the same stream, nor for two streams that are
        not in the same CUDA graph capture (the wait would invalidate a capture).

    Raises:
        CudaError or CuPy's CUDARuntimeError: a runtime call failed.
    """
    if same_stream(producer, consumer):
        return False
    cuda = cuda or CUDA
    capture = cuda.capture(consumer)
    if capture < 0 or capture != cuda.capture(producer):
        return False
    event = cuda.event()
    try:
        cuda.record(event, producer)
        cuda.wait(consumer, event)
    finally:
        cuda.destroy(event)
    return True


class LaunchOrder:
    """The launch section of one communicator: the communicator's CUDA context current, one
    host thread at a time, launches in issue order on any stream.

    Every call of a communicator runs its whole body in the section::

        with order:                      # the lock, then the communicator's context
            ...                          # validation, outputs, plans
            order.follow(stream, owner)  # before the call's first launch on `stream`
            ...                          # its launches, copies and NCCL calls on `stream`

    Entering takes the lock, so that the launches of a call stay together (another
    thread's launches do not come in between, nor overwrite the launchers' argument packs
    under them, nor close the communicator under them), and makes the communicator's
    context current where another one is (``_context.Context``): whatever device the
    caller made current, the call's kernels, compiles, allocations and stream handle 0
    are the communicator's. Leaving compares the context actually current with the
    caller's and gives the caller's back whatever switched it inside (torch or CuPy code
    the call ran, a producer's export), then releases the lock. An operation made of
    several calls and launches of its own takes one ``composite`` section.
    ``follow`` makes ``stream`` wait for the stream of the previous launch when it is
    another one. The per-thread default stream is another stream in every thread, and a
    thread cannot name another thread's one, so leaving records an event after a call on
    it, for the next call to wait for.

    Args:
        context: the communicator's ``_context.Context``.
        cuda: the runtime calls; default ``CUDA`` (looked up at each use).
    """

    def __init__(self, context, cuda: Cuda | None = None):
        self.context = context
        self._device = context.device
        self._handle = context.handle
        self._current = context.current_handle  # the driver's cuCtxGetCurrent
        self._cuda = cuda
        lock = threading.Lock()
        self._acquire, self._release = lock.acquire, lock.release
        self._holder = None    # the thread in the section (a call from inside it must not wait for it)
        self._caller = 0       # what Context.enter returned: the caller's context or thread state
        self._followed = None  # the stream this call launches on, once ``follow`` named it
        self._stream = None    # the raw handle of the previous launch's stream
        self._thread = None    # the thread it came from, for the per-thread default stream
        self._owner = None     # its stream object, kept so that it is not destroyed meanwhile
        self._done = None      # event recorded after the previous launch (per-thread default stream)
        self._depth = 0        # in a composite section: 1 + the calls of it under way
        self._at_exit = []     # what runs once the holder leaves the section (at_exit)

    def __enter__(self) -> LaunchOrder:
        """Blocks while another thread is in the section, then makes the communicator's
        context current (one read of the current context while it already is). Inside a
        :meth:`composite` section of the same thread, the calls it makes enter at once.

        Raises:
            UbnextError: the thread in the section enters it again (code that a call runs,
                a producer's export or a finalizer, calls the same communicator), which
                would wait for itself forever.
            CuPy's CUDADriverError: the context could not be made current (the section is
                left).
        """
        if not self._acquire(False):
            if self._holder == get_ident():
                if self._depth:  # a composite section of this thread: its calls are parts of it
                    self._depth += 1
                    self._keep_context()
                    return self
                from ubnext._protocol.errors import UbnextError

                raise UbnextError("ubnext: a call of this communicator was made from inside one of its own "
                                  "calls (a producer's export, a finalizer); make it after that call returns")
            self._acquire()
        self._holder = get_ident()
        caller = self._current()
        if caller != self._handle:
            try:
                caller = self.context.enter()
            except BaseException:
                self._holder = None
                self._release()
                raise
        self._caller = caller
        return self

    def __exit__(self, *exc) -> None:
        """Records the event a call on the per-thread default stream leaves for the next
        call; then, leaving the outermost section, makes the caller's context current again
        where another one is, whatever switched it (the caller's, or something the call ran:
        torch or CuPy code, a library's export), and leaves the section."""
        try:
            if self._followed == PER_THREAD:
                self._record_done()
        finally:
            self._followed = None
            if self._depth > 1:  # a call inside a composite section: the section goes on
                self._depth -= 1
            else:
                pending, self._at_exit = self._at_exit, []
                try:
                    self._leave()
                finally:
                    for fn in pending:
                        fn()

    def at_exit(self, fn) -> None:
        """Runs ``fn()`` once the thread in the section leaves its outermost level (a
        composite section's end), out of the section: for ``abort()`` called from inside a
        call of this thread (a signal handler, a hook), whose release would wait for the
        section this thread holds, or unmap what the operation still copies from. Only from
        the thread in the section."""
        self._at_exit.append(fn)

    def _leave(self) -> None:
        try:
            self.context.leave(self._caller)
        finally:
            self._holder = None
            self._release()

    def composite(self) -> _Composite:
        """``with order.composite():`` one section for an operation made of several calls of
        the communicator and launches of its own (``ubnext.torch``'s overlapped GEMMs: their
        GEMMs into the pool, copies, barriers and joins): its calls, made by the same
        thread, enter without waiting, and no other thread's call, close or abort comes in
        between. Not a way in for foreign code: a call from inside an ordinary section
        still raises."""
        return _Composite(self)

    def follow(self, stream: int, owner=None) -> None:
        """Orders the launches on ``stream`` (raw handle; ``owner``: the stream object it
        came from, or None) that follow after those of the previous call. Costs one
        comparison while the stream stays the same. Only inside the section.

        Also makes the communicator's context current again where code the call ran
        before its launches switched it (torch's device guard of an allocation, whose exit
        sets the device torch takes for the thread's: one read while nothing did).

        Raises:
            CudaError or CuPy's CUDARuntimeError: the wait could not be queued (the next
                call tries again).
        """
        self._keep_context()
        if stream != self._stream or stream == PER_THREAD:
            self._change(stream, owner)
        self._followed = stream  # once ordered: a failed wait leaves the previous stream the one to follow

    def _keep_context(self) -> None:
        if self._current() != self._handle:
            self.context.enter()

    def close(self) -> None:
        """Drops the previous call's stream object and destroys its pending event, on this
        thread: a closed communicator's objects are left to the garbage collector, which
        may free them on a thread whose current device is another one (destroying a CUDA
        object there would create a context on that device). Only inside the section.
        Idempotent; a later call starts a new order."""
        done, self._done = self._done, None
        self._stream = self._thread = self._owner = None
        if done is not None:
            (self._cuda or CUDA).destroy(done)

    def _change(self, stream: int, owner) -> None:
        thread = _this_thread() if stream == PER_THREAD else None
        if stream == self._stream and thread is self._thread:
            return
        if self._stream is not None:
            self._after_previous(stream)
        self._stream, self._thread, self._owner = stream, thread, owner

    def _after_previous(self, stream: int) -> None:
        cuda = self._cuda or CUDA
        if self._done is None:
            order_after(self._stream, stream, cuda)
            return
        # the previous stream was a thread's default stream, which this thread may not be
        # able to name: wait for the event recorded after its launches
        done, self._done = self._done, None
        try:
            if cuda.capture(stream) == 0:
                cuda.wait(stream, done)
        finally:
            cuda.destroy(done)

    def _record_done(self) -> None:
        cuda = self._cuda or CUDA
        if self._done is not None:
            cuda.destroy(self._done)
            self._done = None
        if cuda.capture(PER_THREAD) == 0:
            event = cuda.event()
            try:
                cuda.record(event, PER_THREAD)
            except BaseException:
                cuda.destroy(event)
                raise
            self._done = event


class _Composite:
    """The ``with`` form of ``LaunchOrder.composite``: a section (or, inside one already
    composite, a part of it) whose holder's calls enter again."""

    __slots__ = ("_order", "_outer")

    def __init__(self, order: LaunchOrder):
        self._order = order
        self._outer = False

    def __enter__(self) -> LaunchOrder:
        order = self._order
        order.__enter__()
        if not order._depth:  # a section of its own (not a part of a composite one)
            order._depth, self._outer = 1, True
        return order

    def __exit__(self, *exc) -> None:
        if self._outer:
            self._order._depth = 0
        self._order.__exit__(*exc)
