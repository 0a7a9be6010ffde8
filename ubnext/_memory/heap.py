"""Planning of the symmetric pool's bytes: library slots and user buffers.

Pure Python, no CUDA. Offsets are relative to the start of a rank's pool
segment; because every rank's segment has the same layout, an offset names
the same buffer on every rank.

* :class:`SlotPlan` lays out named library slots (Lamport buffers, flags,
  staging) deterministically in the order they are added, so a key gets the
  same offset on every rank and for the life of the pool (captured CUDA graphs
  stay valid).
* :class:`UserHeap` hands out user buffers (``comm.empty``) first-fit in the
  free space common to all ranks of the node, so ranks agree on every offset
  even when they free buffers at different times (garbage collection).
* :func:`plan_layout` is the library's plan: a LaunchState per kernel family state, the
  barrier flags and signatures of the barrier two-shot, a set of three receive buffers
  per Lamport family and element width, and the staging slot, at the same offsets on
  every rank for the communicator's life; user buffers follow.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Callable

from ubnext._protocol.constants import (
    FLAG_PHASES,
    HEADER_BYTES,
    LAUNCH_STATE_BYTES,
    LL_MAX_BYTES,
    MAX_BLOCKS,
    MAX_RANKS,
    P2P_BULK_CHUNK,
    P2P_BULK_DEPTH,
    P2P_MAX_ENTRIES,
    TWOSHOT_ALIGN_VECS,
    VEC_BYTES,
)
from ubnext._protocol.errors import UbnextError


def round_up(value: int, align: int) -> int:
    """``value`` rounded up to a multiple of ``align``."""
    return -(-value // align) * align


def _check_align(op: str, align: int) -> None:
    if align <= 0 or align & (align - 1):
        raise ValueError(f"{op}: align must be a power of two, got {align}")


class SlotPlan:
    """Named library slots, laid out one after another in the order added.

    Example::

        plan = SlotPlan()
        plan.add("flags", 4096)
        plan.add("lamport", 3 * 8 << 20, align=4096)
        plan.offset("lamport")  # 4096, on every rank, every time

    Args:
        start: offset of the first slot (usually 0).
    """

    def __init__(self, start: int = 0):
        if start < 0:
            raise ValueError(f"SlotPlan: start must be >= 0, got {start}")
        self._slots: dict[str, tuple[int, int]] = {}
        self._end = start

    def add(self, name: str, nbytes: int, align: int = 256) -> int:
        """Append a slot and return its offset.

        Args:
            name: unique slot name.
            nbytes: slot size in bytes (>= 0).
            align: alignment of the slot's offset, a power of two.

        Returns:
            The slot's offset: the current end rounded up to ``align``.

        Raises:
            ValueError: duplicate name, negative size, or bad alignment.
        """
        _check_align("SlotPlan.add", align)
        if name in self._slots:
            raise ValueError(f"SlotPlan.add: slot {name!r} already planned")
        if nbytes < 0:
            raise ValueError(f"SlotPlan.add: slot {name!r} has negative size {nbytes}")
        offset = round_up(self._end, align)
        self._slots[name] = (offset, nbytes)
        self._end = offset + nbytes
        return offset

    def offset(self, name: str) -> int:
        """Offset of slot ``name``; raises ``KeyError`` if it was never added."""
        return self._slot(name)[0]

    def nbytes(self, name: str) -> int:
        """Size of slot ``name``; raises ``KeyError`` if it was never added."""
        return self._slot(name)[1]

    @property
    def end(self) -> int:
        """First byte after the last slot."""
        return self._end

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def _slot(self, name: str) -> tuple[int, int]:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"SlotPlan: no slot named {name!r}") from None


class UserHeap:
    """First-fit allocator for user buffers whose offsets agree across ranks.

    Each rank of a node owns one ``UserHeap`` over the same byte range.
    :meth:`alloc` is collective: the ranks exchange their free lists and take
    the first block that is free on *every* rank, so all ranks get the same
    offset even when a buffer freed on one rank is still alive on another.
    :meth:`free` is local and communication-free, so a finalizer may call it.

    Args:
        start: first usable offset (rounded up to ``align``).
        end: one past the last usable offset (rounded down to ``align``).
        align: alignment and size granule of every block, a power of two.
    """

    def __init__(self, start: int, end: int, align: int = 256):
        _check_align("UserHeap", align)
        self._align = align
        self._start = round_up(start, align)
        self._end = end // align * align
        if not 0 <= self._start <= self._end:
            raise ValueError(f"UserHeap: empty or negative range [{start}, {end})")
        # Sorted, coalesced, disjoint [lo, hi) intervals; every bound is a
        # multiple of align. Only alloc() touches it.
        self._free: list[tuple[int, int]] = (
            [(self._start, self._end)] if self._end > self._start else []
        )
        self._allocated: dict[int, int] = {}  # offset -> block size
        # Blocks freed since the last alloc(). free() only appends here (one
        # atomic list operation), so a finalizer running in the middle of
        # alloc() can never corrupt the free list.
        self._pending: list[tuple[int, int]] = []

    def alloc(self, nbytes: int, agree: Callable[[bytes], list[bytes]]) -> int:
        """Allocate a block at the same offset on every rank of the node.

        Collective over the node's ranks (one call to ``agree``); blocks the
        host for that exchange. Every rank must request the same ``nbytes``.

        Args:
            nbytes: bytes requested (>= 0); the block is rounded up to the
                alignment (a zero-byte request still gets one granule, so
                offsets stay unique).
            agree: an allgather over the node's ranks: takes this rank's
                bytes, returns every rank's bytes in rank order.

        Returns:
            The block's offset, identical on every rank.

        Raises:
            UbnextError: ``"comm.empty: symmetric pool exhausted: ..."`` when
                no common free block is large enough, or when the ranks asked
                for different sizes. All ranks see the same exchanged data,
                so all ranks raise together.
            ValueError: ``nbytes`` is negative (raised before communicating).
        """
        if nbytes < 0:
            raise ValueError(f"comm.empty: negative size {nbytes}")
        size = round_up(max(nbytes, 1), self._align)
        self._drain_pending()
        message = array("Q", [size] + [bound for block in self._free for bound in block])
        gathered = [_decode(payload) for payload in agree(message.tobytes())]

        sizes = [rank_size for rank_size, _ in gathered]
        if any(rank_size != size for rank_size in sizes):
            raise UbnextError(
                f"comm.empty: ranks requested different sizes {sizes} (bytes, "
                "rounded); every rank must call comm.empty with the same shape and dtype"
            )
        common = gathered[0][1]
        for _, rank_free in gathered[1:]:
            common = _intersect(common, rank_free)
        for lo, hi in common:
            if hi - lo >= size:
                self._take(lo, lo + size)
                self._allocated[lo] = size
                return lo
        largest = max((hi - lo for lo, hi in common), default=0)
        raise UbnextError(
            f"comm.empty: symmetric pool exhausted: requested {nbytes} bytes "
            f"({size} aligned) but the largest block free on all {len(gathered)} "
            f"ranks is {largest} bytes ({sum(hi - lo for lo, hi in common)} bytes "
            f"free in common, {self.free_bytes} of {self.capacity} free on this rank); "
            "free buffers or create the communicator with a larger pool"
        )

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; local, cheap, finalizer-safe.

        Not collective and never communicates: the block becomes available
        to the next :meth:`alloc` on this rank, and to the node once every
        rank has freed it.

        Raises:
            ValueError: ``offset`` is not an allocated block (double free).
        """
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"UserHeap.free: offset {offset} is not an allocated block")
        self._pending.append((offset, offset + size))

    @property
    def used(self) -> int:
        """Bytes in live blocks on this rank."""
        return sum(self._allocated.values())

    @property
    def blocks(self) -> int:
        """Live blocks on this rank (one atomic read: safe while finalizers free blocks)."""
        return len(self._allocated)

    @property
    def capacity(self) -> int:
        """Bytes managed by the heap."""
        return self._end - self._start

    @property
    def free_bytes(self) -> int:
        """Bytes not in live blocks on this rank (possibly fragmented)."""
        return self.capacity - self.used

    def _drain_pending(self) -> None:
        while self._pending:
            self._give_back(*self._pending.pop())

    def _give_back(self, lo: int, hi: int) -> None:
        """Insert [lo, hi) into the free list, merging with its neighbours."""
        index = bisect.bisect_left(self._free, (lo, hi))
        if index > 0 and self._free[index - 1][1] == lo:
            index -= 1
            lo = self._free.pop(index)[0]
        if index < len(self._free) and self._free[index][0] == hi:
            hi = self._free.pop(index)[1]
        self._free.insert(index, (lo, hi))

    def _take(self, lo: int, hi: int) -> None:
        """Remove [lo, hi) from the free list; it lies inside one free interval."""
        index = bisect.bisect_right(self._free, (lo, float("inf"))) - 1
        block_lo, block_hi = self._free[index]
        pieces = [(a, b) for a, b in ((block_lo, lo), (hi, block_hi)) if b > a]
        self._free[index:index + 1] = pieces


