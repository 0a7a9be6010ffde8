"""The node's kernel resources: descriptor channel, symmetric pool, multicast range
(where the NVLS gate allows), timeout record, engine and user heap, created
transactionally and released together."""

from __future__ import annotations

import warnings

from ._engine import Engine, plan_layout
from ._errors import UbnextError
from ._fdpass import FdChannel
from ._heap import UserHeap
from ._log import get_logger
from ._multicast import MulticastRange
from ._pool import SymmetricPool
from ._timeouts import TimeoutRecord
from ._undo import UndoStack


class Block:
    """Owner of one user allocation (``Communicator.empty``); frees it when collected.

    The finalizer only returns the range to the heap (pure Python, no driver call).
    """

    __slots__ = ("ptr", "_heap", "_offset", "__weakref__")

    def __init__(self, heap: UserHeap, offset: int, ptr: int):
        self.ptr, self._heap, self._offset = ptr, heap, offset

    def __del__(self):
        self._heap.free(self._offset)


class Node:
    """Everything ubnext's kernels need on this node. Construction is collective over
    ``local`` (the node's ranks) and undoes itself on failure.

    Args:
        local: bootstrap of this node's ranks.
        device: this rank's CUDA device (current).
        config: the communicator's Config.
        nvls: the NVLS gate's decision; when enabled (mode ``UBNEXT_NVLS=1``), the pool
            is also mapped through a multicast object (:attr:`multicast`).
        driver: the ``cuda.bindings.driver`` module (default) or a fake, for tests.

    Attributes:
        multicast: the MulticastRange, or None.

    Raises:
        UbnextError: the pool is too small for the library slots, or a setup step failed
            (the multicast setup included).
    """

    def __init__(self, local, device: int, config, nvls, driver=None):
        self._local = local
        self._driver = driver
        lamport_bytes, lamport_twoshot_bytes = config.lamport_max_kb << 10, config.lamport_twoshot_max_kb << 10
        # unaligned arrays go through the staging slot, whatever the algorithm
        staging_bytes = max(config.staging_mb << 20, lamport_bytes, lamport_twoshot_bytes)
        plan = plan_layout(local.size, lamport_bytes, lamport_twoshot_bytes, staging_bytes)
        pool_bytes = config.pool_mb << 20
        if plan.end >= pool_bytes:
            raise UbnextError(f"Communicator: UBNEXT_POOL_MB={config.pool_mb} leaves no room for user buffers; "
                              f"the library slots alone take {plan.end / 2**20:.1f} MiB (UBNEXT_STAGING_MB, "
                              f"UBNEXT_LAMPORT_MAX_KB and UBNEXT_LAMPORT_TWOSHOT_MAX_KB size them)")
        # the release steps, run newest first on a failed setup and by close (the
        # multicast range unbinds the segments before the pool releases them)
        undo = self._teardown = UndoStack()
        try:
            self.fds = FdChannel(local, config.timeout_s)
            undo.push(self.fds.close)
            self.pool = self._create_pool(device, pool_bytes)
            undo.push(self.pool.close)
            self.multicast = None
            if nvls.enabled:  # its failures are agreed across the node's ranks
                self.multicast = MulticastRange(self.pool, local, self.fds, driver=driver)
                undo.push(self.multicast.close)
            self.timeouts = TimeoutRecord()
            undo.push(self.timeouts.close)
            self.engine = Engine(self.pool, plan, self.timeouts.device_ptr,
                                 config.timeout_s, config.max_blocks, on_first_use=local.barrier,
                                 mc_base=0 if self.multicast is None else self.multicast.ptr)
            self.engine.initialize()
            self.heap = UserHeap(plan.end, self.pool.size)
        except BaseException:
            for e in undo.unwind():  # keep the original error
                warnings.warn(f"Communicator: cleanup after a failed setup: {e}", RuntimeWarning)
            raise

    def _create_pool(self, device: int, nbytes: int) -> SymmetricPool:
        # Ranks agree that every segment was created before exchanging descriptors, so
        # a rank that failed early never leaves its peers waiting on the channel.
        exchanged = False

        def exchange(fd: int) -> list[int]:
            nonlocal exchanged
            exchanged = True
            if not all(self._local.allgather_obj(True)):
                raise UbnextError("Communicator: a peer failed to create its pool segment")
            return self.fds.allgather_fds(fd)

        try:
            return SymmetricPool(device, nbytes, self._local.rank, self._local.size, exchange,
                                 driver=self._driver)
        except BaseException:
            if not exchanged:
                self._local.allgather_obj(False)
            raise

    def alloc(self, nbytes: int) -> Block:
        """A user block of at least ``nbytes`` (collective over the node's ranks)."""
        offset = self.heap.alloc(max(nbytes, 16), self._local.allgather)
        return Block(self.heap, offset, self.pool.local_ptr(offset))

    def close(self) -> None:
        """Waits for the device and for every local rank, then releases everything.

        Collective over the node's ranks. Every step runs even when one fails. A rank
        whose device failed (a kernel that timed out traps, which ends the CUDA
        context) still meets the others, so that none waits for it, and releases what
        the host holds; the device's resources go with the context.

        Raises:
            The first error of the device wait or of a release step, unless a kernel
            of this rank timed out: every ubnext call since (``synchronize`` too)
            raises CollectiveTimeoutError, and close only logs what failed.
        """
        import cupy

        if self.heap.used:
            warnings.warn("Communicator.close: arrays from empty() are still alive; they must not be used "
                          "after close", ResourceWarning, stacklevel=3)
        errors = []
        try:
            cupy.cuda.Device(self.pool.device).synchronize()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            errors.append(e)
        self._local.barrier()
        timed_out = self.timeouts.tripped
        errors += self._teardown.unwind()
        if errors and not timed_out:
            raise errors[0]
        if errors:
            get_logger().warning("close after a kernel timeout: the CUDA context is gone; host resources "
                                 "released, %d device call(s) failed (first: %s)", len(errors), errors[0])
