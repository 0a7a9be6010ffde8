"""Pool planning: library slots and the rank-agreeing user heap (pure Python)."""

from __future__ import annotations

import random
import threading

import pytest

from ubnext._memory.heap import SlotPlan, UserHeap
from ubnext._protocol.errors import UbnextError

# -- SlotPlan ---------------------------------------------------------------


def _plan():
    plan = SlotPlan()
    plan.add("flags", 100)
    plan.add("lamport", 3000, align=4096)
    plan.add("staging", 1)
    plan.add("empty", 0, align=1024)
    return plan


def test_slot_offsets_deterministic_and_aligned():
    a, b = _plan(), _plan()
    for name in ("flags", "lamport", "staging", "empty"):
        assert a.offset(name) == b.offset(name)
        assert a.nbytes(name) == b.nbytes(name)
    assert a.offset("flags") == 0
    assert a.offset("lamport") == 4096
    assert a.offset("staging") == 4096 + 3072  # 7096 rounded up to 256
    assert a.offset("empty") == 8192
    assert a.end == 8192
    assert "lamport" in a and "missing" not in a


def test_slot_plan_start_and_errors():
    plan = SlotPlan(start=100)
    assert plan.add("x", 8) == 256
    with pytest.raises(ValueError, match="already planned"):
        plan.add("x", 8)
    with pytest.raises(ValueError, match="negative size"):
        plan.add("y", -1)
    with pytest.raises(ValueError, match="power of two"):
        plan.add("z", 8, align=3)
    with pytest.raises(KeyError, match="no slot named 'nope'"):
        plan.offset("nope")


# -- UserHeap on simulated ranks ----------------------------------------------


class Node:
    """One UserHeap per simulated rank, and a real allgather between them.

    Each rank runs ``alloc`` in its own thread; ``agree`` deposits the rank's
    bytes, waits for every rank, and returns all of them in rank order.
    """

    def __init__(self, ranks, start=0, end=64 * 1024, align=256):
        self.heaps = [UserHeap(start, end, align) for _ in range(ranks)]
        self._slots = [b""] * ranks
        self._barrier = threading.Barrier(ranks, timeout=10)

    def _agree(self, rank):
        def agree(payload):
            self._slots[rank] = payload
            self._barrier.wait()
            gathered = list(self._slots)
            self._barrier.wait()  # nobody overwrites a slot before everyone read
            return gathered

        return agree

    def alloc(self, sizes):
        """Collective alloc; returns (offsets, errors), one entry per rank."""
        if isinstance(sizes, int):
            sizes = [sizes] * len(self.heaps)
        offsets = [None] * len(self.heaps)
        errors = [None] * len(self.heaps)

        def run(rank):
            try:
                offsets[rank] = self.heaps[rank].alloc(sizes[rank], self._agree(rank))
            except UbnextError as exc:
                errors[rank] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.heaps))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive(), "simulated allgather hung"
        return offsets, errors

    def alloc_agreed(self, nbytes):
        offsets, errors = self.alloc(nbytes)
        assert errors == [None] * len(self.heaps)
        assert len(set(offsets)) == 1, offsets
        return offsets[0]


def test_single_rank_first_fit_and_reuse():
    node = Node(1, end=4096)
    a = node.alloc_agreed(100)
    b = node.alloc_agreed(256)
    c = node.alloc_agreed(1)
    assert (a, b, c) == (0, 256, 512)
    heap = node.heaps[0]
    assert heap.used == 768 and heap.free_bytes == 4096 - 768
    heap.free(b)
    assert node.alloc_agreed(300) == 768  # the 256-byte hole is too small
    assert node.alloc_agreed(200) == 256  # first fit takes the hole
    heap.free(a)
    heap.free(256)
    assert node.alloc_agreed(512) == 0  # freed neighbours coalesce


def test_zero_bytes_gets_a_distinct_block():
    node = Node(2, end=4096)
    assert node.alloc_agreed(0) != node.alloc_agreed(0)


def test_same_offset_when_ranks_free_at_different_times():
    node = Node(3, end=4096)
    a, b = node.alloc_agreed(1024), node.alloc_agreed(1024)
    assert (a, b) == (0, 1024)
    node.heaps[0].free(a)  # rank 0's GC ran; ranks 1 and 2 still hold `a`
    c = node.alloc_agreed(512)
    assert c == 2048  # `a` is not free everywhere, so it is not used
    node.heaps[1].free(a)
    node.heaps[2].free(a)
    assert node.alloc_agreed(512) == 0  # now it is


