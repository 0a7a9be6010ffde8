"""Low-overhead kernel launches: one driver call with a prebuilt argument pack.

A ``Launcher`` holds, for one compiled entry point, one buffer with an 8-byte slot per
parameter and the array of pointers to those slots that the driver takes. The
parameters that never change (pool addresses, library slots, the timeout record) are
written once; a call packs the others into their slots with one ``struct`` call and
launches. Kernels that run in thread-block clusters carry their cluster shape
(kernels/rmsnorm.cuh: UB_CLUSTER), so they launch the same way. A ``Packed`` launch has
an argument pack of its own, written once: a call plan (``_plans``) launches it without
packing anything.

Two ways to the driver, chosen per launcher:

* **dependent** (programmatic dependent launch, ``Config.pdl``, sm_90 and later):
  ``cuLaunchKernelEx`` with the programmatic stream-serialization attribute, so the
  kernel may start while the kernel before it on the stream finishes; every entry point
  waits for that kernel before it reads anything it wrote (kernels/common.cuh:
  grid_dependency_wait). The ``CUlaunchConfig`` is built once per launcher (and per
  ``Packed``); a call writes its grid, block and stream into it with one ``struct`` call
  and makes one ctypes call into libcuda, whose argument types are set once.
* **plain**: ``cuLaunchKernel`` through CuPy's compiled binding. The binding-layer
  exception (ubnext's other CUDA calls use CuPy's public API, or ``cuda.bindings``
  through ``cuda``): ``cupy_backends.cuda.api.driver`` is private, and taken because it
  is the cheapest launch Python has, cheaper than ``cuda.bindings``' ``cuLaunchKernel``
  with the same pack and far cheaper than CuPy's public ``RawKernel()``
  (bench/launch_floor.py; the figures are in bench/NOTES.md). CuPy has no
  ``cuLaunchKernelEx``.
"""

from __future__ import annotations

import ctypes
import struct

from cupy_backends.cuda.api import driver as _cupy_driver

from ubnext._protocol.errors import CudaError

