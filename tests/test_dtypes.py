"""Every dtype NCCL reduces: ubnext's kernels take bfloat16, float16 and float32; the
others (float64 and the 8-, 32- and 64-bit integers) only the barrier two-shot among them,
and ``auto`` gives them to NCCL except where NCCL cannot run (or deterministic mode takes
a float64): then to the barrier two-shot, named by the selector. The host reference's
integer and float64 paths. Pure host tests."""

from __future__ import annotations

import numpy as np
import pytest

from ubnext._api.communicator import Communicator
from ubnext._environment.config import Config
from ubnext._protocol.algorithms import (
    ALGORITHMS,
    DTYPES,
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    OPS,
    TWOSHOT_ONLY_DTYPES,
    op_problem,
)
from ubnext._protocol.errors import UbnextError
from ubnext._selection.select import Selector, buffer_limits
from ubnext._tools import reference

OTHERS = [d for d in DTYPES if d not in KERNEL_DTYPES]
KERNELS = [name for name, a in ALGORITHMS.items() if a.is_kernel]


def test_the_dtypes_are_those_nccl_reduces():
    assert set(DTYPES) == {"bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "uint32",
                           "int64", "uint64"}
    assert KERNEL_DTYPES == ("bfloat16", "float16", "float32")
    assert set(reference.TWOSHOT_ONLY) == set(OTHERS) == set(TWOSHOT_ONLY_DTYPES)
    for name, (_, width) in DTYPES.items():
        assert np.dtype(name if name != "bfloat16" else "uint16").itemsize == width


@pytest.mark.parametrize("dtype", OTHERS)
def test_nccl_and_the_barrier_two_shot_reduce_the_other_dtypes(dtype):
    for op in OPS:
        if op_problem(dtype, op):
            continue
        assert ALGORITHMS["nccl"].supports(dtype, op)
        assert [k for k in KERNELS if ALGORITHMS[k].supports(dtype, op)] == ["twoshot"]  # unicast: no nvls


@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_takes_floating_types_only(dtype):
    problem = op_problem(dtype, "avg")
    assert (problem is None) == (dtype in FLOAT_DTYPES)
    if problem:
        assert dtype in problem and "use sum" in problem
        assert not ALGORITHMS["nccl"].supports(dtype, "avg")
    assert all(op_problem(dtype, op) is None for op in ("sum", "max", "min"))


SHARED = "local ranks 0, 1 share one GPU, which NCCL refuses"


def selector(deterministic=False, nranks=4, nccl_problem=None, usable=tuple(ALGORITHMS)):
    config = Config.from_env()
    return Selector(nranks, buffer_limits(config), list(usable), None, "", deterministic, nccl_problem)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [d for d in OTHERS if d != "float64"] + ["float64"])
def test_auto_gives_the_other_dtypes_to_nccl_and_says_why(dtype, deterministic):
    sel = selector(deterministic)
    want = "twoshot" if deterministic and dtype == "float64" else "nccl"  # integers: any order, the same bits
    for nbytes in (8, 4096, 1 << 20, 1 << 30):
        assert sel.select(nbytes, dtype) == want
        name, why = sel.explain(nbytes, dtype)
        if want == "nccl":
            assert name == "nccl" and "NCCL reduces " + dtype in why and "bfloat16, float16, float32" in why
            assert "algorithm='twoshot'" in why
        else:
            assert why == "ubnext's barrier two-shot reduces float64: deterministic mode: twoshot in place of nccl"
    assert selector().select(4096, "float32") != "nccl"  # the kernels' dtypes keep their rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_takes_the_barrier_two_shot_where_nccl_cannot_run(dtype):
    sel = selector(nccl_problem=SHARED, usable=list(ALGORITHMS) + ["nvls"])
    for nbytes in (8, 4096, 1 << 20, 1 << 30):
        name, why = sel.explain(nbytes, dtype)
        assert name == sel.select(nbytes, dtype) != "nccl"
        if dtype in OTHERS:  # not nvls: the multicast kernels take the 16- and 32-bit floats only
            assert name == "twoshot"
            assert why == f"ubnext's barrier two-shot reduces {dtype}: NCCL cannot run here ({SHARED}): " \
                          f"twoshot in place of nccl"
    name, why = sel.explain(1 << 30, "bfloat16")  # past the table: NCCL's row, the two-shot's multicast form
    assert name == "nvls"
    assert f"NCCL cannot run here ({SHARED}): twoshot in place of nccl; NVLink multicast: nvls in place of twoshot" in why
    assert sel.select_fused(1 << 30, "bfloat16") != "nccl"
    no_kernels = selector(nccl_problem=SHARED, usable=["nccl"])  # nothing else to run: NCCL, which raises
    assert no_kernels.select(4096, "int32") == "nccl"


