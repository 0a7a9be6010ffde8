"""The throughput-mode expert-parallel kernels (kernels/moe_packed_dispatch.cu,
kernels/moe_packed_combine.cu) compile for sm_90a through NVRTC without a GPU, for every
payload dtype at every world size; the combine keeps the host reference's arithmetic (no
fused multiply-add); the rows move in 16-byte vectors; the launches' argument lists agree
with the entry points; the entry points wait for the kernel before them; the signatures and
the max_rows error read as the docs say."""

from __future__ import annotations

import re

import pytest

from ubnext._engine import failures as _failures
from ubnext._engine import kernels as _kernels
from ubnext._moe import layout as _layout
from ubnext._moe.packed import _PARAMS, SOURCES
from ubnext._protocol import constants as _protocol
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import compile_defines
from ubnext._protocol.errors import RoutingError

RANKS = (1, 2, 4, 8)
CASES = [pytest.param(kind, dtype, n, id=f"{kind}-{dtype}-{n}")
         for kind in SOURCES for dtype in _layout.MOE_DTYPES for n in RANKS]


def _compile(kind, dtype, nranks, arch="sm_90a", fast=False):
    return _kernels.compile_cubin(SOURCES[kind][0], compile_defines(dtype, "sum", nranks), arch=arch, fast=fast)


def _ptx(kind, dtype="bfloat16", nranks=4):
    return _compile(kind, dtype, nranks, arch="compute_90a").decode(errors="replace")


@pytest.mark.parametrize("kind,dtype,nranks", CASES)
def test_every_variant_compiles_for_sm90a(kind, dtype, nranks):
    cubin = _compile(kind, dtype, nranks, fast=True)
    assert cubin[:4] == b"\x7fELF" and SOURCES[kind][1].encode() in cubin


@pytest.mark.parametrize("kind", list(SOURCES))
def test_each_kernel_compiles_with_full_optimization(kind):
    assert SOURCES[kind][1].encode() in _compile(kind, "bfloat16", 8)


@pytest.mark.parametrize("dtype", list(_layout.MOE_DTYPES))
def test_the_combine_rounds_every_product_and_sum(dtype):
    """The reference rounds w * y and acc + w * y separately: a contracted fma.rn.f32 would
    round once and differ from it."""
    ptx = _ptx("combine", dtype)
    assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx
    assert not re.search(r"\bfma\.rn(\.ftz)?\.f32\b", ptx)


@pytest.mark.parametrize("kind", list(SOURCES))
def test_rows_move_in_16_byte_vectors(kind):
    """The bulk stores to peers and to the packed rows are v4.u32 (16 bytes): the
    bandwidth-bound path; the bulk flag is published after a system-scope fence."""
    ptx = _ptx(kind)
    assert re.search(r"st(\.weak)?\.global\.v4\.u32", ptx) or re.search(r"st\.global\.v4\.(u32|b32)", ptx)
    assert re.search(r"ld(\.weak)?\.global(\.nc)?\.v4\.u32", ptx) or "ld.relaxed.sys.global.v4.u32" in ptx
    assert "fence.sc.sys;" in ptx and "atom.global.add.u32" in ptx  # the grid barrier's arrivals


#: the entry points' parameters, in the order PackedExpertParallel packs them (_compile's
#: prefixes, the calls' values: tests/test_moe_packed.py), then the launch state
NAMES = {
    "dispatch": ("base stride rank mc rot_off hdr_off prog_off rec_off data_off experts local topk hidden tokens "
                 "max_rows senders x idx w count recv_x offsets src weights route src_tokens dest counts sig state"),
    "combine": ("base stride rank mc rot_off hdr_off data_off experts local topk hidden tokens max_rows "
                "y weights route src_tokens dest out sig state"),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_entry_points_take_the_launchers_parameters(kind):
    """Parameters of the extern "C" entry point, by name, against the Launcher's types."""
    source, entry = SOURCES[kind]
    text = _kernels.source(source)
    assert "#include" not in text
    params = re.search(rf"{entry}\(([^)]*)\)", text).group(1)
    names = [re.findall(r"\w+", p)[-1] for p in params.split(",")]
    assert names == NAMES[kind].split() and len(names) == len(_PARAMS[kind])
    assert f"#define UB_{source[:-3].upper()}_THREADS {_protocol.THREADS[source]}\n" in _protocol.header()


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


@pytest.mark.parametrize("kind", list(SOURCES))
def test_the_entry_point_waits_for_the_kernel_before_it_and_keeps_subnormals(kind):
    """Programmatic dependent launch: before griddepcontrol.wait, the PTX loads parameters
    only and stores block 0's entry stamp only (sync.cuh: enter_launch); the trigger for
    dependents follows the wait; no instruction flushes subnormals (.ftz)."""
    ptx = _ptx(kind)
    assert ".ftz" not in ptx
    body = ptx[ptx.index(f".entry {SOURCES[kind][1]}("):]
    wait = body.index("griddepcontrol.wait;")
    assert body.index("griddepcontrol.launch_dependents;") > wait
    early = [line.split()[0] for line in body[:wait].splitlines()
             if re.match(r"\s*(ld|st|atom|red|cp|prefetch)\.", line)]
    assert [i for i in early if not i.startswith("ld.param")] == ["st.relaxed.gpu.global.u64"], early