def test_randomised_free_timing_always_agrees():
    rng = random.Random(1234)
    ranks = 4
    node = Node(ranks, end=256 * 1024)
    sizes = {}  # offset -> block size, for blocks some rank has not freed yet
    held = [set() for _ in range(ranks)]  # per rank: offsets it has not freed yet
    garbage = set()  # offsets the user dropped; each rank frees them at its own time
    exhausted = 0
    for _ in range(400):
        for rank in range(ranks):
            for offset in sorted(held[rank] & garbage):
                if rng.random() < 0.3:
                    node.heaps[rank].free(offset)
                    held[rank].discard(offset)
        for offset in [o for o in sizes if not any(o in h for h in held)]:
            del sizes[offset]
            garbage.discard(offset)
        if rng.random() < 0.6:
            nbytes = rng.choice([1, 200, 256, 1000, 4096, 20000])
            offsets, errors = node.alloc(nbytes)
            if errors[0] is not None:
                assert all(isinstance(e, UbnextError) for e in errors), errors
                exhausted += 1
                continue
            assert errors == [None] * ranks
            assert len(set(offsets)) == 1, offsets
            offset, size = offsets[0], -(-nbytes // 256) * 256
            for other, other_size in sizes.items():  # never overlaps a block held anywhere
                assert offset + size <= other or other + other_size <= offset
            sizes[offset] = size
            for h in held:
                h.add(offset)
        else:
            alive = sorted(set(sizes) - garbage)
            if alive:
                garbage.add(rng.choice(alive))
        for rank in range(ranks):
            assert node.heaps[rank].used == sum(sizes[o] for o in held[rank])
    assert exhausted > 0  # the run did reach the pool's limit


def test_exhaustion_raises_on_every_rank():
    node = Node(2, end=4096)
    node.alloc_agreed(2048)
    offsets, errors = node.alloc(4096)
    assert offsets == [None, None]
    for error in errors:
        assert str(error).startswith("comm.empty: symmetric pool exhausted: requested 4096 bytes")
        assert "largest block free on all 2 ranks is 2048 bytes" in str(error)


def test_exhaustion_counts_only_space_free_everywhere():
    node = Node(2, end=4096)
    a = node.alloc_agreed(4096)
    node.heaps[0].free(a)  # free on rank 0 only
    offsets, errors = node.alloc(256)
    assert all(e is not None and "largest block free on all 2 ranks is 0 bytes" in str(e)
               for e in errors)


def test_ranks_requesting_different_sizes_all_raise():
    node = Node(3, end=4096)
    offsets, errors = node.alloc([256, 256, 512])
    assert offsets == [None] * 3
    assert all("ranks requested different sizes [256, 256, 512]" in str(e) for e in errors)


def test_free_unknown_or_twice_raises():
    node = Node(1, end=4096)
    heap = node.heaps[0]
    with pytest.raises(ValueError, match="UserHeap.free: offset 256 is not an allocated block"):
        heap.free(256)
    a = node.alloc_agreed(10)
    heap.free(a)
    with pytest.raises(ValueError, match="not an allocated block"):
        heap.free(a)


def test_free_during_agree_is_safe():
    """A finalizer freeing a buffer in the middle of alloc() must not corrupt it."""
    node = Node(1, end=4096)
    heap = node.heaps[0]
    a = node.alloc_agreed(256)

    def agree(payload):
        heap.free(a)  # as if the GC ran a finalizer during the allgather
        return [payload]

    assert heap.alloc(256, agree) == 256  # `a` was not free when the ranks agreed
    assert heap.used == 256
    assert node.alloc_agreed(256) == 0  # and it is reusable afterwards


def test_heap_range_is_aligned_and_validated():
    heap = UserHeap(100, 1000, align=256)
    assert heap.capacity == 768 - 256
    assert heap.alloc(1, lambda payload: [payload]) == 256
    with pytest.raises(ValueError, match="power of two"):
        UserHeap(0, 1024, align=100)
    with pytest.raises(ValueError, match="empty or negative range"):
        UserHeap(1024, 0)
    with pytest.raises(ValueError, match="negative size"):
        heap.alloc(-1, lambda payload: [payload])


# --------------------------------------------------------------------------- the engine's library slots


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
def test_library_slots_cover_every_lamport_family(nranks):
    """Every Lamport family of the algorithm table has a launch state and a set of three
    buffers per element width (Engine.initialize poisons exactly these), and a Lamport
    two-shot area holds every rank's whole slice of its largest message."""
    from ubnext._memory.heap import plan_layout
    from ubnext._protocol.algorithms import ALGORITHMS
    from ubnext._protocol.constants import HEADER_BYTES, LAUNCH_STATE_BYTES

    one, two = 64 << 10, (1 << 20) + 48
    plan = plan_layout(nranks, one, two, 8 << 20)
    families = {a.family for a in ALGORITHMS.values() if a.pushed}
    assert families == {"lamport", "lamport_twoshot"}
    for width in (2, 4):
        assert plan.nbytes(f"lamport{width}") == 3 * nranks * (one + HEADER_BYTES)  # slots and signature headers
        area = plan.nbytes(f"lamport_twoshot{width}") // 6
        vectors = -(-two // 16)
        assert nranks * -(-vectors // nranks) * 16 + nranks * HEADER_BYTES <= area  # slots and signature headers
        # every rank's header starts a line of its own (kernels: kHeader)
        for family in families:
            assert plan.offset(f"{family}{width}") % HEADER_BYTES == 0
        assert area % HEADER_BYTES == 0 and (one + HEADER_BYTES) % HEADER_BYTES == 0
        for family in families:
            assert plan.nbytes(f"{family}{width}.state") == LAUNCH_STATE_BYTES
    assert plan.offset("staging") + plan.nbytes("staging") == plan.end