def bare_comm(nccl_problem=None, usable=tuple(ALGORITHMS), **config):
    """A Communicator holding only what resolving an algorithm reads."""
    comm = Communicator.__new__(Communicator)
    cfg = Config.from_env()
    for key, value in config.items():
        object.__setattr__(cfg, key, value)
    sel = Selector(4, buffer_limits(cfg), list(usable), None, "", cfg.deterministic, nccl_problem)
    comm.__dict__.update(config=cfg, _resolved={}, _selector=sel, _nccl_reason="UBNEXT_ALGO=nccl")
    return comm


def test_select_names_the_path_for_the_other_dtypes_and_refuses_unknown_ones():
    comm = bare_comm()
    assert comm.select(4096, "int32") == "nccl"
    assert comm.select(4096, "bfloat16") != "nccl"
    assert bare_comm(nccl_problem=SHARED).select(4096, "int32") == "twoshot"
    with pytest.raises(KeyError, match="unknown dtype 'complex64'"):
        comm.select(4096, "complex64")


@pytest.mark.parametrize("dtype", OTHERS)
def test_the_barrier_two_shot_named_takes_the_other_dtypes_and_the_other_kernels_refuse(dtype):
    comm = bare_comm()
    for op in ("sum", "max", "min") + (("avg",) if dtype == "float64" else ()):
        assert comm._resolve("all_reduce", "twoshot", 1 << 30, dtype, op) == "twoshot"
        assert comm._resolve("all_reduce", "nccl", 4096, dtype, op) == "nccl"
    for name in ("lamport", "lamport_twoshot", "nvls", "nvls_lamport"):
        with pytest.raises(UbnextError, match=f"algorithm '{name}' (does not reduce {dtype}|cannot take)"):
            comm._resolve("all_reduce", name, 4096, dtype, "sum")


def test_ubnext_algo_naming_a_kernel_leaves_the_dtypes_it_does_not_take_to_auto():
    comm = bare_comm(algorithm="twoshot")
    assert comm._resolve("all_reduce", "auto", 4096, "float32", "sum") == "twoshot"
    assert comm._resolve("all_reduce", "auto", 4096, "uint8", "sum") == "twoshot"
    comm = bare_comm(algorithm="lamport")
    assert comm._resolve("all_reduce", "auto", 4096, "float32", "sum") == "lamport"
    assert comm._resolve("all_reduce", "auto", 4096, "uint8", "sum") == "nccl"


@pytest.mark.parametrize("algorithm", ["auto", "nccl"])
def test_integer_avg_raises_naming_the_op(algorithm):
    with pytest.raises(UbnextError, match=r"all_reduce: op 'avg' takes floating-point dtypes .* not int64; use sum"):
        bare_comm()._resolve("all_reduce", algorithm, 4096, "int64", "avg")


def test_the_fused_call_takes_the_kernels_dtypes_only():
    comm = bare_comm()
    with pytest.raises(UbnextError, match="fused add \\+ RMSNorm takes bfloat16, float16, float32, not float64"):
        comm._resolve("all_reduce_add_rmsnorm", "auto", 4096, "float64", fused=True)
    with pytest.raises(UbnextError, match="not int8"):
        comm.select(4096, "int8", fused=True)


