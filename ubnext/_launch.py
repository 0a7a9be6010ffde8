"""Low-overhead kernel launches: one driver call with a prebuilt argument pack.

A ``Launcher`` holds, for one compiled entry point, one buffer with an 8-byte slot per
parameter and the array of pointers to those slots that ``cuLaunchKernel`` takes. The
parameters that never change (pool addresses, library slots, the timeout record) are
written once; a call packs the others into their slots with one ``struct`` call and
launches through CuPy's compiled binding of ``cuLaunchKernel`` (a ctypes call with its
argument conversions cost about 3 µs more per launch on H200 hosts). A launch in
thread-block clusters goes through ``cuLaunchKernelEx`` (ctypes) with a prebuilt launch
configuration.
"""

from __future__ import annotations

import ctypes
import struct

from cupy_backends.cuda.api import driver as _cupy_driver

from ._errors import CudaError

U64, I32, F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float

#: how a parameter of each type is packed into its 8-byte slot (little-endian)
_SLOT_FORMAT = {U64: "Q", I32: "i4x", F32: "f4x"}
_SLOT = 8
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (clusterDim: x, y, z)."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class Launcher:
    """Launches one entry point whose parameters have the given ctypes types.

    Args:
        kernel: the compiled ``cupy.RawKernel`` (its CUfunction is used).
        types: one of U64, I32, F32 per kernel parameter, in order.
        prefix: values of the leading parameters, the same on every launch.
        suffix: values of the trailing parameters, the same on every launch.

    A call passes the values of the parameters in between. Not thread-safe (the
    argument pack is reused); one per communicator and kernel.
    """

    def __init__(self, kernel, types, prefix=(), suffix=()):
        self.kernel = kernel  # keeps the module loaded
        self._func = kernel.kernel.ptr
        self._slots = ctypes.create_string_buffer(_SLOT * len(types))
        base = ctypes.addressof(self._slots)
        self._pack = (ctypes.c_void_p * len(types))(*[base + _SLOT * i for i in range(len(types))])
        self._pack_ptr = ctypes.addressof(self._pack)
        end = len(types) - len(suffix)

        def layout(part):
            return struct.Struct("<" + "".join(_SLOT_FORMAT[t] for t in part))

        layout(types[:len(prefix)]).pack_into(self._slots, 0, *prefix)
        layout(types[end:]).pack_into(self._slots, _SLOT * end, *suffix)
        self._varying = layout(types[len(prefix):end])
        self._offset = _SLOT * len(prefix)
        self._launch_ex = None  # with clusters: cuLaunchKernelEx and its configuration

    def __call__(self, blocks: int, threads: int, stream: int, *values, cluster: int = 1) -> None:
        """Launches a 1-D grid on ``stream``, in clusters of ``cluster`` blocks (a
        divisor of ``blocks``) when it is more than 1; raises CudaError if the launch fails."""
        self._varying.pack_into(self._slots, self._offset, *values)
        if cluster == 1:
            try:
                _cupy_driver.launchKernel(self._func, blocks, 1, 1, threads, 1, 1, 0, stream, self._pack_ptr, 0)
            except _cupy_driver.CUDADriverError as e:
                raise _launch_error("cuLaunchKernel", e.status) from None
            return
        rc = self._clustered(blocks, threads, stream, cluster)
        if rc:
            raise _launch_error("cuLaunchKernelEx", rc)

    def _clustered(self, blocks: int, threads: int, stream: int, cluster: int) -> int:
        if self._launch_ex is None:
            attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
            config = _LaunchConfig(gridDimY=1, gridDimZ=1, blockDimY=1, blockDimZ=1, attrs=ctypes.pointer(attr),
                                   numAttrs=1)
            fn = getattr(ctypes.CDLL("libcuda.so.1"), "cuLaunchKernelEx")
            fn.argtypes = [ctypes.POINTER(_LaunchConfig)] + [ctypes.c_void_p] * 3
            fn.restype = ctypes.c_int
            self._launch_ex = (fn, config, attr)
        fn, config, attr = self._launch_ex
        config.gridDimX, config.blockDimX, config.hStream = blocks, threads, stream
        attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
        return fn(ctypes.byref(config), self._func, self._pack_ptr, None)


def _launch_error(call: str, rc: int) -> CudaError:
    from cuda.bindings import driver

    from ._cuda import describe

    return CudaError(call, rc, describe(driver.CUresult(rc)))
