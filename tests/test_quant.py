"""The quantized all-reduce on the host: its arithmetic (the emulation the GPU tests
compare with bit for bit), its error bound on random and heavy-tailed data, the opt-in
rules, the configuration and the pool layout it needs."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from ubnext._environment.config import Config
from ubnext._memory.heap import plan_layout
from ubnext._protocol import quant as _quant
from ubnext._protocol.errors import UbnextError

NP = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def _data(kind: str, dtype: str, count: int, rank: int) -> np.ndarray:
    """Random inputs: normal, heavy-tailed (Student t with 2 degrees of freedom, like
    activations), or normal with a few 1000x outliers."""
    rng = np.random.default_rng([hash(kind) % 1000, rank, count])
    if kind == "normal":
        x = rng.standard_normal(count)
    elif kind == "heavy":
        x = rng.standard_t(2, count)
    else:
        x = rng.standard_normal(count)
        x[rng.choice(count, max(1, count // 200), replace=False)] *= 1000
    scale = 1.0 if dtype == "bfloat16" else 8.0  # float16: stay in its normal range
    return (x * scale).astype(NP[dtype])


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers"])
@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
@pytest.mark.parametrize("op", list(_quant.OPS))
def test_error_bound_holds(fmt, dtype, kind, nranks, op):
    count = 32 * 257 + 5  # a partial last group
    inputs = [_data(kind, dtype, count, r) for r in range(nranks)]
    got = _quant.all_reduce(inputs, fmt, op)
    assert got.dtype == NP[dtype] and got.shape == (count,)
    errors = _quant.group_errors(inputs, got, op)
    assert errors.max() <= _quant.bound(fmt, dtype, nranks), (errors.max(), _quant.bound(fmt, dtype, nranks))
    assert errors.max() > _quant.FORMATS[fmt].step / 4  # lossy: the bound is not vacuous


def test_bounds_are_the_stated_values():
    assert _quant.bound("int8", "bfloat16", 4) == pytest.approx(2 / 254 + 2**-8, rel=2e-2)
    assert _quant.bound("fp8", "bfloat16", 4) == pytest.approx(2 / 28 + 2**-8, rel=3e-2)
    assert _quant.bound("int4", "bfloat16", 4) == pytest.approx(2 / 14 + 2**-8, rel=5e-2)
    assert _quant.bound("int4", "bfloat16", 4) == pytest.approx(0.152, abs=5e-4)  # docs/quantized.md
    assert _quant.wire_fraction("int8") == _quant.wire_fraction("fp8") == 0.5625
    assert _quant.wire_fraction("int4") == 0.3125 and _quant.bytes_per_element("int4") == 0.625


def test_int8_codes_round_to_nearest_even_and_scale_is_amax_over_127():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]  # scale 1: the codes are rint of the values
    codes, scale = _quant.quantize(x, "int8")
    assert scale[0] == 1.0 and list(codes[0, :4]) == [127.0, 0.0, 2.0, -2.0]
    x[0, 0] = 254.0  # scale 2
    codes, scale = _quant.quantize(x, "int8")
    assert scale[0] == 2.0 and list(codes[0, :4]) == [127.0, 0.0, 1.0, -1.0]


def test_codes_are_the_values_times_the_scales_reciprocal():
    """code = rint(x * fp32(1 / scale)), one product per element (the kernel's), which here
    differs from rint(x / scale): 0.8968256 / scale is the tie 104.5 (even: 104), its product
    with the rounded reciprocal 104.50001 (105). Below fp32's normal range the scale divides."""
    amax, x = np.float32(1.089922), np.float32(0.8968256)
    scale = amax / np.float32(127)
    assert np.float32(x / scale) == 104.5 and np.float32(x * (np.float32(1) / scale)) > 104.5
    group = np.zeros((1, 32), np.float32)
    group[0, :2] = [amax, x]
    codes, got = _quant.quantize(group, "int8")
    assert got[0] == scale and list(codes[0, :2]) == [127.0, 105.0]
    tiny = np.float32(2.0**-149)  # scale 2^-149: its reciprocal overflows, x / scale is exact
    group[0, :2] = [127 * tiny, 3 * tiny]
    codes, got = _quant.quantize(group, "int8")
    assert got[0] == tiny and list(codes[0, :2]) == [127.0, 3.0]
    # scales just below 2^-126, whose reciprocals are finite: the quotient's tie (63.5, -3.5),
    # not the product's (63.499996, -3.4999998), pins where the kernel switches
    for fmt, amax, x, code in (("int8", "0x1.6ep-120", "0x1.6ep-121", 64.0), ("int4", "0x1.08p-124", "-0x1.08p-125", -4.0)):
        group[0, :2] = [float.fromhex(amax), float.fromhex(x)]
        codes, got = _quant.quantize(group, fmt)
        assert got[0] < np.finfo(np.float32).tiny and np.isfinite(np.float32(1) / got[0])
        assert codes[0, 1] == code, (fmt, codes[0, 1])


def test_int4_codes_round_to_nearest_even_within_7_and_scale_is_amax_over_7():
    x = np.zeros((1, 32), np.float32)
    x[0, :7] = [7.0, 0.5, 1.5, -2.5, 3.5, -0.0, -6.5]  # scale 1: the codes are rint of the values
    codes, scale = _quant.quantize(x, "int4")
    assert scale[0] == 1.0 and list(codes[0, :7]) == [7.0, 0.0, 2.0, -2.0, 4.0, 0.0, -6.0]
    assert not np.signbit(codes[0, 5])  # -0.0 is code 0
    x[0, 0] = -14.0  # scale 2; the largest magnitude negative
    codes, scale = _quant.quantize(x, "int4")
    assert scale[0] == 2.0 and list(codes[0, :5]) == [-7.0, 0.0, 1.0, -1.0, 2.0]


def test_int4_clamps_where_the_scale_rounds_down():
    """A scale that rounds down (here to the least subnormal) would put the largest value
    past 7: the clamp keeps its code at 7."""
    tiny = np.float32(2.0**-149)
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [10 * tiny, -3 * tiny]
    codes, scale = _quant.quantize(x, "int4")
    assert scale[0] == tiny and list(codes[0, :2]) == [7.0, -3.0]
    assert list(_quant.dequantize(codes, scale)[0, :2]) == [7 * tiny, -3 * tiny]


def test_fp8_codes_are_e4m3_nearest_even_up_to_448():
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [448.0, 1.0625, 1.1875, -3.0, 2.0**-9]  # scale 1; ties to even
    codes, scale = _quant.quantize(x, "fp8")
    assert scale[0] == 1.0 and list(codes[0, :5]) == [448.0, 1.0, 1.25, -3.0, 2.0**-9]


def test_non_finite_values_poison_their_group_only():
    x = np.ones((3, 32), np.float32)
    x[0, 3], x[1, 7] = np.nan, np.inf
    for fmt in _quant.FORMATS:
        out = _quant.dequantize(*_quant.quantize(x, fmt))
        assert np.isnan(out[:2]).all() and (out[2] == 1.0).all()


def test_zero_groups_and_negative_zero_come_out_as_positive_zero():
    for fmt in _quant.FORMATS:
        for dtype in NP:
            a = np.full(40, -0.0, NP[dtype])
            out = _quant.all_reduce([a, a], fmt)
            assert (out.view(np.uint16) == 0).all()


def test_every_rank_order_of_addition_is_rank_order():
    """The owner adds the dequantized contributions 0, 1, ..., N-1 in fp32: a value that
    cancels first keeps the small ones (another order would lose them)."""
    big, small = 2.0**20, 1.0
    parts = [np.full(32, v, np.float32) for v in (big, -big, small, small)]
    got = _quant.all_reduce([p.astype(NP["bfloat16"]) for p in parts], "int8")
    assert (got.astype(np.float32) == 2.0).all()


@pytest.mark.parametrize("count", [1, 31, 32, 33, 4099])
def test_result_has_the_inputs_shape_and_ignores_the_padding(count):
    a = _data("normal", "bfloat16", count, 0)
    got = _quant.all_reduce([a.reshape(1, count)], "int8")
    assert got.shape == (1, count)


# ---- the reduce-scatter ------------------------------------------------------------------------
def _slices(inputs, r):
    """Slice r of every rank's input (the inputs of rank r's reduce-scatter output)."""
    k = inputs[0].size // len(inputs)
    return [x.reshape(-1)[r * k:(r + 1) * k] for x in inputs]


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers"])
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("op", list(_quant.OPS))
def test_reduce_scatter_error_bound_holds(fmt, dtype, kind, nranks, op):
    """Each rank's k elements are within the reduce-scatter's bound of the exact reduction
    of its slice (one quantization, no requantization: a smaller bound than the
    all-reduce's), and the bound is not vacuous."""
    k = 32 * 129 + 7  # slices of a partial last group, so slices do not start on the message's groups
    inputs = [_data(kind, dtype, nranks * k, r) for r in range(nranks)]
    outs = _quant.reduce_scatter(inputs, fmt, op)
    assert len(outs) == nranks
    limit = _quant.bound(fmt, dtype, nranks, "reduce_scatter")
    assert limit < _quant.bound(fmt, dtype, nranks)
    worst = 0.0
    for r, got in enumerate(outs):
        assert got.dtype == NP[dtype] and got.shape == (k,)
        worst = max(worst, _quant.group_errors(_slices(inputs, r), got, op).max())
    assert worst <= limit, (worst, limit)
    assert worst > _quant.FORMATS[fmt].step / 4


def test_reduce_scatter_bounds_are_the_stated_values():
    """docs/quantized.md: about 0.0079 (int8), 0.040 (fp8) and 0.076 (int4) for bfloat16 at 4 ranks."""
    got = {f: _quant.bound(f, "bfloat16", 4, "reduce_scatter") for f in _quant.FORMATS}
    assert got["int8"] == pytest.approx(0.0079, abs=5e-5) and got["fp8"] == pytest.approx(0.040, abs=5e-4)
    assert got["int4"] == pytest.approx(0.076, abs=5e-4)


def _written_out_reduce_scatter(inputs, r: int, qmax: int) -> np.ndarray:
    """Rank r's output of the integer-format reduce-scatter written out element by element in
    fp32, in the kernel's order, without the emulation's code: slice r of each rank's input
    in groups of 32 from the slice's first element; per group the scale amax / qmax, the
    codes rint(x * (1 / scale)) clamped to +-qmax, integers (a code of -0 is 0), dequantized
    as code * scale; the ranks' values added in rank order; one rounding to the dtype.
    (Normal scales only.)"""
    f32 = np.float32
    k = inputs[0].size // len(inputs)
    out = []
    for start in range(0, k, 32):
        acc = None
        for x in inputs:
            group = [f32(v) for v in x[r * k + start:r * k + min(start + 32, k)]]
            scale = f32(max(abs(v) for v in group) / f32(qmax))
            assert scale >= f32(2.0**-126)
            inv = f32(f32(1) / scale)
            values = [f32(f32(min(max(int(np.rint(f32(v * inv))), -qmax), qmax)) * scale) for v in group]
            acc = values if acc is None else [f32(a + v) for a, v in zip(acc, values)]
        out += acc
    return np.array(out, np.float32).astype(inputs[0].dtype)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_reduce_scatter_groups_each_slice_from_its_start(n, fmt, qmax):
    """A group never spans two slices: rank r's output depends on slice r of the inputs only,
    and a slice's first group starts at its first element (k = 33: the second slice starts
    one element into the message's second group); each rank's output is its written-out
    reference bit for bit. At 4 ranks, ranks 0 and 1 cancel at 2^30 times the others'
    magnitude, so the order of the additions shows (any other order loses ranks 2 and 3)."""
    k = 33
    inputs = [_data("normal", "bfloat16", n * k, r) for r in range(n)]
    if n == 4:
        inputs[0] = (inputs[0].astype(np.float32) * 2.0**30).astype(NP["bfloat16"])
        inputs[1] = -inputs[0]
    changed = [x.copy() for x in inputs]
    changed[0][:k] = (changed[0][:k].astype(np.float32) * 100).astype(NP["bfloat16"])  # slice 0 of rank 0
    a, b = _quant.reduce_scatter(inputs, fmt), _quant.reduce_scatter(changed, fmt)
    assert all((a[r].view(np.uint16) == b[r].view(np.uint16)).all() for r in range(1, n)) and not (a[0] == b[0]).all()
    for r in range(n):
        want = _written_out_reduce_scatter(inputs, r, qmax)
        assert (a[r].view(np.uint16) == want.view(np.uint16)).all(), r


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_reduce_scatter_is_exact_where_every_code_is(fmt, qmax):
    """Integer inputs whose every group holds +-qmax have scale 1 and exact codes: the
    reduce-scatter then returns the exact sums (float16 holds them), which the all-reduce's
    second quantization would not (its sums reach beyond qmax)."""
    n, k = 4, 32 * 40 + 11
    rng = np.random.default_rng(5)
    inputs = []
    for _ in range(n):
        x = rng.integers(-qmax, qmax + 1, n * k).astype(np.float32)
        for r in range(n):  # +-qmax in every group of every slice
            x[r * k:(r + 1) * k:32] = qmax * rng.choice([-1, 1], -(-k // 32))
        inputs.append(x.astype(np.float16))
    outs = _quant.reduce_scatter(inputs, fmt)
    for r in range(n):
        want = np.sum([x.astype(np.float64) for x in _slices(inputs, r)], axis=0)
        assert (outs[r].astype(np.float64) == want).all()
    assert not (np.concatenate(outs) == _quant.all_reduce(inputs, fmt)).all()


def test_reduce_scatter_adds_in_rank_order_and_avg_divides_once():
    big, small = 2.0**20, 1.0
    parts = [np.full(64, v, np.float32).astype(NP["bfloat16"]) for v in (big, -big, small, small)]
    for got in _quant.reduce_scatter(parts, "int8"):
        assert (got.astype(np.float32) == 2.0).all()
    for got in _quant.reduce_scatter(parts, "int8", "avg"):
        assert (got.astype(np.float32) == 0.5).all()


def test_reduce_scatter_specials():
    """A group holding a NaN or infinity comes out NaN (its slice's group only); zeros of
    either sign as +0.0."""
    x = np.ones(2 * 64, np.float32)
    x[3], x[64 + 40] = np.nan, np.inf  # slice 0 group 0, slice 1 group 1
    zeros = np.full(2 * 64, -0.0, np.float32)
    for fmt in _quant.FORMATS:
        a, b = _quant.reduce_scatter([x.astype(NP["bfloat16"]), np.ones(128, NP["bfloat16"])], fmt)
        assert np.isnan(a[:32].astype(np.float32)).all() and (a[32:].astype(np.float32) == 2).all()
        assert (b[:32].astype(np.float32) == 2).all() and np.isnan(b[32:].astype(np.float32)).all()
        for out in _quant.reduce_scatter([zeros.astype(NP["float16"])] * 2, fmt):
            assert (out.view(np.uint16) == 0).all()


BIG = 1.5 * 2.0**127  # a bfloat16 value; two of them overflow fp32


def _overflow_groups(nranks: int) -> list[np.ndarray]:
    """Every rank's bfloat16 input of 2 slices x 3 groups: a group whose element 0 is BIG on
    every rank (its sum overflows to +inf), one whose element 5 is -BIG (-inf), one of small
    integers (finite); the second slice the same groups in another order."""
    out = []
    for r in range(nranks):
        g = np.tile(np.arange(1, 33, dtype=np.float32) * (r + 1), (3, 1))
        g[0, 0], g[1, 5] = BIG, -BIG
        out.append(np.concatenate([g[[0, 1, 2]].reshape(-1), g[[2, 0, 1]].reshape(-1)]).astype(NP["bfloat16"]))
    return out


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
@pytest.mark.parametrize("op", list(_quant.OPS))
def test_an_overflowing_sum_turns_its_group_nan_in_both_collectives(fmt, op):
    """The overflow rule: a group whose fp32 sum overflows comes out NaN, every element of it,
    in the all-reduce and in the reduce-scatter alike; the other groups stay finite within
    the bound."""
    inputs = _overflow_groups(2)
    nan_groups = np.array([True, True, False, False, True, True])  # the groups of the whole message
    ar = _quant.all_reduce(inputs, fmt, op).astype(np.float32).reshape(6, 32)
    rs = np.concatenate(_quant.reduce_scatter(inputs, fmt, op)).astype(np.float32).reshape(6, 32)
    for got in (ar, rs):
        assert np.isnan(got[nan_groups]).all() and np.isfinite(got[~nan_groups]).all()
    finite = [x.reshape(6, 32)[~nan_groups] for x in inputs]
    assert _quant.group_errors(finite, ar[~nan_groups], op).max() <= _quant.bound(fmt, "bfloat16", 2)


def test_an_overflow_in_rank_order_counts_even_where_the_exact_sum_is_finite():
    """BIG + BIG - BIG: the exact sum is BIG, the fp32 sum in rank order overflows first."""
    parts = [np.full(64, v, np.float32).astype(NP["bfloat16"]) for v in (BIG, BIG, -BIG)]
    parts = [np.concatenate([p, p[:32]]) for p in parts]  # 3 slices of 32
    for fmt in _quant.FORMATS:
        assert np.isnan(_quant.all_reduce(parts, fmt).astype(np.float32)).all()
        assert all(np.isnan(o.astype(np.float32)).all() for o in _quant.reduce_scatter(parts, fmt))


def test_a_finite_sum_past_float16s_range_is_inf_in_that_element_only():
    """float16: the fp32 sum of 40000 + 40000 is finite; rounded to float16 it is +inf, the
    group's other elements stay finite, in both collectives."""
    x = np.ones(64, np.float16)
    x[0] = x[32 + 7] = 40000
    for fmt in _quant.FORMATS:
        for got in (_quant.all_reduce([x, x], fmt), np.concatenate(_quant.reduce_scatter([x, x], fmt))):
            got = got.astype(np.float32)
            assert got[0] == got[32 + 7] == np.inf
            assert np.isfinite(np.delete(got, [0, 32 + 7])).all()


def test_reduce_scatter_takes_whole_slices():
    with pytest.raises(ValueError, match="not 4 slices"):
        _quant.reduce_scatter([np.ones(10, NP["bfloat16"])] * 4, "int8")


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5, 8])
def test_reduce_scatter_launches_take_whole_units_of_every_slice_and_fit_the_slots(nranks):
    chunk = _quant.slice_launch_elems(nranks)
    assert chunk > 0 and chunk % _quant.UNIT == 0 and nranks * chunk * 2 <= _quant.LAUNCH_BYTES
    for fmt in _quant.FORMATS:
        assert nranks * (chunk // _quant.UNIT) * _quant.record_bytes(fmt) <= _quant.slots_bytes(nranks)


# ---- opt-in -------------------------------------------------------------------------------
MiB = 1 << 20


def _choose(precision="auto", algorithm="auto", dtype="bfloat16", op="sum", nbytes=16 * MiB, threshold=16 * MiB,
            setting="int8", kernels=True, arch=90):
    return _quant.choose("all_reduce", precision, algorithm, dtype, op, nbytes, threshold, setting, kernels,
                         lambda: arch)


def test_auto_never_quantizes_without_the_opt_in():
    for dtype in ("bfloat16", "float16", "float32"):
        for op in ("sum", "avg", "max"):
            assert _choose(setting="off", dtype=dtype, op=op) is None


def test_auto_quantizes_what_it_takes_once_opted_in():
    assert _choose() == "int8" and _choose(setting="fp8", dtype="float16", op="avg") == "fp8"
    # full precision for everything else
    assert _choose(dtype="float32") is None and _choose(op="max") is None
    assert _choose(algorithm="twoshot") is None and _choose(kernels=False) is None
    assert _choose(precision="exact") is None


def test_auto_quantizes_only_from_the_measured_threshold():
    """Below the selector table's threshold, or where it has none (never pays, not
    measured, one rank: ``Selector.quantized``), auto keeps full precision; a format named
    per call still runs at any size."""
    assert _choose(nbytes=16 * MiB - 2) is None and _choose(threshold=None, nbytes=1 << 30) is None
    assert _choose(nbytes=1 << 30) == "int8" and _choose(threshold=64, nbytes=64) == "int8"
    assert _choose(precision="int8", nbytes=64, threshold=None) == "int8"


def test_a_format_per_call_needs_the_opt_in_and_a_call_it_takes():
    assert _choose(precision="fp8") == "fp8" and _choose(precision="int8", setting="fp8") == "int8"
    for kwargs, words in (({"setting": "off"}, "UBNEXT_QUANTIZED"), ({"dtype": "float32"}, "float32"),
                          ({"op": "max"}, "'max'"), ({"algorithm": "lamport"}, "algorithm='auto'"),
                          ({"kernels": False}, "NCCL only")):
        with pytest.raises(UbnextError, match=words):
            _choose(precision="int8", **kwargs)


def test_fp8_needs_sm89_and_unknown_precisions_raise():
    with pytest.raises(UbnextError, match="8.9"):
        _choose(precision="fp8", arch=80)
    with pytest.raises(UbnextError, match="8.9"):
        _choose(setting="fp8", arch=80)
    assert _choose(precision="int8", arch=80) == "int8"
    assert _choose(precision="int4", arch=80) == "int4" and _choose(setting="int4") == "int4"
    with pytest.raises(UbnextError, match="unknown precision"):
        _choose(precision="int2")


def test_describe_says_whether_auto_quantizes():
    start = (64 * MiB, "from 64 MiB (2 ranks bfloat16 (quantized, tune file t.json: GPU nvlink plain graph))")
    note = _quant.selection_note
    assert note("off", True, "bfloat16", 1 << 30, start) == note("int8", True, "float32", 1 << 30, start) == ""
    assert note("int8", False, "bfloat16", 1 << 30, start) == ""
    assert note("fp8", True, "float16", 64 * MiB, start) == (
        "; sum and avg run the quantized two-shot in fp8 instead (fp8 " + start[1] + ")")
    assert note("fp8", True, "float16", 16 * MiB, start) == "; sum and avg too (fp8 " + start[1] + ")"
    assert note("int8", True, "bfloat16", 1 << 30, (None, "never: not measured for 4 ranks")) == (
        "; sum and avg too (int8 never: not measured for 4 ranks)")
    assert note("int8", True, "bfloat16", 64 * MiB, start, "reduce_scatter") == (
        "; sum and avg run the quantized reduce-scatter in int8 instead (int8 " + start[1] + ")")
    rs = (None, "never: not measured for 2 ranks (no selector table has quantized reduce_scatter thresholds")
    starts = {"all_reduce": {"bfloat16": start, "float16": (None, "never (measured not to pay: x)")},
              "reduce_scatter": {"bfloat16": rs, "float16": rs}}
    assert "auto never quantizes" in _quant.describe("off", True, {})
    assert "NCCL only" in _quant.describe("int8", False, starts)
    text = _quant.describe("int4", True, starts)
    assert text.startswith("int4: auto reduces sum/avg in the quantized two-shot where the selector table says it "
                           "pays: bfloat16 from 64 MiB (2 ranks bfloat16 (quantized, tune file t.json: GPU nvlink "
                           "plain graph)); float16 never (measured not to pay: x); reduce-scatters where it says so "
                           f"for them: bfloat16 {rs[1]}; float16 {rs[1]} (31% of the bytes; error <= 0.1524 x the "
                           "group's magnitude for bfloat16, 0.0756 in a reduce-scatter)"), text
    assert "UBNEXT_QUANTIZED=int8|fp8|int4" in _quant.describe("off", True, {})


def test_formats_carry_their_own_signatures():
    from ubnext._protocol import signature as _signature

    sig = _signature.encode("all_reduce", "bfloat16", "sum", 4099)
    tagged = {fmt: _quant.signature(sig, fmt) for fmt in _quant.FORMATS}
    assert len({sig, *tagged.values()}) == 1 + len(_quant.FORMATS) and all(t & 0xFFFF == 4099 for t in tagged.values())
    assert all(t >> _signature.COUNT_BITS == sig >> _signature.COUNT_BITS for t in tagged.values())


# ---- configuration and layout ----------------------------------------------------------------
def test_config_opt_in(monkeypatch):
    assert Config().quantized == "off"
    monkeypatch.setenv("UBNEXT_QUANTIZED", "INT8")
    assert Config.from_env().quantized == "int8"
    assert Config(quantized="int4").quantized == "int4"
    with pytest.raises(ValueError, match="UBNEXT_QUANTIZED"):
        Config(quantized="int2")


def test_pool_reserves_the_areas_only_when_opted_in():
    off = plan_layout(4, 1 << 20, 1 << 20, 1 << 20, _quant.quant_area_bytes(4, "off"))
    on = plan_layout(4, 1 << 20, 1 << 20, 1 << 20, _quant.quant_area_bytes(4, "int8"))
    assert off.nbytes("quant") == 0 and on.nbytes("quant") == _quant.slots_bytes(4) + _quant.gather_bytes(4)
    assert on.nbytes("quant") == 18 * 2**20 + 18 * 2**20 // 4  # 22.5 MiB at 4 ranks (docs, Config)
    assert on.offset("quant") % 128 == 0 and on.offset("flags.quant") % 16 == 0  # records on whole lines
    assert "quant.state" in on
    # any opt-in reserves room for every format (precision= picks one per call): int8's
    assert _quant.quant_area_bytes(4, "int4") == _quant.quant_area_bytes(4, "fp8") == on.nbytes("quant")


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
def test_areas_hold_every_launch_its_gather_area_apart_from_every_launchs_slots(nranks):
    """Every launch up to LAUNCH_BYTES in every format fits the areas (kernels/quant_twoshot.cu:
    QuantAreas: N slots of S unit records, then an all-gather area of the S records of the
    rank's own slice from slots_bytes), its records on whole 128-byte lines. The all-gather
    area starts where the slots of the largest launch in the largest format end: a peer's
    next launch, of any size and format, fills this rank's slots while other ranks may
    still load that area."""
    slots, gather = _quant.slots_bytes(nranks), _quant.gather_bytes(nranks)
    assert slots % 128 == 0 and _quant.quant_area_bytes(nranks, "int8") == slots + gather
    assert gather * nranks == slots  # the largest launch's own slice: its S records
    for fmt in _quant.FORMATS:
        assert _quant.record_bytes(fmt) % 128 == 0
        assert _quant.record_bytes(fmt) == _quant.UNIT * _quant.bytes_per_element(fmt)
        for count in (1, 33, 4099, _quant.LAUNCH_BYTES // 2 - 7, _quant.LAUNCH_BYTES // 2):
            own = -(-_quant.units(count) // nranks) * _quant.record_bytes(fmt)  # S records
            assert nranks * own <= slots and own <= gather  # the slots end before the all-gather area
    big = nranks * -(-_quant.units(_quant.LAUNCH_BYTES // 2) // nranks) * _quant.record_bytes("int8")
    assert big == slots  # no room wasted: the largest launch fills the slots


# ---- benchmark option ----------------------------------------------------------------------
def test_all_reduce_perf_takes_a_precision():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed
    from bench import all_reduce_perf as arp

    assert arp.parse_args(["-d", "bfloat16", "--precision", "int8"]).precision == "int8"
    assert arp.parse_args(["-d", "half", "--precision", "int4"]).precision == "int4"
    assert arp.parse_args([]).precision == "auto"
    for argv in (["-d", "float", "--precision", "int8"], ["-d", "bf16", "-o", "max", "--precision", "fp8"],
                 ["-d", "bf16", "--backend", "nccl", "--precision", "int8"]):
        with pytest.raises(SystemExit):
            arp.parse_args(argv)


def test_reduce_scatter_perf_takes_a_precision_and_all_gather_perf_none():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed
    from bench import _sliced_perf
    from bench import all_reduce_perf as arp

    rs, ag = _sliced_perf.REDUCE_SCATTER_PERF, _sliced_perf.ALL_GATHER_PERF
    assert arp.parse_args(["-d", "bfloat16", "--precision", "int4"], rs).precision == "int4"
    assert arp.parse_args(["-d", "half", "-o", "avg", "--precision", "fp8"], rs).precision == "fp8"
    for argv, program in ((["-d", "float", "--precision", "int8"], rs), (["-d", "bf16", "--algo", "twoshot",
                                                                          "--precision", "int8"], rs),
                          (["-d", "bf16", "--backend", "nccl", "--precision", "int8"], rs),
                          (["-d", "bf16", "--precision", "int8"], ag)):
        with pytest.raises(SystemExit):
            arp.parse_args(argv, program)
    assert arp.parse_args(["-d", "bf16", "--precision", "exact"], ag).precision == "exact"


def test_reduce_scatter_perf_checks_the_quantized_result_bit_for_bit(monkeypatch, capsys):
    """On the fake GPU, an engine that stores the emulation's slice counts no wrong element,
    and one that stores the exact sums (what a full-precision kernel would) counts them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_fakes as fakes

    from bench import _sliced_perf
    from bench import all_reduce_perf as arp

    fakes.install(monkeypatch)
    import cupy  # the fake

    class Quantized(fakes.ReduceEngine):
        def __init__(self, bootstrap, fmt):
            super().__init__(bootstrap)
            self.fmt = fmt

        def reduce_scatter(self, send, recv, dtype, op, stream):
            def work():
                inputs = self.bootstrap.allgather_obj(send.host.copy())
                recv.host[...] = _quant.reduce_scatter(inputs, self.fmt, op)[self.bootstrap.rank]
            stream.enqueue(work)

    program = _sliced_perf.REDUCE_SCATTER_PERF
    argv = ["-b", "64", "-e", "64K", "-f", "32", "-d", "bfloat16", "-n", "1", "-w", "1", "--precision", "int4"]
    args = arp.parse_args(argv, program)
    boot = fakes.Bootstrap()
    for engine, wrong in ((Quantized(boot, "int4"), False), (fakes.ReduceEngine(boot), True)):
        world = arp.World(fakes.Comm(boot), engine, cupy.cuda.Stream(),
                          lambda count, dtype: cupy.empty((count,), dtype.numpy), ["# Buffers: fake"],
                          collective=program.collective)
        assert arp.run(args, world, argv) == int(wrong)
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
        assert rows and all((r[8] != "0") == wrong for r in rows), rows


def test_all_reduce_perf_flags_in_place_quantized_rows_whose_data_reached_inf(monkeypatch, capsys, tmp_path):
    """A quantized in-place timing whose data turned non-finite (an engine that stores the
    emulation, then inf in a call in place after one in place: the timed calls, not the
    check; as a sum at N ranks reaches after about 128 / log2(N) calls) ends its row with '*',
    sets non_finite_data in its JSON record
    and prints the note; out of place, and in place on data that stays finite, nothing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_fakes as fakes

    from bench import all_reduce_perf as arp

    fakes.install(monkeypatch)
    import cupy  # the fake

    class Quantized(fakes.ReduceEngine):
        def __init__(self, bootstrap, overflows):
            super().__init__(bootstrap)
            self.overflows, self.in_place = overflows, False

        def all_reduce(self, send, recv, dtype, op, stream):
            def work():
                in_place, after_in_place = np.shares_memory(send.host, recv.host), self.in_place
                self.in_place = in_place
                recv.host[...] = _quant.all_reduce([send.host.copy()], "int8", op)
                if in_place and after_in_place and self.overflows:
                    recv.host[0] = np.inf
            stream.enqueue(work)

    for overflows in (True, False):
        argv = ["-b", "64", "-e", "4K", "-f", "8", "-d", "bfloat16", "-n", "2", "-w", "1", "--precision", "int8",
                "-J", str(tmp_path / f"{overflows}.json")]
        args = arp.parse_args(argv)
        boot = fakes.Bootstrap()
        world = arp.World(fakes.Comm(boot), Quantized(boot, overflows), cupy.cuda.Stream(),
                          lambda count, dtype: cupy.empty((count,), dtype.numpy), ["# Buffers: fake"])
        assert arp.run(args, world, argv) == 0
        out = capsys.readouterr().out
        rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
        assert rows and all((r[-1] == arp.NON_FINITE_MARK) == overflows for r in rows), rows
        assert all(r[8] == "0" and r[-1 - overflows] == "0" for r in rows), rows  # checked bit for bit
        assert (arp.NON_FINITE_NOTE in out) == overflows
        records = json.loads((tmp_path / f"{overflows}.json").read_text())["results"]
        assert all(r["in_place"].get("non_finite_data", False) == overflows for r in records)
        assert not any("non_finite_data" in r["out_of_place"] for r in records)


def test_quant_error_script_writes_its_table(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import quant_error

    assert quant_error.main(["--count", "8192", "--ranks", "2", "--outdir", str(tmp_path)]) == 0
    text = (tmp_path / "quant_error.txt").read_text()
    assert "rows whose maximum exceeds the bound: 0" in text and "56.2% of bfloat16's" in text
    assert "int4: 0.625 bytes per element" in text and "31.2% of bfloat16's" in text
    assert "rs median    rs max  rs bound" in text  # the reduce-scatter's columns, checked against its bound
    assert "rel2   rs rel2 exact rel2" in text  # relative to the result: each collective's and the exact path's
    assert (tmp_path / "quant_error.png").stat().st_size > 0 and (tmp_path / "quant_error.json").is_file()
    rows = json.loads((tmp_path / "quant_error.json").read_text())["rows"]
    int8 = [r for r in rows if r["format"] == "int8" and r["data"] == "normal"]
    assert all(r["exact_path_rel2"] < r["rs_rel2"] < r["rel2"] < 0.02 for r in int8), int8
    # ||result - exact|| / ||exact||: 3-4-5 by hand
    inputs = [np.array([1.0, 4.0], np.float32), np.array([2.0, 0.0], np.float32)]
    assert quant_error.relative_2norm(inputs, np.array([3.0, 4.0])) == 0.0
    assert quant_error.relative_2norm(inputs, np.array([0.0, 0.0])) == 1.0
    assert quant_error.relative_2norm(inputs, np.array([3.0, 1.0])) == pytest.approx(0.6)


@pytest.mark.parametrize("setting", ["off", "int8"])
def test_describe_report_shows_the_opt_in(monkeypatch, setting):
    """Per size, the report says whether sums and averages run quantized and why: with the
    shipped table never where it has no thresholds (8 ranks; a GPU not measured), from its
    H100 entry's on that machine; with a tune file's threshold from that size, naming the
    file's entry."""
    import types

    from ubnext._api import report as _report
    from ubnext._selection.select import Selector, buffer_limits
    from ubnext._selection.table import Machine
    from ubnext._selection.table_format import parse_table

    H100 = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr("ubnext._environment.devices.device_name", lambda device: "fake")
    cfg = Config(quantized=setting)
    names = ["lamport", "lamport_twoshot", "twoshot", "nccl"]
    tuned = parse_table({"format": 2, "entries": [
        {"gpu": "*", "link": "*", "placement": "*", "mode": "*", "tables": {"64": {"bfloat16": [[None, "nccl"]]}},
         "quantized": {"tables": {"4": {"bfloat16": {"int8": 64 * MiB}}},
                       "collectives": {"reduce_scatter": {"tables": {"4": {"bfloat16": {"int8": 16 * MiB}}}}}}}]},
        "tune file t.json")

    def describe(table, size=4, machine=Machine(H100)):
        comm = types.SimpleNamespace(config=cfg, rank=0, size=size, local_rank=0, local_size=size, device=0,
                                     path="kernels on the symmetric pool", algorithms=lambda: names, pool=None,
                                     nvls=None, selector=Selector(size, buffer_limits(cfg), names, table,
                                                                  machine=machine))
        return _report.report(comm)

    d = describe(None, size=8)  # the shipped table has no thresholds for 8 ranks
    assert d["config"]["UBNEXT_QUANTIZED"] == setting
    assert f"quantized all-reduce and reduce-scatter: {d['quantized']}" in str(d)
    whys = [why for _, _, why in d["selection"]["bfloat16"]]
    assert not any("quantized two-shot" in why for why in whys)
    assert not any("sum and avg" in why for _, _, why in d["selection"]["float32"])
    if setting == "off":
        assert d["quantized"] == _quant.describe("off", True, {}) and not any("sum and avg" in w for w in whys)
        return
    never = f"int8 never: not measured for 8 ranks on {H100} nvlink plain graph (no selector table has quantized " \
            "thresholds for them"
    assert f"bfloat16 {never[5:]}" in d["quantized"] and all(never in why for why in whys)
    shipped = describe(None)["quantized"]  # the H100 entry's thresholds, measured at 4 ranks
    assert f"bfloat16 from 16 MiB (4 ranks bfloat16 (quantized, default table: {H100} nvlink plain graph))" \
        in shipped, shipped
    # a GPU the shipped table has no thresholds for (its rows from the nearest entry): never, at every size
    elsewhere = describe(None, machine=Machine("NVIDIA B200"))["quantized"]
    rs_never = ("int8 never: not measured for 4 ranks on NVIDIA B200 nvlink plain graph (no selector table has "
                "quantized reduce_scatter thresholds")
    assert f"reduce-scatters where it says so for them: bfloat16 {rs_never[5:]}" in elsewhere, elsewhere
    assert not any("quantized" in why for _, _, why in d["collectives"]["all_gather"]["bfloat16"])
    d = describe(tuned)
    assert "bfloat16 from 64 MiB (4 ranks bfloat16 (quantized, tune file t.json: any machine))" in d["quantized"]
    for nbytes, _, why in d["selection"]["float16"]:
        quantized = "sum and avg run the quantized two-shot in int8 instead (int8 from 64 MiB (4 ranks bfloat16 " \
                    "(no float16 rows) (quantized, tune file t.json: any machine)))"
        assert (quantized in why) == (nbytes >= 64 * MiB), (nbytes, why)
    for nbytes, _, why in d["collectives"]["reduce_scatter"]["bfloat16"]:
        quantized = "sum and avg run the quantized reduce-scatter in int8 instead (int8 from 16 MiB (4 ranks " \
                    "bfloat16 (quantized reduce_scatter, tune file t.json: any machine)))"
        assert (quantized in why) == (nbytes >= 16 * MiB), (nbytes, why)
