"""The expert-parallel kernels of both modes (kernels/moe_dispatch.cu, kernels/moe_combine.cu;
kernels/moe_packed_dispatch.cu, kernels/moe_packed_combine.cu) compile for sm_90a through
NVRTC without a GPU, for every payload dtype at every world size, and keep the arithmetic
the host reference (ubnext/_moe/reference.py) computes: no fused multiply-add in the
combines' products and sums. The launches' argument lists agree with the entry points; the
entry points wait for the kernel before them; the signatures and the routing errors read as
the docs say (the packed mode's own: tests/test_moe_packed_kernels.py)."""

from __future__ import annotations

import re

import pytest

from ubnext._engine import failures as _failures
from ubnext._engine import kernels as _kernels
from ubnext._moe import layout as _layout
from ubnext._moe.expert_parallel import ExpertParallel
from ubnext._moe.packed import PackedExpertParallel
from ubnext._protocol import constants as _protocol
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import compile_defines
from ubnext._protocol.errors import RoutingError

RANKS = (1, 2, 4, 8)
#: every MoE kernel source -> (its entry point, the Launcher's parameter types), of both objects
KERNELS = {source: (entry, cls.PARAMS[kind]) for cls in (ExpertParallel, PackedExpertParallel)
           for kind, (source, entry) in cls.SOURCES.items()}
COMBINES = [source for source in KERNELS if "combine" in source]
CASES = [pytest.param(source, dtype, n, id=f"{source[:-3]}-{dtype}-{n}")
         for source in KERNELS for dtype in _layout.MOE_DTYPES for n in RANKS]


def _compile(source, dtype, nranks, arch="sm_90a", fast=False):
    return _kernels.compile_cubin(source, compile_defines(dtype, "sum", nranks), arch=arch, fast=fast)


def ptx(source, dtype="bfloat16", nranks=4):
    """The PTX of ``source`` for compute_90a."""
    return _compile(source, dtype, nranks, arch="compute_90a").decode(errors="replace")


@pytest.mark.parametrize("source,dtype,nranks", CASES)
def test_every_variant_compiles_for_sm90a(source, dtype, nranks):
    cubin = _compile(source, dtype, nranks, fast=True)
    assert cubin[:4] == b"\x7fELF" and KERNELS[source][0].encode() in cubin


@pytest.mark.parametrize("source", list(KERNELS))
def test_each_kernel_compiles_with_full_optimization(source):
    assert KERNELS[source][0].encode() in _compile(source, "bfloat16", 8)


@pytest.mark.parametrize("source", COMBINES)
@pytest.mark.parametrize("dtype", list(_layout.MOE_DTYPES))
def test_the_combine_rounds_every_product_and_sum(source, dtype):
    """The reference rounds w * y and acc + w * y separately: a contracted fma.rn.f32 would
    round once and differ from it."""
    text = ptx(source, dtype)
    assert "mul.rn.f32" in text and "add.rn.f32" in text
    assert not re.search(r"\bfma\.rn(\.ftz)?\.f32\b", text)


#: the entry points' parameters, in the order the objects pack them (their _prefixes, the
#: calls' values: tests/test_moe_host.py, tests/test_moe_packed.py), then the launch state
NAMES = {
    "moe_dispatch.cu": ("base stride rank mc rot_off hdr_off rec_off rows_off experts local topk hidden tokens "
                        "capacity x idx w count recv_x scales counts src weights route src_tokens dest sig state"),
    "moe_combine.cu": ("base stride rank mc rot_off hdr_off part_off experts local topk hidden tokens capacity "
                       "y weights route src_tokens dest out bf16_partials sig state"),
    "moe_packed_dispatch.cu": ("base stride rank mc rot_off hdr_off prog_off rec_off data_off experts local topk "
                               "hidden tokens max_rows senders x idx w count recv_x offsets src weights route "
                               "src_tokens dest counts sig state"),
    "moe_packed_combine.cu": ("base stride rank mc rot_off hdr_off data_off experts local topk hidden tokens "
                              "max_rows y weights route src_tokens dest out sig state"),
}


