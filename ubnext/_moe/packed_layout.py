"""The shape of one throughput-mode (packed) expert-parallel object: its sizes, checked,
and its pool area.

Pure Python, no CUDA (docs/moe.md, "Throughput mode"). The area lies at the same offset of
every rank's segment; its regions, in order (kernels/moe_packed.cuh indexes them):

* the objects' rotations: per kernel, its launches and its grid barrier's arrivals, in each
  rank's own segment (not polled)
* dispatch headers: 3 sets of ``[N][HEADER_BYTES]`` (signature, T + 1, the bulk flag)
* combine headers: 3 sets of ``[N][HEADER_BYTES]`` (signature, the bulk flag)
* the dispatch's progress flags: ``[N source][M]`` uint32, entry q the launch epoch + 1
  once the source's token group q (its tokens ``q * W`` to ``q * W + W - 1``, W warps per
  block) is sent
* routing records: one set of ``[N source][M token][R vectors]``
* data: one set of ``[N][M][H x max(b, 4)]``: the dispatch's token rows (per source),
  then the combine's fp32 partials (per expert GPU), in turn

Only the headers are polled (filled with the sentinel at creation).
"""

from __future__ import annotations

from dataclasses import dataclass

from ubnext._moe import layout as _layout
from ubnext._protocol.constants import HEADER_BYTES, VEC_BYTES
from ubnext._protocol.errors import UbnextError

#: the object's name, which its errors start with
NAME = "PackedExpertParallel"
#: the regions of the area, in order
REGIONS = ("rotation", "dispatch_headers", "combine_headers", "progress", "records", "data")
#: the largest row index a route or offset holds (int32)
MAX_ROWS = (1 << 31) - 1


@dataclass(frozen=True)
class PackedShape:
    """The sizes of one packed object (docs/moe.md, "Terms" and "Throughput mode").

    Attributes:
        nranks: N, ranks of the node.
        num_experts: E, a multiple of N.
        hidden: H, elements of a token row (H x element bytes a multiple of 16).
        max_tokens: M, tokens per rank per call.
        top_k: K, 1..16.
        dtype: a key of ``layout.MOE_DTYPES``.
        max_rows: R, rows of the packed output: a bound on the rows a rank receives.
    """

    nranks: int
    num_experts: int
    hidden: int
    max_tokens: int
    top_k: int
    dtype: str
    max_rows: int

    # the low-latency shape's arithmetic, which reads only the fields both have and region_bytes
    local_experts = _layout.Shape.local_experts
    width = _layout.Shape.width
    row_bytes = _layout.Shape.row_bytes
    offsets = _layout.Shape.offsets
    area_bytes = _layout.Shape.area_bytes

    def region_bytes(self) -> dict[str, int]:
        """Bytes of each region of the pool area, by name (REGIONS)."""
        n, m = self.nranks, self.max_tokens
        headers = _layout.POLLED_SETS * n * HEADER_BYTES
        return {"rotation": HEADER_BYTES,
                "dispatch_headers": headers,
                "combine_headers": headers,
                "progress": -(-n * m * 4 // HEADER_BYTES) * HEADER_BYTES,
                "records": n * m * _layout.record_vectors(self.top_k) * VEC_BYTES,
                "data": n * m * self.hidden * max(self.width, _layout.PARTIAL_BYTES)}

    @property
    def polled(self) -> tuple[str, ...]:
        """The regions filled with the sentinel at creation."""
        return ("dispatch_headers", "combine_headers")

    @property
    def key(self) -> str:
        """The area's key (``Communicator._symmetric_area``): one area per shape (R is the
        outputs', not the area's)."""
        return f"moe_packed:{self.num_experts}x{self.hidden}x{self.max_tokens}x{self.top_k}:{self.dtype}"

    @property
    def output_bytes(self) -> int:
        """Bytes of the packed output ``[R, H]`` (an ordinary device array)."""
        return self.max_rows * self.row_bytes

    def padded(self) -> _layout.Shape:
        """The low-latency shape of the same sizes with a capacity of N x M (no expert can
        overflow): the host reference lays the packed rows out from its layout."""
        return _layout.Shape(self.nranks, self.num_experts, self.hidden, self.max_tokens, self.top_k, self.dtype,
                             self.nranks * self.max_tokens)


def most_rows(nranks: int, num_experts: int, max_tokens: int, top_k: int) -> int:
    """The most rows a rank can receive: every token of every rank to min(K, L) of its experts."""
    return nranks * max_tokens * min(top_k, num_experts // nranks)


def shape(nranks: int, num_experts: int, hidden: int, max_tokens: int, top_k: int, dtype: str,
          max_rows: int | None = None) -> PackedShape:
    """The checked PackedShape of a packed object: the low-latency checks of the sizes
    (``layout.shape``), and ``max_rows`` (default ``most_rows``: no token can be lost).

    Raises:
        UbnextError: a size out of range (the message starts with ``PackedExpertParallel``).
    """
    try:
        _layout.shape(nranks, num_experts, hidden, max_tokens, top_k, dtype, capacity=1)
    except UbnextError as e:
        raise UbnextError(NAME + str(e).removeprefix("ExpertParallel")) from None
    most = most_rows(nranks, num_experts, max_tokens, top_k)
    if max_rows is None:
        max_rows = most
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or not 1 <= max_rows <= min(most, MAX_ROWS):
        raise UbnextError(f"{NAME}: max_rows must be an int in 1..{min(most, MAX_ROWS)} (ranks x max_tokens x "
                          f"min(top_k, local experts)), got {max_rows!r}")
    return PackedShape(nranks, num_experts, hidden, max_tokens, top_k, dtype, max_rows)
