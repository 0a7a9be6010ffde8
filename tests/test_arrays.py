"""Argument validation that needs no GPU: what is not CUDA memory is refused clearly;
the launch stream is resolved first and handed to arrays of other frameworks."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from stream_fakes import FakeContexts, FakeCuda

from ubnext import UbnextError
from ubnext._interop import arrays as _arrays
from ubnext._interop import context as _context
from ubnext._interop import streams as _streams
from ubnext._interop.arrays import as_buffer, launch_stream, record_stream, stream_handle


@pytest.mark.parametrize("obj", [np.ones(4, np.float32), [1.0, 2.0], 3.0, "x"])
def test_host_and_foreign_objects_are_refused(obj):
    with pytest.raises(UbnextError, match="all_reduce: .*(CUDA array|host memory)"):
        as_buffer(obj, "all_reduce", 0)


def test_cupy_dtypes_are_named_once_and_unsupported_ones_always_refused(monkeypatch):
    class ndarray:  # the attributes as_buffer() reads from a cupy.ndarray
        def __init__(self, dtype):
            self.dtype, self.size, self.shape = np.dtype(dtype), 4, (4,)
            self.flags = types.SimpleNamespace(c_contiguous=True)
            self.data = types.SimpleNamespace(ptr=4096)
            self.device = types.SimpleNamespace(id=0)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=ndarray))
    monkeypatch.setattr(_arrays, "_CUPY_NAMES", {})
    for _ in range(2):
        b = as_buffer(ndarray("float16"), "all_reduce", 0)
        assert (b.framework, b.dtype, b.ptr, b.count, b.nbytes) == ("cupy", "float16", 4096, 4, 8)
        with pytest.raises(UbnextError, match="all_reduce: unsupported dtype complex64"):
            as_buffer(ndarray("complex64"), "all_reduce", 0)
    assert _arrays._CUPY_NAMES == {np.dtype("float16"): "float16"}


# -- the launch stream ---------------------------------------------------------------------


class Stream:
    """A CuPy-like stream object (``ptr``)."""

    def __init__(self, ptr):
        self.ptr = ptr


@pytest.fixture
def cupy_stream(monkeypatch):
    """CuPy's current stream, faked (CuPy needs a driver to name it)."""
    import cupy

    current = Stream(0x5100)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device=-1: current)
    return current


def test_stream_handle_accepts_ints_and_stream_objects():
    class TorchLike:
        cuda_stream = 1234

    class CoreLike:  # cuda.core: the CUDA stream protocol
        def __cuda_stream__(self):
            return 0, 4321

    assert stream_handle(7) == 7
    assert stream_handle(TorchLike()) == 1234
    assert stream_handle(Stream(99)) == 99
    assert stream_handle(CoreLike()) == 4321
    with pytest.raises(UbnextError, match="stream"):
        stream_handle(object())


def test_launch_stream_of_an_array_that_is_not_torch_is_cupys_current(cupy_stream):
    x = object()
    assert launch_stream(None, x, 0) == (0x5100, cupy_stream, False)
    given = Stream(0x6200)
    assert launch_stream(given, x, 0) == (0x6200, given, True)
    assert launch_stream(0x6200, x, 0) == (0x6200, None, True)
    assert launch_stream(0x5100, x, 0) == (0x5100, None, False)  # the current one, named


def test_launch_stream_of_a_tensor_is_torchs_current(monkeypatch):
    torch = fake_torch(monkeypatch, current=0x7700)
    t = torch.Tensor(device=2)
    assert launch_stream(None, t, 0) == (0x7700, None, False)
    assert torch.asked == [2]
    s = torch.cuda.Stream(0x7800)
    assert launch_stream(s, t, 0) == (0x7800, s, True)
    assert launch_stream(0x7700, t, 0)[2] is False


def test_record_stream_marks_every_torch_tensor_for_the_side_stream(monkeypatch):
    torch = fake_torch(monkeypatch, current=0x7700)
    x, out = torch.Tensor(device=0), torch.Tensor(device=0)
    side = torch.cuda.Stream(0x7800)
    record_stream(0x7800, side, (buffer_of(x, "torch"), None, buffer_of(out, "torch"), buffer_of(object(), "cupy")))
    assert x.recorded == [side] and out.recorded == [side]
    record_stream(0x7900, None, (buffer_of(x, "torch"),))  # a raw handle: an external stream of the device
    assert (x.recorded[-1].cuda_stream, x.recorded[-1].device, x.recorded[-1].device_type) == (0x7900, 0, 1)
    record_stream(_streams.LEGACY, None, (buffer_of(x, "torch"),))  # the legacy default stream: torch's default, id 0
    assert x.recorded[-1].cuda_stream == 0


