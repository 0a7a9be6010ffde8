"""Who holds a communicator's resources: arrays, captured CUDA graphs and the node itself.

As a torch storage owns its allocator's memory, everything that points into the pool or
the node's host words keeps what it needs mapped (DESIGN: Ownership):

* :class:`Lease`: this rank's pool segment and the node's whole address range (never
  reserved again while an array of it lives), and the retain of the CUDA context they
  belong to. Held by the node until ``close``, by every ``Block`` (the owner of an array
  from ``empty()``, whatever framework views it) and by :class:`Graphs` while a captured
  graph lives. Released once, when the last holder is gone, on the thread that drops it,
  with the context current, or where a capture that ubnext knows of is in progress, after
  it on a thread of ubnext (``captures``; not at interpreter exit: the process's end
  frees it).
* :class:`Graphs`: captured CUDA graphs that launched work of a communicator. Neither
  torch's ``CUDAGraph`` nor CuPy's ``Graph`` keeps a list of Python objects alive, so each
  capture that a call joins gets a CUDA user object (``cuUserObjectCreate``), retained by
  the graph being captured (``cuGraphRetainUserObject``; instantiated graphs and clones
  retain it too). Its destructor runs on a CUDA-internal thread, where no CUDA call and no
  Python may run: it is libc's ``sem_post`` on a semaphore of ours, nothing else. A thread
  of ubnext waits on the semaphore, counts the graphs gone, and once none lives and the
  owner is closed, runs the releases the owner deferred to then. The node's graphs (its
  kernels' captures) defer what only graphs still need (the peers' segments, the multicast
  range, the failure words) and hold the lease; the dispatcher's (captures of NCCL work)
  defer the NCCL communicator's release, so that a graph replayed after ``close`` never
  uses a destroyed ``ncclComm``.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import sys
import threading
from typing import Any, Callable

from ubnext._engine.captures import CAPTURES, RELEASES
from ubnext._environment.cuda import drv
from ubnext._interop import streams as _streams

#: capture ids remembered per node (a capture's later calls find theirs among them)
_RECENT_CAPTURES = 64
#: bytes reserved for a sem_t (32 on Linux x86-64 and aarch64)
_SEM_BYTES = 64


class Lease:
    """Keeps a node's own memory mapped while it is referenced; ``release`` runs once, when
    :meth:`release` is called or when the last reference goes (then through
    ``captures.RELEASES``: not while a capture ubnext knows of is in progress, and its
    errors are logged, not raised; nothing runs at interpreter exit).

    Args:
        release: what gives the memory back (it makes the context current itself).
        context: the memory's context (``_interop.context.Context``), or None.
    """

    __slots__ = ("_release", "_context", "__weakref__")

    def __init__(self, release: Callable[[], None], context=None):
        self._release, self._context = release, context

    def release(self) -> None:
        """Releases now (idempotent).

        Raises:
            What the release raised (it runs once all the same).
        """
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        release, self._release = self._release, None
        if release is None or sys.is_finalizing():
            return
        RELEASES.run(release, self._context)


class Semaphore:
    """A POSIX semaphore in memory of its own (libc's malloc), which CUDA's destructor
    thread posts through ``post_fn``: a C function, no Python, no GIL. :meth:`wait` blocks
    without the GIL (ctypes releases it). Freed by :meth:`destroy` only, once nothing can
    post it any more; a semaphore left at exit is never freed."""

    def __init__(self):
        libc = _libc()
        self._libc = libc
        self.ptr = libc.malloc(_SEM_BYTES)
        if not self.ptr:
            raise MemoryError("ubnext: no memory for a semaphore")
        if libc.sem_init(self.ptr, 0, 0) != 0:
            libc.free(self.ptr)
            raise OSError(ctypes.get_errno(), "ubnext: sem_init failed")
        #: address of libc's sem_post, the destructor CUDA calls with ``ptr``
        self.post_fn = ctypes.cast(libc.sem_post, ctypes.c_void_p).value

    def post(self) -> None:
        self._libc.sem_post(self.ptr)

    def wait(self) -> None:
        """Blocks until a post, then takes it."""
        while self._libc.sem_wait(self.ptr) != 0:
            if ctypes.get_errno() != errno.EINTR:
                raise OSError(ctypes.get_errno(), "ubnext: sem_wait failed")

    def destroy(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._libc.sem_destroy(ptr)
            self._libc.free(ptr)


_LIBC: list = []


def _libc():
    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
        libc.sem_init.restype, libc.sem_init.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        for name in ("sem_post", "sem_wait", "sem_destroy"):
            fn = getattr(libc, name)
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
        _LIBC.append(libc)
    return _LIBC[0]


class Graphs:
    """The captured CUDA graphs that hold what an owner (a node, a dispatcher) released at
    close (see the module docstring).

    Args:
        driver: the ``cuda.bindings.driver`` module (default) or a fake, for tests.
        context: the owner's context (``_interop.context.Context``), where its captures are
            queried until they end (``captures.CAPTURES``); None: they are not tracked.

    Attributes:
        live: graphs (captures) holding the owner's resources.
    """

    def __init__(self, driver: Any = None, context=None):
        self._driver, self._context = driver, context
        self._lock = threading.Lock()
        self.live = 0
        self._open = True
        self._wakeups = 0  # posts of ours (not CUDA's) still to be taken
        self._lease: Lease | None = None  # held while a graph lives
        self._releases: list[Callable] = []  # run once no graph lives after close
        self._releasing = False  # the graphs' thread runs them now (a later close's wait behind)
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self._signal: Semaphore | None = None
        self._thread: threading.Thread | None = None

    def hold(self, stream: int, lease: Lease | None = None) -> None:
        """Where ``stream`` is being captured into a CUDA graph, makes that graph hold the
        owner's resources (and ``lease``, if given) until it is destroyed, and tracks the
        capture until it ends (``captures.CAPTURES.track``: no release runs meanwhile):
        once per capture (its later calls cost a lookup; a stream not captured, a query).
        In the launch section, before the call's launches.

        Raises:
            CudaError: a driver call failed (nothing is held then).
        """
        capture = _streams.CUDA.capture(stream)  # 0: not captured (the cost of every call)
        if capture <= 0 or capture in self._recent:
            return
        if self._context is not None:
            CAPTURES.track(capture, stream, self._context)
        d = self._driver_module()
        graph = drv("cuStreamGetCaptureInfo", d.CUstream(stream), driver=self._driver)[2]
        with self._lock:
            if self._signal is None:
                self._signal = Semaphore()
            self.live += 1  # the reaper counts the destructor's post, also of an object released below
            if lease is not None:
                self._lease = lease
            signal = self._signal
        obj = None
        try:
            obj = drv("cuUserObjectCreate", signal.ptr, d.CUhostFn(signal.post_fn), 1,
                      d.CUuserObject_flags.CU_USER_OBJECT_NO_DESTRUCTOR_SYNC, driver=self._driver)
            drv("cuGraphRetainUserObject", graph, obj, 1, d.CUuserObjectRetain_flags.CU_GRAPH_USER_OBJECT_MOVE,
                driver=self._driver)
        except BaseException:
            if obj is None:  # no destructor will post: undo the count here
                with self._lock:
                    self.live -= 1
            else:  # the reference stayed ours: releasing it runs the destructor (a post)
                drv("cuUserObjectRelease", obj, 1, driver=self._driver)
                self._start()
            raise
        self._recent[capture] = True
        if len(self._recent) > _RECENT_CAPTURES:
            self._recent.popitem(last=False)
        self._start()

    def close(self, *releases: Callable) -> bool:
        """The owner is closed: no graph holds anything new. Returns whether no graph lives
        (the caller runs ``releases`` now); else they run on the graphs' thread, in the order
        given (after those of an earlier call), once the last graph is destroyed, and the
        lease goes then (through ``captures.RELEASES``). A release returns a list of errors,
        or None; what it returns or raises is logged there. Idempotent; a later call may
        defer more.
        """
        with self._lock:
            first, self._open = self._open, False
            if self.live or self._releasing:
                self._releases += releases
                return False
            self._lease = None
            if first and self._thread is not None:  # waiting for a destructor that will not come: let it end
                self._wakeups += 1
                self._signal.post()
            return True

    def _driver_module(self) -> Any:
        if self._driver is not None:
            return self._driver
        from cuda.bindings import driver

        return driver

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._reap, name="ubnext-graphs", daemon=True)
                self._thread.start()

    def _reap(self) -> None:
        """The graphs' thread: takes each post (a graph's user object destroyed, or a wake-up
        of ``close``), and once no graph lives drops the lease's hold and, after close, runs
        the deferred releases; then ends, freeing the semaphore."""
        signal = self._signal
        while True:
            signal.wait()
            with self._lock:
                if self._wakeups:
                    self._wakeups -= 1
                else:
                    self.live -= 1
                lease = None
                if self.live == 0:
                    lease, self._lease = self._lease, None
                done = not self._open and self.live == 0
                run = self._releasing = done and bool(self._releases)  # a close meanwhile appends to them
            if run:
                self._run_releases()
            del lease  # the last hold: the segment is released here, on this thread
            if done:
                with self._lock:
                    self._thread = None
                    if not self._wakeups:
                        self._signal = None
                        signal.destroy()
                        return

    def _run_releases(self) -> None:
        """Runs the deferred releases, those a ``close`` adds meanwhile included, through
        ``captures.RELEASES`` (in order; not while a known capture is in progress)."""
        while True:
            with self._lock:
                if not self._releases:
                    self._releasing = False
                    return
                release = self._releases.pop(0)
            RELEASES.run(release)
