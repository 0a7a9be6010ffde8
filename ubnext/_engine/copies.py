"""Device-to-device copies on a stream, and the alignment the kernels' vectors need: how
arrays that the kernels cannot read or write directly go through the staging slot."""

from __future__ import annotations

from ubnext._protocol.constants import VEC_BYTES

_D2D = 3  # cudaMemcpyDeviceToDevice
#: the largest pitch a 2-D copy takes (cudaDevAttrMaxPitch: 2**31 - 1 on every current GPU)
MAX_PITCH = (1 << 31) - 1


def aligned(*ptrs: int) -> bool:
    """Whether every address is aligned to the kernels' vectors."""
    return all(p % VEC_BYTES == 0 for p in ptrs)


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from ``src`` to ``dst``, both device addresses, on ``stream``."""
    from cupy.cuda import runtime

    runtime.memcpyAsync(dst, src, nbytes, _D2D, stream)


def copy_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: int) -> None:
    """``rows`` rows of ``width`` bytes, row r from ``src + r * src_pitch`` to
    ``dst + r * dst_pitch``, on ``stream``: one 2-D copy, or a copy per row where a pitch
    is past what a 2-D copy takes (slices of 2 GiB and more)."""
    from cupy.cuda import runtime

    if max(dst_pitch, src_pitch) > MAX_PITCH:
        for r in range(rows):
            copy(dst + r * dst_pitch, src + r * src_pitch, width, stream)
        return
    runtime.memcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, _D2D, stream)
