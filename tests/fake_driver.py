"""A recording fake of the ``cuda.bindings.driver`` calls ubnext makes.

``FakeDriver`` stands in for the driver module: it has the same function
names and return convention (``(CUresult, *values)``), returns the real
``cuda.bindings`` types (``CUresult``, ``CUdeviceptr``,
``CUmemGenericAllocationHandle``), and takes everything else (enums, structs
such as ``CUmemAllocationProp``) from the real module. Each stub is a method
``_<name>`` listed in :attr:`FakeDriver.STUBS`; add entries (e.g. the
``cuMulticast*`` calls) by subclassing. A ``cu*`` function without a stub is
an ``AttributeError``, so a fake-driven test never reaches a real GPU.

Every call is recorded in :attr:`FakeDriver.calls`, in order. A failure can be
injected at the N-th call (:meth:`fail_at`) or at the k-th call of a name
(:meth:`fail_on`); the failing call is recorded too. :meth:`leaks` lists what
is still alive (handles, mappings, reservations, exported descriptors).
:class:`MulticastFakeDriver` is such a subclass: it adds the multicast calls and
is thread-safe, for ranks simulated as threads.

Shareable handles are real file descriptors (``os.memfd_create``): exporting
returns a fresh memfd; importing looks the allocation up by the descriptor's
inode, so a closed descriptor fails like it would with the real driver.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from cuda.bindings import driver as _real

CUresult = _real.CUresult
SUCCESS = CUresult.CUDA_SUCCESS
INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE
MIB = 1 << 20


@dataclass
class Call:
    """One recorded driver call."""

    name: str
    args: tuple
    failed: bool = False  # True when the failure was injected


class FakeDriver:
    """Recording fake driver module; see the module docstring.

    Args:
        granularity_min: ``CU_MEM_ALLOC_GRANULARITY_MINIMUM``.
        granularity_recommended: ``CU_MEM_ALLOC_GRANULARITY_RECOMMENDED``.
        device_count: valid ordinals for ``cuDeviceGet``.
    """

    #: stubbed function -> number of values it returns after the CUresult
    STUBS: dict[str, int] = {
        "cuInit": 0,
        "cuDeviceGet": 1,
        "cuMemGetAllocationGranularity": 1,
        "cuMemAddressReserve": 1,
        "cuMemAddressFree": 0,
        "cuMemCreate": 1,
        "cuMemRelease": 0,
        "cuMemExportToShareableHandle": 1,
        "cuMemImportFromShareableHandle": 1,
        "cuMemMap": 0,
        "cuMemUnmap": 0,
        "cuMemSetAccess": 0,
        "cuMemsetD32Async": 0,   # recorded only: the fake has no device memory
        "cuMemcpyDtoHAsync": 0,
    }

    def __init__(
        self,
        granularity_min: int = 2 * MIB,
        granularity_recommended: int = 2 * MIB,
        device_count: int = 8,
    ):
        option = _real.CUmemAllocationGranularity_flags
        self.granularity = {
            option.CU_MEM_ALLOC_GRANULARITY_MINIMUM: granularity_min,
            option.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: granularity_recommended,
        }
        self.device_count = device_count
        self.calls: list[Call] = []
        self.initialized = False
        self.allocations: dict[int, int] = {}  # allocation id -> bytes
        self.handles: dict[int, int] = {}  # live handle -> allocation id
        self.reservations: dict[int, int] = {}  # base -> bytes
        self.mappings: dict[int, tuple[int, int]] = {}  # va -> (bytes, handle)
        self.access: list[tuple[int, int, list]] = []  # (va, bytes, descriptors)
        self.exported: list[tuple[int, int]] = []  # (fd, inode) handed out by export
        self._by_inode: dict[int, int] = {}  # shareable fd inode -> allocation id
        self._ids = itertools.count(1)
        self._next_va = 0x7F00_0000_0000
        self._fail_index: dict[int, CUresult] = {}
        self._fail_name: dict[tuple[str, int], CUresult] = {}

    # -- injection and inspection ---------------------------------------

    def fail_at(self, index: int, error: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY) -> None:
        """Make call number ``index`` (0-based, over all calls) return ``error``."""
        self._fail_index[index] = error

    def fail_on(
        self, name: str, occurrence: int = 0, error: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    ) -> None:
        """Make the ``occurrence``-th (0-based) call of ``name`` return ``error``."""
        self._fail_name[(name, occurrence)] = error

    def names(self) -> list[str]:
        """Names of the recorded calls, in order."""
        return [call.name for call in self.calls]

    def leaks(self) -> list[str]:
        """Human-readable list of resources still alive; empty when clean."""
        out = [f"handle {h} (allocation {a})" for h, a in self.handles.items()]
        out += [f"mapping 0x{va:x} +{n}" for va, (n, _) in self.mappings.items()]
        out += [f"reservation 0x{va:x} +{n}" for va, n in self.reservations.items()]
        out += [f"exported fd {fd}" for fd, inode in self.exported if fd_is_open(fd, inode)]
        return out

    def peer_fd(self, nbytes: int) -> int:
        """A descriptor as a peer's export would deliver it (caller-owned)."""
        allocation = next(self._ids)
        self.allocations[allocation] = nbytes
        return self._shareable_fd(allocation)

    def exchange(
        self, local_rank: int, local_size: int, received: list[int] | None = None
    ) -> Callable[[int], list[int]]:
        """An ``exchange_fds`` that simulates peers exporting same-sized segments.

        The entry at ``local_rank`` is a duplicate of the rank's own descriptor;
        every returned descriptor is also appended to ``received``.
        """
        def exchange_fds(fd: int) -> list[int]:
            nbytes = self.allocations[self._by_inode[os.fstat(fd).st_ino]]
            fds = [
                os.dup(fd) if r == local_rank else self.peer_fd(nbytes)
                for r in range(local_size)
            ]
            if received is not None:
                received.extend(fds)
            return fds

        return exchange_fds

    # -- dispatch ---------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name in self.STUBS:
            return lambda *args: self._dispatch(name, args)
        if name.startswith("cu"):
            raise AttributeError(f"FakeDriver: no stub for {name}")
        return getattr(_real, name)

    def _dispatch(self, name: str, args: tuple) -> tuple:
        index = len(self.calls)
        occurrence = sum(call.name == name for call in self.calls)
        error = self._fail_index.get(index, self._fail_name.get((name, occurrence)))
        self.calls.append(Call(name, args, failed=error is not None))
        if error is not None:
            return (error,) + (None,) * self.STUBS[name]
        return getattr(self, "_" + name)(*args)

    def _error(self, nvalues: int) -> tuple:
        return (INVALID_VALUE,) + (None,) * nvalues

    def _shareable_fd(self, allocation: int) -> int:
        fd = os.memfd_create("fake-cumem")
        self._by_inode[os.fstat(fd).st_ino] = allocation
        return fd

    # -- stubs ------------------------------------------------------------

    def _cuInit(self, flags: int) -> tuple:
        self.initialized = True
        return (SUCCESS,)

    def _cuDeviceGet(self, ordinal: int) -> tuple:
        if not self.initialized:
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
        if not 0 <= ordinal < self.device_count:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (SUCCESS, _real.CUdevice(ordinal))

    def _cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple:
        return (SUCCESS, self.granularity[option])

    def _aligned(self, *values: int) -> bool:
        minimum = min(self.granularity.values())
        return all(int(v) % minimum == 0 for v in values)

    def _cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> tuple:
        if size <= 0 or not self._aligned(size) or alignment & (alignment - 1):
            return self._error(1)
        alignment = alignment or min(self.granularity.values())
        base = -(-self._next_va // alignment) * alignment
        self._next_va = base + size + alignment  # leave a gap between ranges
        self.reservations[base] = size
        return (SUCCESS, _real.CUdeviceptr(base))

    def _cuMemAddressFree(self, ptr: Any, size: int) -> tuple:
        base = int(ptr)
        if self.reservations.get(base) != size:
            return self._error(0)
        if any(base <= va < base + size for va in self.mappings):
            return (CUresult.CUDA_ERROR_NOT_PERMITTED,)  # still mapped
        del self.reservations[base]
        return (SUCCESS,)

    def _cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:
        if size <= 0 or not self._aligned(size) or not 0 <= prop.location.id < self.device_count:
            return self._error(1)
        allocation = next(self._ids)
        self.allocations[allocation] = size
        return (SUCCESS, self._new_handle(allocation))

    def _new_handle(self, allocation: int) -> Any:
        handle = next(self._ids)
        self.handles[handle] = allocation
        return _real.CUmemGenericAllocationHandle(handle)

    def _cuMemRelease(self, handle: Any) -> tuple:
        if self.handles.pop(int(handle), None) is None:
            return self._error(0)
        return (SUCCESS,)

    def _cuMemExportToShareableHandle(self, handle: Any, handle_type: Any, flags: int) -> tuple:
        fd_type = _real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if int(handle) not in self.handles or handle_type != fd_type:
            return self._error(1)
        fd = self._shareable_fd(self.handles[int(handle)])
        self.exported.append((fd, os.fstat(fd).st_ino))
        return (SUCCESS, fd)

    def _cuMemImportFromShareableHandle(self, os_handle: Any, handle_type: Any) -> tuple:
        try:
            inode = os.fstat(int(os_handle)).st_ino
        except OSError:
            return self._error(1)
        if inode not in self._by_inode:
            return self._error(1)
        return (SUCCESS, self._new_handle(self._by_inode[inode]))

    def _cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:
        va = int(ptr)
        inside = any(b <= va and va + size <= b + n for b, n in self.reservations.items())
        overlaps = any(va < v + n and v < va + size for v, (n, _) in self.mappings.items())
        allocation = self.handles.get(int(handle))
        if not inside or overlaps or allocation is None or not self._aligned(va, size, offset):
            return self._error(0)
        if offset + size > self.allocations[allocation]:
            return self._error(0)
        self.mappings[va] = (size, int(handle))
        return (SUCCESS,)

    def _cuMemUnmap(self, ptr: Any, size: int) -> tuple:
        va = int(ptr)
        if self.mappings.get(va, (None,))[0] != size:
            return self._error(0)
        del self.mappings[va]
        return (SUCCESS,)

    def _cuMemsetD32Async(self, ptr: Any, value: int, count: int, stream: Any) -> tuple:
        return (SUCCESS,)

    def _cuMemcpyDtoHAsync(self, dst: Any, src: Any, nbytes: int, stream: Any) -> tuple:
        return (SUCCESS,)  # leaves the host buffer as it was (zeros: not broken)

    def _cuMemSetAccess(self, ptr: Any, size: int, desc: list, count: int) -> tuple:
        va, end = int(ptr), int(ptr) + size
        while va < end:  # the range must be fully mapped
            if va not in self.mappings:
                return self._error(0)
            va += self.mappings[va][0]
        if va != end or count != len(desc):
            return self._error(0)
        self.access.append((int(ptr), size, list(desc)))
        return (SUCCESS,)


def fd_is_open(fd: int, inode: int | None = None) -> bool:
    """True when ``fd`` is open (and, if given, still refers to ``inode``)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return inode is None or st.st_ino == inode


@dataclass
class _MulticastObject:
    """A fake multicast object: its size, team size, added devices and bindings."""

    size: int
    num_devices: int
    devices: set
    bindings: dict  # device -> (mc offset, bytes, memory handle)


class MulticastFakeDriver(FakeDriver):
    """:class:`FakeDriver` plus ``cuDeviceGetAttribute`` and the ``cuMulticast*`` calls.

    Thread-safe, so the N ranks of a node can run as N threads sharing one
    fake: each call is recorded with the name of its thread in
    :attr:`threads` (parallel to ``calls``); :meth:`fail_in` injects a failure
    into one thread's call. Like the real driver, it refuses to bind or map a
    multicast object before all ``numDevices`` devices were added (the real
    one blocks), to bind memory of a device that was not added, and to bind
    or map sizes that are not multiples of the minimum multicast granularity.
    A multicast handle exports and imports like an allocation's.

    Args:
        mc_granularity_min, mc_granularity_recommended: what
            ``cuMulticastGetGranularity`` returns.
        unsupported: device ordinals that report no multicast support.
        add_device_delay: device ordinal -> seconds ``cuMulticastAddDevice``
            sleeps first (outside the lock), to expose missing barriers.
        **kwargs: as for :class:`FakeDriver`.
    """

    STUBS = {
        **FakeDriver.STUBS,
        "cuDeviceGetAttribute": 1,
        "cuMulticastGetGranularity": 1,
        "cuMulticastCreate": 1,
        "cuMulticastAddDevice": 0,
        "cuMulticastBindMem": 0,
        "cuMulticastUnbind": 0,
    }

    def __init__(self, mc_granularity_min: int = 2 * MIB, mc_granularity_recommended: int = 2 * MIB,
                 unsupported: frozenset = frozenset(), add_device_delay: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        option = _real.CUmulticastGranularity_flags
        self.mc_granularity = {
            option.CU_MULTICAST_GRANULARITY_MINIMUM: mc_granularity_min,
            option.CU_MULTICAST_GRANULARITY_RECOMMENDED: mc_granularity_recommended,
        }
        self.unsupported = set(unsupported)
        self.add_device_delay = dict(add_device_delay or {})
        self.threads: list[str] = []  # thread name of each recorded call
        self.multicast: dict[int, _MulticastObject] = {}  # allocation id -> object
        self.device_of: dict[int, int] = {}  # allocation id -> device (cuMemCreate)
        self._lock = threading.RLock()
        self._fail_thread: dict[tuple[str, str], CUresult] = {}

    def fail_in(self, thread: str, name: str, error: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY) -> None:
        """Make the first call of ``name`` from thread ``thread`` return ``error``."""
        self._fail_thread[(thread, name)] = error

    def calls_of(self, thread: str) -> list[Call]:
        """The calls made by thread ``thread``, in order."""
        with self._lock:
            return [c for c, t in zip(self.calls, self.threads) if t == thread]

    def leaks(self) -> list[str]:
        out = super().leaks()
        for allocation, mc in self.multicast.items():
            out += [f"multicast {allocation} binding on device {dev}" for dev in mc.bindings]
        return out

    def _dispatch(self, name: str, args: tuple) -> tuple:
        if name == "cuMulticastAddDevice":
            time.sleep(self.add_device_delay.get(int(args[1]), 0.0))
        thread = threading.current_thread().name
        with self._lock:
            error = self._fail_thread.pop((thread, name), None)
            if error is not None:
                self.fail_at(len(self.calls), error)
            self.threads.append(thread)
            return super()._dispatch(name, args)

    def _mc(self, handle: Any) -> _MulticastObject | None:
        return self.multicast.get(self.handles.get(int(handle), -1))

    def _mc_aligned(self, *values: int) -> bool:
        minimum = min(self.mc_granularity.values())
        return all(int(v) % minimum == 0 for v in values)

    # -- stubs ------------------------------------------------------------

    def _cuDeviceGetAttribute(self, attrib: Any, dev: Any) -> tuple:
        if attrib != _real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED:
            return self._error(1)
        return (SUCCESS, int(int(dev) not in self.unsupported))

    def _cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:
        result = super()._cuMemCreate(size, prop, flags)
        if result[0] == SUCCESS:
            self.device_of[self.handles[int(result[1])]] = prop.location.id
        return result

    def _cuMulticastGetGranularity(self, prop: Any, option: Any) -> tuple:
        return (SUCCESS, self.mc_granularity[option])

    def _cuMulticastCreate(self, prop: Any) -> tuple:
        fd_type = _real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if (prop.size <= 0 or not self._mc_aligned(prop.size) or prop.numDevices < 1
                or prop.handleTypes != fd_type):
            return self._error(1)
        allocation = next(self._ids)
        self.allocations[allocation] = prop.size
        self.multicast[allocation] = _MulticastObject(prop.size, prop.numDevices, set(), {})
        return (SUCCESS, self._new_handle(allocation))

    def _cuMulticastAddDevice(self, handle: Any, dev: Any) -> tuple:
        mc = self._mc(handle)
        if mc is None or int(dev) in mc.devices or len(mc.devices) == mc.num_devices:
            return self._error(0)
        mc.devices.add(int(dev))
        return (SUCCESS,)

    def _cuMulticastBindMem(self, handle: Any, mc_offset: int, mem: Any, mem_offset: int, size: int,
                            flags: int) -> tuple:
        mc = self._mc(handle)
        allocation = self.handles.get(int(mem))
        if mc is None or allocation is None or not self._mc_aligned(mc_offset, mem_offset, size):
            return self._error(0)
        if len(mc.devices) != mc.num_devices:
            return (CUresult.CUDA_ERROR_NOT_PERMITTED,)  # the real driver would block here
        device = self.device_of.get(allocation)
        if device not in mc.devices or device in mc.bindings:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE,)
        if mem_offset + size > self.allocations[allocation] or mc_offset + size > mc.size:
            return self._error(0)
        mc.bindings[device] = (mc_offset, size, int(mem))
        return (SUCCESS,)

    def _cuMulticastUnbind(self, handle: Any, dev: Any, mc_offset: int, size: int) -> tuple:
        mc = self._mc(handle)
        if mc is None or mc.bindings.get(int(dev), (None, None))[:2] != (mc_offset, size):
            return self._error(0)
        del mc.bindings[int(dev)]
        return (SUCCESS,)

    def _cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:
        mc = self._mc(handle)
        if mc is not None and (len(mc.devices) != mc.num_devices or not self._mc_aligned(size, offset)):
            return (CUresult.CUDA_ERROR_NOT_PERMITTED,)
        return super()._cuMemMap(ptr, size, offset, handle, flags)


class GraphFakeDriver(MulticastFakeDriver):
    """:class:`MulticastFakeDriver` plus stream capture and CUDA user objects.

    :meth:`begin_capture` makes a stream capture into a new fake graph (its id, as
    ``cuStreamGetCaptureInfo`` reports it); ``cuUserObjectCreate`` keeps the destructor
    (a ``CUhostFn``: a C function address) and its argument; ``cuGraphRetainUserObject``
    gives a graph references (moved from the caller's with ``CU_GRAPH_USER_OBJECT_MOVE``);
    :meth:`destroy_graph` drops a graph's references, and an object whose last one goes
    has its destructor called, for real, through ctypes, from a thread of the fake (as
    CUDA's internal thread would): no Python runs there but what the destructor is.
    """

    STUBS = {
        **MulticastFakeDriver.STUBS,
        "cuStreamGetCaptureInfo": 3,
        "cuUserObjectCreate": 1,
        "cuGraphRetainUserObject": 0,
        "cuUserObjectRelease": 0,
    }

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.capturing: dict[int, int] = {}  # stream -> graph (its capture id too)
        self.objects: dict[int, list] = {}  # user object -> [references, destructor address, its argument]
        self.graph_refs: dict[int, dict[int, int]] = {}  # graph -> {user object: references}
        self._graphs = itertools.count(101)

    def begin_capture(self, stream: int) -> int:
        graph = next(self._graphs)
        self.capturing[stream] = graph
        self.graph_refs[graph] = {}
        return graph

    def end_capture(self, stream: int) -> int:
        return self.capturing.pop(stream)

    def capture_id(self, stream: int) -> int:
        """``_streams.Cuda.capture``'s answer for ``stream``."""
        return self.capturing.get(stream, 0)

    def destroy_graph(self, graph: int) -> None:
        with self._lock:
            refs = self.graph_refs.pop(graph)
        for obj, count in refs.items():
            self._drop(obj, count)

    def live_objects(self) -> int:
        return len(self.objects)

    def _drop(self, obj: int, count: int) -> None:
        import ctypes

        with self._lock:
            entry = self.objects[obj]
            entry[0] -= count
            if entry[0] > 0:
                return
            del self.objects[obj]
        fn, arg = entry[1:]
        destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)
        thread = threading.Thread(target=destructor, args=(arg,), name="fake-cuda-destructor", daemon=True)
        thread.start()
        thread.join(5)

    def _cuStreamGetCaptureInfo(self, stream: Any) -> tuple:
        graph = self.capturing.get(int(stream))
        status = _real.CUstreamCaptureStatus
        if graph is None:
            return (SUCCESS, status.CU_STREAM_CAPTURE_STATUS_NONE, 0, None)
        return (SUCCESS, status.CU_STREAM_CAPTURE_STATUS_ACTIVE, graph, graph)

    def _cuUserObjectCreate(self, ptr: Any, destroy: Any, refs: int, flags: Any) -> tuple:
        if int(flags) != int(_real.CUuserObject_flags.CU_USER_OBJECT_NO_DESTRUCTOR_SYNC) or not int(destroy):
            return self._error(1)
        obj = next(self._ids)
        self.objects[obj] = [refs, int(destroy), int(ptr)]
        return (SUCCESS, obj)

    def _cuGraphRetainUserObject(self, graph: Any, obj: Any, count: int, flags: Any) -> tuple:
        if int(graph) not in self.graph_refs or int(obj) not in self.objects:
            return self._error(0)
        refs = self.graph_refs[int(graph)]
        refs[int(obj)] = refs.get(int(obj), 0) + count
        if int(flags) != int(_real.CUuserObjectRetain_flags.CU_GRAPH_USER_OBJECT_MOVE):
            self.objects[int(obj)][0] += count
        return (SUCCESS,)

    def _cuUserObjectRelease(self, obj: Any, count: int) -> tuple:
        if int(obj) not in self.objects:
            return self._error(0)
        self._drop(int(obj), count)
        return (SUCCESS,)
