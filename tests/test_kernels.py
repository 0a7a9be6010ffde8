"""Kernel sources compile for sm_90a through NVRTC, without a GPU (CI's compile gate),
and the algorithm table and compile options agree with each other."""

from __future__ import annotations

import pytest

from ubnext import _kernels
from ubnext._algorithms import ALGORITHMS, DTYPES, MAX_BLOCKS, MAX_RANKS, OPS, compile_defines

KERNEL_ALGOS = [name for name, a in ALGORITHMS.items() if a.is_kernel]


@pytest.mark.parametrize("algorithm", KERNEL_ALGOS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
def test_every_instantiation_compiles_for_sm90a(algorithm, dtype, nranks):
    ops = list(OPS) if nranks == 4 else ["sum"]  # every op once; every width and world size
    for op in ops:
        cubin = _kernels.compile_cubin(algorithm, dtype, op, nranks, arch="sm_90a")
        assert cubin[:4] == b"\x7fELF", "NVRTC did not return a CUBIN"
        assert ALGORITHMS[algorithm].entry.encode() in cubin, "entry point missing from the CUBIN"


def test_compile_error_carries_the_log(monkeypatch):
    from ubnext._errors import CudaError

    monkeypatch.setattr(_kernels, "source", lambda name: "this is not CUDA")
    with pytest.raises(CudaError, match="nvrtcCompileProgram"):
        _kernels.compile_cubin("lamport", "float32", "sum", 2)


def test_sources_are_self_contained_and_limits_match_the_headers():
    text = _kernels.source("twoshot.cu")
    assert "#include" not in text
    assert f"#define UB_MAX_RANKS {MAX_RANKS}" in text
    assert f"#define UB_MAX_BLOCKS {MAX_BLOCKS}" in text


def test_compile_defines_cover_the_table():
    for dtype in DTYPES:
        for op in OPS:
            d = compile_defines(dtype, op, 4)
            assert d["UB_NRANKS"] == "4" and d["UB_OP"].startswith("Op")
    with pytest.raises(ValueError):
        _kernels.options("nccl", "float32", "sum", 2)
