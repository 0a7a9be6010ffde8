"""Interop with the caller's arrays: CuPy, PyTorch, and anything with DLPack or CAI.

Fast paths read torch tensors and CuPy arrays directly; arrays of other frameworks are
viewed as CuPy arrays through ``__dlpack__`` or ``__cuda_array_interface__``, ordered
before the stream the call launches on (so the launch stream is resolved first, by
``launch_stream``). torch is optional and imported lazily: it is only touched when the
caller passes a tensor or asks for one.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from ubnext._interop import streams as _streams
from ubnext._interop.context import current_device, keep_current
from ubnext._protocol.algorithms import DTYPES
from ubnext._protocol.errors import UbnextError

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged
_DLPACK_VERSION = (1, 0)  # the newest DLPack this module reads (through CuPy)
_DEVICE_MEMORY, _MANAGED_MEMORY = 2, 3  # cudaMemoryType


class Buffer(NamedTuple):
    """A validated view of a caller's device array.

    Attributes:
        obj: the caller's object (returned to the caller as is).
        framework: ``"torch"`` or ``"cupy"`` (other inputs are wrapped as CuPy).
        ptr: device address of element 0.
        count: number of elements.
        dtype: a key of ``DTYPES``.
        device: CUDA device ordinal.
        shape: the array's shape.
        nbytes: bytes of its elements.
    """

    obj: object
    framework: str
    ptr: int
    count: int
    dtype: str
    device: int
    shape: tuple
    nbytes: int


def _torch():
    return sys.modules.get("torch")


def _compiling_before_torch() -> bool:
    """``_compiling`` until torch is imported: False without torch; once torch is there, it
    puts ``torch.compiler.is_dynamo_compiling`` in its place (:func:`bind_torch`), in
    eager code only: dynamo guards a compiled function on the ``_compiling`` it traced,
    so a rebinding from inside its first trace would recompile it at its second call."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if torch.compiler.is_dynamo_compiling():
        return True
    bind_torch()
    return False


def bind_torch() -> None:
    """Binds ``_compiling`` to ``torch.compiler.is_dynamo_compiling`` where torch is
    imported (nothing otherwise). Called in eager code (``ubnext.torch``'s import, each
    Communicator's creation), so that a compiled function's first collective finds it
    bound already. Not collective; no CUDA call."""
    global _compiling, _TENSOR
    torch = sys.modules.get("torch")
    if torch is not None:
        _compiling, _TENSOR = torch.compiler.is_dynamo_compiling, torch.Tensor


#: whether dynamo is tracing: ``torch.compiler.is_dynamo_compiling`` (a plain ``return
#: False`` in eager code, True under dynamo, which folds it) once torch is imported
_compiling = _compiling_before_torch
#: torch.Tensor once ``bind_torch`` ran: ``traced`` reads it rather than ``sys.modules``, which
#: dynamo would walk as a dict while another thread imports (RuntimeError: dictionary
#: changed size during iteration)
_TENSOR = None


def traced(x) -> bool:
    """Whether ``x`` is a torch tensor that torch.compile's dynamo is tracing (the
    Communicator's collectives then become ``torch.ops.ubnext`` ops: ``ubnext.torch._traced``).
    False in eager code at the cost of one more call, which returns False (the eager hot
    path takes it on every collective, so it does no more), and without torch, which it
    never imports. Dynamo
    traces it without a graph break. Not collective; no CUDA call."""
    return _compiling() and isinstance(x, _TENSOR if _TENSOR is not None else sys.modules["torch"].Tensor)


def _is_torch(x) -> bool:
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    if not _TORCH_NAMES:
        _TORCH_NAMES.update({getattr(torch, n): n for n in DTYPES if hasattr(torch, n)})  # uint32: torch >= 2.3
    return True


#: dtype name -> bytes per element
_WIDTH = {name: width for name, (_, width) in DTYPES.items()}
#: torch.dtype -> dtype name, filled on first use of a tensor
_TORCH_NAMES: dict = {}
#: numpy dtype of a CuPy array -> dtype name, filled as dtypes are seen (supported ones only)
_CUPY_NAMES: dict = {}


def _dtype_name(name: str, op: str) -> str:
    if name not in DTYPES:
        raise UbnextError(f"{op}: unsupported dtype {name}; ubnext reduces {', '.join(DTYPES)}")
    return name


