"""Low-overhead kernel launches: one driver call with a prebuilt argument pack.

A ``Launcher`` holds, for one compiled entry point, one buffer with an 8-byte slot per
parameter and the array of pointers to those slots that ``cuLaunchKernel`` takes. The
parameters that never change (pool addresses, library slots, the timeout record) are
written once; a call packs the others into their slots with one ``struct`` call and
launches through CuPy's compiled binding of ``cuLaunchKernel``. Kernels that run in
thread-block clusters carry their cluster shape (kernels/rmsnorm.cuh: UB_CLUSTER), so
they launch the same way. A ``Packed`` launch has an argument pack of its own, written
once: a call plan (``_plans``) launches it without packing anything.

The binding-layer exception (ubnext's other CUDA calls use CuPy's public API, or
``cuda.bindings`` through ``cuda``): ``cupy_backends.cuda.api.driver`` is private, and
taken because it is the cheapest launch Python has, cheaper than ``cuda.bindings``'
``cuLaunchKernel`` with the same pack and far cheaper than CuPy's public ``RawKernel()``
(bench/launch_floor.py; the figures are in bench/NOTES.md).
"""

from __future__ import annotations

import ctypes
import struct

from cupy_backends.cuda.api import driver as _cupy_driver

from ubnext._protocol.errors import CudaError

U64, I32, F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float

#: how a parameter of each type is packed into its 8-byte slot (little-endian)
_SLOT_FORMAT = {U64: "Q", I32: "i4x", F32: "f4x"}
_SLOT = 8


class Launcher:
    """Launches one entry point whose parameters have the given ctypes types.

    Args:
        kernel: the compiled ``cupy.RawKernel`` (its CUfunction is used).
        types: one of U64, I32, F32 per kernel parameter, in order.
        prefix: values of the leading parameters, the same on every launch.
        suffix: values of the trailing parameters, the same on every launch.

    A call passes the values of the parameters in between. The argument pack is
    reused: calls must not overlap (a Communicator launches only inside its
    ``_streams.LaunchOrder`` section, which one thread holds at a time; a ``Packed``
    launch has a pack of its own). One per communicator and kernel.
    """

    def __init__(self, kernel, types, prefix=(), suffix=()):
        self.kernel = kernel  # keeps the module loaded
        self._func = kernel.kernel.ptr
        self._slots = ctypes.create_string_buffer(_SLOT * len(types))
        self._pack, self._pack_ptr = _pointers(self._slots)
        end = len(types) - len(suffix)

        def layout(part):
            return struct.Struct("<" + "".join(_SLOT_FORMAT[t] for t in part))

        layout(types[:len(prefix)]).pack_into(self._slots, 0, *prefix)
        layout(types[end:]).pack_into(self._slots, _SLOT * end, *suffix)
        self._varying = layout(types[len(prefix):end])
        self._offset = _SLOT * len(prefix)

    def __call__(self, blocks: int, threads: int, stream: int, *values) -> None:
        """Launches a 1-D grid on ``stream``; raises CudaError if the launch fails."""
        self._varying.pack_into(self._slots, self._offset, *values)
        _launch(self._func, blocks, threads, stream, self._pack_ptr)

    def _filled(self, values: tuple):
        """A new argument buffer with the constant parameters and ``values``."""
        slots = type(self._slots).from_buffer_copy(self._slots)  # the constant ones, packed once
        self._varying.pack_into(slots, self._offset, *values)
        return slots


class Packed:
    """One launch of a Launcher but for its stream, with an argument pack of its own,
    written once here: calling it packs nothing and writes nothing, so calls from several
    threads share no state; the pack holds the bytes that ``launcher(blocks, threads,
    stream, *values)`` packs. It keeps its launcher (the module) and ints, nothing else.

    Args:
        launcher: the entry point's Launcher.
        blocks, threads: the 1-D grid.
        values: the parameters between the launcher's prefix and suffix.
    """

    __slots__ = ("launcher", "blocks", "threads", "values", "_func", "_slots", "_pack", "_pack_ptr")

    def __init__(self, launcher: Launcher, blocks: int, threads: int, values: tuple):
        self.launcher, self.blocks, self.threads, self.values = launcher, blocks, threads, values
        self._func = launcher._func
        self._slots = launcher._filled(values)
        self._pack, self._pack_ptr = _pointers(self._slots)

    def __call__(self, stream: int) -> None:
        """Launches on ``stream``; raises CudaError if the launch fails."""
        _launch(self._func, self.blocks, self.threads, stream, self._pack_ptr)


def issue(launch: tuple, stream: int) -> None:
    """Launches ``launch`` on ``stream``: ``(launcher, blocks, threads, values)``, as the
    engine's ``*_launch`` methods give it (``Packed`` takes the same)."""
    launcher, blocks, threads, values = launch
    launcher(blocks, threads, stream, *values)


def _pointers(slots) -> tuple:
    """The array of pointers to the 8-byte slots of ``slots`` that ``cuLaunchKernel``
    takes, and its address."""
    n = len(slots) // _SLOT
    base = ctypes.addressof(slots)
    # packed as one struct call: a third of the time of a ctypes array built from a list
    pack = (ctypes.c_uint64 * n).from_buffer_copy(struct.pack(f"<{n}Q", *range(base, base + _SLOT * n, _SLOT)))
    return pack, ctypes.addressof(pack)


def _launch(func: int, blocks: int, threads: int, stream: int, pack_ptr: int) -> None:
    try:
        _cupy_driver.launchKernel(func, blocks, 1, 1, threads, 1, 1, 0, stream, pack_ptr, 0)
    except _cupy_driver.CUDADriverError as e:
        raise _launch_error(e.status) from None


def _launch_error(rc: int) -> CudaError:
    from cuda.bindings import driver

    from ubnext._environment.cuda import error_text

    return CudaError("cuLaunchKernel", rc, error_text(driver.CUresult(rc)))
