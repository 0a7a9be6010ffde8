"""Symmetric memory pool: every local rank's device memory in one VA range.

Each rank of a node creates one allocation of ``stride`` bytes with the CUDA
virtual memory API, shares it with the other local ranks as a POSIX file
descriptor, and maps all of them, in local-rank order, into one reserved
virtual address range::

    base + 0 * stride   local rank 0's segment
    base + 1 * stride   local rank 1's segment
    ...

so ``pool.ptr(r, offset)`` is the same byte of rank ``r``'s segment on every
rank, and a kernel reaches a peer's buffer by adding ``(r - me) * stride`` to
its own pointer.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable

from ubnext._environment.cuda import drv
from ubnext._memory.transaction import TornDown, UndoStack
from ubnext._protocol.errors import ClosedError, CudaError, UbnextError


class PeerAccessError(CudaError):
    """Peer memory could not be imported or made accessible on this device.

    Raised by :class:`SymmetricPool` when ``cuMemImportFromShareableHandle``
    or ``cuMemSetAccess`` fails, which means the devices of this node cannot
    share memory this way (no P2P path, or no POSIX-fd VMM sharing); the
    caller should fall back to NCCL.

    Attributes:
        peer: the local rank whose memory failed, or None when the failure
            concerns the whole range (``cuMemSetAccess``).
    """

    def __init__(self, call: str, code: int | None, message: str, peer: int | None):
        super().__init__(call, code, message)
        who = "the peer segments" if peer is None else f"local rank {peer}"
        self.args = (f"SymmetricPool: {call} failed for {who}: {message}",)
        self.peer = peer


class SymmetricPool(TornDown):
    """Device memory of every local rank, mapped at one stride in one VA range.

    Construction is collective over the node's ranks (through
    ``exchange_fds``) and blocks the host until every peer's descriptor has
    arrived. It is transactional: if any step fails, everything created so
    far is undone (mappings, handles, the address range, descriptors) and the
    error is re-raised.

    The caller must have made ``device``'s primary context current on this
    thread (e.g. ``cupy.cuda.Device(device).use()`` plus any CUDA call, or
    ``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent``).

    Args:
        device: CUDA device ordinal of this rank.
        size: bytes wanted per segment; rounded up to the allocation
            granularity (see :attr:`size`).
        local_rank: this rank's index among the node's ranks.
        local_size: number of ranks on the node.
        exchange_fds: allgather of file descriptors over the node's ranks:
            takes this rank's exported descriptor (still owned by the pool,
            which closes it afterwards) and returns one *new* descriptor per
            local rank, in local-rank order, owned by the pool (it closes all
            of them; the entry at ``local_rank`` is closed without import).
        driver: the ``cuda.bindings.driver`` module (the default), or a fake
            with the same functions and return conventions, for tests.

    Attributes:
        stride: bytes between consecutive segments; equals :attr:`size`.
        size: usable bytes per segment (``size`` rounded up).
        local_rank, local_size, device: as given.

    Raises:
        PeerAccessError: a peer's memory cannot be imported or accessed
            (fall back to NCCL).
        CudaError: another driver call failed (e.g. out of memory).
        UbnextError: ``exchange_fds`` returned the wrong number of descriptors.
        ValueError: invalid arguments.
    """

    _leaks = "its device memory stays mapped until the process exits"

    def __init__(
        self,
        device: int,
        size: int,
        local_rank: int,
        local_size: int,
        exchange_fds: Callable[[int], list[int]],
        driver: Any = None,
    ):
        if size <= 0:
            raise ValueError(f"SymmetricPool: size must be positive, got {size}")
        if not 0 <= local_rank < local_size:
            raise ValueError(
                f"SymmetricPool: local_rank {local_rank} out of range for local_size {local_size}"
            )
        if driver is None:
            from cuda.bindings import driver
        self._driver = driver
        self.device = device
        self.local_rank = local_rank
        self.local_size = local_size
        self._teardown: UndoStack | None = None  # set on commit; None when closed
        undo = UndoStack()
        try:
            self._setup(size, exchange_fds, undo)
        except BaseException:
            for error in undo.unwind():
                warnings.warn(
                    f"SymmetricPool: cleanup after failed setup also failed: {error}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            raise
        self._teardown = undo  # commit

    def _setup(
        self, size: int, exchange_fds: Callable[[int], list[int]], undo: UndoStack
    ) -> None:
        d = self._driver
        self._call("cuInit", 0)
        cu_device = self._call("cuDeviceGet", self.device)
        fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(cu_device)
        prop.requestedHandleTypes = fd_type
        option = d.CUmemAllocationGranularity_flags
        minimum = self._call(
            "cuMemGetAllocationGranularity", prop, option.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        recommended = self._call(
            "cuMemGetAllocationGranularity", prop, option.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        )
        granularity = math.lcm(int(minimum), int(recommended))  # == recommended in practice
        self.stride = self.size = -(-size // granularity) * granularity
        total = self.local_size * self.stride

        # the peers' imported handles and the mapped segments, which release_peers gives
        # back before the rest (their undo steps then find nothing left to do)
        self._peer_handles: dict[int, Any] = {}
        self._mapped: set[int] = set()

        # 1. Reserve the address range of all segments.
        self._base = int(self._call("cuMemAddressReserve", total, granularity, 0, 0))
        undo.push(self._call, "cuMemAddressFree", d.CUdeviceptr(self._base), total)

        # 2. Create this rank's segment.
        handles: list[Any] = [None] * self.local_size
        self._handle = handles[self.local_rank] = self._call("cuMemCreate", self.stride, prop, 0)
        undo.push(self._call, "cuMemRelease", self._handle)

        # 3. Share it and import the peers' segments.
        fd = int(self._call("cuMemExportToShareableHandle", self._handle, fd_type, 0))
        try:
            fds = list(exchange_fds(fd))
        finally:
            os.close(fd)
        try:
            if len(fds) != self.local_size:
                raise UbnextError(
                    f"SymmetricPool: exchange_fds returned {len(fds)} descriptors "
                    f"for {self.local_size} local ranks"
                )
            for peer, peer_fd in enumerate(fds):
                if peer != self.local_rank:
                    handles[peer] = self._peer_handles[peer] = self._peer_call(
                        peer, "cuMemImportFromShareableHandle", peer_fd, fd_type
                    )
                    undo.push(self._release_peer, peer)
        finally:
            _close_all(fds)

        # 4. Map segment r at base + r * stride.
        for rank, handle in enumerate(handles):
            segment = d.CUdeviceptr(self._base + rank * self.stride)
            self._call("cuMemMap", segment, self.stride, 0, handle, 0)
            self._mapped.add(rank)
            undo.push(self._unmap, rank)

        # 5. Let this device read and write the whole range.
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = int(cu_device)
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._peer_call(None, "cuMemSetAccess", d.CUdeviceptr(self._base), total, [access], 1)

    def _call(self, name: str, *args: Any) -> Any:
        return drv(name, *args, driver=self._driver)

    def _unmap(self, rank: int) -> None:
        """Unmaps local rank ``rank``'s segment, once."""
        if rank in self._mapped:
            self._mapped.discard(rank)
            self._call("cuMemUnmap", self._driver.CUdeviceptr(self._base + rank * self.stride), self.stride)

    def _release_peer(self, peer: int) -> None:
        """Releases the handle imported from local rank ``peer``, once."""
        handle = self._peer_handles.pop(peer, None)
        if handle is not None:
            self._call("cuMemRelease", handle)

    def _peer_call(self, peer: int | None, name: str, *args: Any) -> Any:
        """A call whose failure means peers cannot share memory: PeerAccessError."""
        try:
            return self._call(name, *args)
        except CudaError as exc:
            message = str(exc).removeprefix(f"{name}: ")
            raise PeerAccessError(name, exc.code, message, peer) from exc

    @property
    def base(self) -> int:
        """Virtual address of local rank 0's segment."""
        self._check_open("base")
        return self._base

    @property
    def handle(self) -> Any:
        """This rank's ``CUmemGenericAllocationHandle`` (e.g. to bind to a multicast object)."""
        self._check_open("handle")
        return self._handle

    def ptr(self, rank: int, offset: int = 0) -> int:
        """Address of byte ``offset`` of local rank ``rank``'s segment.

        Raises:
            IndexError: ``rank`` or ``offset`` out of range.
            ClosedError: the pool is closed.
        """
        self._check_open("ptr")
        if not 0 <= rank < self.local_size:
            raise IndexError(
                f"SymmetricPool.ptr: rank {rank} out of range for {self.local_size} local ranks"
            )
        if not 0 <= offset < self.stride:
            raise IndexError(
                f"SymmetricPool.ptr: offset {offset} out of range for a {self.stride}-byte segment"
            )
        return self._base + rank * self.stride + offset

    def local_ptr(self, offset: int = 0) -> int:
        """Address of byte ``offset`` of this rank's segment; see :meth:`ptr`."""
        return self.ptr(self.local_rank, offset)

    def contains(self, ptr: int, nbytes: int) -> int | None:
        """Offset of ``[ptr, ptr + nbytes)`` inside this rank's segment, or None.

        Returns None for ranges that are outside the local segment or only
        partly inside it (including pointers into peers' segments).

        Raises:
            ClosedError: the pool is closed.
        """
        self._check_open("contains")
        offset = ptr - (self._base + self.local_rank * self.stride)
        if offset >= 0 and nbytes >= 0 and offset + nbytes <= self.stride:
            return offset
        return None

    def release_peers(self) -> None:
        """Unmaps the peers' segments and releases their imported handles, keeping this
        rank's segment and the whole address range: what arrays of this rank's segment
        need once no kernel reaches the peers any more (``close`` releases the rest; no
        other object is ever mapped into the range while it is reserved). Idempotent; a
        peer's memory goes when its last mapping and handle are gone, on any rank.

        Raises:
            CudaError: a driver call failed; the other peers are released all the same.
        """
        errors = []
        for step, ranks in ((self._unmap, [r for r in sorted(self._mapped) if r != self.local_rank]),
                            (self._release_peer, sorted(self._peer_handles))):
            for rank in ranks:
                try:
                    step(rank)
                except CudaError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Unmap every segment, release every handle, free the address range.

        Idempotent. Not collective by itself, but the caller must make sure
        no peer still accesses this rank's memory and no kernel using the
        pool is still running (the communicator synchronizes first). Blocks the
        host only for the driver calls.

        Raises:
            CudaError: a driver call failed; every other resource is still
                released before the first such error is raised.
        """
        self._handle = None
        super().close()  # unmap segments -> release handles -> free VA

    def _check_open(self, op: str) -> None:
        if self._teardown is None:
            raise ClosedError(f"SymmetricPool.{op}: the pool is closed")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"base=0x{self._base:x}"
        return (
            f"SymmetricPool(device={self.device}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, stride={self.stride}, {state})"
        )


def _close_all(fds: list[int]) -> None:
    """Close every descriptor, then raise the first error, if any."""
    errors = []
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
