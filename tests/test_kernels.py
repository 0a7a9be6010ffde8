"""Kernel sources compile for sm_90a through NVRTC, without a GPU (CI's compile gate),
and the algorithm table, compile options and selector agree with each other."""

from __future__ import annotations

import pytest

from ubnext import _kernels
from ubnext._algorithms import ALGORITHMS, DTYPES, MAX_BLOCKS, MAX_RANKS, OPS, compile_defines
from ubnext._select import DEFAULT_TABLE, Selector

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


def test_selector_prefers_lamport_small_twoshot_large_and_respects_limits():
    sel = Selector(4, lamport_max=1 << 20, usable=["lamport", "twoshot", "nccl"])
    assert sel.select(2048, "bfloat16") == "lamport"
    assert sel.select(16 << 20, "bfloat16") == "twoshot"
    assert sel.select(256 << 20, "bfloat16") == "nccl"  # measured: NCCL wins there at 4 ranks
    assert Selector(2, 1 << 20, ["lamport", "twoshot", "nccl"]).select(256 << 20, "bfloat16") == "twoshot"
    small_lamport = Selector(4, lamport_max=1024, usable=["lamport", "twoshot", "nccl"])
    assert small_lamport.select(4096, "float32") == "twoshot"
    assert small_lamport.capped() == [("lamport", 512 << 10)]  # the table's Lamport row is cut short
    assert sel.capped() == []
    nccl_only = Selector(8, lamport_max=1 << 20, usable=["nccl"])
    assert nccl_only.select(16, "float16") == "nccl"
    assert not nccl_only.fits("lamport", 16)
    assert nccl_only.capped() == []


def test_default_table_rows_ascend_and_name_known_algorithms():
    for rows in DEFAULT_TABLE.values():
        limits = [limit for limit, _ in rows]
        assert limits == sorted(limits)
        assert all(name in ALGORITHMS for _, name in rows)


def test_tune_file_round_trip_and_validation(tmp_path):
    import json

    from ubnext import UbnextError
    from ubnext._select import load_table

    good = tmp_path / "t.json"
    good.write_text(json.dumps({"4": [[65536, "lamport"], [1 << 40, "nccl"]]}))
    table = load_table(str(good))
    sel = Selector(4, lamport_max=1 << 20, usable=["lamport", "twoshot", "nccl"], table=table)
    assert sel.select(1024, "bfloat16") == "lamport"
    assert sel.select(1 << 20, "bfloat16") == "nccl"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"4": [[10, "ring"]]}))
    with pytest.raises(UbnextError, match="unknown algorithm"):
        load_table(str(bad))
