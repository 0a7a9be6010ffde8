"""Fakes for the benchmark tests: a numpy stand-in for the few cupy calls the
benchmarks make, a bootstrap, a communicator and an all-reduce engine, so their whole
flow (check, time, table, JSON, plots) runs on a machine without a GPU.

"Device" memory is host memory with real addresses, so ``UnownedMemory`` views
alias it as on a GPU. A :class:`Stream` runs work at once, except while it
captures: then work is recorded into the :class:`Graph` that ``end_capture``
returns. Fake engines enqueue their work with :meth:`Stream.enqueue`.

``install(monkeypatch)`` puts the fake in ``sys.modules`` as ``cupy``,
``cupy.cuda`` and ``cupy.cuda.nccl``.
"""

from __future__ import annotations

import ctypes
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def use(self) -> None:
        pass

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = 0) -> None:
        self.ptr, self.size, self.owner = ptr, size, owner


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class ndarray:  # noqa: N801 - cupy's name
    """A 1-D-or-more host array with ``data.ptr`` and cupy's set/get/fill/view."""

    def __init__(self, shape: Any, dtype: Any = np.float32, memptr: MemoryPointer | None = None,
                 *, _host: np.ndarray | None = None, _owner: Any = None) -> None:
        if _host is None:
            count = int(np.prod(shape))
            raw = (ctypes.c_char * max(count * np.dtype(dtype).itemsize, 1)).from_address(memptr.ptr)
            _host = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
            _owner = memptr
        self.host, self._owner = _host, _owner

    data = property(lambda self: _Pointer(self.host.ctypes.data))
    device = property(lambda self: Device(0))
    size = property(lambda self: self.host.size)
    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)

    def view(self, dtype: Any) -> ndarray:
        return ndarray(None, _host=self.host.view(dtype), _owner=self)

    def reshape(self, *shape: Any) -> ndarray:
        return ndarray(None, _host=self.host.reshape(*shape), _owner=self)

    def __getitem__(self, index: Any) -> ndarray:
        return ndarray(None, _host=self.host[index], _owner=self)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self.host[...] = arr

    def get(self, stream: Any = None) -> np.ndarray:
        return self.host.copy()

    def fill(self, value: Any) -> None:
        self.host.fill(value)


def empty(shape: Any, dtype: Any = np.float32) -> ndarray:
    return ndarray(None, _host=np.zeros(shape, dtype=dtype))


class Graph:
    def __init__(self, work: list[Callable[[], None]]) -> None:
        self.work = work

    def launch(self, stream: Any = None) -> None:
        for fn in self.work:
            fn()


class Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = id(self)
        self._captured: list[Callable[[], None]] | None = None

    def enqueue(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now, or record it while capturing (fake engines call this)."""
        if self._captured is None:
            fn()
        else:
            self._captured.append(fn)

    def begin_capture(self) -> None:
        self._captured = []

    def end_capture(self) -> Graph:
        graph, self._captured = Graph(self._captured or []), None
        return graph

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Event:
    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


def get_elapsed_time(start: Event, end: Event) -> float:
    return (end.t - start.t) * 1e3


def _properties(device: int) -> dict[str, Any]:
    return {"name": b"Fake GPU", "pciDomainID": 0, "pciBusID": 0x18 + device, "pciDeviceID": 0,
            "totalGlobalMem": 1 << 30}


def install(monkeypatch: Any = None) -> types.ModuleType:
    """Register the fake as ``cupy`` (and ``cupy.cuda``, ``cupy.cuda.nccl``).

    With a pytest ``monkeypatch`` the registration ends with the test;
    without one it lasts for the process (MPI scripts).
    """
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = False
    runtime = types.SimpleNamespace(getDeviceProperties=_properties, driverGetVersion=lambda: 0,
                                    runtimeGetVersion=lambda: 0)
    for name, value in dict(Device=Device, UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
                            Stream=Stream, Event=Event, Graph=Graph, get_elapsed_time=get_elapsed_time,
                            runtime=runtime, nccl=nccl).items():
        setattr(cuda, name, value)
    cupy.cuda, cupy.ndarray, cupy.empty, cupy.float32 = cuda, ndarray, empty, np.float32
    cupy.uint8, cupy.__version__ = np.uint8, "fake"
    setitem = monkeypatch.setitem if monkeypatch is not None else (lambda d, k, v: d.__setitem__(k, v))
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        setitem(sys.modules, name, module)
    from stream_fakes import FakeContexts

    from ubnext._interop import context as _context

    setitem(_context.__dict__, "_DRIVER", [FakeContexts()])  # the device guard's driver calls
    return cupy


# --------------------------------------------------------------------------- ranks and engines


class Bootstrap:
    """The bootstrap calls the benchmarks make: one rank, or every rank of ``MPI.COMM_WORLD``."""

    def __init__(self, mpi_comm: Any = None) -> None:
        self._comm = mpi_comm

    rank = property(lambda self: self._comm.Get_rank() if self._comm else 0)
    size = property(lambda self: self._comm.Get_size() if self._comm else 1)

    def allgather(self, data: bytes) -> list[bytes]:
        return self._comm.allgather(data) if self._comm else [data]

    def allgather_obj(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj) if self._comm else [obj]

    def barrier(self) -> None:
        if self._comm:
            self._comm.Barrier()


class Comm:
    """What ``World``/``Session`` use of ``ubnext.Communicator``."""

    def __init__(self, bootstrap: Bootstrap) -> None:
        self.bootstrap, self.device, self.closed = bootstrap, bootstrap.rank, False

    rank = property(lambda self: self.bootstrap.rank)
    size = property(lambda self: self.bootstrap.size)

    def close(self) -> None:
        self.closed = True


class ReduceEngine:
    """An all-reduce (and reduce-scatter, all-gather) computed on the host over the
    bootstrap; ``faults`` corrupts the all-reduce's last element."""

    _REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}

    def __init__(self, bootstrap: Bootstrap, faults: bool = False) -> None:
        self.bootstrap, self.faults = bootstrap, faults

    def all_reduce(self, send: ndarray, recv: ndarray, dtype: Any, op: str, stream: Stream) -> None:
        def work() -> None:
            parts = self.bootstrap.allgather_obj(send.host.astype(np.float64))
            result = self._REDUCE[op](np.stack(parts), axis=0)
            if self.faults and result.size:
                result[-1] += 1
            recv.host[...] = result.astype(recv.host.dtype)

        stream.enqueue(work)

    def reduce_scatter(self, send: ndarray, recv: ndarray, dtype: Any, op: str, stream: Stream) -> None:
        """Rank r's slice of the all-reduce of ``send`` (``recv.size`` elements)."""
        def work() -> None:
            parts = self.bootstrap.allgather_obj(send.host.astype(np.float64))
            k = recv.size
            at = self.bootstrap.rank * k
            recv.host[...] = self._REDUCE[op](np.stack(parts), axis=0)[at:at + k].astype(recv.host.dtype)

        stream.enqueue(work)

    def all_gather(self, send: ndarray, recv: ndarray, dtype: Any, op: str, stream: Stream) -> None:
        """Every rank's ``send``, in rank order."""
        def work() -> None:
            recv.host[...] = np.concatenate(self.bootstrap.allgather_obj(send.host.copy()))

        stream.enqueue(work)
