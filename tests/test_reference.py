"""CPU tests of the host reference (ubnext/_tools/reference.py) that the GPU tests compare with bit
for bit: its roundings are the IEEE ones, its results agree with fp64 within the
roundings the kernels make, its orders are the kernels' (and different from each other
where that matters), and its checker catches planted kernel mutations."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from ubnext._tools import reference as ref

DTYPES = tuple(ref.DTYPES)
OPS = ("sum", "avg", "max", "min")
F32 = np.float32


def random_inputs(nranks, count, dtype, seed, specials=True):
    """Random normal inputs of every rank; with specials: -0.0 at every 9th element on
    every rank and at a rank-dependent 5th, +inf / NaN / -inf at elements 3, 4, 6 (NaN and
    inf+(-inf) where the ranks allow), an order probe at every 512th from element 7."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(nranks):
        x = rng.standard_normal(count).astype(np.float32)
        if specials:
            x[1::9] = -0.0
            x[(2 + r)::5] = -0.0
            if count > 6:
                x[3] = np.inf if r == 0 else x[3]
                x[4] = np.nan if r == nranks - 1 else x[4]
                x[6] = -np.inf if r == nranks - 1 else np.inf
            x[7::512] = ref.order_probe(dtype, r)
        out.append(x.astype(ref.DTYPES[dtype]))
    return out


def round_f32(q: Fraction) -> np.float32:
    """The exact rational ``q`` rounded to nearest even fp32 (subnormals, overflow to inf)."""
    if q == 0:
        return F32(0)
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    m = q / quantum
    n = m.numerator // m.denominator
    rest = m - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    value = n * quantum
    return F32(sign * np.inf) if value >= 2**128 else F32(sign * float(value))


def exact_fma(a, b, c) -> np.float32:
    return round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def ulp(x: np.ndarray, dtype) -> np.ndarray:
    """The spacing of ``dtype`` at |x| (fp64)."""
    info = ml_dtypes.finfo(ref.DTYPES[dtype])
    e = np.floor(np.log2(np.maximum(np.abs(x), float(info.smallest_normal))))
    return 2.0 ** (e - info.nmant)


# ---- roundings -----------------------------------------------------------------------------
def test_rounding_to_bfloat16_is_to_nearest_even():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    u[:4096] = (u[:4096] & 0xFFFF0000) | 0x8000  # exact ties
    u[4096:8192] = (u[4096:8192] & 0xFFFF0000) | 0x7FFF
    f = u.view(np.float32)
    finite = np.isfinite(f)
    want = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # RNE on the bits
    got = ref.bits(ref.narrow(f, ref.DTYPES["bfloat16"]))
    assert np.array_equal(got[finite], want[finite])
    assert ref.nan_mask(ref.narrow(f[np.isnan(f)], ref.DTYPES["bfloat16"])).all()


@pytest.mark.parametrize("value, want", [
    (1 + 2.0**-11, 1.0), (1 + 3 * 2.0**-11, 1 + 2.0**-9), (1 + 2.0**-11 + 2.0**-20, 1 + 2.0**-10),
    (65519.0, 65504.0), (65520.0, np.inf), (-65520.0, -np.inf), (2.0**-25, 0.0), (3 * 2.0**-26, 2.0**-24),
])
def test_rounding_to_float16_is_to_nearest_even(value, want):
    got = ref.narrow(np.array([value], np.float32), ref.DTYPES["float16"])
    assert ref.bits(got)[0] == ref.bits(np.array([want], np.float16))[0]


