"""The communicator's CUDA context: current while ubnext works, the caller's given back.

A call never depends on the caller's ambient CUDA state (DESIGN: the device and context
invariant). Kernels are launched into the current context, CuPy compiles and memoizes
modules for the current device, stream handle 0 is the current context's null stream,
CuPy allocates on the current device, and a thread that never set a device has no
current context at all. So whatever ubnext does on the device runs with the
communicator's context current: :class:`Context` makes it current only where another is
(one read of the current context while it already is) and gives the caller's back
afterwards, also where the caller had none.

The communicator's launch section (``_streams.LaunchOrder``) enters it for every call,
close and a dropped communicator's release included; the steps that run outside the
section (abort's and the watchdog's announce, the node's teardown) enter it with
``with context.current():``. Leaving either compares the context actually current with
the caller's, so a switch made inside is undone too.

This module is the one place that sets the context (tests/test_ambient_state.py). What
else could switch it inside runs through :func:`keep_current` (a torch stream's
constructor, which enters torch's device guard; a producer's DLPack export); torch's
stream guard (``torch.cuda.stream``) and ``ExternalStream`` are not used at all: leaving
the stream guard sets torch's lazy per-thread device, a ``cudaSetDevice`` that makes a
context on a device no call of the communicator uses, which no restore undoes.
"""

from __future__ import annotations

from ubnext._environment.cuda import drv
from ubnext._interop.streams import LEGACY, PER_THREAD

#: stream handles that name a default stream of whatever context is current
_DEFAULT_STREAMS = (0, LEGACY, PER_THREAD)


def caller_device() -> int:
    """The device the caller made current (the runtime's answer: 0 where the thread has
    none): a communicator's default device, where the caller set one. Read only there;
    every call uses the communicator's own."""
    from cupy.cuda import runtime

    return runtime.getDevice()


def current_device() -> int:
    """The device of the current context (in a launch section: the communicator's; the
    runtime's answer). Not collective; no context is made or switched."""
    return _default_driver().runtime_device()


class Driver:
    """The context calls of the CUDA driver. Tests pass a recording fake with these methods.

    ``current`` and ``make_current`` are CuPy's compiled driver bindings (every call reads
    the current context: the cheapest binding); the primary context is retained through
    ``cuda.bindings``.
    """

    def __init__(self):
        from cupy_backends.cuda.api import driver, runtime

        self.current = driver.ctxGetCurrent  # () -> the current context's handle (0: none)
        self.make_current = driver.ctxSetCurrent  # (handle) -> None; 0 leaves the thread without one
        self.stream_context = driver.streamGetCtx  # (stream handle) -> its context's handle
        # the runtime's device of a thread without a context: the one its next call would use
        self.runtime_device, self.set_runtime_device = runtime.getDevice, runtime.setDevice

    @staticmethod
    def active(device: int) -> bool:
        """Whether ``device``'s primary context exists (making it current creates none)."""
        return bool(drv("cuDevicePrimaryCtxGetState", drv("cuDeviceGet", device))[1])

    @staticmethod
    def retain(device: int) -> int:
        """The handle of ``device``'s primary context, retained (created if need be)."""
        return int(drv("cuDevicePrimaryCtxRetain", drv("cuDeviceGet", device)))

    @staticmethod
    def release(device: int) -> None:
        """Releases one retain of ``device``'s primary context."""
        drv("cuDevicePrimaryCtxRelease", drv("cuDeviceGet", device))


