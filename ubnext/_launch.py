"""Low-overhead kernel launches: one driver call with a prebuilt argument pack.

A ``Launcher`` holds, for one compiled entry point, a ctypes buffer per parameter
and the array of pointers to them that ``cuLaunchKernel`` takes. The parameters that
never change (pool addresses, library slots, the timeout record) are written once; a
call writes the others into their buffers and calls the driver directly: no per-call
allocation and no conversion of Python objects beyond the integers themselves. A
launch in thread-block clusters goes through ``cuLaunchKernelEx`` with a prebuilt
launch configuration.
"""

from __future__ import annotations

import ctypes

from ._errors import CudaError

U64, I32, F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float

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


_driver = {}


def _driver_fn(name: str, argtypes: list):
    fn = _driver.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        _driver[name] = fn
    return fn


class Launcher:
    """Launches one entry point whose parameters have the given ctypes types.

    Args:
        kernel: the compiled ``cupy.RawKernel`` (its CUfunction is used).
        types: one ctypes type per kernel parameter, in order.
        prefix: values of the leading parameters, the same on every launch.
        suffix: values of the trailing parameters, the same on every launch.

    A call passes the values of the parameters in between. Not thread-safe (the
    argument pack is reused); one per communicator and kernel.
    """

    def __init__(self, kernel, types, prefix=(), suffix=()):
        self.kernel = kernel  # keeps the module loaded
        self._func = ctypes.c_void_p(kernel.kernel.ptr)
        self._args = [t() for t in types]
        self._pack = (ctypes.c_void_p * len(types))(*[ctypes.addressof(a) for a in self._args])
        end = len(types) - len(suffix)
        for slot, value in zip(self._args[:len(prefix)] + self._args[end:], (*prefix, *suffix)):
            slot.value = value
        self._varying = self._args[len(prefix):end]
        self._launch = _driver_fn("cuLaunchKernel", [ctypes.c_void_p] + [ctypes.c_uint] * 7
                                  + [ctypes.c_void_p] * 3)
        self._launch_ex = None  # with clusters: cuLaunchKernelEx and its configuration

    def __call__(self, blocks: int, threads: int, stream: int, *values, cluster: int = 1) -> None:
        """Launches a 1-D grid on ``stream``, in clusters of ``cluster`` blocks (a
        divisor of ``blocks``) when it is more than 1; raises CudaError if the launch fails."""
        for slot, value in zip(self._varying, values):
            slot.value = value
        if cluster == 1:
            rc = self._launch(self._func, blocks, 1, 1, threads, 1, 1, 0, stream, self._pack, None)
        else:
            rc = self._clustered(blocks, threads, stream, cluster)
        if rc:
            from cuda.bindings import driver

            from ._cuda import describe

            raise CudaError("cuLaunchKernel" + ("Ex" if cluster > 1 else ""), rc, describe(driver.CUresult(rc)))

    def _clustered(self, blocks: int, threads: int, stream: int, cluster: int) -> int:
        if self._launch_ex is None:
            attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
            config = _LaunchConfig(gridDimY=1, gridDimZ=1, blockDimY=1, blockDimZ=1, attrs=ctypes.pointer(attr),
                                   numAttrs=1)
            fn = _driver_fn("cuLaunchKernelEx", [ctypes.POINTER(_LaunchConfig)] + [ctypes.c_void_p] * 3)
            self._launch_ex = (fn, config, attr)
        fn, config, attr = self._launch_ex
        config.gridDimX, config.blockDimX, config.hStream = blocks, threads, stream
        attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
        return fn(ctypes.byref(config), self._func, self._pack, None)
