"""The expert-parallel kernels of both modes (kernels/moe_dispatch.cu, kernels/moe_combine.cu;
kernels/moe_packed_dispatch.cu, kernels/moe_packed_combine.cu) compile for sm_90a through
NVRTC without a GPU, for every payload dtype at every world size, and keep the arithmetic
the host reference (ubnext/_moe/reference.py) computes: no fused multiply-add in the
combines' products and sums; the low-latency dispatch orders its rows before their records
with one release fence and acquire loads, and every kernel's two closing counts are in flight
together. The launches' argument lists agree with the entry points; the entry points wait
for the kernel before them; the signatures and the routing errors read as the docs say (the
packed mode's own: tests/test_moe_packed_kernels.py). The low-latency dispatch's timing
variants (bench/moe_phases.py) compile, and the library's kernel is the whole one."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from bench import moe_phases
from ubnext._engine import failures as _failures
from ubnext._engine import kernels as _kernels
from ubnext._moe import base
from ubnext._moe import layout as _layout
from ubnext._moe import packed_layout
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


def _dispatch_entry(defines=()):
    """The PTX of the dispatch's entry point (bf16, 4 ranks, full optimization) with ``defines``."""
    ptx = _kernels.compile_cubin("moe_dispatch.cu", {**compile_defines("bfloat16", "sum", 4), **dict(defines)},
                                 arch="compute_90a").decode(errors="replace")
    return ptx[ptx.index(f".entry {KERNELS['moe_dispatch.cu'][0]}("):]


def test_the_dispatch_releases_rows_with_one_fence_and_acquires_them_with_loads():
    """The send's release is one acquire-release fence before the record's relaxed store
    (no sequentially consistent fence: message passing needs none); the scatter acquires a
    record by loading its first vector with ld.acquire (no fence waiting for the lane's
    stores), at the poll and in the poll's wait (the load that sees it written)."""
    body = _dispatch_entry()
    assert "fence.sc.sys" not in body and body.count("fence.acq_rel.sys") == 1
    assert body.count("ld.acquire.sys.global.v4.u32") == 2


@pytest.mark.parametrize("name,defines", [(name, defines) for name, defines, _ in moe_phases.VARIANTS])
def test_every_timing_variant_of_bench_moe_phases_compiles(name, defines):
    cubin = _kernels.compile_cubin("moe_dispatch.cu", {**compile_defines("bfloat16", "sum", 4), **dict(defines)},
                                   fast=True)
    assert KERNELS["moe_dispatch.cu"][0].encode() in cubin


def test_without_definitions_the_dispatch_is_the_whole_one():
    """The library compiles none of the timing variants' definitions: its kernel is every
    phase, with this branch's fences and the prefetch."""
    assert _dispatch_entry() == _dispatch_entry((("UB_MOE_PHASES", "4"), ("UB_MOE_FENCES", "3"),
                                                 ("UB_MOE_PREFETCH", "1")))
    assert _dispatch_entry() != _dispatch_entry((("UB_MOE_PHASES", "3"),))


def test_the_definitions_hook_reaches_its_calls_kernel_only(monkeypatch):
    """MoeObject._compile adds a subclass's _extra_defines of a call to that call's kernel's
    compilation only (bench/moe_phases.py: the low-latency dispatch's); the library's
    classes add none."""
    compiled = {}

    def compile_module(source, defines, device):
        compiled[source] = defines
        return SimpleNamespace(get_function=lambda entry: entry)

    monkeypatch.setattr(base, "compile_module", compile_module)
    monkeypatch.setattr(base, "Launcher", lambda *args: args)
    node = SimpleNamespace(pool=SimpleNamespace(base=0, stride=0, local_rank=0, local_ptr=lambda offset: offset),
                           engine=SimpleNamespace(_mc_base=0, plan=SimpleNamespace(offset=lambda key: 0),
                                                  dependent=True))
    sizes = (4, 256, 7168, 128, 8, "bfloat16")
    plain = compile_defines("bfloat16", "sum", 4)
    phased = type("Phased", (ExpertParallel,), {"_extra_defines": {"dispatch": (("UB_MOE_PHASES", "2"),)}})
    for cls, shape, extra in ((ExpertParallel, _layout.shape(*sizes), {}),
                              (PackedExpertParallel, packed_layout.shape(*sizes), {}),
                              (phased, _layout.shape(*sizes), {"UB_MOE_PHASES": "2"})):
        ep = cls.__new__(cls)
        ep.shape, ep._senders = shape, 1
        compiled.clear()
        ep._compile(SimpleNamespace(device=0), node, shape.offsets())
        (dispatch, _), (combine, _) = cls.SOURCES["dispatch"], cls.SOURCES["combine"]
        assert compiled == {dispatch: {**plain, **extra}, combine: plain}


def test_bench_moe_phases_subtracts_each_variant_from_its_reference():
    names = [name for name, *_ in moe_phases.variants([66])]
    record = {"shape": {"hidden": 128, "experts": 8, "top_k": 1, "tokens": 1}, "wrong": {"whole": 0},
              "times_us": {name: float(2 ** i) for i, name in enumerate(names)}}
    rows = {line[:28].strip(): float(line[28:]) for line in moe_phases.table([record], names)
            if line[:1] != "#" and line[28:].strip() not in ("", "-") and not line.startswith("variant")}
    t = record["times_us"]
    assert rows["send (2 - 1)"] == t["phase 2"] - t["phase 1"] and rows["copy (whole - 3)"] == t["whole"] - t["phase 3"]
    assert rows["send fence"] == t["whole"] - t["no send fence"] and rows["both"] == t["whole"] - t["no fences"]
    assert rows["fences, this branch's gain"] == t["fences as before"] - t["whole"]
    assert rows["grid 66 - whole"] == t["grid 66"] - t["whole"]
    assert rows["phase 0, grid 66 - phase 0"] == t["phase 0, grid 66"] - t["phase 0"]
    assert rows["wrong (checked variants)"] == 0


@pytest.mark.parametrize("source", list(KERNELS))
def test_the_two_counts_at_a_launchs_end_are_in_flight_together(source):
    """moe.cuh's moe_finish: the rotation's count (the second-to-last atomic add) is issued
    before the launch state's (the last) and its result is read only after it, so that a
    block's end waits for one atomic round trip, not two."""
    text = ptx(source)
    body = text[text.index(f".entry {KERNELS[source][0]}("):]
    last = body.rindex("atom.global.add.u32")
    rotation = body.rindex("atom.global.add.u32", 0, last)
    result = re.match(r"atom\.global\.add\.u32\s+(%r\d+),", body[rotation:]).group(1)
    assert re.search(rf"{re.escape(result)}\b", body[body.index("\n", rotation):last]) is None
    assert re.search(rf"{re.escape(result)}\b", body[last:]) is not None


def test_the_dispatch_prefetches_its_first_token_before_it_reads_the_rotation():
    """The send's first loads (ids, weights, row) are requested into L1 after the wait for the
    kernel before (which may write them) and before the object's rotation is read (the
    send's addresses wait for it); the timing variants without the send prefetch nothing."""
    body = _dispatch_entry()
    first = body.index("prefetch.global.L1")
    assert body.index("griddepcontrol.wait;") < first < body.index("ld.volatile.global")
    assert "prefetch.global.L1" not in _dispatch_entry((("UB_MOE_PHASES", "1"),))