def as_buffer(x, op: str, stream: int) -> Buffer:
    """Validates ``x`` and returns its Buffer view.

    An array of another framework is handed the launch stream, so that its data is
    complete before the call's kernels read it, without the host waiting: a DLPack
    producer gets it as ``__dlpack__(stream=...)`` and orders its work before it; an
    array whose ``__cuda_array_interface__`` names the stream that produces it is waited
    for on ``stream`` (an event, ``_streams.order_after``). The interface is read first
    when it is version 3 (it states its stream, or that none is needed); older versions
    say nothing about streams (JAX's, version 2, may name data still being computed), so
    DLPack comes first for them. Not collective.

    Args:
        x: a CUDA torch.Tensor, cupy.ndarray, or object with ``__cuda_array_interface__``
            or ``__dlpack__``.
        op: operation name for error messages (e.g. ``"all_reduce"``).
        stream: the raw cudaStream_t the call launches on (``launch_stream``).

    Returns:
        The Buffer; for other frameworks ``obj`` is a CuPy array viewing the memory.

    Raises:
        UbnextError: host memory, non-contiguous data, unsupported dtype, an array that
            cannot be viewed as CUDA memory.
    """
    if _is_torch(x):
        device = x.get_device()  # -1: host memory
        if device < 0:
            raise UbnextError(f"{op}: tensor is in host memory ({x.device}); ubnext reduces CUDA device memory")
        if not x.is_contiguous():
            raise UbnextError(f"{op}: tensor is not contiguous; call .contiguous() first")
        dtype = _TORCH_NAMES.get(x.dtype) or _dtype_name(str(x.dtype).replace("torch.", ""), op)
        count = x.numel()
        return Buffer(x, "torch", x.data_ptr(), count, dtype, device, x.shape, count * _WIDTH[dtype])
    import cupy

    if not isinstance(x, cupy.ndarray):
        x = _foreign(x, op, stream)
    if not x.flags.c_contiguous:
        raise UbnextError(f"{op}: array is not C-contiguous; call cupy.ascontiguousarray first")
    dtype = _CUPY_NAMES.get(x.dtype) or _numpy_name(x.dtype, op)
    count = x.size
    return Buffer(x, "cupy", x.data.ptr, count, dtype, x.device.id, tuple(x.shape), count * _WIDTH[dtype])


def identity(x) -> tuple | None:
    """What ``as_buffer`` reads of a torch.Tensor, torch.nn.Parameter (a model's weights) or
    cupy.ndarray (those classes exactly, not other subclasses, whose attributes may read
    otherwise), as a hashable key: its class, address, shape, dtype, device and
    contiguity, so that arrays with equal keys give equal Buffers (but for ``obj``), or
    fail it alike. None for anything else, and for an array whose attributes cannot be
    read (``as_buffer`` names the problem). Not collective; no CUDA call."""
    kind = type(x)
    torch = _torch()
    try:
        if torch is not None and (kind is torch.Tensor or kind is torch.nn.Parameter):
            return kind, x.get_device(), x.is_contiguous(), x.dtype, x.shape, x.data_ptr()
        cupy = sys.modules.get("cupy")
        if cupy is not None and kind is cupy.ndarray:
            return kind, x.device.id, x.flags.c_contiguous, x.dtype, x.shape, x.data.ptr
    except Exception:  # e.g. a tensor without storage: as_buffer raises for it
        pass
    return None


def _numpy_name(dtype, op: str) -> str:
    """The DTYPES name of a numpy dtype (numpy's dtype.name is slow, a few µs: looked up
    once per dtype)."""
    name = _dtype_name(dtype.name, op)
    _CUPY_NAMES[dtype] = name
    return name


def _foreign(x, op: str, stream: int):
    """A CuPy array viewing ``x``, an array of another framework, ordered before ``stream``."""
    try:
        cai = keep_current(getattr, x, "__cuda_array_interface__", None)  # may run the producer's code
    except Exception:  # e.g. a sharded JAX array refuses it: DLPack may still work
        cai = None
    dlpack = hasattr(x, "__dlpack__")
    if cai is not None and (not dlpack or cai.get("version", 0) >= 3):
        return _from_cai(x, cai, op, stream)
    if dlpack:
        return _from_dlpack(x, op, stream)
    raise UbnextError(
        f"{op}: expected a CUDA array (torch.Tensor, cupy.ndarray, __cuda_array_interface__ "
        f"or __dlpack__), got {type(x).__name__} (host memory is not supported)"
    )


