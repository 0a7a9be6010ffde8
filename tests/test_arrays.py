"""Argument validation that needs no GPU: what is not CUDA memory is refused clearly."""

from __future__ import annotations

import numpy as np
import pytest

from ubnext import UbnextError
from ubnext._arrays import describe, stream_handle


@pytest.mark.parametrize("obj", [np.ones(4, np.float32), [1.0, 2.0], 3.0, "x"])
def test_host_and_foreign_objects_are_refused(obj):
    with pytest.raises(UbnextError, match="all_reduce: .*(CUDA array|host memory)"):
        describe(obj, "all_reduce")


def test_stream_handle_accepts_ints_and_stream_objects():
    class TorchLike:
        cuda_stream = 1234

    class CupyLike:
        ptr = 99

    assert stream_handle(7, None) == 7
    assert stream_handle(TorchLike(), None) == 1234
    assert stream_handle(CupyLike(), None) == 99
    with pytest.raises(UbnextError, match="stream"):
        stream_handle(object(), None)


def test_cupy_dtypes_are_named_once_and_unsupported_ones_always_refused(monkeypatch):
    import types

    from ubnext import _arrays

    class ndarray:  # the attributes describe() reads from a cupy.ndarray
        def __init__(self, dtype):
            self.dtype, self.size, self.shape = np.dtype(dtype), 4, (4,)
            self.flags = types.SimpleNamespace(c_contiguous=True)
            self.data = types.SimpleNamespace(ptr=4096)
            self.device = types.SimpleNamespace(id=0)

    monkeypatch.setitem(__import__("sys").modules, "cupy", types.SimpleNamespace(ndarray=ndarray))
    monkeypatch.setattr(_arrays, "_CUPY_NAMES", {})
    for _ in range(2):
        b = describe(ndarray("float16"), "all_reduce")
        assert (b.framework, b.dtype, b.ptr, b.count, b.nbytes) == ("cupy", "float16", 4096, 4, 8)
        with pytest.raises(UbnextError, match="all_reduce: unsupported dtype float64"):
            describe(ndarray("float64"), "all_reduce")
    assert _arrays._CUPY_NAMES == {np.dtype("float16"): "float16"}
