"""Low-overhead kernel launches: one driver call with a prebuilt argument pack.

A ``Launcher`` holds, for one compiled entry point, a ctypes buffer per parameter
and the array of pointers to them that ``cuLaunchKernel`` takes. The parameters that
never change (pool addresses, library slots, the timeout record) are written once; a
call writes the others into their buffers and calls the driver directly: no per-call
allocation and no conversion of Python objects beyond the integers themselves.
"""

from __future__ import annotations

import ctypes

from ._errors import CudaError

U64, I32, F32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float

_cuLaunchKernel = None


def _driver_launch():
    global _cuLaunchKernel
    if _cuLaunchKernel is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                   ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _cuLaunchKernel = fn
    return _cuLaunchKernel


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
        self._launch = _driver_launch()

    def __call__(self, blocks: int, threads: int, stream: int, *values) -> None:
        """Launches a 1-D grid on ``stream``; raises CudaError if the launch fails."""
        for slot, value in zip(self._varying, values):
            slot.value = value
        rc = self._launch(self._func, blocks, 1, 1, threads, 1, 1, 0, stream, self._pack, None)
        if rc:
            from cuda.bindings import driver

            from ._cuda import describe

            raise CudaError("cuLaunchKernel", rc, describe(driver.CUresult(rc)))