def test_fma32_rounds_once():
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(3000).astype(np.float32) * F32(2.0) ** rng.integers(-30, 30, 3000).astype(np.float32)
               for _ in range(3))
    c[:1000] = -(a[:1000].astype(np.float64) * b[:1000]).astype(np.float32)  # cancellation
    got = ref.fma32(a, b, c)
    want = np.array([exact_fma(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(ref.bits(got), ref.bits(want))
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a midpoint between two floats; + 2^-80 lies just
    # above it: rounding the fp64 sum to fp32 (two roundings) would give the even neighbour
    a1, c1 = np.array([1 + 2.0**-12], np.float32), np.array([2.0**-80], np.float32)
    assert ref.fma32(a1, a1, c1)[0] == F32(1 + 2.0**-11 + 2.0**-23) == exact_fma(a1[0], a1[0], c1[0])
    assert (a1.astype(np.float64) ** 2 + c1.astype(np.float64)).astype(np.float32)[0] == F32(1 + 2.0**-11)
    assert np.isnan(ref.fma32(np.array([np.inf], np.float32), np.array([0], np.float32), F32(1)))[0]
    assert ref.fma32(np.array([np.inf], np.float32), F32(2), F32(-1))[0] == np.inf


def test_rms_scale_rounds_every_step():
    """1 / sqrt(sumsq / hidden + eps) with each step correctly rounded: the fp64 results
    of a square root and a quotient of fp32 values round to the same fp32 (53 >= 2*24+2)."""
    rng = np.random.default_rng(2)
    sumsq = (rng.random(5000) * 1e4).astype(np.float32)
    for hidden, eps in ((4096, 1e-6), (12288, 1e-5), (100, 0.0)):
        mean = (sumsq.astype(np.float64) / hidden).astype(np.float32)
        y = (mean.astype(np.float64) + float(F32(eps))).astype(np.float32)
        root = np.sqrt(y.astype(np.float64)).astype(np.float32)
        want = (1.0 / root.astype(np.float64)).astype(np.float32)
        assert np.array_equal(ref.rms_scale(sumsq, hidden, eps), want)


# ---- all-reduce ---------------------------------------------------------------------------
def fp64_reduce(inputs, op):
    f = [x.astype(np.float64) for x in inputs]
    acc = f[0]
    with np.errstate(invalid="ignore"):
        for x in f[1:]:
            acc = acc + x if op in ("sum", "avg") else (np.fmax if op == "max" else np.fmin)(acc, x)
    return acc / len(f) if op == "avg" else acc


@pytest.mark.parametrize("algorithm", list(ref.ALL_REDUCE))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
def test_all_reduce_agrees_with_fp64(algorithm, dtype, op, nranks):
    """Within the kernels' roundings of fp64: N - 1 fp32 steps and one to the dtype (max
    and min: none); NaN and inf where fp64 has them."""
    inputs = random_inputs(nranks, 20_011, dtype, seed=nranks)
    got = ref.all_reduce(algorithm, inputs, op).astype(np.float64)
    want = fp64_reduce(inputs, op)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite])
    if op in ("max", "min"):
        assert err.max() == 0
    else:
        scale = sum(np.abs(x.astype(np.float64)) for x in inputs)[finite] / (nranks if op == "avg" else 1)
        bound = ulp(want[finite], dtype) + nranks * 2.0**-24 * scale
        assert (err <= bound).all(), f"worst {(err / bound).max():.2f} of the bound"


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_is_pushed_as_positive_zero_by_the_lamport_kernels_only(dtype):
    """-0.0 on every rank: the Lamport kernels push it as +0.0, the barrier two-shot adds
    -0.0 + -0.0 = -0.0."""
    x = np.array([-0.0, -0.0, 1.0, -0.0], np.float32).astype(ref.DTYPES[dtype])
    y = np.array([-0.0, 2.0, -0.0, 0.5], np.float32).astype(ref.DTYPES[dtype])
    for op in OPS:
        for inputs in ([x, x.copy()], [x, y]):
            assert ref.bits(ref.lamport(inputs, op))[0] == 0
            assert ref.bits(ref.lamport_twoshot(inputs, op))[0] == 0
        assert ref.bits(ref.twoshot([x, x.copy()], op))[0] == ref.bits(x)[0]
    assert ref.twoshot([x, y], "sum")[3] == 0.5


def test_lamport_twoshot_clears_its_result():
    """Its step 3 clears the reduced result too: an average that rounds to -0.0 in fp16
    (-2^-24 / 4) stays -0.0 in the one-shot and the barrier two-shot, not here."""
    inputs = [np.array([-(2.0**-24)], np.float16)] + [np.array([-0.0], np.float16)] * 3
    assert ref.bits(ref.lamport(inputs, "avg"))[0] == 0x8000
    assert ref.bits(ref.twoshot(inputs, "avg"))[0] == 0x8000
    assert ref.bits(ref.lamport_twoshot(inputs, "avg"))[0] == 0


@pytest.mark.parametrize("count, dtype, nranks, want", [
    (7, "bfloat16", 4, [(0, 0, 7)]),
    (100, "float32", 4, [(0, 0, 28), (1, 28, 56), (2, 56, 84), (3, 84, 100)]),
    (100, "float16", 3, [(0, 0, 40), (1, 40, 80), (2, 80, 100)]),
    (17, "float32", 8, [(0, 0, 4), (1, 4, 8), (2, 8, 12), (3, 12, 16), (4, 16, 17)]),
    (1, "float32", 2, [(0, 0, 1)]),
])
def test_owner_ranges_are_the_two_shot_slices(count, dtype, nranks, want):
    """Slices of ceil(nvec / N) whole 16-byte vectors (kernels/twoshot.cu); ranks past the
    last vector own nothing."""
    assert ref.owner_ranges(count, ref.DTYPES[dtype].itemsize, nranks) == want


def test_twoshot_reduces_each_slice_in_its_owners_order():
    """At 4 ranks on fp32 data the owner's order changes bits: owner 0's slice equals rank
    order, every other slice differs from it somewhere, and there an element of owner 2's
    slice is ((x2 + x3) + x0) + x1."""
    inputs = random_inputs(4, 4096, "float32", seed=5, specials=False)
    two = ref.twoshot(inputs, "sum")
    lam = ref.lamport(inputs, "sum")
    for owner, lo, hi in ref.owner_ranges(4096, 4, 4):
        differ = ref.mismatches(two[lo:hi], lam[lo:hi])
        assert (differ.size == 0) if owner == 0 else (differ.size > 0), (owner, differ.size)
        if owner == 2:
            x = [v[lo + differ[0]] for v in inputs]
            assert two[lo + differ[0]] == F32(F32(F32(x[2] + x[3]) + x[0]) + x[1])
            assert lam[lo + differ[0]] == F32(F32(F32(x[0] + x[1]) + x[2]) + x[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_order_probes_show_the_owner_order_in_every_dtype(dtype):
    """At 4 ranks, a probe sums to s2 + s3 in rank order (owner 0), and in owner o's order
    to 0 (o = 1, 2: a small value meets +-B first) or s2 (o = 3: s3 is lost)."""
    n = 4 * 1024
    inputs = [np.full(n, ref.order_probe(dtype, r), np.float32).astype(ref.DTYPES[dtype]) for r in range(4)]
    two = ref.twoshot(inputs, "sum").astype(np.float64)
    s2, s3 = (float(ref.order_probe(dtype, r)) for r in (2, 3))
    per_owner = {o: set(two[lo:hi]) for o, lo, hi in ref.owner_ranges(n, ref.DTYPES[dtype].itemsize, 4)}
    assert per_owner == {0: {s2 + s3}, 1: {0.0}, 2: {0.0}, 3: {s2}}
    assert set(ref.lamport(inputs, "sum").astype(np.float64)) == {s2 + s3}


def test_twoshot_launches_are_sliced_one_by_one():
    inputs = random_inputs(4, 10_000, "float32", seed=6)
    whole = ref.twoshot(inputs, "sum", [6000, 4000])
    parts = np.concatenate([ref.twoshot([x[:6000] for x in inputs], "sum"),
                            ref.twoshot([x[6000:] for x in inputs], "sum")])
    assert ref.mismatches(whole, parts).size == 0
    assert ref.mismatches(whole, ref.twoshot(inputs, "sum")).size > 0
    with pytest.raises(ValueError, match="launches of 9999 elements"):
        ref.twoshot(inputs, "sum", [5999, 4000])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_exact_inputs_give_the_same_bits_in_every_order(dtype, op):
    rng = np.random.default_rng(7)
    inputs = [(rng.integers(1, 17, 5000) * rng.choice([-0.5, 0.5], 5000)).astype(ref.DTYPES[dtype]) for _ in range(4)]
    want = ref.exact(inputs, op)
    for algorithm in ref.ALL_REDUCE:
        assert ref.mismatches(ref.all_reduce(algorithm, inputs, op), want).size == 0
    reverse = ref.narrow(ref.reduce_fp32([ref.widen(x) for x in inputs], op, [3, 1, 2, 0]), ref.DTYPES[dtype])
    assert ref.mismatches(reverse, want).size == 0


@pytest.mark.parametrize("inputs, op, words", [
    ([np.array([0.3], np.float32)] * 2, "sum", "multiples of 0.5"),
    ([np.array([1.0, 0.0], np.float32)] * 2, "sum", "nonzero"),
    ([np.array([np.inf], np.float32)] * 2, "max", "finite"),
    ([np.array([100.0], ml_dtypes.bfloat16)] * 2, "sum", "precision"),
    ([np.array([1.0], np.float32)] * 3, "avg", "not a power of two"),
])
def test_exact_refuses_inputs_whose_order_matters(inputs, op, words):
    with pytest.raises(ValueError, match=words):
        ref.exact(inputs, op)


# ---- residual add + RMSNorm ----------------------------------------------------------------
def literal_row_sum(f: np.ndarray, per: int, group: int, by_vectors: bool) -> np.float32:
    """rmsnorm.cuh's finish_row + row_sum for one row (fp32 values f), thread by thread and
    lane by lane, with fma from exact rationals: an independent reading of the kernel."""
    ss = [F32(0)] * group
    if by_vectors:
        vectors = len(f) // per
        for t in range(group):
            for v in range(t, vectors, group):
                s = F32(0)
                for e in range(per):
                    s = exact_fma(f[v * per + e], f[v * per + e], s)
                ss[t] = F32(ss[t] + s)
    else:
        for t in range(group):
            for k in range(t, len(f), group):
                ss[t] = exact_fma(f[k], f[k], ss[t])

    def butterfly(lanes):
        for o in (16, 8, 4, 2, 1):
            lanes = [F32(lanes[lane] + lanes[lane ^ o]) for lane in range(32)]
        assert len(set(lanes)) == 1
        return lanes[0]

    totals = [butterfly(ss[w * 32:(w + 1) * 32]) for w in range(group // 32)]
    return butterfly(totals + [F32(0)] * (32 - len(totals)))


@pytest.mark.parametrize("hidden, dtype, group, by_vectors", [
    (800, "bfloat16", 64, True), (800, "bfloat16", 96, True), (1024, "float32", 32, True),
    (4096, "float16", 512, True), (101, "float16", 32, False), (333, "float32", 64, False),
])
def test_row_sums_follow_the_kernels_tree(hidden, dtype, group, by_vectors):
    rng = np.random.default_rng(hidden + group)
    res = ref.widen(rng.standard_normal((3, hidden)).astype(ref.DTYPES[dtype]))
    per = ref.VEC_BYTES // ref.DTYPES[dtype].itemsize
    if by_vectors:
        partials = ref.per_thread(ref.vector_squares(res.reshape(3, hidden // per, per)), group, np.add)
    else:
        partials = ref.per_thread(res, group, lambda acc, x: ref.fma32(x, x, acc))
    got = ref.row_sums(partials)
    for row in range(3):
        assert got[row] == literal_row_sum(res[row], per, group, by_vectors)
    assert np.allclose(got, (res.astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)


def fp64_add_rmsnorm(ar, residual, bias, weight, eps, dtype):
    """(normed, residual_out, bound on residual_out's error) in fp64 from fp64 operands."""
    terms = [ar] + [t.astype(np.float64) for t in (bias, residual) if t is not None]
    s = sum(terms)
    magnitude = sum(np.abs(t) for t in terms)
    res = s.astype(np.float32).astype(ref.DTYPES[dtype]).astype(np.float64)
    scale = 1 / np.sqrt((res**2).mean(axis=1, keepdims=True) + eps)
    return res * scale * weight.astype(np.float64), res, ulp(res, dtype) + 2.0**-23 * magnitude


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ref.FUSED)
@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_fused_agrees_with_fp64(dtype, algorithm, nranks):
    """Rows of several launches with row groups of several sizes: residual sums within the
    dtype's rounding and the fp32 steps' of the fp64 sum of the all-reduced rows; normed
    within 2 ulps of the dtype, plus the fp32 sum of squares' rounding, of fp64 from them."""
    rows, hidden = 37, 1024
    rng = np.random.default_rng(nranks)
    inputs = [x.reshape(rows, hidden) for x in random_inputs(nranks, rows * hidden, dtype, seed=11, specials=False)]
    residual = rng.standard_normal((rows, hidden)).astype(ref.DTYPES[dtype])
    bias = rng.standard_normal(hidden).astype(ref.DTYPES[dtype])
    weight = (1 + 0.25 * rng.standard_normal(hidden)).astype(ref.DTYPES[dtype])
    normed, res = ref.fused(algorithm, inputs, residual, bias, weight, 1e-6, [(16, 128), (16, 64), (5, 1024)])
    ar = ref.all_reduce("twoshot" if algorithm == "twoshot" else "lamport", inputs, "sum").astype(np.float64)
    if algorithm == "twoshot":  # rows, not vectors, are owned: recompute in fp64 from the exact sum
        ar = sum(x.astype(np.float64) for x in inputs).astype(np.float32).astype(ref.DTYPES[dtype]).astype(np.float64)
        ar_bound = ulp(ar, dtype) + nranks * 2.0**-24 * sum(np.abs(x.astype(np.float64)) for x in inputs)
    else:
        ar_bound = 0
    _, want_res, bound = fp64_add_rmsnorm(ar, residual, bias, weight, 1e-6, dtype)
    assert (np.abs(res.astype(np.float64) - want_res) <= bound + 2 * ar_bound).all()
    want_normed = fp64_add_rmsnorm(res.astype(np.float64), None, None, weight, 1e-6, dtype)[0]
    bound = 2 * ulp(want_normed, dtype) + np.abs(want_normed) * hidden * 2.0**-24
    assert (np.abs(normed.astype(np.float64) - want_normed) <= bound).all()


def test_fused_kernels_reduce_and_clear_as_the_kernels_do():
    """-0.0 rows: the Lamport kernels push them as +0.0, so their residual sums are +0.0;
    the barrier two-shot's are -0.0. Its rank r reduces rows [r * rpr, (r + 1) * rpr) in
    its order: rank 0's rows in rank order, the others not."""
    rows, hidden = 8, 64
    x = np.full((rows, hidden), -0.0, np.float32)
    weight = np.ones(hidden, np.float32)
    residual = np.full((rows, hidden), -0.0, np.float32)
    bias = np.full(hidden, -0.0, np.float32)
    for algorithm, bits in (("lamport", 0), ("lamport_twoshot", 0), ("twoshot", 0x80000000)):
        normed, res = ref.fused(algorithm, [x, x.copy()], residual, bias, weight, 1e-6, [(rows, 32)])
        assert (ref.bits(res) == bits).all() and (ref.bits(normed) == bits).all(), algorithm
    data = [d.reshape(rows, hidden) for d in random_inputs(4, rows * hidden, "float32", 12, specials=False)]
    lam = ref.fused("lamport", data, None, None, weight, 1e-6, [(rows, 32)])[1]
    bar = ref.fused("twoshot", data, None, None, weight, 1e-6, [(rows, 32)])[1]
    assert ref.mismatches(lam[:2], bar[:2]).size == 0  # rpr = 2
    for owner in (1, 2, 3):
        assert ref.mismatches(lam[2 * owner:2 * owner + 2], bar[2 * owner:2 * owner + 2]).size > 0


def test_fused_launches_must_cover_the_rows():
    x = [np.ones((4, 8), np.float32)]
    with pytest.raises(ValueError, match="launches of 3 rows for 4"):
        ref.fused("lamport", x, None, None, np.ones(8, np.float32), 1e-6, [(3, 32)])


# ---- the checker ---------------------------------------------------------------------------
def test_checker_compares_bits_and_nan_as_a_class():
    a = np.array([np.nan, -0.0, 1.0, np.inf], np.float32)
    b = a.copy()
    ref.bits(b)[0] = 0x7FC00001  # another NaN payload
    assert ref.mismatches(a, b).size == 0
    b[1] = 0.0
    assert ref.mismatches(a, b).tolist() == [1]
    b[1], b[2] = -0.0, np.nan
    assert ref.mismatches(a, b).tolist() == [2]
    with pytest.raises(AssertionError, match=r"1 of 4 elements differ.*\[2\] got nan"):
        ref.assert_same_bits(b, a, "sum")
    with pytest.raises(ValueError, match="comparing"):
        ref.mismatches(a, a.astype(np.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [4096, (1 << 20) + 3])
def test_checker_catches_a_reversed_rank_order_at_4_ranks(dtype, count):
    """Planted mutation: the Lamport one-shot reducing in rank order 3, 2, 1, 0 (in 16-bit
    dtypes seen at the order probes)."""
    inputs = random_inputs(4, count, dtype, seed=13)
    want = ref.lamport(inputs, "sum")
    parts = [ref.widen(ref.clear_negative_zero(x)) for x in inputs]
    mutated = ref.narrow(ref.reduce_fp32(parts, "sum", [3, 2, 1, 0]), ref.DTYPES[dtype])
    with pytest.raises(AssertionError, match="differ from the reference"):
        ref.assert_same_bits(mutated, want)


@pytest.mark.parametrize("algorithm", list(ref.ALL_REDUCE))
@pytest.mark.parametrize("count", [1, 7, 4096, (1 << 20) + 3])
def test_checker_catches_a_dropped_tail_vector(algorithm, count):
    """Planted mutation: the last 16-byte vector (whole or partial) never stored, so it
    keeps the poison (NaN) of an out-of-place output or the input of an in-place one."""
    inputs = random_inputs(2, count, "bfloat16", seed=14)
    want = ref.all_reduce(algorithm, inputs, "sum")
    per = ref.VEC_BYTES // 2
    tail = slice((count - 1) // per * per, count)
    poisoned = want.copy()
    poisoned[tail] = np.nan
    with pytest.raises(AssertionError, match="differ from the reference"):
        ref.assert_same_bits(poisoned, want)
    in_place = want.copy()
    in_place[tail] = inputs[0][tail]
    assert ref.mismatches(in_place, want).size > 0
