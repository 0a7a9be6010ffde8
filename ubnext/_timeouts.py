"""The timeout record: how a kernel that waited too long tells the host who was missing.

Kernels bound every spin-wait (``UBNEXT_TIMEOUT_S``). On timeout the waiting thread
writes (rank, peer, site, epoch) into this host-mapped pinned record, then traps
(kernels/sync.cuh: ``ErrorRecord``, ``fail_timeout``). The host reads the record
without synchronizing the device, at the start of every ubnext call and in
``Communicator.synchronize``, and raises ``CollectiveTimeoutError``.
"""

from __future__ import annotations

import ctypes

from ._errors import CollectiveTimeoutError

#: kernels/sync.cuh WaitSite -> words for the error message
SITES = {1: "Lamport poll", 2: "two-shot entry barrier", 3: "two-shot exit barrier"}
_BYTES = 64


class _Record(ctypes.Structure):
    _fields_ = [("flag", ctypes.c_uint32), ("rank", ctypes.c_uint32), ("peer", ctypes.c_uint32),
                ("site", ctypes.c_uint32), ("epoch", ctypes.c_uint64)]


#: ErrorRecord.peer of a counting wait (kernels/transport.cuh, Multicast::barrier)
_ANY_PEER = 0xFFFFFFFF


class TimeoutRecord:
    """Host-mapped pinned memory holding one kernels/sync.cuh ``ErrorRecord``.

    Attributes:
        device_ptr: the record's address as kernels see it.
    """

    def __init__(self):
        from cuda.bindings import runtime as cudart
        from cupy.cuda import runtime

        from ._cuda import check

        self._host = runtime.hostAlloc(_BYTES, runtime.hostAllocMapped)
        ctypes.memset(self._host, 0, _BYTES)
        self._rec = _Record.from_address(self._host)
        self.device_ptr = int(check(cudart.cudaHostGetDevicePointer(self._host, 0), "cudaHostGetDevicePointer"))

    @property
    def tripped(self) -> bool:
        """Whether a kernel recorded a timeout. Never blocks."""
        return self._rec is not None and bool(self._rec.flag)

    def check(self, op: str, timeout_s: float) -> None:
        """Raises CollectiveTimeoutError if a kernel recorded a timeout. Never blocks."""
        if self.tripped:
            rec = self._rec
            where = SITES.get(rec.site, f"site {rec.site}")
            peer = None if rec.peer == _ANY_PEER else rec.peer
            raise CollectiveTimeoutError(op, rec.rank, peer, f"{where}, launch {rec.epoch}", timeout_s)

    def close(self) -> None:
        """Frees the pinned memory. Idempotent."""
        host, self._host, self._rec = self._host, None, None
        if host is not None:
            from cupy.cuda import runtime

            runtime.freeHost(host)