@pytest.mark.parametrize("source", list(KERNELS))
def test_entry_points_take_the_launchers_parameters(source):
    """Parameters of the extern "C" entry point, by name, against the Launcher's types."""
    entry, types = KERNELS[source]
    text = _kernels.source(source)
    assert "#include" not in text and "#define UB_MOE_MAX_CAPACITY" in text
    params = re.search(rf"{entry}\(([^)]*)\)", text).group(1)
    names = [re.findall(r"\w+", p)[-1] for p in params.split(",")]
    assert names == NAMES[source].split() and len(names) == len(types)
    header = _protocol.header()
    assert f"#define UB_{source[:-3].upper()}_THREADS {_protocol.THREADS[source]}\n" in header
    for code, (name, _) in _protocol.MOE_INPUT_ERRORS.items():
        assert f"  {name} = {code}," in header


def test_moe_signatures_name_the_object():
    sig = _signature.encode_moe("moe_dispatch", "bfloat16", 256, 8, 128, 7168)
    assert _signature.text(sig) == "moe_dispatch of 256 experts, top-8, 128 tokens of 7168 bfloat16"
    assert sig != _signature.encode_moe("moe_combine", "bfloat16", 256, 8, 128, 7168)
    assert sig != _signature.encode_moe("moe_dispatch", "float32", 256, 8, 128, 7168)
    half = _signature.encode_moe("moe_combine", "bfloat16", 256, 8, 128, 7168, wire=1)
    assert _signature.text(half) == "moe_combine of 256 experts, top-8, 128 tokens of 7168 bfloat16, bfloat16 partials"
    assert half != _signature.encode_moe("moe_combine", "bfloat16", 256, 8, 128, 7168)
    fp8 = _signature.encode_moe("moe_dispatch", "bfloat16", 256, 8, 128, 7168, wire=_layout.FP8_WIRE)
    assert _signature.text(fp8) == ("moe_dispatch of 256 experts, top-8, 128 tokens of 7168 bfloat16, e4m3 rows "
                                    "with fp32 scales")
    assert _signature.MOE_WIRES[_layout.PARTIALS["bfloat16"]] == "bfloat16 partials"
    with pytest.raises(ValueError):
        _signature.encode_moe("moe_dispatch", "bfloat16", 4096, 8, 128, 7168)
    with pytest.raises(ValueError):
        _signature.encode_moe("moe_combine", "bfloat16", 256, 8, 128, 7168, wire=len(_signature.MOE_WIRES))


def test_a_routing_failure_reads_as_a_routing_error():
    kind = next(code for code, (name, _) in _protocol.FAIL_KINDS.items() if name == "kFailInput")
    site = next(code for code, (name, _) in _protocol.MOE_INPUT_ERRORS.items() if name == "kMoeBadExpert")
    e = _failures.error_of("ExpertParallel.dispatch", kind, 2, 2, site, 7, 13, (1 << 64) - 5, 600.0)
    assert isinstance(e, RoutingError) and e.rank == 2 and (e.where, e.value) == (13, -5)
    assert str(e).startswith("ExpertParallel.dispatch: rank 2 found an expert id out of range (at 13: -5)")
    peer = next(code for code, (name, _) in _protocol.FAIL_KINDS.items() if name == "kFailPeer")
    other = _failures.error_of("ExpertParallel.combine", peer, 0, 2, kind, 8, 0, 0, 600.0)
    assert "rank 2 failed first (a call's input was invalid" in str(other)


@pytest.mark.parametrize("source", list(KERNELS))
def test_the_entry_point_waits_for_the_kernel_before_it_and_keeps_subnormals(source):
    """Programmatic dependent launch: before griddepcontrol.wait, the PTX loads parameters
    only and stores block 0's entry stamp only (sync.cuh: enter_launch); the trigger for
    dependents follows the wait; no instruction flushes subnormals (.ftz)."""
    text = ptx(source)
    assert ".ftz" not in text
    body = text[text.index(f".entry {KERNELS[source][0]}("):]
    wait = body.index("griddepcontrol.wait;")
    assert body.index("griddepcontrol.launch_dependents;") > wait
    early = [line.split()[0] for line in body[:wait].splitlines()
             if re.match(r"\s*(ld|st|atom|red|cp|prefetch)\.", line)]
    assert [i for i in early if not i.startswith("ld.param")] == ["st.relaxed.gpu.global.u64"], early
