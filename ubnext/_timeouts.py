"""The timeout record: how a kernel that waited too long tells the host who was missing.

Kernels bound every spin-wait (``UBNEXT_TIMEOUT_S``). On timeout the waiting thread
writes (rank, peer, site, epoch) into this host-mapped pinned record, then traps
(``_protocol.ERROR_RECORD``; kernels/sync.cuh: ``fail_timeout``). The host reads the record
without synchronizing the device, at the start of every ubnext call and in
``Communicator.synchronize``, and raises ``CollectiveTimeoutError``.
"""

from __future__ import annotations

import ctypes

from ._errors import CollectiveTimeoutError
from ._protocol import ANY_PEER, ERROR_RECORD, WAIT_SITES, struct_bytes

_BYTES = 64
_CTYPES = {"u32": ctypes.c_uint32, "u64": ctypes.c_uint64}


class _Record(ctypes.Structure):
    _fields_ = [(field, _CTYPES[ctype]) for ctype, field, _ in ERROR_RECORD]


assert ctypes.sizeof(_Record) == struct_bytes(ERROR_RECORD) <= _BYTES


class TimeoutRecord:
    """Host-mapped pinned memory holding one ``ErrorRecord`` (``_protocol.ERROR_RECORD``).

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
            where = WAIT_SITES[rec.site][1] if rec.site in WAIT_SITES else f"site {rec.site}"
            peer = None if rec.peer == ANY_PEER else rec.peer
            raise CollectiveTimeoutError(op, rec.rank, peer, f"{where}, launch {rec.epoch}", timeout_s)

    def close(self) -> None:
        """Frees the pinned memory. Idempotent."""
        host, self._host, self._rec = self._host, None, None
        if host is not None:
            from cupy.cuda import runtime

            runtime.freeHost(host)
