"""The node's kernel resources: descriptor channel, symmetric pool, multicast range
(where the NVLS gate allows), failure records, engine and user heap, created
transactionally and released together."""

from __future__ import annotations

import threading
import warnings

import numpy as np

from ubnext._engine.engine import Engine
from ubnext._engine.failures import FailureRecords, broken_word, state_field
from ubnext._engine.holders import Graphs, Lease
from ubnext._environment.cuda import drv
from ubnext._memory.descriptors import FdChannel
from ubnext._memory.heap import STATES, UserHeap, plan_layout
from ubnext._memory.multicast import MulticastRange
from ubnext._memory.pool import SymmetricPool
from ubnext._memory.transaction import UndoStack
from ubnext._protocol.errors import UbnextError
from ubnext._protocol.quant import quant_area_bytes


class Block:
    """Owner of one user allocation (``Communicator.empty``, and the areas of features
    built on the communicator): every array viewing it, of any framework, holds it, and it
    holds the node's lease, so this rank's segment stays mapped (and its address range
    reserved) while the array lives, the communicator closed or dropped included.

    Collected, it returns its range to the heap (pure Python); the lease it drops may be
    the last hold of the segment, which is then released on this thread.
    """

    __slots__ = ("ptr", "_heap", "_offset", "_lease", "__weakref__")

    def __init__(self, heap: UserHeap, offset: int, ptr: int, lease: Lease):
        self.ptr, self._heap, self._offset, self._lease = ptr, heap, offset, lease

    def __del__(self):
        self._heap.free(self._offset)