def _decode(payload: bytes) -> tuple[int, list[tuple[int, int]]]:
    """Inverse of the message built in :meth:`UserHeap.alloc`."""
    words = array("Q")
    words.frombytes(payload)
    if len(words) % 2 != 1:
        raise UbnextError(f"comm.empty: malformed free-list message of {len(payload)} bytes")
    return words[0], [(words[i], words[i + 1]) for i in range(1, len(words), 2)]


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intersection of two sorted lists of disjoint [lo, hi) intervals."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


#: the LaunchState slots of the plan: one per Lamport family and element width (the
#: sentinel's bit pattern depends on the width), one per barrier two-shot transport, the
#: quantized two-shot's, and one per expert-parallel kernel (ubnext._moe)
STATES = tuple([f"{family}{width}.state" for width in (2, 4) for family in ("lamport", "lamport_twoshot")]
               + [f"twoshot.{transport}.state" for transport in ("unicast", "multicast")] + ["quant.state"]
               + ["moe_dispatch.state", "moe_combine.state", "ll.state", "p2p.state", "moe_packed_dispatch.state",
                  "moe_packed_combine.state"])
#: bytes of the barrier flags and signatures of one transport (kernels/sync.cuh:
#: flag_offset, signature_offset)
FLAG_BYTES = (4 * FLAG_PHASES + 8) * MAX_BLOCKS * MAX_RANKS
#: the fused Lamport two-shot's all-gather area also holds a 16-byte scale per row: room
#: for them at the full message for rows of at least this many vectors (1 KiB)
SCALE_ROW_VECS = 64


