"""The quantized two-shot kernel (its all-reduce and reduce-scatter entry points, one
translation unit) compiles through NVRTC without a GPU (sm_90a and sm_80; fp8 from sm_89),
with exactly rounded fp32 arithmetic, its groups spread over lanes and its records laid out
as the host sizes them, as tests/test_kernels.py does for the algorithm table's kernels
(the gate in NVRTC's fast-compile mode; the arithmetic checks fully optimized)."""

from __future__ import annotations

import re

import pytest

from ubnext._engine import kernels as _kernels
from ubnext._protocol import constants as _protocol
from ubnext._protocol import quant as _quant


def _compile(fmt, dtype, op, nranks, arch, fast=False):
    return _kernels.compile_cubin(_quant.SOURCE, _quant.compile_defines(fmt, dtype, op, nranks), arch=arch, fast=fast)


#: the world sizes the gate compiles, turning with the dtype and the op as in tests/test_kernels.py
RANKS = (1, 2, 4, 8)


def gate_cases():
    """Every format x dtype x op once, each format at every world size (the full rank
    matrix compiles in the GPU suite, tests/test_gpu_quant.py, at the ranks it runs)."""
    for i, fmt in enumerate(_quant.FORMATS):
        for j, dtype in enumerate(_quant.DTYPES):
            for k, op in enumerate(_quant.OPS):
                nranks = RANKS[(2 * i + 2 * j + k) % len(RANKS)]
                yield pytest.param(fmt, dtype, op, nranks, id=f"{fmt}-{dtype}-{op}-{nranks}")


def test_the_gate_covers_every_format_dtype_op_and_world_size():
    cases = [tuple(case.values) for case in gate_cases()]
    assert sorted(c[:3] for c in cases) == sorted(
        (f, d, o) for f in _quant.FORMATS for d in _quant.DTYPES for o in _quant.OPS)
    for fmt in _quant.FORMATS:
        assert {n for f, _, _, n in cases if f == fmt} == set(RANKS), fmt


def _has_every_entry(cubin: bytes) -> bool:
    return all(entry.encode() + b"\x00" in cubin for entry in _quant.ENTRIES.values())


@pytest.mark.parametrize("fmt,dtype,op,nranks", list(gate_cases()))
def test_every_instantiation_compiles_for_sm90a(fmt, dtype, op, nranks):
    """Each compile builds both entry points: the all-reduce and the reduce-scatter."""
    cubin = _compile(fmt, dtype, op, nranks, "sm_90a", fast=True)
    assert cubin[:4] == b"\x7fELF" and _has_every_entry(cubin)
    assert set(_quant.ENTRIES) == {"all_reduce", "reduce_scatter"} == set(_quant.COLLECTIVES)


@pytest.mark.parametrize("dtype", list(_quant.DTYPES))
def test_integer_formats_compile_for_sm80_and_fp8_from_sm89(dtype):
    for fmt in ("int8", "int4"):
        assert _quant.FORMATS[fmt].min_arch == 0
        assert _has_every_entry(_compile(fmt, dtype, "sum", 4, "sm_80", fast=True))
    assert _has_every_entry(_compile("fp8", dtype, "sum", 4, "sm_89", fast=True))
    assert _quant.FORMATS["fp8"].min_arch == 89
    with pytest.raises(Exception, match="QFp8"):  # the host never asks for it (_quant.choose)
        _compile("fp8", dtype, "sum", 4, "sm_80", fast=True)


def test_the_kernel_checks_the_record_size_of_the_host():
    """kernels/quant.cuh's Record static_asserts its size against _quant.record_bytes
    (UB_QRECORD_BYTES): a host that sized the areas for another layout fails to compile."""
    defines = {**_quant.compile_defines("int4", "bfloat16", "sum", 2), "UB_QRECORD_BYTES": "1152"}
    with pytest.raises(Exception, match="record_bytes"):
        _kernels.compile_cubin(_quant.SOURCE, defines, fast=True)
    assert [_quant.record_bytes(f) for f in _quant.FORMATS] == [1152, 1152, 640]


def _entry_ptx(ptx: str) -> dict[str, str]:
    """entry point -> its PTX body."""
    parts = re.split(r"\.visible \.entry (\w+)\(", ptx)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
def test_fp32_steps_are_exactly_rounded(fmt):
    """No FMA contraction, no approximate division or reciprocal (the IEEE reciprocal of a
    group's scale, and the division for a scale below the normal range, round to nearest
    even): the host emulation reproduces the bits.
    Integer codes round and widen through exact fp32 additions and byte permutes (no
    float-int conversions); a group's maximum is a butterfly of shuffles. In both entry
    points (the reduce-scatter quantizes, dequantizes and sums as the all-reduce does)."""
    ptx = _compile(fmt, "bfloat16", "avg", 4, "compute_90a").decode()
    bodies = _entry_ptx(ptx)
    assert set(bodies) == set(_quant.ENTRIES.values())
    for entry, body in bodies.items():
        ops = {line.split()[0] for line in body.splitlines() if line.strip() and not line.strip().startswith("//")}
        assert not any(o.startswith(("fma.", "div.approx", "div.full", "mad.f", "rcp.approx")) for o in ops), (entry, ops)
        assert {"rcp.rn.f32", "div.rn.f32", "mul.rn.f32", "add.rn.f32", "shfl.sync.bfly.b32"} <= ops, entry
        if _quant.FORMATS[fmt].floating:
            assert {"cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.f16x2.e4m3x2"} <= ops, entry
        else:
            assert "prmt.b32" in ops and not any(o.startswith(("cvt.rni", "cvt.rn.f32.s", "cvt.s32.f32"))
                                                 for o in ops), entry
        assert "ld.local" not in body and "st.local" not in body, entry  # the units stay in registers


def test_source_takes_its_constants_from_the_protocol_header():
    text = _kernels.source(_quant.SOURCE)
    assert "#include" not in text and _protocol.header().split("#pragma once\n")[1] in text
    assert f"#define UB_QUANT_GROUP {_quant.GROUP}\n" in text
    assert f"#define UB_QUANT_UNIT_GROUPS {_quant.UNIT_GROUPS}\n" in text
    for entry in _quant.ENTRIES.values():  # one block per SM, the threads the host launches
        bound = re.search(r"__launch_bounds__\((\w+), 1\)\s*\n\s*" + entry + r"\(", text).group(1)
        assert int(re.search(rf"#define {bound} (\d+)", text).group(1)) == _protocol.THREADS[_quant.SOURCE]


def test_the_host_packs_each_entry_points_parameters():
    """The engine's parameter list of each quantized entry point (``_engine._PARAMS``) has
    the kernel's count and widths, in order: the all-reduce takes the reduce-scatter slots
    and the all-gather area, the reduce-scatter its slots and the slices' pitch."""
    from ubnext._engine import engine as _engine
    from ubnext._engine.launch import F32, I32, U64

    ptx = _compile("int8", "bfloat16", "sum", 2, "compute_90a").decode()
    width = {U64: ".u64", I32: ".u32", F32: ".f32"}
    for entry, body in _entry_ptx(ptx).items():
        params = re.findall(r"\.param (\.\w+) " + entry + r"_param_\d+", body)
        assert params == [width[t] for t in _engine._PARAMS[entry]], entry
