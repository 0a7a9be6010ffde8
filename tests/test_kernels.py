"""Kernel sources compile for sm_90a through NVRTC, without a GPU (CI's compile gate),
and the algorithm table and compile options agree with each other."""

from __future__ import annotations

import pytest

from ubnext import _kernels
from ubnext._algorithms import (ALGORITHMS, DTYPES, MAX_BLOCKS, MAX_RANKS, NORM_ENTRY, NORM_SOURCE, OPS,
                                compile_defines)

KERNEL_ALGOS = [name for name, a in ALGORITHMS.items() if a.is_kernel]


def _compile(algorithm, dtype, op, nranks, arch="sm_90a"):
    alg = ALGORITHMS[algorithm]
    return _kernels.compile_cubin(alg.source, compile_defines(dtype, op, nranks, alg.transport), arch=arch)


@pytest.mark.parametrize("algorithm", KERNEL_ALGOS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
def test_every_instantiation_compiles_for_sm90a(algorithm, dtype, nranks):
    alg = ALGORITHMS[algorithm]
    ops = list(OPS) if nranks == 4 else ["sum"]  # every op once; every width and world size
    for op in ops:
        if not alg.supports(dtype, op):
            continue
        cubin = _compile(algorithm, dtype, op, nranks)
        assert cubin[:4] == b"\x7fELF", "NVRTC did not return a CUBIN"
        for entry in (alg.entry, alg.norm_entry):
            assert entry.encode() in cubin, f"entry point {entry} missing from the CUBIN"


def _ptx_instructions(ptx: bytes) -> set[str]:
    return {line.split()[0] for line in ptx.decode(errors="replace").splitlines() if line.strip()}


@pytest.mark.parametrize("algorithm", [name for name in KERNEL_ALGOS if ALGORITHMS[name].multicast])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_multicast_instantiations_emit_multimem(algorithm, dtype):
    """The NVLS kernels really use the switch: multimem loads-with-reduce / stores / reds."""
    expected = {"nvls": ("multimem.ld_reduce", "multimem.st", "multimem.red"),
                "nvls_lamport": ("multimem.st",)}[algorithm]
    for op in OPS:
        if not ALGORITHMS[algorithm].supports(dtype, op):
            continue
        ptx = _compile(algorithm, dtype, op, 4, arch="compute_90a")
        found = {i for i in _ptx_instructions(ptx) if i.startswith("multimem.")}
        for prefix in expected:
            assert any(i.startswith(prefix) for i in found), f"{prefix} missing ({algorithm} {dtype} {op}): {found}"
        if algorithm == "nvls" and dtype != "float32":
            assert any(".acc::f32" in i for i in found), "16-bit sums must accumulate in fp32"
    unicast = _compile("twoshot" if algorithm == "nvls" else "lamport", dtype, "sum", 4, arch="compute_90a")
    assert not any(i.startswith("multimem.") for i in _ptx_instructions(unicast))


def test_multicast_kernels_compile_for_sm100a_when_nvrtc_knows_it():
    from cuda.bindings import nvrtc

    from ubnext._cuda import check

    archs = check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    if 100 not in archs:
        pytest.skip(f"this NVRTC does not target sm_100 (supports {archs})")
    for algorithm in ("nvls", "nvls_lamport"):
        assert _compile(algorithm, "bfloat16", "sum", 8, arch="sm_100a")[:4] == b"\x7fELF"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_separate_norm_kernel_compiles(dtype):
    cubin = _kernels.compile_cubin(NORM_SOURCE, compile_defines(dtype, "sum", 1))
    assert NORM_ENTRY.encode() in cubin


def test_compile_error_carries_the_log(monkeypatch):
    from ubnext._errors import CudaError

    monkeypatch.setattr(_kernels, "source", lambda name: "this is not CUDA")
    with pytest.raises(CudaError, match="nvrtcCompileProgram"):
        _compile("lamport", "float32", "sum", 2)


def test_sources_are_self_contained_and_limits_match_the_headers():
    text = _kernels.source("twoshot.cu")
    assert "#include" not in text
    assert f"#define UB_MAX_RANKS {MAX_RANKS}" in text
    assert f"#define UB_MAX_BLOCKS {MAX_BLOCKS}" in text


def test_compile_defines_cover_the_table():
    for dtype in DTYPES:
        for op in OPS:
            d = compile_defines(dtype, op, 4)
            assert d["UB_NRANKS"] == "4" and d["UB_OP"].startswith("Op") and d["UB_TRANSPORT"] == "Unicast"
    assert compile_defines("float32", "sum", 4, "multicast")["UB_TRANSPORT"] == "Multicast"
    assert _kernels.options({"B": "2", "A": "1"})[-2:] == ("-DA=1", "-DB=2")

