"""Recording fakes for the stream tests (no GPU): the CUDA runtime calls of
``ubnext._interop.streams`` and the driver launch of ``ubnext._engine.launch``."""

from __future__ import annotations

import ctypes
import threading
import types


class FakeCuda:
    """Stands in for ``ubnext._interop.streams.Cuda``: records every call in order.

    Args:
        captures: stream handle -> the id of the CUDA graph capture it is in (absent: 0,
            not capturing; -1: an invalidated capture).
    """

    def __init__(self, captures: dict | None = None):
        self.calls: list[tuple] = []
        self.captures = dict(captures or {})
        self.live: set[int] = set()
        self.fail_record = False
        self._next = 100
        self._mutex = threading.Lock()

    def event(self) -> int:
        with self._mutex:
            self._next += 1
            event = self._next
            self.live.add(event)
            self.calls.append(("event", event))
        return event

    def record(self, event: int, stream: int) -> None:
        if self.fail_record:
            raise RuntimeError("record failed")
        self.calls.append(("record", event, stream))

    def wait(self, stream: int, event: int) -> None:
        self.calls.append(("wait", stream, event))

    def destroy(self, event: int) -> None:
        self.live.remove(event)
        self.calls.append(("destroy", event))

    def capture(self, stream: int) -> int:
        return self.captures.get(stream, 0)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def fake_kernel(ptr: int = 0xF00):
    """An object shaped like a ``cupy.RawKernel`` as ``Launcher`` reads it."""
    return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=ptr))


def read_pack(pack_ptr: int, count: int) -> list[int]:
    """The 8-byte slots behind a ``cuLaunchKernel`` argument array, as unsigned integers."""
    pointers = (ctypes.c_void_p * count).from_address(pack_ptr)
    return [ctypes.c_uint64.from_address(p).value for p in pointers]


def read_launch_config(config_ptr: int) -> tuple:
    """A ``cuLaunchKernelEx`` config's (grid, block, stream, attributes): attributes as
    (id, the value's first 32-bit word) pairs; a 1-D grid and no shared memory checked."""
    from ubnext._engine.launch import LaunchAttribute, LaunchConfig

    config = LaunchConfig.from_address(config_ptr)
    assert (config.gridDimY, config.gridDimZ, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (1,) * 4 + (0,)
    attributes = (LaunchAttribute * config.numAttrs).from_address(config.attrs)
    return (config.gridDimX, config.blockDimX, config.hStream or 0,
            [(a.id, int.from_bytes(a.value[:4], "little")) for a in attributes])


#: what a dependent launch's config carries: programmatic stream serialization allowed
PROGRAMMATIC = [(6, 1)]


class FakeDriver:
    """Stands in for CuPy's driver binding in ``ubnext._engine.launch``: ``launchKernel`` calls
    ``on_launch(args, stream)`` with the parameters the launch would pass; ``launch_ex``
    stands in for libcuda's ``cuLaunchKernelEx`` (``_launch._launch_ex``) alike."""

    class CUDADriverError(Exception):
        status = 1

    def __init__(self, nparams: int, on_launch):
        self._nparams = nparams
        self._on_launch = on_launch

    def launchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, pack_ptr, extra):  # noqa: N802 - CuPy's name
        self._on_launch(stream, lambda: read_pack(pack_ptr, self._nparams))

    def launch_ex(self, config_ptr, func, pack_ptr, extra) -> int:
        _, _, stream, attributes = read_launch_config(config_ptr)
        assert attributes == PROGRAMMATIC and extra is None
        self._on_launch(stream, lambda: read_pack(pack_ptr, self._nparams))
        return 0


class FakeContexts:
    """Stands in for ``ubnext._interop.context.Driver``: one context per device (handle 0xC0 +
    device), a current one per host thread (0: none), every change recorded.

    Args:
        streams: stream handle -> the context handle it belongs to (``stream_context``).
    """

    def __init__(self, streams: dict | None = None):
        self.streams = dict(streams or {})
        self.changes: list[tuple] = []   # (thread name, context made current)
        self.retained: dict[int, int] = {}
        self.primary: set[int] = set()  # devices whose primary context exists besides the retained
        self._current = threading.local()

    @staticmethod
    def of(device: int) -> int:
        return 0xC0 + device

    def current(self) -> int:
        return getattr(self._current, "handle", 0)

    def make_current(self, handle: int) -> None:
        """As CUDA does: the runtime then takes the context's device as the thread's."""
        self._current.handle = handle
        if handle:
            self._current.device = handle - 0xC0
        self.changes.append((threading.current_thread().name, handle))

    def runtime_device(self) -> int:
        return getattr(self._current, "device", 0)

    def set_runtime_device(self, device: int) -> None:
        self.make_current(self.of(device))

    def active(self, device: int) -> bool:
        return device in self.retained or device in self.primary

    def stream_context(self, stream: int) -> int:
        """The context of ``stream``: as ``streams`` says, else the first retained device's."""
        return self.streams.get(stream) or self.of(next(iter(self.retained), 0))

    def retain(self, device: int) -> int:
        self.retained[device] = self.retained.get(device, 0) + 1
        return self.of(device)

    def release(self, device: int) -> None:
        self.retained[device] -= 1


def fake_context(device: int, contexts: FakeContexts | None = None):
    """A ``ubnext._interop.context.Context`` of ``device`` on ``contexts`` (default: a new
    FakeContexts)."""
    from ubnext._interop.context import Context

    return Context(device, contexts or FakeContexts())


def fake_order(device: int = 0, contexts: FakeContexts | None = None, cuda=None):
    """A ``ubnext._interop.streams.LaunchOrder`` on a fake context of ``device``."""
    from ubnext._interop.streams import LaunchOrder

    return LaunchOrder(fake_context(device, contexts), cuda)


def bare_communicator(order, **attrs):
    """A Communicator built without a GPU: ``order`` (``fake_order``) as its launch section,
    ``attrs`` as its attributes (what the test's calls read: ``_dispatch``, ``_node``,
    ``_selector``...), and what ``close`` releases made of them (no watchdog, no bootstrap
    of its own)."""
    import weakref

    from ubnext._api.communicator import Communicator
    from ubnext._api.lifetime import Exchanges, Owned
    from ubnext._api.plans import Plans

    comm = Communicator.__new__(Communicator)
    comm.__dict__.update(rank=0, size=1, device=order.context.device, _closed=False, _resolved={}, _plans=Plans(),
                         _node=None, _local=None, _order=order, _context=order.context, _areas={},
                         _exchanges=Exchanges())
    comm.__dict__.update(attrs)
    comm._owned = Owned(order, comm._node, comm.__dict__.get("_dispatch"), None, comm._local, None, 0,
                        comm._exchanges)
    comm._finalizer = weakref.finalize(comm, lambda: None)
    return comm
