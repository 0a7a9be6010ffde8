"""The device memory a rank holds, for the GPU tests that check memory comes back
(create/close cycles, dropped communicators, arrays and graphs outliving a communicator).

The device's free memory (``cudaMemGetInfo``) is the whole GPU's: another process's
allocations move it (a leak test run beside other jobs on the same GPUs failed that way).
:class:`MemoryGauge` reads this process's own usage instead, from NVML, where NVML names
the process; where it does not (a PID namespace hides the pid), it reads the device's free
memory only while NVML counts no compute process on the device besides this job's ranks,
and skips, saying why, where it cannot tell.
"""

from __future__ import annotations

import gc
import os
import socket

import pytest

#: what a rank may keep on its device after a test's cycles (caches settling)
SLACK_BYTES = 8 << 20
#: NVML's "not available" for a process's memory (an unsigned -1), and anything above
_NOT_AVAILABLE = 1 << 63


def nvml_processes(device: int) -> list[tuple[int, int | None]]:
    """The compute processes NVML lists on CUDA device ``device`` (this process's ordinal),
    as ``(pid, bytes used)`` (None where NVML does not say), through cuda-bindings' ``nvml``
    or else nvidia-ml-py's ``pynvml``.

    Raises:
        RuntimeError: neither binding is installed, or NVML failed (the message says how).
    """
    import cupy

    bus = cupy.cuda.runtime.deviceGetPCIBusId(device)
    try:
        try:
            from cuda.bindings import nvml
        except ImportError:
            rows = _pynvml_processes(bus)
        else:
            nvml.init_v2()
            try:
                infos = nvml.device_get_compute_running_processes_v3(nvml.device_get_handle_by_pci_bus_id_v2(bus))
                rows = [(int(infos[i].pid), int(infos[i].used_gpu_memory)) for i in range(len(infos))]
            finally:
                nvml.shutdown()
    except ImportError as e:
        raise RuntimeError(f"no NVML binding (cuda-bindings' nvml, nvidia-ml-py): {e}") from e
    except Exception as e:  # NVML's own errors: no library, no permission, not supported
        raise RuntimeError(f"NVML failed: {type(e).__name__}: {e}") from e
    return [(pid, None if used is None or used >= _NOT_AVAILABLE else used) for pid, used in rows]


def _pynvml_processes(bus: str) -> list[tuple[int, int | None]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
        return [(int(p.pid), p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    finally:
        pynvml.nvmlShutdown()


class MemoryGauge:
    """What this rank holds on CUDA device ``device``, read the same way by every rank of
    ``world`` (construction and :meth:`read` are collective: every rank reads between two
    barriers, never inside another rank's cycle, garbage collected first, so that a peer's
    mapping of a dropped communicator's segment is gone).

    Attributes:
        how: ``"process"`` (NVML's usage of this process: other processes change nothing)
            or ``"device"`` (the device's used memory, valid while the device's compute
            processes are this job's ranks on it, checked at every read).
        sharing: this job's ranks on this rank's GPU.
        slack: bytes a read after the cycles may exceed one before (``SLACK_BYTES`` per
            rank measured: this one, or every rank on the device).

    Skips on every rank where a rank can measure neither way (or the device gains a
    process of another job between reads), saying why.
    """

    def __init__(self, world, device: int):
        import cupy

        self._world, self._device = world, device
        here = (socket.gethostname(), cupy.cuda.runtime.deviceGetPCIBusId(device))
        self.sharing = world.allgather(here).count(here)
        hows = world.allgather(self._how())
        self._skip_unless([why for how, why in hows if how is None])
        self.how = "process" if all(how == "process" for how, _ in hows) else "device"
        self.slack = SLACK_BYTES * (1 if self.how == "process" else self.sharing)

    def read(self) -> int:
        """Bytes this rank holds on its device (``how``); collective.

        Skips on every rank where the device's free memory is read and a process of another
        job appeared on a rank's device."""
        gc.collect()
        self._world.Barrier()
        gc.collect()
        used, why = self._used()
        self._skip_unless([w for w in self._world.allgather(why) if w])
        return used

    def _how(self) -> tuple[str | None, str]:
        try:
            processes = nvml_processes(self._device)
        except RuntimeError as e:
            return None, f"cannot tell this process's device memory from another's: {e}"
        if dict(processes).get(os.getpid()) is not None:
            return "process", ""
        why = self._alone(processes)
        return (None, why) if why else ("device", "")

    def _used(self) -> tuple[int, str]:
        import cupy

        processes = nvml_processes(self._device)
        if self.how == "process":
            used = dict(processes).get(os.getpid())
            if used is None:  # NVML named this process at the gauge's creation, not now
                return 0, f"NVML stopped reporting this process's memory (pid {os.getpid()}) on GPU {self._device}"
            return used, ""
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free, self._alone(processes)

    def _alone(self, processes: list) -> str:
        """Why the device's memory says nothing of this job's (another process holds the
        device, or NVML cannot tell), or "" where its processes are this job's ranks."""
        if len(processes) == self.sharing:
            return ""
        return (f"NVML does not name this process (pid {os.getpid()}) and lists {len(processes)} compute "
                f"process(es) on GPU {self._device}, where this job has {self.sharing} rank(s): the device's "
                f"free memory would count another process's; run the test alone on its GPUs")

    @staticmethod
    def _skip_unless(whys: list) -> None:
        if whys:
            pytest.skip(whys[0])


def assert_memory_given_back(world, device: int, cycle, times: int, what: str) -> None:
    """``cycle()`` ``times`` times on every rank gives the device's memory back: what this
    rank holds (:class:`MemoryGauge`) before and after, within the gauge's slack."""
    gauge = MemoryGauge(world, device)
    before = gauge.read()
    for _ in range(times):
        cycle()
    grown = gauge.read() - before
    assert grown < gauge.slack, (f"device memory held grew by {grown >> 20} MiB after {times} {what} (measured: "
                                 f"{gauge.how}, {gauge.sharing} rank(s) on this GPU)")
