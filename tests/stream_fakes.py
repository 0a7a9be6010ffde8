"""Recording fakes for the stream tests (no GPU): the CUDA runtime calls of
``ubnext._streams`` and the driver launch of ``ubnext._launch``."""

from __future__ import annotations

import ctypes
import threading
import types


class FakeCuda:
    """Stands in for ``ubnext._streams.Cuda``: records every call in order.

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

    def event(self, device: int) -> int:
        with self._mutex:
            self._next += 1
            event = self._next
            self.live.add(event)
            self.calls.append(("event", device, event))
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


class FakeDriver:
    """Stands in for CuPy's driver binding in ``ubnext._launch``: ``launchKernel`` calls
    ``on_launch(args, stream)`` with the parameters the launch would pass."""

    class CUDADriverError(Exception):
        status = 1

    def __init__(self, nparams: int, on_launch):
        self._nparams = nparams
        self._on_launch = on_launch

    def launchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, pack_ptr, extra):  # noqa: N802 - CuPy's name
        self._on_launch(stream, lambda: read_pack(pack_ptr, self._nparams))