def _from_dlpack(x, op: str, stream: int):
    device_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else None
    if device_type not in _DLPACK_CUDA:
        raise UbnextError(f"{op}: {type(x).__name__} is not in CUDA device memory (DLPack device "
                          f"type {device_type}); host memory is not supported")
    # The consumer stream as DLPack names it: 1 for the legacy default stream; -1 (no
    # synchronization) while it is being captured into a CUDA graph, where the producer's
    # event wait would invalidate the capture (a replayed graph reads the memory as it is
    # then: ordering the producer before a replay is the caller's contract).
    if _streams.CUDA.capture(stream) != 0:
        consumer = -1
    else:
        consumer = _streams.LEGACY if stream == 0 else stream
    try:
        try:
            capsule = keep_current(x.__dlpack__, stream=consumer, max_version=_DLPACK_VERSION)
        except TypeError:  # a producer older than DLPack 1.0 takes no max_version
            capsule = keep_current(x.__dlpack__, stream=consumer)
        return _capsule_array(capsule)
    except Exception as e:  # host arrays, unknown devices or dtypes
        raise UbnextError(f"{op}: cannot view {type(x).__name__} as CUDA memory: {e}") from e


def _capsule_array(capsule):
    """A CuPy array over the memory of a DLPack capsule (replaceable in tests)."""
    import cupy

    return cupy.from_dlpack(capsule)  # an object without __dlpack_device__ is taken as a capsule


def _from_cai(x, desc: dict, op: str, stream: int):
    """A CuPy array over ``x``'s ``__cuda_array_interface__`` ``desc``, after the stream it
    names. Built here rather than by ``cupy.asarray``, which blocks the host until that
    stream is done (CUPY_CUDA_ARRAY_INTERFACE_SYNC)."""
    import cupy
    import numpy

    kind = type(x).__name__
    try:
        shape = tuple(int(d) for d in desc["shape"])
        ptr = int(desc["data"][0])
        dtype = numpy.dtype(desc["typestr"])
        strides = desc.get("strides")
        producer = desc.get("stream")
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise UbnextError(f"{op}: {kind} has an invalid __cuda_array_interface__ ({e!r})") from None
    if desc.get("mask") is not None:
        raise UbnextError(f"{op}: {kind} is a masked array; pass its data without the mask")
    name = _CUPY_NAMES.get(dtype) or _numpy_name(dtype, op)
    if strides is not None and not _c_contiguous(shape, tuple(strides), dtype.itemsize):
        raise UbnextError(f"{op}: {kind} is not C-contiguous (strides {tuple(strides)}); pass a contiguous copy")
    count = 1
    for d in shape:
        count *= d
    nbytes = count * _WIDTH[name]
    device = _pointer_device(ptr, op, kind) if nbytes else -1  # no memory: CuPy's -1, the current device
    # nothing to read: no wait; memory of another device than the section's: the call refuses it
    # (on_device), and an event of the section's context cannot be recorded on that device's stream
    if producer is not None and nbytes and device == current_device():
        _streams.order_after(int(producer), stream)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, x, device_id=device)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


def _c_contiguous(shape: tuple, strides: tuple, itemsize: int) -> bool:
    """Whether byte ``strides`` lay ``shape`` out in C order without gaps."""
    if len(strides) != len(shape):
        return False
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n == 0:
            return True
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _pointer_device(ptr: int, op: str, kind: str) -> int:
    """The device of the CUDA memory at ``ptr`` (replaceable in tests)."""
    from cupy.cuda import runtime

    try:
        attrs = runtime.pointerGetAttributes(ptr)
    except runtime.CUDARuntimeError as e:
        raise UbnextError(f"{op}: cannot view {kind} as CUDA memory: {e}") from None
    if attrs.type not in (_DEVICE_MEMORY, _MANAGED_MEMORY):
        raise UbnextError(f"{op}: {kind} is not in CUDA device memory (pointer type {attrs.type}); "
                          f"host memory is not supported")
    return attrs.device


def on_device(b: Buffer, device: int, op: str, what: str) -> Buffer:
    """``b`` where it is on ``device`` (the communicator's); else raises. The one device
    check of every array a call takes or returns: inputs, operands, given and new outputs."""
    if b.device != device:
        raise UbnextError(f"{op}: {what} is on device {b.device}, communicator on device {device}")
    return b


