"""NVLink multicast (NVLS): one address for the same byte of every local segment.

A :class:`MulticastRange` binds every local rank's :class:`~ubnext._memory.pool.SymmetricPool`
segment to one multicast object and maps that object into this process, so that
``range.ptr + o`` addresses byte ``o`` of *every* rank's segment at once
(``multimem.ld_reduce`` reads and reduces all of them, ``multimem.st`` writes all
of them).

Set-up, collective over the node's ranks (DESIGN.md, "Symmetric memory pool")::

    every rank   cuMulticastGetGranularity (object size rounded up to it)
    rank 0       cuMulticastCreate, cuMemExportToShareableHandle (POSIX fd)
    -- agree --  FdChannel.bcast_fd: the descriptor to every rank
    others       cuMemImportFromShareableHandle
    every rank   cuMulticastAddDevice
    -- agree --  (all devices added before anyone binds)
    every rank   cuMulticastBindMem (its own segment), cuMemAddressReserve,
                 cuMemMap (the multicast handle), cuMemSetAccess
    -- agree --

Each "agree" is an allgather of every rank's error (or None), so a failure on one
rank makes every rank raise, and nobody waits for a peer that gave up. Every step
registers its undo; teardown runs them in reverse: unmap, free the address range,
unbind, release the handle. The creator's handle is released only at teardown,
which the node runs after a barrier, so it outlives every import.

Only ``ubnext._engine.node`` creates a MulticastRange, and only when the NVLS gate
(``ubnext._environment.nvls_gate``) says ``enabled``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ubnext._environment.cuda import default_driver, drv
from ubnext._memory.transaction import TornDown, UndoStack
from ubnext._protocol.errors import ClosedError, UbnextError

__all__ = ["MulticastRange"]


class MulticastRange(TornDown):
    """A multicast mapping of every local rank's pool segment.

    Construction is collective over ``local`` and blocks the host until every
    rank has bound and mapped (three allgathers and one descriptor broadcast).
    It is transactional: on any rank's failure every rank undoes what it did
    and raises.

    Args:
        pool: this rank's open SymmetricPool; its segment (``pool.handle``,
            ``pool.size`` bytes) is bound to the multicast object.
        local: bootstrap of the node's ranks (same ranks and order as the pool's).
        fds: the node's ``FdChannel``; carries the multicast object's descriptor.
        driver: the ``cuda.bindings.driver`` module (default) or a fake with the
            same functions, for tests.

    Attributes:
        size: bytes addressed through :attr:`ptr` (``pool.size``).
        object_size: size of the multicast object: ``size`` rounded up to the
            recommended multicast granularity.

    Raises:
        UbnextError: a step failed on some rank (every rank raises, naming the
            failed ranks and their errors), e.g. ``pool.size`` is not a multiple
            of the minimum multicast granularity.
        ValueError: ``local`` does not match the pool's ranks.
    """

    _leaks = "the multicast object stays bound until the process exits"

    def __init__(self, pool: Any, local: Any, fds: Any, driver: Any = None):
        if (local.rank, local.size) != (pool.local_rank, pool.local_size):
            raise ValueError(f"MulticastRange: bootstrap rank {local.rank} of {local.size} does not match "
                             f"the pool's local rank {pool.local_rank} of {pool.local_size}")
        self._driver = default_driver() if driver is None else driver
        self._pool = pool  # the bound segment must outlive the binding
        self._local = local
        self.device = pool.device
        self.local_rank = pool.local_rank
        self.size = pool.size
        self._teardown: UndoStack | None = None  # set on commit; None when closed
        undo = UndoStack()
        try:
            self._setup(fds, undo)
        except BaseException:
            for error in undo.unwind():
                warnings.warn(f"MulticastRange: cleanup after failed setup also failed: {error}",
                              RuntimeWarning, stacklevel=2)
            raise
        self._teardown = undo  # commit

    def _setup(self, fds: Any, undo: UndoStack) -> None:
        d, pool = self._driver, self._pool
        fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        creator = self.local_rank == 0
        exported = None
        handle = None
        error = None
        try:
            # 1. Size the object; local rank 0 creates and exports it.
            dev = self._call("cuDeviceGet", self.device)
            prop = d.CUmulticastObjectProp()
            prop.numDevices = self._local.size
            prop.handleTypes = fd_type
            prop.size = self.size
            option = d.CUmulticastGranularity_flags
            minimum = int(self._call("cuMulticastGetGranularity", prop, option.CU_MULTICAST_GRANULARITY_MINIMUM))
            recommended = int(self._call("cuMulticastGetGranularity", prop,
                                         option.CU_MULTICAST_GRANULARITY_RECOMMENDED))
            if self.size % minimum:
                raise UbnextError(f"MulticastRange: the pool segment ({self.size} bytes) is not a multiple of "
                                  f"the minimum multicast granularity ({minimum} bytes)")
            self.object_size = prop.size = -(-self.size // recommended) * recommended
            if creator:
                handle = self._call("cuMulticastCreate", prop)
                undo.push(self._call, "cuMemRelease", handle)
                exported = int(self._call("cuMemExportToShareableHandle", handle, fd_type, 0))
        except Exception as exc:  # agreed on below, so no rank is left waiting
            error = exc
        try:
            self._agree("creating the multicast object", error)
            # 2. Every rank gets the object and adds its device.
            received = fds.bcast_fd(exported, 0)
        finally:
            if exported is not None:
                os.close(exported)
        try:
            if not creator:
                handle = self._call("cuMemImportFromShareableHandle", received, fd_type)
                undo.push(self._call, "cuMemRelease", handle)
            self._call("cuMulticastAddDevice", handle, dev)
        except Exception as exc:
            error = exc
        finally:
            os.close(received)
        # Binding and mapping wait for every device to be added: agree (a barrier) first.
        self._agree("adding the devices", error)

        # 3. Bind this rank's segment; map the object; let this device access it.
        try:
            self._call("cuMulticastBindMem", handle, 0, pool.handle, 0, self.size, 0)
            undo.push(self._call, "cuMulticastUnbind", handle, dev, 0, self.size)
            self._ptr = int(self._call("cuMemAddressReserve", self.size, recommended, 0, 0))
            undo.push(self._call, "cuMemAddressFree", d.CUdeviceptr(self._ptr), self.size)
            self._call("cuMemMap", d.CUdeviceptr(self._ptr), self.size, 0, handle, 0)
            undo.push(self._call, "cuMemUnmap", d.CUdeviceptr(self._ptr), self.size)
            access = d.CUmemAccessDesc()
            access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.device
            access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._call("cuMemSetAccess", d.CUdeviceptr(self._ptr), self.size, [access], 1)
        except Exception as exc:
            error = exc
        self._agree("binding and mapping", error)

    def _call(self, name: str, *args: Any) -> Any:
        return drv(name, *args, driver=self._driver)

    def _agree(self, step: str, error: Exception | None) -> None:
        """Share every rank's error of ``step``; if any rank failed, raise on every rank.

        Collective: yes (one allgather over the node's ranks).
        """
        mine = None if error is None else (str(error) or type(error).__name__)
        failed = [(r, e) for r, e in enumerate(self._local.allgather_obj(mine)) if e is not None]
        if failed:
            detail = "; ".join(f"local rank {r}: {e}" for r, e in failed)
            raise UbnextError(f"MulticastRange: {step} failed on {len(failed)} rank(s): {detail}") from error

    @property
    def ptr(self) -> int:
        """Device address of the multicast mapping: ``ptr + o`` is byte ``o`` of every segment.

        Raises:
            ClosedError: the range is closed.
        """
        if self._teardown is None:
            raise ClosedError("MulticastRange.ptr: the multicast range is closed")
        return self._ptr

    def close(self) -> None:
        """Unmap, free the address range, unbind this rank's segment, release the handle.

        Idempotent. Not collective by itself, but the caller must make sure no
        kernel still uses the range (the node synchronizes first), and must close
        it before the pool. Blocks the host only for the driver calls.

        Raises:
            CudaError: a driver call failed; every other resource is still
                released before the first such error is raised.
        """
        super().close()  # unmap -> free VA -> unbind -> release

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self._ptr:x}"
        return f"MulticastRange(device={self.device}, local_rank={self.local_rank}, size={self.size}, {state})"
