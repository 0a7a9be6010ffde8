"""The throughput-mode expert-parallel kernels (kernels/moe_packed_dispatch.cu,
kernels/moe_packed_combine.cu), beyond what tests/test_moe_kernels.py checks of both modes'
kernels (every variant compiles, the combines' arithmetic, the entry points' parameters and
their wait for the kernel before them): the rows move in 16-byte vectors and the bulk flag
follows a fence and the grid barrier; the signatures and the max_rows error read as the docs
say."""

from __future__ import annotations

import re

import pytest
from test_moe_kernels import ptx

from ubnext._engine import failures as _failures
from ubnext._moe.packed import SOURCES
from ubnext._protocol import constants as _protocol
from ubnext._protocol import signature as _signature
from ubnext._protocol.errors import RoutingError


@pytest.mark.parametrize("kind", list(SOURCES))
def test_rows_move_in_16_byte_vectors(kind):
    """The bulk stores to peers and to the packed rows are v4.u32 (16 bytes): the
    bandwidth-bound path; the bulk flag is published after a system-scope fence."""
    text = ptx(SOURCES[kind][0])
    assert re.search(r"st(\.weak)?\.global\.v4\.u32", text) or re.search(r"st\.global\.v4\.(u32|b32)", text)
    assert re.search(r"ld(\.weak)?\.global(\.nc)?\.v4\.u32", text) or "ld.relaxed.sys.global.v4.u32" in text
    assert "fence.sc.sys;" in text and "atom.global.add.u32" in text  # the grid barrier's arrivals


def test_packed_signatures_differ_from_the_low_latency_ones():
    sig = _signature.encode_moe("moe_packed_dispatch", "bfloat16", 256, 8, 4096, 7168)
    assert _signature.text(sig) == "moe_packed_dispatch of 256 experts, top-8, 4096 tokens of 7168 bfloat16"
    others = {_signature.encode_moe(c, "bfloat16", 256, 8, 4096, 7168)
              for c in ("moe_dispatch", "moe_combine", "moe_packed_combine")}
    assert sig not in others and len(others) == 3


def test_more_rows_than_max_rows_reads_as_a_routing_error():
    kind = next(code for code, (name, _) in _protocol.FAIL_KINDS.items() if name == "kFailInput")
    site = next(code for code, (name, _) in _protocol.MOE_INPUT_ERRORS.items() if name == "kMoeOverRows")
    e = _failures.error_of("PackedExpertParallel.dispatch", kind, 1, 1, site, 3, 20, 36, 600.0)
    assert isinstance(e, RoutingError) and e.rank == 1
    assert str(e).startswith("PackedExpertParallel.dispatch: rank 1 found more rows than the packed layout's "
                             "max_rows (at 20: 36)")