def check_out(x: Buffer, out, op: str, stream: int) -> Buffer:
    """Validates ``out`` against ``x`` (on the communicator's device): same count, dtype
    and device; no partial overlap.
    ``stream``: as for ``as_buffer``."""
    o = as_buffer(out, op, stream)
    if o.count != x.count or o.dtype != x.dtype:
        raise UbnextError(
            f"{op}: out has {o.count} {o.dtype} elements, input has {x.count} {x.dtype}; they must match"
        )
    on_device(o, x.device, op, "out")
    if o.ptr != x.ptr and overlap(o, x):
        raise UbnextError(f"{op}: out partially overlaps the input; pass out=x for in place, or a separate array")
    return o


def check_part(x: Buffer, out, count: int, slice_offset: int, op: str, stream: int) -> Buffer:
    """Validates ``out`` of a reduce-scatter (``count`` < x's: out is the slice) or an
    all-gather (x is the slice): ``count`` elements of x's dtype on x's device, apart from
    x, or in place: the slice is the larger array's bytes from ``slice_offset`` on.
    ``stream``: as for ``as_buffer``."""
    o = as_buffer(out, op, stream)
    if o.count != count or o.dtype != x.dtype:
        raise UbnextError(f"{op}: out has {o.count} {o.dtype} elements; it must have {count} {x.dtype}")
    on_device(o, x.device, op, "out")
    part, whole = (o, x) if count <= x.count else (x, o)
    if overlap(o, x) and part.ptr != whole.ptr + slice_offset:
        raise UbnextError(f"{op}: out overlaps the input other than in place (this rank's slice of the larger "
                          f"array is the smaller one); pass a separate array or the in-place views")
    return o


def overlap(a: Buffer, b: Buffer) -> bool:
    """Whether the bytes of ``a`` and ``b`` intersect."""
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def empty_like(x: Buffer, stream: int, owner, side: bool, shape: tuple | None = None):
    """A new array of x's framework, shape (or ``shape``) and dtype (the framework's
    allocator), on the communicator's device (the section's context is current). Not
    collective.

    With ``side`` (``launch_stream``: the call runs on a stream other than the current
    one; ``owner``: its stream object or None), the new array is ordered for the launch
    stream ``stream``: the caching allocators of torch and CuPy hand out memory in the
    order of the allocating stream only, so memory taken on the current stream could
    still be in use by work queued there. CuPy allocates on ``stream`` itself (CuPy's
    stream context sets no device). torch would need its stream guard for that, whose
    exit sets torch's idea of the current device (``cudaSetDevice``, which makes a
    context on a device no call of this communicator uses): the tensor is allocated on
    torch's current stream of the device, and ``stream`` waits for that stream's work
    queued so far, as torch's NCCL backend orders every call (the call then records the
    tensor on ``stream``: ``record_stream``).
    """
    if x.framework == "torch":
        new = _torch().empty_like(x.obj) if shape is None else x.obj.new_empty(shape)
        if side:
            _streams.order_after(_torch()._C._cuda_getCurrentRawStream(x.device), stream)
        return new
    import cupy

    def make():
        return cupy.empty_like(x.obj) if shape is None else cupy.empty(shape, _cupy_dtype(x.dtype))
    if not side:
        return make()
    on = owner if isinstance(owner, cupy.cuda.Stream) else cupy.cuda.Stream.from_external(_StreamRef(stream))
    with on:
        return make()