class Node:
    """Everything ubnext's kernels need on this node. Construction is collective over
    ``local`` (the node's ranks) and undoes itself on failure.

    Args:
        local: bootstrap of this node's ranks.
        context: this rank's device and CUDA context (``_context.Context``; current during
            construction); the node's steps outside a call (announce, broken, close) make
            it current themselves.
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

    def __init__(self, local, context, config, nvls, driver=None):
        import cupy

        self._local = local
        self._context = context
        device = context.device
        self._driver = driver
        lamport_bytes, lamport_twoshot_bytes = config.lamport_max_kb << 10, config.lamport_twoshot_max_kb << 10
        # unaligned arrays go through the staging slot, whatever the algorithm
        staging_bytes = max(config.staging_mb << 20, lamport_bytes, lamport_twoshot_bytes)
        quant_bytes = quant_area_bytes(local.size, config.quantized)
        plan = plan_layout(local.size, lamport_bytes, lamport_twoshot_bytes, staging_bytes, quant_bytes)
        pool_bytes = config.pool_mb << 20
        if plan.end >= pool_bytes:
            raise UbnextError(f"Communicator: UBNEXT_POOL_MB={config.pool_mb} leaves no room for user buffers; "
                              f"the library slots alone take {plan.end / 2**20:.1f} MiB (UBNEXT_STAGING_MB, "
                              f"UBNEXT_LAMPORT_MAX_KB and UBNEXT_LAMPORT_TWOSHOT_MAX_KB size them)")
        # the release steps, run newest first on a failed setup (the multicast range
        # unbinds the segments before the pool releases them); close releases in parts
        undo = UndoStack()
        try:
            # the descriptor channel serves the setup only: closed (collectively) once the
            # segments and the multicast object are shared, so that closing the node later
            # needs no other rank (idempotent: its undo step is then a no-op)
            self.fds = FdChannel(local, config.timeout_s)
            undo.push(self.fds.close)
            self.pool = self._create_pool(device, pool_bytes)
            undo.push(self.pool.close)
            self.multicast = None
            if nvls.enabled:  # its failures are agreed across the node's ranks
                self.multicast = MulticastRange(self.pool, local, self.fds, driver=driver)
                undo.push(self.multicast.close)
            self.fds.close()
            self.failures = FailureRecords(STATES)
            undo.push(self.failures.close)
            self.engine = Engine(self.pool, plan, self.failures.device_ptr, self.failures.tripped_ptr,
                                 config.timeout_s, config.max_blocks,
                                 mc_base=0 if self.multicast is None else self.multicast.ptr,
                                 deterministic=config.deterministic, pdl=config.pdl)
            self._broken_ptrs = [self.pool.ptr(r, plan.offset(name) + state_field("broken"))
                                 for r in range(local.size) for name in STATES]
            self._own_broken = [p for p in self._broken_ptrs if self.pool.contains(p, 4) is not None]
            undo.push(self.engine.close)
            self._side = cupy.cuda.Stream(non_blocking=True)  # announce() and broken() run on it
            undo.push(self._drop_side)
            # announce and close exclude each other: an abort or the watchdog of another
            # thread never writes into a pool that close is releasing
            self._announce_lock, self._announced, self._closed = threading.Lock(), False, False
            # failure()'s first announce: whoever sees the failure first (a call, synchronize,
            # the watchdog) announces; the others wait until it is done (see failure())
            self._failure_lock = threading.Lock()
            self.engine.initialize()
            self.heap = UserHeap(plan.end, self.pool.size)
        except BaseException:
            for e in undo.unwind():  # keep the original error
                warnings.warn(f"Communicator: cleanup after a failed setup: {e}", RuntimeWarning)
            raise
        # committed: what points into the pool holds it (holders): this rank's segment and the
        # address range stay while the node, an array or a captured graph holds the lease; the
        # peers' segments, the multicast range and the failure words while the node or a graph does
        self._lease, self._released = Lease(self._release_own, context), False
        self._release_lock, self._on_release = threading.Lock(), []
        self.graphs = Graphs(driver=driver, context=context)

    def _drop_side(self) -> None:
        """Destroys the side stream on the closing thread (the garbage collector may free
        it on a thread whose current device is another one, creating a context there)."""
        self._side = None

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

    def alloc(self, nbytes: int, exchange=None) -> Block:
        """A user block of at least ``nbytes`` (collective over the node's ranks: the heap's
        allgather, through ``exchange(fn, *args)`` where given: ``lifetime.Exchanges.run``)."""
        agree = self._local.allgather
        if exchange is not None:
            local = self._local
            agree = lambda message: exchange(local.allgather, message)  # noqa: E731
        offset = self.heap.alloc(max(nbytes, 16), agree)
        return Block(self.heap, offset, self.pool.local_ptr(offset), self._lease)

    def hold(self, stream: int) -> None:
        """Where ``stream`` is being captured into a CUDA graph, makes that graph hold the
        node's memory until it is destroyed (``holders.Graphs.hold``). In the launch section,
        before a call's launches.

        Raises:
            CudaError: a driver call failed.
        """
        lease = self._lease
        if lease is not None:
            self.graphs.hold(stream, lease)

    def announce(self, kind: int, rank: int) -> None:
        """Marks every kernel family of every local rank broken by rank ``rank`` with failure
        ``kind``, so that their waits give up and their launches write poison. Local; the
        stores go on a stream of their own, beside any kernel still waiting, and only they
        are waited for."""
        word = broken_word(kind, rank)
        with self._announce_lock, self._context.current():  # from any thread (the watchdog's, abort's)
            if self._closed:
                return
            for ptr in self._broken_ptrs:
                drv("cuMemsetD32Async", ptr, word, 1, self._side.ptr, driver=self._driver)
            self._side.synchronize()  # done when this returns: a peer told of it afterwards sees it

    def announce_abort(self, rank: int) -> None:
        """``announce`` that local rank ``rank`` gave the communicator up (``abort()``, or a
        communicator dropped without ``close()``)."""
        from ubnext._protocol.constants import FAIL_KINDS

        self.announce(next(code for code, (name, _) in FAIL_KINDS.items() if name == "kFailAborted"), rank)

    def failure(self, op: str, timeout_s: float):
        """The error a kernel of this rank recorded, or None. The first time one is seen,
        every kernel family of every local rank is marked broken (``announce``), and no
        thread gets the error before that announce is done: a rank that raises it and then
        lines up with its peers (a barrier, a message) must find their families marked
        already, or a late peer's Lamport launch, finding all pushed data present (the
        failed launch pushed its own), would complete without failing. Safe from any
        thread; blocks only while another thread's announce is in progress.

        Returns:
            a ``BrokenCommunicatorError`` (or subclass) naming what failed, or None.
        """
        error = self.failures.error(op, timeout_s)
        if error is not None and not self._announced:
            with self._failure_lock:  # the watchdog's thread may be announcing it right now
                if not self._announced:
                    try:
                        self.announce(*self.failures.origin())
                    finally:  # once: a second announce would only write the same words
                        self._announced = True
        return error

    def broken(self) -> bool:
        """Whether the communicator failed: a kernel of this rank recorded a failure, or a
        rank marked this rank's kernel families broken. Local; waits only for a read on a
        stream of its own."""
        if self.failures.tripped:
            return True
        words = np.zeros(len(self._own_broken), np.uint32)
        with self._context.current():
            for i, ptr in enumerate(self._own_broken):
                drv("cuMemcpyDtoHAsync", words.ctypes.data + 4 * i, ptr, 4, self._side.ptr, driver=self._driver)
            self._side.synchronize()
        return bool(words.any())

    def close(self, local: bool = False, exchange=None) -> bool:
        """Waits for the device, then for every local rank, then releases what is the node's
        and gives up its hold of the memory: the peers' segments, the multicast range and
        the failure words go now unless a captured graph still holds them (then when the
        last such graph is destroyed); this rank's segment and the address range once no
        array from ``empty()`` and no graph holds them either (see ``holders``).

        Collective over the node's ranks, unless ``local`` or the communicator is broken
        (``broken()``): then no rank is waited for, since a failed peer may never come;
        the segments stay valid for the peers that still map them (their memory goes with
        the last mapping). Every step runs even when one fails, the rank's barrier included
        (``exchange(fn)``: ``lifetime.Exchanges.run``, which an abort makes raise).

        Returns:
            Whether it closed locally (waited for no rank).

        Raises:
            The first error of the device wait, the barrier or a release step.
        """
        import cupy

        errors = []
        try:
            with self._context.current():
                cupy.cuda.Device(self.pool.device).synchronize()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            errors.append(e)
        local = local or bool(errors) or self.broken()
        if not local:
            try:
                self._local.barrier() if exchange is None else exchange(self._local.barrier)
            except Exception as e:  # a peer gone, an abort: released locally all the same
                errors.append(e)
                local = True
        with self._announce_lock, self._context.current():  # no announce writes into what is released
            if self._closed:
                return local
            self._closed = True
            for step in (self.fds.close, self.engine.close, self._drop_side):
                try:
                    step()
                except Exception as e:
                    errors.append(e)
            lease, self._lease = self._lease, None
            if self.graphs.close(self._release_shared):  # no graph holds the memory: shared parts now
                errors += self._release_shared()
                if not self.heap.blocks:  # nor an array: the rest now, its errors raised here
                    try:
                        lease.release()
                    except Exception as e:
                        errors.append(e)
            del lease  # else the last holder releases it
        if errors:
            raise errors[0]
        return local

    @property
    def holds_memory(self) -> bool:
        """Whether this rank's segment is still mapped (an array or a graph holds it)."""
        return self._lease is not None or not self._released

    def _release_shared(self) -> list[Exception]:
        """Releases what only the node and captured graphs use: the multicast range, the
        peers' segments, the failure words. Once; returns the errors (every step runs)."""
        errors = []
        with self._context.current():
            for step in ((self.multicast.close,) if self.multicast is not None else ()) + (
                    self.pool.release_peers, self.failures.close):
                try:
                    step()
                except Exception as e:
                    errors.append(e)
        return errors

    def on_release(self, fn) -> None:
        """Calls ``fn()`` once this rank's memory is released: now if it is (the communicator
        gives its context's retain back then, not before)."""
        with self._release_lock:
            if not self._released:
                self._on_release.append(fn)
                return
        fn()

    def _release_own(self) -> None:
        """Waits for the device (a kernel may still read an array that was just dropped),
        releases this rank's segment and the address range (``pool.close``: whatever is
        still mapped), then runs the ``on_release`` callbacks: the lease's release, run once
        by its last holder, on its thread."""
        import cupy

        try:
            with self._context.current():
                try:
                    cupy.cuda.Device(self.pool.device).synchronize()
                finally:  # a device error (another library's kernel) still releases
                    self.pool.close()
        finally:
            with self._release_lock:
                self._released, callbacks, self._on_release = True, self._on_release, []
            for fn in callbacks:
                fn()