def test_deterministic_mode_takes_float64_to_the_kernel_and_refuses_it_without_one():
    comm = bare_comm(deterministic=True)
    assert comm._resolve("all_reduce", "auto", 4096, "float64", "sum") == "twoshot"  # rank order
    assert comm._resolve("all_reduce", "auto", 4096, "int32", "sum") == "nccl"  # any order: the same bits
    nccl_only = bare_comm(deterministic=True, usable=("nccl",))
    with pytest.raises(UbnextError, match="deterministic mode .* cannot reduce float64 here: "
                                          "this communicator has no ubnext kernels \\(UBNEXT_ALGO=nccl\\)"):
        nccl_only._resolve("all_reduce", "auto", 4096, "float64", "sum")
    assert nccl_only._resolve("all_reduce", "auto", 4096, "int32", "sum") == "nccl"


def test_nccl_enums_cover_every_dtype():
    nccl = pytest.importorskip("cupy.cuda.nccl")
    from ubnext._engine.nccl import _tables

    dtypes, ops = _tables(nccl)
    assert set(dtypes) == set(DTYPES) and set(ops) == set(OPS)
    assert len(set(dtypes.values())) == len(dtypes)
    assert dtypes["int8"] == nccl.NCCL_INT8 and dtypes["float64"] == nccl.NCCL_FLOAT64
    assert dtypes["uint64"] == nccl.NCCL_UINT64


def test_arrays_name_numpy_dtypes_of_every_kind():
    from ubnext._interop import arrays as _arrays

    for name in OTHERS:
        assert _arrays._numpy_name(np.dtype(name), "all_reduce") == name
    with pytest.raises(UbnextError, match="unsupported dtype complex64"):
        _arrays._numpy_name(np.dtype("complex64"), "all_reduce")


# ---- the reference -----------------------------------------------------------------------
def test_integer_sums_wrap_around_in_their_own_type():
    a = [np.array([127, -128, 5], np.int8), np.array([1, -1, 6], np.int8), np.array([1, 0, -3], np.int8)]
    assert reference.integer(a).tolist() == [-127, 127, 8]
    u = [np.array([2**64 - 1, 7], np.uint64), np.array([2, 9], np.uint64)]
    assert reference.integer(u).tolist() == [1, 16]
    assert reference.integer(u, "max").tolist() == [2**64 - 1, 9]
    assert reference.integer(a, "min").tolist() == [1, -128, -3]
    with pytest.raises(ValueError, match="with op 'avg'"):
        reference.integer(a, "avg")


def test_integer_sums_are_the_same_in_every_order():
    rng = np.random.default_rng(1)
    parts = [rng.integers(-2**31, 2**31, 1000, dtype=np.int64).astype(np.int32) for _ in range(5)]
    assert (reference.integer(parts) == reference.integer(parts[::-1])).all()


def test_exact_keeps_float64_precision():
    big = 2.0**40 + 0.5  # not a float32 value
    parts = [np.array([big, -1.5], np.float64), np.array([0.5, 3.0], np.float64)]
    assert reference.exact(parts).tolist() == [big + 0.5, 1.5]
    assert reference.exact(parts, "avg").tolist() == [(big + 0.5) / 2, 0.75]