class _StreamRef:
    """A raw stream handle with the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def record_stream(stream: int, owner, buffers) -> None:
    """Tells torch's caching allocator that the torch tensors among ``buffers`` (Buffers or
    None) are used on ``stream`` (``Tensor.record_stream``): their memory is then not
    reused before the work queued there so far is done, even if the caller drops them at
    once. For a call on a stream other than torch's current one (``side``).

    CuPy's memory pool has no such record: it reuses a freed block on the stream that
    allocated it, in that stream's order, so a CuPy array used on another stream must stay
    alive until that stream has passed the call (the caller's part, as for any CuPy work
    on a second stream).
    """
    torch_stream = None
    for b in buffers:
        if b is not None and b.framework == "torch":
            if torch_stream is None:
                torch_stream = _torch_stream(stream, owner, b.device)
            b.obj.record_stream(torch_stream)


def mark_written(buffers) -> None:
    """Tells autograd that the torch tensors among ``buffers`` (Buffers, or None) changed:
    outputs the caller gave, which a call writes through their addresses, out of torch's
    sight. Their version counters go up (as an in-place torch op's do), so that a backward
    pass that saved one of them refuses it instead of computing a wrong gradient with the
    new values. Not collective; no CUDA call."""
    tensors = tuple([b.obj for b in buffers if b is not None and b.framework == "torch"])
    if tensors:
        increment_versions(tensors)


def increment_versions(tensors) -> None:
    """Increments the version counters of ``tensors`` (a tuple or list of torch tensors
    written out of torch's sight; see ``mark_written``). Tensors made in inference mode
    have none: left alone. torch's own binding, the one
    ``torch.autograd.graph.increment_version`` calls, is bound once (the hot path skips the
    wrapper's checks)."""
    if not _INCREMENT:
        torch = _torch()
        _INCREMENT.append(getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version)
    _INCREMENT[0](tensors)


_INCREMENT: list = []  # torch's version-counter increment, bound on first use


#: c10::DeviceType::CUDA, as torch's stream objects carry it
_TORCH_CUDA = 1


def _torch_stream(stream: int, owner, device: int):
    """``stream`` (a raw handle of ``device``; ``owner``: its stream object or None) as a
    torch.cuda.Stream, made without a device guard (``torch.cuda.ExternalStream`` enters
    one): by the fields torch's own ``current_stream`` builds a Stream from. torch names
    a foreign stream by its handle (c10's external stream id: the pointer, even); the
    legacy default stream is torch's default stream, id 0."""
    torch = _torch()
    if isinstance(owner, torch.cuda.Stream):
        return owner
    return torch.cuda.Stream(stream_id=0 if stream == _streams.LEGACY else stream, device_index=device,
                             device_type=_TORCH_CUDA)


def launch_stream(stream, x, device: int) -> tuple[int, object, bool]:
    """The stream a call on ``x`` launches on. Resolved before ``x`` is viewed, so that an
    array of another framework can be ordered before it (``as_buffer``).

    Args:
        stream: the caller's ``stream=``: None for the current stream of x's framework
            (torch's of the tensor's device; CuPy's of ``device`` otherwise), or as
            ``stream_handle`` takes it.
        x: the call's input, as the caller passed it.
        device: the communicator's device (whatever device the caller made current).

    Returns:
        ``(handle, owner, side)``: the raw cudaStream_t; the stream object it came from
        (CuPy's current stream, or the ``stream`` object given; None for an int, and for
        torch's current stream, whose streams live as long as the process), which the
        communicator keeps while it is the stream of its last launch; whether ``stream``
        names another stream than the current one of x's framework.

    Raises:
        UbnextError: ``stream`` is not a stream.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        device = x.get_device()
        # torch's private raw-stream read: a fraction of the public
        # torch.cuda.current_stream(device).cuda_stream's cost (bench/NOTES.md)
        current = torch._C._cuda_getCurrentRawStream(device) if device >= 0 else 0  # host: as_buffer refuses
        if stream is None:
            return current, None, False
    else:
        import cupy

        now = cupy.cuda.get_current_stream(device)
        if stream is None:
            return now.ptr, now, False
        current = now.ptr
    handle = stream_handle(stream)
    return handle, None if isinstance(stream, int) else stream, not _streams.same_stream(handle, current)


def stream_handle(stream) -> int:
    """The raw cudaStream_t of ``stream``: an int handle, a torch stream (``cuda_stream``),
    a CuPy stream (``ptr``), or any object with the ``__cuda_stream__`` protocol (cuda.core).

    Raises:
        UbnextError: ``stream`` is none of these.
    """
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy Stream
        value = getattr(stream, attr, None)
        if value is not None:
            return int(value)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])  # (version, handle)
    raise UbnextError(f"stream: expected a torch/CuPy/cuda.core stream or an int handle, got {type(stream).__name__}")


def wrap(ptr: int, shape: tuple, dtype: str, device: int, framework: str, owner):
    """An array of ``framework`` over device memory at ``ptr`` kept alive by ``owner``.

    The array (and anything viewing it) holds a reference to ``owner``, so the
    memory is released only after the last view is gone.
    """
    import cupy

    count = 1
    for d in shape:
        count *= d
    nbytes = count * DTYPES[dtype][1]
    mem = cupy.cuda.UnownedMemory(ptr, max(nbytes, 1), owner, device_id=device)
    if framework == "cupy":
        return cupy.ndarray(shape, dtype=_cupy_dtype(dtype), memptr=cupy.cuda.MemoryPointer(mem, 0))
    if framework == "torch":
        import torch

        raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.from_dlpack(raw).view(getattr(torch, dtype)).view(shape)
    raise UbnextError(f"empty: framework must be 'cupy' or 'torch', got {framework!r}")


def _cupy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype
