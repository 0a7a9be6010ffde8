"""Interop with the caller's arrays: CuPy, PyTorch, and anything with DLPack or CAI.

Fast paths read torch tensors and CuPy arrays directly; other objects go through
``__cuda_array_interface__`` or ``__dlpack__`` (via CuPy). torch is optional and
imported lazily: it is only touched when the caller passes a tensor or asks for one.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from ._algorithms import DTYPES
from ._errors import UbnextError

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


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


def _is_torch(x) -> bool:
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    if not _TORCH_NAMES:
        _TORCH_NAMES.update({getattr(torch, n): n for n in DTYPES})
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


def describe(x, op: str) -> Buffer:
    """Validates ``x`` and returns its Buffer view.

    Args:
        x: a CUDA torch.Tensor, cupy.ndarray, or object with ``__cuda_array_interface__``
            or ``__dlpack__``.
        op: operation name for error messages (e.g. ``"all_reduce"``).

    Raises:
        UbnextError: host memory, non-contiguous data, unsupported dtype.
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
        if hasattr(x, "__cuda_array_interface__"):
            x = cupy.asarray(x)
        elif hasattr(x, "__dlpack__"):
            device_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else None
            if device_type not in _DLPACK_CUDA:
                raise UbnextError(f"{op}: {type(x).__name__} is not in CUDA device memory (DLPack device "
                                  f"type {device_type}); host memory is not supported")
            try:
                x = cupy.from_dlpack(x)
            except Exception as e:  # host arrays, unknown devices
                raise UbnextError(f"{op}: cannot view {type(x).__name__} as CUDA memory: {e}") from e
        else:
            raise UbnextError(
                f"{op}: expected a CUDA array (torch.Tensor, cupy.ndarray, __cuda_array_interface__ "
                f"or __dlpack__), got {type(x).__name__} (host memory is not supported)"
            )
    if not x.flags.c_contiguous:
        raise UbnextError(f"{op}: array is not C-contiguous; call cupy.ascontiguousarray first")
    dtype = _CUPY_NAMES.get(x.dtype)
    if dtype is None:  # numpy's dtype.name is slow (a few µs per call): look it up once per dtype
        dtype = _CUPY_NAMES[x.dtype] = _dtype_name(x.dtype.name, op)
    count = x.size
    return Buffer(x, "cupy", x.data.ptr, count, dtype, x.device.id, tuple(x.shape), count * _WIDTH[dtype])


def check_out(x: Buffer, out, op: str) -> Buffer:
    """Validates ``out`` against ``x``: same count, dtype and device; no partial overlap."""
    o = describe(out, op)
    if o.count != x.count or o.dtype != x.dtype:
        raise UbnextError(
            f"{op}: out has {o.count} {o.dtype} elements, input has {x.count} {x.dtype}; they must match"
        )
    if o.device != x.device:
        raise UbnextError(f"{op}: out is on device {o.device}, input on device {x.device}")
    if o.ptr != x.ptr and overlap(o, x):
        raise UbnextError(f"{op}: out partially overlaps the input; pass out=x for in place, or a separate array")
    return o


def overlap(a: Buffer, b: Buffer) -> bool:
    """Whether the bytes of ``a`` and ``b`` intersect."""
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def empty_like(x: Buffer):
    """A new array of x's framework, shape and dtype (the framework's allocator)."""
    if x.framework == "torch":
        return _torch().empty_like(x.obj)
    import cupy

    return cupy.empty_like(x.obj)


def stream_handle(stream, x: Buffer) -> int:
    """The raw cudaStream_t to launch on: ``stream`` if given, else the current one of x's framework."""
    if stream is None:
        if x.framework == "torch":
            return _torch()._C._cuda_getCurrentRawStream(x.device)
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise UbnextError(f"stream: expected a torch/cupy stream or an int handle, got {type(stream).__name__}")


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