def test_bits_and_nan_mask_take_every_width():
    assert reference.bits(np.array([-1], np.int8)).tolist() == [255]
    assert reference.bits(np.array([-0.0], np.float64)).tolist() == [1 << 63]
    assert not reference.nan_mask(np.array([-1, 0], np.int64)).any()
    assert reference.nan_mask(np.array([np.nan, np.inf], np.float64)).tolist() == [True, False]
    reference.assert_same_bits(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    with pytest.raises(AssertionError, match="1 of 2 elements differ"):
        reference.assert_same_bits(np.array([3, 4], np.uint32), np.array([3, 5], np.uint32))


def test_the_two_shot_reference_reduces_in_the_accumulator_of_each_dtype():
    assert reference.accumulator(np.dtype(np.float16)) == np.float32
    assert reference.accumulator(reference.DTYPES["bfloat16"]) == np.float32
    for name, dtype in reference.TWOSHOT_ONLY.items():
        assert reference.accumulator(dtype) == dtype, name
    rng = np.random.default_rng(2)
    for name in ("int8", "uint32", "int64"):
        info = np.iinfo(name)
        parts = [rng.integers(info.min, info.max, 1001, dtype=name, endpoint=True) for _ in range(3)]
        for op in ("sum", "max", "min"):  # wraps: the same bits in the kernel's order as in any
            assert (reference.twoshot(parts, op) == reference.integer(parts, op)).all()
    # float64 in double, in the owner's order: rank 0 owns vector 0 (order 0, 1, 2), rank 1
    # vector 1 (order 1, 2, 0); a 1.0 added to -+2**60 first is lost
    big = 2.0**60
    parts = [np.array([big, 1.0, big, 1.0]), np.array([-big, -big, -big, -big]), np.array([1.0, big, 1.0, big])]
    assert reference.twoshot(parts, "sum").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert reference.twoshot(parts, "avg").tolist() == [1 / 3, 0.0, 0.0, 1 / 3]
    zeros = [np.array([-0.0, 1.5]), np.array([-0.0, 2.0])]
    assert reference.bits(reference.twoshot(zeros))[0] == 1 << 63  # nothing cleared
    assert reference.bits(reference.lamport_twoshot(zeros)).tolist() == [0, reference.bits(np.array([3.5]))[0]]
    ints = [np.array([0, -5], np.int32)] * 2
    assert reference.lamport_twoshot(ints).tolist() == [0, -10]  # deterministic mode: integers as they are


class _Local:
    def __init__(self, views):
        self.views = views

    def allgather_obj(self, _mine):
        return self.views


def test_nccl_cannot_run_where_ranks_share_a_gpu_or_lack_the_library(monkeypatch):
    from ubnext._engine import nccl as _nccl

    monkeypatch.setattr(_nccl._devices, "device_uuid", lambda device: f"GPU-{device}")
    assert _nccl.cannot_run(_Local([("GPU-0", None), ("GPU-1", None)]), 0) is None
    assert (_nccl.cannot_run(_Local([("GPU-0", None), ("GPU-1", None), ("GPU-0", None)]), 0)
            == "local ranks 0, 2 share one GPU, which NCCL refuses")
    assert (_nccl.cannot_run(_Local([("GPU-0", None), ("GPU-1", "cupy cannot load the NCCL library")]), 0)
            == "local rank 1: cupy cannot load the NCCL library")


def test_describe_names_the_path_of_every_dtype(monkeypatch):
    from types import SimpleNamespace

    from ubnext._api import report as _report

    monkeypatch.setattr("ubnext._environment.devices.device_name", lambda device: "Fake GPU")
    cfg = Config.from_env()
    for problem, path in ((None, "nccl"), ("local ranks 0, 1 share one GPU, which NCCL refuses", "twoshot")):
        comm = SimpleNamespace(rank=0, size=4, device=0, config=cfg, pool=None, path="kernels", local_rank=0,
                               local_size=4, selector=selector(nccl_problem=problem),
                               algorithms=lambda: list(ALGORITHMS))
        d = _report.report(comm)
        assert set(d["selection"]) == set(DTYPES)
        assert {row[1] for row in d["selection"]["uint64"]} == {path}
        text = str(d)
        assert f"  uint64\n    any size  {path:<8} " in text
        assert "  bfloat16\n       1 KiB  " in text  # the kernels' dtypes by size


def test_a_call_that_needs_nccl_where_nccl_cannot_run_raises_before_any_launch():
    """Ranks sharing a GPU (or a rank without NCCL), known alike on every rank since
    construction: what only NCCL could run raises at once, naming why, instead of failing
    in NCCL's setup (an exchange a rank without the library never reaches)."""
    comm = bare_comm(nccl_problem=SHARED)
    assert comm._resolve("all_reduce", "auto", 4096, "int32", "sum") == "twoshot"
    with pytest.raises(UbnextError, match=f"reduce_scatter of int32 needs NCCL, which cannot run here \\({SHARED}\\)"):
        comm._resolve("reduce_scatter", "auto", 4096, "int32", "sum", collective="reduce_scatter")
    with pytest.raises(UbnextError, match="all_reduce of bfloat16 needs NCCL, which cannot run here"):
        comm._resolve("all_reduce", "nccl", 4096, "bfloat16", "sum")
    assert bare_comm()._resolve("all_reduce", "nccl", 4096, "bfloat16", "sum") == "nccl"