def test_a_new_torch_output_on_a_side_stream_is_ordered_after_the_current_stream(monkeypatch):
    """Without torch's stream guard (whose exit sets torch's device: a context on another
    GPU): allocated on the current stream, which the launch stream then waits for."""
    torch = fake_torch(monkeypatch, current=0x7700)  # no torch.cuda.stream: a guard would raise
    cuda = FakeCuda()
    monkeypatch.setattr(_streams, "CUDA", cuda)
    made = []
    torch.empty_like = lambda t: made.append(t) or torch.Tensor(device=0)
    x = torch.Tensor(device=0)
    new = _arrays.empty_like(buffer_of(x, "torch"), 0x7800, None, True)
    assert made == [x] and isinstance(new, torch.Tensor)
    event = cuda.calls[0][1]
    assert cuda.calls == [("event", event), ("record", event, 0x7700), ("wait", 0x7800, event), ("destroy", event)]
    cuda.calls.clear()
    _arrays.empty_like(buffer_of(x, "torch"), 0x7700, None, False)  # on the current stream: nothing to order
    assert cuda.calls == [] and len(made) == 2


def fake_torch(monkeypatch, current):
    """A ``torch`` module with what _arrays touches: Tensor, the dtypes, the current raw
    stream, streams and ``record_stream``."""
    asked = []

    class Tensor:
        def __init__(self, device):
            self._device, self.recorded = device, []

        def get_device(self):
            return self._device

        def record_stream(self, stream):
            self.recorded.append(stream)

    class CudaStream:
        """torch.cuda.Stream: made by ubnext from the fields (stream_id, device_index,
        device_type), which enters no device guard; its ``cuda_stream`` as torch reads an
        external stream's id (the handle) or the default stream's (0)."""

        def __init__(self, handle=None, device=0, *, stream_id=None, device_index=None, device_type=None):
            if stream_id is not None:
                handle, device, self.device_type = stream_id, device_index, device_type
            self.cuda_stream, self.device = handle, device

    def raw(device):
        asked.append(device)
        return current

    torch = types.SimpleNamespace(
        Tensor=Tensor, bfloat16="bf16", float16="f16", float32="f32", asked=asked,
        _C=types.SimpleNamespace(_cuda_getCurrentRawStream=raw),
        cuda=types.SimpleNamespace(Stream=CudaStream),  # no ExternalStream: it enters torch's device guard
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_arrays, "_TORCH_NAMES", {})
    return torch


def buffer_of(obj, framework):
    return _arrays.Buffer(obj, framework, 4096, 4, "float32", 0, (4,), 16)


# -- arrays of other frameworks -------------------------------------------------------------

LAUNCH = 0x5500  # the stream a call launches on


@pytest.fixture
def cuda(monkeypatch):
    """The runtime calls of stream ordering, faked and recorded."""
    fake = FakeCuda()
    monkeypatch.setattr(_streams, "CUDA", fake)
    monkeypatch.setattr(_context, "_DRIVER", [FakeContexts()])  # keep_current around producers
    return fake


@pytest.fixture
def device_memory(monkeypatch):
    """Pointers are taken to be memory of device 0; CuPy arrays over them need no GPU.
    ``cupy.asarray`` must not be used on interface objects: it blocks the host until
    the producer's stream is done."""
    import cupy

    monkeypatch.setattr(_arrays, "_pointer_device", lambda ptr, op, kind: 0)

    def refuse(*args, **kwargs):
        raise AssertionError("cupy.asarray would block the host on the producer's stream")

    monkeypatch.setattr(cupy, "asarray", refuse)
    views = []

    def capsule_array(capsule):  # what cupy.from_dlpack would make of the capsule
        views.append(capsule)
        mem = cupy.cuda.UnownedMemory(capsule.ptr, 16, capsule, device_id=0)
        return cupy.ndarray((4,), np.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))

    monkeypatch.setattr(_arrays, "_capsule_array", capsule_array)
    return views


class Capsule:
    ptr = 8192


class DlpackProducer:
    """A DLPack producer that records the stream it is handed."""

    def __init__(self, device_type=2, versioned=True):
        self.device_type, self.versioned, self.streams = device_type, versioned, []

    def __dlpack_device__(self):
        return self.device_type, 0

    def __dlpack__(self, stream=None, **kwargs):
        if kwargs and not self.versioned:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.streams.append(stream)
        return Capsule()


class CaiProducer:
    """An object with ``__cuda_array_interface__`` (``version``, ``stream`` as given)."""

    def __init__(self, version=3, stream=None, **fields):
        self.desc = {"shape": (4,), "typestr": "<f4", "data": (4096, False), "version": version, **fields}
        if stream is not None or version >= 3:
            self.desc["stream"] = stream

    @property
    def __cuda_array_interface__(self):
        return self.desc


class Both(CaiProducer, DlpackProducer):
    def __init__(self, version, stream=None):
        CaiProducer.__init__(self, version, stream)
        DlpackProducer.__init__(self)


def test_a_dlpack_producer_is_handed_the_launch_stream(cuda, device_memory):
    x = DlpackProducer()
    b = as_buffer(x, "all_reduce", LAUNCH)
    assert x.streams == [LAUNCH]
    assert (b.framework, b.ptr, b.count, b.dtype) == ("cupy", Capsule.ptr, 4, "float32")
    as_buffer(x, "all_reduce", 0)  # the legacy default stream is 1 in DLPack (0 is ambiguous there)
    assert x.streams[-1] == 1
    old = DlpackProducer(versioned=False)  # before DLPack 1.0: no max_version
    as_buffer(old, "all_reduce", LAUNCH)
    assert old.streams == [LAUNCH]


def test_a_dlpack_producer_is_not_asked_to_wait_while_the_stream_is_captured(cuda, device_memory):
    cuda.captures[LAUNCH] = 4
    x = DlpackProducer()
    as_buffer(x, "all_reduce", LAUNCH)
    assert x.streams == [-1]


def test_dlpack_memory_off_the_gpu_is_refused(cuda, device_memory):
    with pytest.raises(UbnextError, match="all_reduce: DlpackProducer is not in CUDA device memory"):
        as_buffer(DlpackProducer(device_type=1), "all_reduce", LAUNCH)


def test_an_interface_stream_is_waited_for_on_the_launch_stream(cuda, device_memory):
    b = as_buffer(CaiProducer(stream=0x6600), "all_reduce", LAUNCH)
    assert (b.ptr, b.count, b.dtype, b.shape) == (4096, 4, "float32", (4,))
    event = cuda.calls[0][1]
    assert cuda.calls == [("event", event), ("record", event, 0x6600), ("wait", LAUNCH, event),
                          ("destroy", event)]


def test_an_interface_without_a_stream_is_not_waited_for(cuda, device_memory):
    as_buffer(CaiProducer(stream=None), "all_reduce", LAUNCH)
    as_buffer(CaiProducer(stream=LAUNCH), "all_reduce", LAUNCH)  # already in order
    assert cuda.calls == []


def test_a_version_3_interface_comes_before_dlpack(cuda, device_memory):
    x = Both(version=3, stream=0x6600)
    as_buffer(x, "all_reduce", LAUNCH)
    assert x.streams == [] and cuda.names() == ["event", "record", "wait", "destroy"]


def test_an_older_interface_gives_way_to_dlpack(cuda, device_memory):
    """JAX offers version 2 (no stream; the data may still be computed) and DLPack."""
    x = Both(version=2)
    b = as_buffer(x, "all_reduce", LAUNCH)
    assert x.streams == [LAUNCH] and b.ptr == Capsule.ptr
    b = as_buffer(CaiProducer(version=2), "all_reduce", LAUNCH)  # only the interface: taken as it is
    assert b.ptr == 4096 and cuda.calls == []


@pytest.mark.parametrize("fields, words", [
    ({"strides": (8,)}, "not C-contiguous"),
    ({"mask": object()}, "masked"),
    ({"typestr": "<c8"}, "unsupported dtype complex64"),
    ({"shape": None}, "invalid __cuda_array_interface__"),
])
def test_interface_arrays_that_cannot_be_reduced_are_refused(cuda, device_memory, fields, words):
    with pytest.raises(UbnextError, match=f"all_reduce: .*{words}"):
        as_buffer(CaiProducer(**fields), "all_reduce", LAUNCH)
    assert cuda.calls == []


def test_contiguous_strides_are_accepted(cuda, device_memory):
    b = as_buffer(CaiProducer(shape=(2, 1, 2), strides=(8, 123, 4)), "all_reduce", LAUNCH)
    assert b.shape == (2, 1, 2) and b.count == 4