U64, I32, F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float
#: threads resident on one SM (sm_90): the grids of the local kernels that fill the GPU
SM_THREADS = 2048
_UINT = ctypes.c_uint32

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
        dependent: launch with programmatic dependent launch (the module docstring).

    A call passes the values of the parameters in between. The argument pack is
    reused: calls must not overlap (a Communicator launches only inside its
    ``_streams.LaunchOrder`` section, which one thread holds at a time; a ``Packed``
    launch has a pack of its own). One per communicator and kernel.
    """

    def __init__(self, kernel, types, prefix=(), suffix=(), dependent: bool = False):
        self.kernel = kernel  # keeps the module loaded
        self._func = kernel.kernel.ptr
        self.dependent = dependent
        self._ex = _Dependent() if dependent else None
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
        ex = self._ex
        if ex is None:
            _launch(self._func, blocks, threads, stream, self._pack_ptr)
            return
        SHAPE_AND_STREAM.pack_into(ex.config, 0, blocks, 1, 1, threads, 1, 1, 0, stream)
        ex.stream = stream
        rc = ex.driver(ex.address, self._func, self._pack_ptr, None)
        if rc:
            raise _launch_error(rc, "cuLaunchKernelEx", _PDL_HINT)

    def _filled(self, values: tuple):
        """A new argument buffer with the constant parameters and ``values``."""
        slots = type(self._slots).from_buffer_copy(self._slots)  # the constant ones, packed once
        self._varying.pack_into(slots, self._offset, *values)
        return slots


class Packed:
    """One launch of a Launcher but for its stream, with an argument pack of its own,
    written once here: calling it packs nothing; the pack holds the bytes that
    ``launcher(blocks, threads, stream, *values)`` packs. A dependent launch rewrites its
    own config's stream when the stream changes, so calls must not overlap (a
    Communicator launches plans only inside its launch section, as Launcher calls). It
    keeps its launcher (the module), its config and ints, nothing else.

    Args:
        launcher: the entry point's Launcher.
        blocks, threads: the 1-D grid.
        values: the parameters between the launcher's prefix and suffix.
    """

    __slots__ = ("launcher", "blocks", "threads", "values", "_func", "_slots", "_pack", "_pack_ptr", "_ex")

    def __init__(self, launcher: Launcher, blocks: int, threads: int, values: tuple):
        self.launcher, self.blocks, self.threads, self.values = launcher, blocks, threads, values
        self._func = launcher._func
        self._slots = launcher._filled(values)
        self._pack, self._pack_ptr = _pointers(self._slots)
        self._ex = None
        if launcher.dependent:
            self._ex = _Dependent()
            self._ex.shape(blocks, threads)

    def __call__(self, stream: int) -> None:
        """Launches on ``stream``; raises CudaError if the launch fails."""
        ex = self._ex
        if ex is None:
            _launch(self._func, self.blocks, self.threads, stream, self._pack_ptr)
            return
        if stream != ex.stream:
            ex.restream(stream)
        rc = ex.driver(ex.address, self._func, self._pack_ptr, None)
        if rc:
            raise _launch_error(rc, "cuLaunchKernelEx", _PDL_HINT)


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


#: what a failed dependent launch adds to its error: the way back to plain launches
_PDL_HINT = ("; the launch used programmatic dependent launch: UBNEXT_PDL=0 (Config.pdl) turns it off, "
             "should this GPU, driver or setup not take it")


def _launch_error(rc: int, call: str = "cuLaunchKernel", hint: str = "") -> CudaError:
    from cuda.bindings import driver

    from ubnext._environment.cuda import error_text

    return CudaError(call, rc, error_text(driver.CUresult(rc)) + hint)


# ---- programmatic dependent launch: cuLaunchKernelEx through ctypes ----------------------


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", _UINT), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [("gridDimX", _UINT), ("gridDimY", _UINT), ("gridDimZ", _UINT),
                ("blockDimX", _UINT), ("blockDimY", _UINT), ("blockDimZ", _UINT),
                ("sharedMemBytes", _UINT), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", _UINT)]


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: a launch's grid, block and stream as LaunchConfig lays them out, packed by one call:
#: grid x, y, z, block x, y, z, shared bytes, padding, the stream
SHAPE_AND_STREAM = struct.Struct("<7I4xQ")
_STREAM = struct.Struct("<Q")
_STREAM_OFFSET = LaunchConfig.hStream.offset


def _programmatic_attribute() -> LaunchAttribute:
    attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    struct.pack_into("<i", attribute, LaunchAttribute.value.offset, 1)  # programmaticStreamSerializationAllowed
    return attribute


_ATTRIBUTE = _programmatic_attribute()  # read-only: every launch config points at it
_launch_ex = None  # libcuda's cuLaunchKernelEx, loaded at the first dependent launcher


def _driver_launch_ex():
    """libcuda's ``cuLaunchKernelEx`` as a ctypes function (its argument types set once)."""
    global _launch_ex
    if _launch_ex is None:
        function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        function.argtypes = (ctypes.c_void_p,) * 4
        function.restype = ctypes.c_int
        _launch_ex = function
    return _launch_ex


def programmatic(pdl: bool, device: int) -> bool:
    """Whether launches on ``device`` are dependent ones: ``Config.pdl`` and a device of
    compute capability 9.0 or later (where the kernels' griddepcontrol instructions run)."""
    import cupy

    return pdl and int(cupy.cuda.Device(device).compute_capability) >= 90


class _Dependent:
    """One ``CUlaunchConfig`` with the programmatic stream-serialization attribute, its
    address, its current stream, and the driver's ``cuLaunchKernelEx``; the launches use
    the fields directly (each method call a launch saves is measurable in
    bench/host_path.py). Not shared between threads (as a Launcher's pack)."""

    __slots__ = ("config", "address", "driver", "stream")

    def __init__(self):
        self.config = LaunchConfig(gridDimY=1, gridDimZ=1, blockDimY=1, blockDimZ=1,
                                   attrs=ctypes.addressof(_ATTRIBUTE), numAttrs=1)
        self.address = ctypes.addressof(self.config)
        self.driver = _driver_launch_ex()
        self.stream = 0

    def shape(self, blocks: int, threads: int) -> None:
        """Sets the grid and block (a ``Packed`` launch's, once)."""
        SHAPE_AND_STREAM.pack_into(self.config, 0, blocks, 1, 1, threads, 1, 1, 0, self.stream)

    def restream(self, stream: int) -> None:
        """Sets the stream (a call plan's rarely changes: written only then)."""
        _STREAM.pack_into(self.config, _STREAM_OFFSET, stream)
        self.stream = stream
