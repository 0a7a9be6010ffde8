"""The low-latency data movers' kernel (kernels/ll_move.cu) without a GPU: it compiles
through NVRTC for sm_90a at every world size with both entry points, its lines are 64-bit
flag-and-data words stored and polled as such (the single-copy atomicity the protocol
rests on), and its set fits the plan of the pool."""

from __future__ import annotations

import re

import pytest

from ubnext._engine import kernels as _kernels
from ubnext._memory.heap import STATES, ll_slot_bytes, plan_layout
from ubnext._protocol.algorithms import LL_ENTRIES, LL_SOURCE, ll_defines
from ubnext._protocol.constants import HEADER_BYTES, LL_MAX_BYTES


@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
def test_both_entry_points_compile_at_every_world_size(nranks):
    cubin = _kernels.compile_cubin(LL_SOURCE, ll_defines(nranks), fast=True)
    for entry in LL_ENTRIES.values():
        assert entry.encode() + b"\0" in cubin


def test_compiles_with_full_optimization():
    """What ubnext launches (Engine.ll_move: compile_module's options), at the largest world size."""
    cubin = _kernels.compile_cubin(LL_SOURCE, ll_defines(8))
    assert all(entry.encode() + b"\0" in cubin for entry in LL_ENTRIES.values())


def test_lines_are_stored_and_polled_as_64_bit_words():
    ptx = _kernels.compile_cubin(LL_SOURCE, ll_defines(4), arch="compute_90a").decode()
    for entry in LL_ENTRIES.values():
        body = ptx[ptx.index(f".entry {entry}("):]
        body = body[:body.find(".entry ", 1) if ".entry " in body[1:] else None]
        assert re.search(r"st\.relaxed\.sys\.global\.v2\.u64", body), entry
        assert re.search(r"ld\.volatile\.global\.v2\.u64", body), entry
        assert "trap" not in body, entry


def test_the_set_is_planned_with_its_state():
    plan = plan_layout(8, 1 << 20, 1 << 20, 8 << 20)
    assert "ll.state" in STATES
    assert plan.nbytes("ll") == 2 * 8 * ll_slot_bytes() == 2 * 8 * (HEADER_BYTES + 2 * LL_MAX_BYTES)
    assert plan.offset("ll") + plan.nbytes("ll") <= plan.offset("staging")  # zeroed by Engine.initialize
