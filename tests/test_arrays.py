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