def plan_layout(nranks: int, lamport_bytes: int, lamport_twoshot_bytes: int, staging_bytes: int,
                quant_bytes: int = 0) -> SlotPlan:
    """The library slots of every segment, identical on every rank.

    Each Lamport family has one set of 3 receive buffers and a launch state per element
    width; a set is shared by a family's unicast and multicast kernels and by its fused
    kernel (same protocol, same rotation). A one-shot buffer holds nranks slots of
    ``lamport_bytes`` and a signature header per rank; a two-shot buffer holds a
    reduce-scatter and an all-gather area of ``area(lamport_twoshot_bytes)``. The barrier
    two-shot kernels have a launch state and barrier flags per transport: the unicast
    barrier stores epochs per source rank, the multicast one counts arrivals. The
    quantized two-shot (opt-in) has a launch state, barrier flags and ``quant_bytes`` of
    receive areas of its own (``_quant.quant_area_bytes``; 0 where the communicator did not opt in).
    The low-latency data movers have a launch state and two buffers of LL lines (``ll``);
    point-to-point a launch state and its area (``p2p``: ``p2p_bytes``).
    """
    plan = SlotPlan()
    for name in STATES:
        plan.add(name, LAUNCH_STATE_BYTES)
    for transport in ("unicast", "multicast"):
        plan.add(f"flags.{transport}", FLAG_BYTES)
    for width in (2, 4):
        plan.add(f"lamport{width}", set_bytes("lamport", nranks, lamport_bytes))
        plan.add(f"lamport_twoshot{width}", set_bytes("lamport_twoshot", nranks, area(lamport_twoshot_bytes)))
    plan.add("flags.quant", FLAG_BYTES)
    plan.add("quant", quant_bytes)
    plan.add("ll", 2 * nranks * ll_slot_bytes())
    plan.add("p2p", p2p_bytes(nranks))
    plan.add("staging", staging_bytes)
    return plan


