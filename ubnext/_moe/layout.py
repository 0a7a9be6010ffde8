"""The shape of one expert-parallel object: its sizes, checked, and its pool area.

Pure Python, no CUDA (docs/moe.md, "Size of the pool area"). The area lies at the same
offset of every rank's segment; its regions, in order (each region's sets one after the
other, each set indexed as the kernels index it, kernels/moe.cuh):

* the object's rotation: its launches, per kernel, in each rank's own segment (not polled)
* dispatch headers: 3 sets of ``[N][HEADER_BYTES]`` (signature vector, then T + 1)
* dispatch routing records: 3 sets of ``[N source][M token][R vectors]``
* dispatch token rows: 2 sets of ``[N source][M token][H elements]``
* combine headers: 3 sets of ``[N][HEADER_BYTES]``
* combine partials: 2 sets of ``[N expert GPU][M token][H fp32]``

The headers, records and partials are polled for the sentinel (filled with it at
creation); the token rows are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from ubnext._protocol.algorithms import DTYPES
from ubnext._protocol.constants import (HEADER_BYTES, MAX_RANKS, MOE_FP8_GROUP, MOE_MAX_CAPACITY, MOE_MAX_TOPK,
                                        VEC_BYTES)
from ubnext._protocol.errors import UbnextError
from ubnext._protocol.signature import HIDDEN_BITS, MOE_BITS, MOE_WIRES

#: the payload dtypes of dispatch and combine, and their element bytes
MOE_DTYPES = {dtype: DTYPES[dtype][1] for dtype in ("bfloat16", "float32")}
#: the combine's partials, as they cross the link: fp32, or rounded to bf16 (half the bytes,
#: a second rounding; a bfloat16 payload only), by their code in the kernel's argument and
#: the signature's format (signature.MOE_WIRES)
PARTIALS = {"float32": 0, "bfloat16": MOE_WIRES.index("bfloat16 partials")}
#: bytes of an element of a combine's partial as the area holds it (fp32)
PARTIAL_BYTES = 4
#: channels per scale of an FP8 dispatch, and the multiple of them a row must be (its
#: scales, 4 bytes per group, are whole 16-byte vectors)
FP8_GROUP, FP8_HIDDEN_MULTIPLE = MOE_FP8_GROUP, MOE_FP8_GROUP * VEC_BYTES // 4
#: the FP8 dispatch's format in its signature (signature.MOE_WIRES)
FP8_WIRE = MOE_WIRES.index("e4m3 rows with fp32 scales")
#: the largest top-k a routing record holds (its ids and weights, kernels/moe.cuh)
MAX_TOPK = MOE_MAX_TOPK
#: rotating sets of the polled regions (the Lamport rotation) and of the unpolled rows
POLLED_SETS, ROW_SETS = 3, 2
#: the regions of the area, in order
REGIONS = ("rotation", "dispatch_headers", "records", "rows", "combine_headers", "partials")


def record_vectors(top_k: int) -> int:
    """16-byte vectors of a routing record: ``top_k`` int32 ids, then ``top_k`` fp32
    weights, padded to a whole vector."""
    return -(-2 * top_k // 4)


@dataclass(frozen=True)
class Shape:
    """The sizes of one expert-parallel object (docs/moe.md, "Terms").

    Attributes:
        nranks: N, ranks of the node.
        num_experts: E, a multiple of N.
        hidden: H, elements of a token row (H x element bytes a multiple of 16).
        max_tokens: M, tokens per rank per call.
        top_k: K, 1..MAX_TOPK.
        dtype: a key of MOE_DTYPES.
        capacity: C, rows per local expert of the dispatch's output.
        fp8: the dispatch moves e4m3 codes and one fp32 scale per FP8_GROUP channels
            (a bfloat16 payload; a row's codes and scales fit the place of its bf16 row).
    """

    nranks: int
    num_experts: int
    hidden: int
    max_tokens: int
    top_k: int
    dtype: str
    capacity: int
    fp8: bool = False

    @property
    def local_experts(self) -> int:
        """L = E / N."""
        return self.num_experts // self.nranks

    @property
    def width(self) -> int:
        """Bytes of one element of the payload."""
        return MOE_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.width

    def region_bytes(self) -> dict[str, int]:
        """Bytes of each region of the pool area (all sets), by name (REGIONS)."""
        n, m = self.nranks, self.max_tokens
        headers = POLLED_SETS * n * HEADER_BYTES
        return {"rotation": HEADER_BYTES,
                "dispatch_headers": headers,
                "records": POLLED_SETS * n * m * record_vectors(self.top_k) * VEC_BYTES,
                "rows": ROW_SETS * n * m * self.row_bytes,
                "combine_headers": headers,
                "partials": ROW_SETS * n * m * self.hidden * PARTIAL_BYTES}

    def offsets(self, base: int = 0) -> dict[str, int]:
        """Offset of each region, from ``base`` (the area's offset), by name."""
        out, at = {}, base
        for name, nbytes in self.region_bytes().items():
            out[name] = at
            at += nbytes
        return out

    @property
    def area_bytes(self) -> int:
        """Bytes of the pool area (docs/moe.md's formula)."""
        return sum(self.region_bytes().values())

    @property
    def polled(self) -> tuple[str, ...]:
        """The regions filled with the sentinel at creation."""
        return ("dispatch_headers", "records", "combine_headers", "partials")

    @property
    def key(self) -> str:
        """The area's key (``Communicator._symmetric_area``): one area per shape."""
        return (f"moe:{self.num_experts}x{self.hidden}x{self.max_tokens}x{self.top_k}x{self.capacity}:"
                f"{self.dtype}")


def shape(nranks: int, num_experts: int, hidden: int, max_tokens: int, top_k: int, dtype: str,
          capacity: int | None = None, fp8: bool = False) -> Shape:
    """The checked Shape of an expert-parallel object.

    Raises:
        UbnextError: a size out of range (the message starts with ``ExpertParallel``).
    """
    name = "ExpertParallel"
    if dtype not in MOE_DTYPES:
        raise UbnextError(f"{name}: dtype must be one of {', '.join(MOE_DTYPES)}, not {dtype!r}")
    ints = dict(experts=num_experts, hidden=hidden, max_tokens=max_tokens, top_k=top_k)
    for what, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UbnextError(f"{name}: {'num_experts' if what == 'experts' else what} must be a positive int, "
                              f"got {value!r}")
    for what, bits in (*MOE_BITS.items(), ("hidden", HIDDEN_BITS)):
        if ints[what] >= 1 << bits:
            raise UbnextError(f"{name}: {what} must be below {1 << bits} (the call signature's field), "
                              f"got {ints[what]}")
    if not 1 <= nranks <= MAX_RANKS:
        raise UbnextError(f"{name}: {nranks} ranks on the node; the kernels take 1 to {MAX_RANKS}")
    if num_experts % nranks:
        raise UbnextError(f"{name}: num_experts ({num_experts}) must be a multiple of the ranks ({nranks})")
    if top_k > min(MAX_TOPK, num_experts):
        raise UbnextError(f"{name}: top_k must be at most {min(MAX_TOPK, num_experts)} "
                          f"(num_experts and {MAX_TOPK}), got {top_k}")
    if hidden * MOE_DTYPES[dtype] % VEC_BYTES:
        raise UbnextError(f"{name}: hidden ({hidden}) times the {dtype} element bytes must be a multiple of "
                          f"{VEC_BYTES}")
    if capacity is None:
        capacity = nranks * max_tokens
    most = min(nranks * max_tokens, MOE_MAX_CAPACITY)
    if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= most:
        raise UbnextError(f"{name}: capacity must be an int in 1..{most} (ranks x max_tokens, at most "
                          f"{MOE_MAX_CAPACITY}), got {capacity!r}; give a capacity where ranks x max_tokens "
                          f"exceeds {MOE_MAX_CAPACITY}")
    if fp8 and (dtype != "bfloat16" or hidden % FP8_HIDDEN_MULTIPLE):
        raise UbnextError(f"{name}: fp8 takes a bfloat16 payload whose hidden is a multiple of "
                          f"{FP8_HIDDEN_MULTIPLE} (its scales whole 16-byte vectors), got {dtype} x {hidden}")
    return Shape(nranks, num_experts, hidden, max_tokens, top_k, dtype, capacity, bool(fp8))