class Context:
    """One device's primary CUDA context, held while a communicator lives.

    Args:
        device: the CUDA device ordinal (this process's numbering).
        driver: the context calls (default: :class:`Driver`).

    Attributes:
        device: the ordinal.
        handle: the context's handle (an int, as the driver's ``CUcontext``).

    Raises:
        CudaError: the primary context cannot be retained.
    """

    def __init__(self, device: int, driver: Driver | None = None):
        driver = driver or _default_driver()
        self.device = device
        self.handle = driver.retain(device)
        self._driver = driver
        self._make_current = driver.make_current
        #: the driver's cuCtxGetCurrent (the section reads it itself, calling enter only to switch)
        self.current_handle = driver.current
        self._released = False

    def enter(self):
        """Makes this context current where it is not; returns what :meth:`leave` gives
        back: the caller's context, or for a thread without one (a new thread) the device
        the runtime would use there.

        Raises:
            CuPy's CUDADriverError: the context could not be made current.
        """
        caller = self.current_handle()
        if caller != self.handle:
            if not caller:
                caller = _Bare(self._driver.runtime_device())  # read before any context is current
            self._make_current(self.handle)
        return caller

    def leave(self, caller) -> None:
        """Gives the caller's context back (``caller``: what :meth:`enter` returned, or the
        context current before, where it was this one), whatever was made current
        meanwhile: code run in between (torch's guards, a library's export) may have
        switched it. One read of the current context where the caller's is current."""
        if caller.__class__ is _Bare:
            _restore(self._driver, caller)
        elif self.current_handle() != caller:
            self._make_current(caller)

    def owns(self, stream: int) -> bool:
        """Whether stream handle ``stream`` belongs to this context: the handles of the
        current context's default streams (0, legacy, per-thread) do in the section.

        Raises:
            CuPy's CUDADriverError: ``stream`` is no stream.
        """
        return stream in _DEFAULT_STREAMS or self._driver.stream_context(stream) == self.handle

    def current(self) -> _Current:
        """``with context.current():`` runs its body with this context current and gives
        the caller's back (for the steps that run outside a call's launch section)."""
        return _Current(self)

    def release(self) -> None:
        """Releases the retain taken at construction (the context itself lives on while
        CUDA's runtime, CuPy or torch hold it). Idempotent."""
        if not self._released:
            self._released = True
            self._driver.release(self.device)


class _Bare:
    """The state of a caller's thread without a current context: the runtime's device."""

    __slots__ = ("device",)

    def __init__(self, device: int):
        self.device = device


def _restore(driver: Driver, caller) -> None:
    """Makes ``caller`` (a context handle, or a ``_Bare`` thread state) current again. A
    thread that had no context is left without one, its runtime device as it was: CUDA's
    runtime takes the device of a context it has seen current as the thread's device, so
    the caller's one is set again, where that creates no context (its primary context
    exists: as torch's device guard does); else the runtime keeps the other device for
    the thread's next runtime call."""
    if caller.__class__ is not _Bare:
        driver.make_current(caller)
        return
    driver.make_current(0)
    if driver.runtime_device() != caller.device and driver.active(caller.device):
        driver.set_runtime_device(caller.device)
        driver.make_current(0)


def keep_current(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with the thread's current context (or, without one, its
    runtime device) given back afterwards where ``fn`` changed it: foreign code called in
    a call's section (a DLPack producer's export: XLA's switches to its own device) must
    not take the section's context away, and a communicator made and closed by a helper
    (the selftest's) must not leave its device current."""
    try:
        driver = _default_driver()
        before = driver.current() or _Bare(driver.runtime_device())
    except Exception:  # no CUDA driver can be loaded here: no context to keep; fn says what is wrong
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    finally:
        now = driver.current()
        if before.__class__ is _Bare:  # had no context: changed if fn left one, or another runtime device
            changed = bool(now) or driver.runtime_device() != before.device
        else:
            changed = now != before
        if changed:
            _restore(driver, before)


_DRIVER: list = []


def _default_driver() -> Driver:
    if not _DRIVER:
        _DRIVER.append(Driver())
    return _DRIVER[0]


class _Current:
    """The ``with`` form of ``Context.enter`` / ``Context.leave``."""

    __slots__ = ("_context", "_caller")

    def __init__(self, context: Context):
        self._context = context

    def __enter__(self) -> Context:
        self._caller = self._context.enter()
        return self._context

    def __exit__(self, *exc) -> None:
        self._context.leave(self._caller)