def ll_slot_bytes() -> int:
    """Bytes of one rank's slot in a buffer of the low-latency data movers
    (kernels/ll_move.cu): its header line, then a 16-byte line per 8 bytes of up to
    LL_MAX_BYTES; their set holds two buffers of nranks slots."""
    return HEADER_BYTES + 2 * LL_MAX_BYTES


def p2p_bytes(nranks: int) -> int:
    """Bytes of the point-to-point area (kernels/p2p.cu): a line of credits and a line of
    counters, then two slots of ``ll_slot_bytes`` per source rank (one per buffer); then
    the bulk part (kernels/p2p_bulk.cuh): a line of counters, a credit word and a 16-byte
    flag line per rank and chunk slot, a 16-byte verdict line per rank and entry, and
    P2P_BULK_DEPTH chunk slots per source rank."""
    bulk = (HEADER_BYTES + 20 * MAX_RANKS * P2P_BULK_DEPTH + 16 * MAX_RANKS * P2P_MAX_ENTRIES
            + nranks * P2P_BULK_DEPTH * P2P_BULK_CHUNK)
    return 2 * HEADER_BYTES + 2 * nranks * ll_slot_bytes() + bulk


def set_bytes(family: str, nranks: int, unit: int) -> int:
    """Bytes of a Lamport family's set of 3 receive buffers whose kernels take ``unit``:
    one-shot, nranks slots of ``unit`` bytes and HEADER_BYTES per rank for its signature
    header (kernels/lamport.cu); two-shot, a reduce-scatter and an all-gather area of
    ``unit`` bytes (kernels/lamport_twoshot.cu)."""
    return 3 * (nranks * (unit + HEADER_BYTES) if family == "lamport" else 2 * unit)


def set_unit(family: str, nranks: int, nbytes: int) -> int:
    """The ``unit`` of a set of ``nbytes`` (the inverse of set_bytes)."""
    return nbytes // (3 * nranks) - HEADER_BYTES if family == "lamport" else nbytes // 6


def area(max_bytes: int) -> int:
    """Bytes of a Lamport two-shot area for messages up to ``max_bytes``: the slots of the
    reduce-scatter area are whole slices of whole TWOSHOT_ALIGN_VECS-vector units, up to
    that many vectors per rank more than the message, followed by HEADER_BYTES per rank
    for its signature header, starting at a multiple of HEADER_BYTES; the all-gather area
    of the fused kernel also holds a 16-byte scale per row of at least SCALE_ROW_VECS
    vectors."""
    vecs = -(-max_bytes // VEC_BYTES)
    data = VEC_BYTES * (vecs + vecs // SCALE_ROW_VECS + TWOSHOT_ALIGN_VECS * MAX_RANKS)
    return -(-data // HEADER_BYTES) * HEADER_BYTES + MAX_RANKS * HEADER_BYTES


def twoshot_norm_rows(area_bytes: int, row_bytes: int, nranks: int) -> int:
    """Rows of ``row_bytes`` one fused Lamport two-shot launch takes with areas of
    ``area_bytes`` (kernels/lamport_twoshot.cu): every rank's slot holds ceil(rows / nranks)
    rows before the signature headers (reduce-scatter area), the all-gather area also a
    16-byte scale per row."""
    rows = min(area_bytes // (row_bytes + VEC_BYTES), (area_bytes - nranks * HEADER_BYTES) // row_bytes)
    return rows // nranks * nranks
