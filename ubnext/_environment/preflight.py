"""Checks a communicator makes before any collective setup, each failure one line
naming the cause and the fix instead of a CuPy traceback: the installed CUDA packages
and a driver that runs them (``_install.check_driver``), a visible device, and, where
the configuration sends every call to NCCL, the NCCL library. mpi4py and the MPI
library are checked where the bootstrap imports them (``bootstrap/_mpi.py``), also
before anything collective.
"""

from __future__ import annotations

import os
from typing import Any

from ubnext._protocol.errors import UbnextError

__all__ = ["check", "gpu_problem"]

_NO_DEVICE = 100  # cudaErrorNoDevice
_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver


def gpu_problem() -> str | None:
    """Why this process cannot use a GPU, or None when it can.

    Asks the CUDA runtime for the device count, which creates no context. A
    missing GPU or driver reads ``"no GPU: ..."``.

    Collective: no.

    Returns:
        None, or one line naming the cause and the fix.
    """
    try:
        import cupy
    except ImportError as exc:
        return (f"CuPy is not importable ({exc}); install the CuPy build for the CUDA driver "
                f"(pip install cupy-cuda13x, or cupy-cuda12x for a CUDA 12 driver)")
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        return _explain(exc, runtime)
    if count == 0:
        return "no GPU: the CUDA driver reports no device; run on a GPU node"
    return None


def check(op: str, config: Any) -> None:
    """Raise before any collective setup when this process cannot run a communicator.

    Collective: no.

    Args:
        op: operation name that starts the message (``"Communicator"``).
        config: the communicator's Config; with ``algorithm="nccl"`` NCCL must load.

    Raises:
        UbnextError: no GPU, a driver older than CuPy's CUDA runtime, CuPy missing,
            or NCCL missing where every call goes to it; one line with the fix.
    """
    problem = gpu_problem()
    if problem is not None:
        raise UbnextError(f"{op}: {problem}")
    from ubnext._environment.install import check_driver

    check_driver(op)
    if config.algorithm == "nccl":
        from ubnext._environment.install import load_nccl

        load_nccl(op)


def _explain(exc: Any, runtime: Any) -> str:
    """One line for a failed device count."""
    status = getattr(exc, "status", None)
    if status == _NO_DEVICE:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "unset" if visible is None else repr(visible)
        return (f"no GPU: CUDA sees no device (cudaErrorNoDevice; CUDA_VISIBLE_DEVICES is {where}); "
                f"run on a GPU node, or list its GPUs in CUDA_VISIBLE_DEVICES")
    if status == _INSUFFICIENT_DRIVER:
        if not _version(runtime.driverGetVersion):
            return ("no GPU: no NVIDIA driver is loaded (cudaErrorInsufficientDriver); "
                    "run on a node with an NVIDIA GPU and its driver")
        from ubnext._environment.install import driver_problem, query_versions

        try:  # a driver older than the runtimes: named with both versions and the fix
            problem = driver_problem(query_versions("Communicator"))
        except UbnextError as error:  # NVRTC not loadable
            return str(error).split(": ", 1)[1]
        if problem is not None:
            return problem
    return f"CUDA cannot start ({exc}); check the GPU and its driver with nvidia-smi"


def _version(query: Any) -> int:
    try:
        return int(query())
    except Exception:  # the query itself fails without a driver
        return 0

