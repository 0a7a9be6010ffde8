"""The expert-parallel host reference (ubnext/_moe/reference.py) on the CPU: its dispatch
against a naive gather written another way (sorting every rank's (expert, source, token)
triples), its combine against the same fixed order written as scalar loops and against
fp64 within fp32's error bound, on random routing, skewed routing, tokens with no expert
on some GPUs, dropped (-1) slots, T = 0 on some ranks, and -0.0 / inf / NaN payloads;
and the checked sizes and the pool area's formula (docs/moe.md)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from moe_support import NP, expert_outputs, inputs, routing, tokens_of

from ubnext._moe import layout
from ubnext._moe import reference as ref
from ubnext._protocol.errors import UbnextError

def naive_dispatch(shape, xs, idxs, ws):
    """Per GPU and local expert, the (source, token, weight) rows in the order of a sort of
    (expert, source, token) triples."""
    triples = sorted((int(e), s, t, k) for s, idx in enumerate(idxs) for t in range(len(idx))
                     for k, e in enumerate(idx[t]) if e >= 0)
    out = {}
    for e, s, t, k in triples:
        out.setdefault(e, []).append((s, t, k))
    return out


SHAPES = {
    "n4": dict(nranks=4, num_experts=16, hidden=24, max_tokens=9, top_k=3),
    "n2": dict(nranks=2, num_experts=6, hidden=16, max_tokens=5, top_k=4),
    "n1": dict(nranks=1, num_experts=4, hidden=8, max_tokens=6, top_k=2),
}
KINDS = ("random", "skewed", "not_last_gpu", "dropped")


def cases():
    for name, sizes in SHAPES.items():
        for dtype in layout.MOE_DTYPES:
            for kind in KINDS:
                if kind == "not_last_gpu" and sizes["nranks"] == 1:
                    continue
                yield pytest.param(sizes, dtype, kind, id=f"{name}-{dtype}-{kind}")


@pytest.mark.parametrize("sizes,dtype,kind", list(cases()))
def test_dispatch_matches_a_sort_of_the_routing(sizes, dtype, kind):
    shape = layout.shape(dtype=dtype, **sizes)
    xs, idxs, ws = inputs(shape, kind, tokens_of(shape), seed=len(kind))
    got = ref.dispatch(shape, xs, idxs, ws)
    want = naive_dispatch(shape, xs, idxs, ws)
    lo, c, m = shape.local_experts, shape.capacity, shape.max_tokens
    for g, d in enumerate(got):
        assert not d.overflow
        for e in range(lo):
            rows = want.get(g * lo + e, [])
            assert d.counts[e] == len(rows)
            for j, (s, t, k) in enumerate(rows):
                assert d.src[e, j] == s * m + t
                np.testing.assert_array_equal(d.recv_x[e, j].view(np.uint8), xs[s][t].view(np.uint8))  # bit for bit
                w = ws[s][t, k]
                assert d.weights[e, j] == w and not np.signbit(d.weights[e, j])  # -0.0 arrives as +0.0
                assert d.route[s, t, k] == e * c + j
            assert (d.src[e, len(rows):] == -1).all()
        # every slot whose expert is elsewhere (or dropped) routes nowhere here
        for s, idx in enumerate(idxs):
            for t in range(len(idx)):
                for k, e in enumerate(idx[t]):
                    if not (e >= 0 and e // lo == g):
                        assert d.route[s, t, k] == ref.ROUTE_ELSEWHERE
            assert (d.route[s, len(idx):] == ref.ROUTE_ELSEWHERE).all()


def naive_combine_token(shape, dispatched, ys, idx_row, s, t, bf16_partials=False):
    """The fixed order, element by element with numpy fp32 scalars; with ``bf16_partials``
    each GPU's partial rounded to bfloat16 (to nearest even) before it is added."""
    lo = shape.local_experts
    out = np.zeros(shape.hidden, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for h in range(shape.hidden):
            acc = np.float32(0.0)
            for g in range(shape.nranks):
                if not any(e >= 0 and e // lo == g for e in idx_row):
                    continue
                part = np.float32(0.0)
                for k, e in enumerate(idx_row):
                    if e >= 0 and e // lo == g:
                        r = int(dispatched[g].route[s, t, k])
                        w = dispatched[g].weights.reshape(-1)[r]
                        part = np.float32(part + np.float32(w * np.float32(ys[g].reshape(-1, shape.hidden)[r, h])))
                if bf16_partials:
                    part = np.float32(NP["bfloat16"].type(part))
                acc = np.float32(acc + part)
            out[h] = acc
    return out


@pytest.mark.parametrize("sizes,dtype,kind", list(cases()))
def test_combine_is_the_fixed_order_fp32_sum(sizes, dtype, kind):
    shape = layout.shape(dtype=dtype, **sizes)
    xs, idxs, ws = inputs(shape, kind, tokens_of(shape), seed=7 + len(kind))
    dispatched = ref.dispatch(shape, xs, idxs, ws)
    ys = expert_outputs(shape, seed=3)
    got = ref.combine(shape, dispatched, ys, idxs)
    for s, idx in enumerate(idxs):
        assert got[s].shape == (len(idx), shape.hidden) and got[s].dtype == NP[dtype]
        for t in range(len(idx)):
            want = naive_combine_token(shape, dispatched, ys, idx[t], s, t).astype(NP[dtype])
            np.testing.assert_array_equal(got[s][t].view(np.uint8), want.view(np.uint8))
            if (idx[t] < 0).all():
                assert not np.signbit(got[s][t].astype(np.float32)).any()  # +0.0


@pytest.mark.parametrize("sizes,kind", [pytest.param(sizes, kind, id=f"{name}-{kind}") for name, sizes in SHAPES.items()
                                        for kind in KINDS if kind != "not_last_gpu" or sizes["nranks"] > 1])
def test_bf16_partials_round_each_gpus_partial_once_more(sizes, kind):
    """partials="bfloat16": each GPU's fp32 partial rounded to bf16, then the fixed-order fp32
    sum, rounded once more; at several GPUs per token that differs from fp32 partials."""
    shape = layout.shape(dtype="bfloat16", **sizes)
    xs, idxs, ws = inputs(shape, kind, tokens_of(shape), seed=17 + len(kind))
    dispatched = ref.dispatch(shape, xs, idxs, ws)
    ys = expert_outputs(shape, seed=4)
    got = ref.combine(shape, dispatched, ys, idxs, partials="bfloat16")
    differs = False
    for s, idx in enumerate(idxs):
        assert got[s].shape == (len(idx), shape.hidden) and got[s].dtype == NP["bfloat16"]
        for t in range(len(idx)):
            want = naive_combine_token(shape, dispatched, ys, idx[t], s, t, bf16_partials=True).astype(NP["bfloat16"])
            np.testing.assert_array_equal(got[s][t].view(np.uint16), want.view(np.uint16))
            fp32 = naive_combine_token(shape, dispatched, ys, idx[t], s, t).astype(NP["bfloat16"])
            differs |= bool((fp32.view(np.uint16) != want.view(np.uint16)).any())
    several = any(len({int(e) // shape.local_experts for e in row if e >= 0}) > 1 for idx in idxs for row in idx)
    assert differs == several  # one partial rounded twice is rounded once


def test_bf16_partials_take_a_bfloat16_payload_only():
    shape = layout.shape(dtype="float32", **SHAPES["n2"])
    with pytest.raises(ValueError, match="bfloat16"):
        ref.combine(shape, [], [], [], partials="bfloat16")


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_combine_is_within_fp32_bounds_of_fp64(dtype):
    """Finite inputs: the fp32 sum of at most K products differs from the fp64 sum by at
    most 2K 2^-24 sum |w y| before the final rounding (each product and sum rounded once),
    and the rounding to bfloat16 adds 2^-8 of the sum."""
    shape = layout.shape(dtype=dtype, **SHAPES["n4"])
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((shape.max_tokens, shape.hidden)).astype(NP[dtype]) for _ in range(shape.nranks)]
    idxs = [routing("random", shape.max_tokens, shape, rng) for _ in range(shape.nranks)]
    ws = [rng.random((shape.max_tokens, shape.top_k)).astype(np.float32) for _ in range(shape.nranks)]
    dispatched = ref.dispatch(shape, xs, idxs, ws)
    ys = [rng.standard_normal((shape.local_experts, shape.capacity, shape.hidden)).astype(NP[dtype])
          for _ in dispatched]
    got = ref.combine(shape, dispatched, ys, idxs)
    lo = shape.local_experts
    for s, idx in enumerate(idxs):
        for t in range(len(idx)):
            exact = np.zeros(shape.hidden)
            mag = np.zeros(shape.hidden)
            for k, e in enumerate(idx[t]):
                g = int(e) // lo
                r = int(dispatched[g].route[s, t, k])
                term = float(ws[s][t, k]) * ys[g].reshape(-1, shape.hidden)[r].astype(np.float64)
                exact += term
                mag += np.abs(term)
            u = 2.0 ** -8 if dtype == "bfloat16" else 0.0  # the final rounding's unit roundoff
            fp32 = 2 * shape.top_k * 2.0 ** -24 * mag
            bound = fp32 + u * (np.abs(exact) + fp32) + 1e-30
            assert (np.abs(got[s][t].astype(np.float64) - exact) <= bound).all()


def e4m3_group(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One group of channels quantized element by element: scale = amax / 448 (NaN where
    an element is not finite), code = e4m3(clamp(x * (1 / scale), +-448)), 0 where the scale
    is 0 or NaN; the scales here are all normal."""
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        return np.zeros(x.size, np.float32).astype(ml_dtypes.float8_e4m3fn), np.float32(np.nan)
    scale = np.float32(np.float32(np.abs(x).max()) / np.float32(448))
    if scale == 0:
        return np.zeros(x.size, np.float32).astype(ml_dtypes.float8_e4m3fn), scale
    assert scale >= np.finfo(np.float32).tiny
    inv = np.float32(np.float32(1) / scale)
    codes = [np.float32(min(max(np.float32(v * inv), np.float32(-448)), np.float32(448))) for v in x]
    return np.array(codes, np.float32).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_fp8_dispatch_moves_each_rows_e4m3_codes_and_scales(kind):
    """fp8: every row reaches its experts as the e4m3 codes and fp32 scales of its groups
    of 128 channels (quantized once, at the source); inf and NaN make their group's scale
    NaN and its codes 0; the rest of the layout is the bf16 dispatch's."""
    sizes = dict(nranks=2, num_experts=6, hidden=512, max_tokens=5, top_k=3)
    shape = layout.shape(dtype="bfloat16", fp8=True, **sizes)
    plain = layout.shape(dtype="bfloat16", **sizes)
    xs, idxs, ws = inputs(shape, kind, tokens_of(shape), seed=21)
    xs[0][1, 256:384] = 0  # a group of zeros: scale 0, codes 0
    got, want = ref.dispatch(shape, xs, idxs, ws), ref.dispatch(plain, xs, idxs, ws)
    groups = shape.hidden // 128
    for g, (d, w) in enumerate(zip(got, want)):
        assert d.recv_x.dtype == ml_dtypes.float8_e4m3fn and d.scales.shape == (shape.local_experts, shape.capacity, groups)
        np.testing.assert_array_equal(d.counts, w.counts)
        np.testing.assert_array_equal(d.src, w.src)
        np.testing.assert_array_equal(d.route, w.route)
        for e in range(shape.local_experts):
            for j in range(d.counts[e]):
                s, t = divmod(int(d.src[e, j]), shape.max_tokens)
                for q in range(groups):
                    codes, scale = e4m3_group(xs[s][t, 128 * q:128 * (q + 1)].astype(np.float32))
                    np.testing.assert_array_equal(d.recv_x[e, j, 128 * q:128 * (q + 1)].view(np.uint8),
                                                  codes.view(np.uint8))
                    assert d.scales[e, j, q].view(np.uint32) == scale.view(np.uint32) or np.isnan(scale)
                    assert np.isnan(d.scales[e, j, q]) == np.isnan(scale)
    if kind == "random":  # token 0 (the inf and NaN of inputs()) has experts: its group 0's scale is NaN
        assert any(np.isnan(d.scales).any() for d in got)


def test_slot_errors_mark_out_of_range_and_repeated_ids():
    idx = np.array([[0, 3, -1], [4, 0, 2], [-2, 1, 1], [2, -1, 2]], np.int32)
    want = np.array([[0, 0, 0], [1, 0, 0], [1, 0, 1], [0, 0, 1]], bool)
    np.testing.assert_array_equal(ref.slot_errors(idx, num_experts=4), want)
    np.testing.assert_array_equal(ref.valid_slots(idx, 4), (idx >= 0) & ~want)


def test_capacity_overflow_drops_later_rows():
    shape = layout.shape(nranks=2, num_experts=2, hidden=8, max_tokens=4, top_k=1, dtype="float32", capacity=3)
    xs = [np.arange(32, dtype=np.float32).reshape(4, 8) + 100 * r for r in range(2)]
    idxs = [np.zeros((4, 1), np.int32), np.zeros((4, 1), np.int32)]
    ws = [np.ones((4, 1), np.float32)] * 2
    d = ref.dispatch(shape, xs, idxs, ws)[0]
    assert d.overflow and d.counts[0] == 3
    np.testing.assert_array_equal(d.src[0], [0, 1, 2])
    assert (d.route[0, 3] == ref.ROUTE_OVERFLOW).all() and (d.route[1] == ref.ROUTE_OVERFLOW).all()


def test_area_formula_of_the_docs():
    s = layout.shape(nranks=4, num_experts=256, hidden=7168, max_tokens=128, top_k=8, dtype="bfloat16")
    rows, partials = 2 * 4 * 128 * 7168 * 2, 2 * 4 * 128 * 7168 * 4
    assert s.region_bytes()["rows"] == rows and s.region_bytes()["partials"] == partials
    assert s.area_bytes == 128 + 2 * 3 * 4 * 128 + 3 * 4 * 128 * 4 * 16 + rows + partials
    assert round(s.area_bytes / 1e6, 1) == 44.1
    assert round(layout.shape(nranks=8, num_experts=256, hidden=7168, max_tokens=128, top_k=8,
                              dtype="bfloat16").area_bytes / 1e6, 1) == 88.3
    offsets = s.offsets(4096)
    assert list(offsets) == list(layout.REGIONS) and offsets["rotation"] == 4096
    assert all(o % 16 == 0 for o in offsets.values())


@pytest.mark.parametrize("bad,words", [
    (dict(dtype="float16"), "dtype"), (dict(num_experts=6), "multiple"), (dict(top_k=17), "top_k"),
    (dict(hidden=12), "hidden"), (dict(capacity=0), "capacity"), (dict(capacity=129), "capacity"),
    (dict(max_tokens=0), "max_tokens"), (dict(nranks=9), "ranks"),
    (dict(nranks=8, max_tokens=2048), "capacity"), (dict(num_experts=4096), "experts must be below 4096"),
    (dict(max_tokens=1 << 15, capacity=8), "max_tokens must be below"), (dict(hidden=1 << 20), "hidden must be"),
    (dict(fp8=True, hidden=256), "fp8 .*multiple of 512"), (dict(fp8=True, dtype="float32", hidden=512), "fp8 .*bfloat16"),
])
def test_bad_sizes_raise_before_anything(bad, words):
    sizes = dict(nranks=4, num_experts=8, hidden=16, max_tokens=32, top_k=2, dtype="bfloat16") | bad
    with pytest.raises(UbnextError, match=f"^ExpertParallel: .*{words}"):
        layout.shape(**sizes)


def test_combine_with_unit_weights_sums_the_rows_in_the_fixed_order():
    """weights=ones: each token's rows summed (the dispatch's transpose), top-k order on a
    GPU, GPUs in rank order, from +0.0, rounded once."""
    shape = layout.shape(dtype="float32", **SHAPES["n4"])
    xs, idxs, ws = inputs(shape, "dropped", tokens_of(shape), seed=12)
    dispatched = ref.dispatch(shape, xs, idxs, ws)
    ys = expert_outputs(shape, seed=13)
    ones = [np.ones((shape.local_experts, shape.capacity), np.float32) for _ in range(shape.nranks)]
    got = ref.combine(shape, dispatched, ys, idxs, ones)
    lo = shape.local_experts
    for s, idx in enumerate(idxs):
        for t in range(len(idx)):
            want = np.zeros(shape.hidden, np.float32)
            with np.errstate(invalid="ignore", over="ignore"):
                for g in range(shape.nranks):
                    rows = [int(dispatched[g].route[s, t, k]) for k, e in enumerate(idx[t]) if e >= 0 and e // lo == g]
                    if rows:
                        part = np.zeros(shape.hidden, np.float32)
                        for r in rows:
                            part = part + ys[g].reshape(-1, shape.hidden)[r]
                        want = want + part
            np.testing.assert_array_equal(got[s][t].view(np.uint32), want.view(np.uint32))
