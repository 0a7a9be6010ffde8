"""The plan of an overlapped all-gather + matmul or matmul + reduce-scatter: how many rows
each round moves through the bounded area of the pool, where each rank's part of the
area lies, and in which order the peers are visited. Pure Python (no CUDA), shared by the
GPU runner (``_overlap``) and the tests, which rebuild the same chunks for their
references.

The area (``AREA_BYTES`` of every rank's pool segment) has two halves; a call's rounds
start on half 0 and alternate (``_overlap`` says why that is safe: within a call by each
round's barrier, across calls, CUDA graph replays included, by the barrier every call
opens with). A call takes as few rounds as its rows fit, one where they fit a half: the
fewer the rounds, the larger, and the more efficient, each GEMM.

* all-gather side: round j moves rows ``[r0, r0 + rows)`` of every rank's shard; each rank
  copies its own rows into its half, the peers pull them from there.
* reduce-scatter side: round j moves rows ``[r0, r0 + rows)`` of every rank's output
  shard; the half holds one slot per source rank (``slot_bytes``), each rank pushes the
  product of rank dst's rows into slot [rank] of dst's half, and dst reduces its slots.
"""

from __future__ import annotations

import dataclasses

#: the bytes of every rank's pool segment that the overlapped ops use, both halves (one
#: area per communicator, allocated at the first overlapped call, kept until close)
AREA_BYTES = 64 << 20
#: alignment of a slot in the area (the copy engines' and cuBLAS's preference)
SLOT_ALIGN = 256


def half_bytes() -> int:
    """Bytes of one half of the area."""
    return AREA_BYTES // 2


@dataclasses.dataclass(frozen=True)
class Rounds:
    """The rounds of one call.

    Attributes:
        parts: ``(r0, rows)`` of each round, in order; at least one.
        slot_bytes: bytes of one slot (all-gather: the one slot of a rank's own rows;
            reduce-scatter: a source rank's slot), a multiple of SLOT_ALIGN.
    """

    parts: tuple[tuple[int, int], ...]
    slot_bytes: int

    def half(self, j: int) -> int:
        """The half of the area round ``j`` uses: 0, 1, 0, 1, ..."""
        return j % 2

    def offset(self, j: int, slot: int = 0) -> int:
        """Byte offset in the area of round ``j``'s ``slot``."""
        return self.half(j) * half_bytes() + slot * self.slot_bytes


def split(rows: int, row_bytes: int, slots: int) -> Rounds:
    """The rounds that move ``rows`` rows of ``row_bytes`` each, ``slots`` slots of a
    round's rows per half: as few rounds as fit (at least one), rows spread evenly
    (the first rounds one row more where they do not divide).

    Raises:
        ValueError: a single row of ``slots`` slots does not fit a half.
    """
    if rows < 0 or row_bytes <= 0 or slots <= 0:
        raise ValueError(f"split: rows={rows}, row_bytes={row_bytes}, slots={slots}")
    slot_budget = half_bytes() // slots // SLOT_ALIGN * SLOT_ALIGN
    most = slot_budget // row_bytes  # rows of one round
    if most == 0:
        raise ValueError(f"a row of {row_bytes} bytes in {slots} slots does not fit half of the "
                         f"{AREA_BYTES >> 20} MiB overlap area")
    count = max(1, -(-rows // most))
    base, extra = divmod(rows, count)
    parts, r0 = [], 0
    for j in range(count):
        n = base + (j < extra)
        parts.append((r0, n))
        r0 += n
    largest = parts[0][1]
    return Rounds(tuple(parts), -(-max(largest * row_bytes, 1) // SLOT_ALIGN) * SLOT_ALIGN)


def gather_rounds(shard_rows: int, row_bytes: int) -> Rounds:
    """All-gather side: a rank's own rows of each round in one slot of a half."""
    return split(shard_rows, row_bytes, 1)


def scatter_rounds(shard_rows: int, row_bytes: int, size: int) -> Rounds:
    """Reduce-scatter side: ``size`` slots (one per source rank) of an output row each."""
    return split(shard_rows, row_bytes, size)


def pull_order(rank: int, size: int) -> list[int]:
    """The peers whose rows rank ``rank`` pulls, in order: rank+1, rank+2, ... (its own
    rows need no pull: its GEMM takes them first). Every rank starts at a different peer,
    so the ranks' reads spread over the links."""
    return [(rank + s) % size for s in range(1, size)]


def push_order(rank: int, size: int) -> list[int]:
    """The ranks whose output rows rank ``rank`` computes, in order: rank+1, ..., its own
    last (no push: its product lands in its own slot while the last push moves)."""
    return [(rank + s) % size for s in range(1, size + 1)]
