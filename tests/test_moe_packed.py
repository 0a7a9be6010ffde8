"""The throughput-mode (packed) expert-parallel object on the CPU: its checked sizes and pool
area (docs/moe.md, "Throughput mode"), the packed layout of the host reference
(ubnext/_moe/packed_reference.py) against a naive walk of the routing written another way,
its combine against the low-latency reference on the padded layout, and its host side
over a recording stand-in of the communicator: what dispatch and combine check before any
launch and the arguments each launch passes in the entry points' order."""

from __future__ import annotations

import numpy as np
import pytest
from moe_support import NP, inputs, tokens_of
from test_moe_host import STREAM, recording
from test_moe_reference import SHAPES, cases

from ubnext._moe import layout, packed_layout
from ubnext._moe import packed_reference as pref
from ubnext._moe import reference as ref
from ubnext._moe.packed import OUTPUTS, PackedExpertParallel, PackedHandle
from ubnext._protocol import signature
from ubnext._protocol.constants import THREADS
from ubnext._protocol.errors import UbnextError



# -- sizes and the pool area --------------------------------------------------------------
def test_the_issue_shape_fits_the_default_pool_and_the_padded_layout_does_not():
    """N = 4, M = 4096, H = 7168, K = 8, bf16: the packed area is one set of fp32-sized rows
    (470 MB), 1 MB of records and 64 KiB of progress flags; the low-latency area at the same sizes is three times
    that, and its padded output [L, N x M, H] 15 GB (docs/moe.md)."""
    s = packed_layout.shape(4, 256, 7168, 4096, 8, "bfloat16")
    regions = s.region_bytes()
    assert regions["data"] == 4 * 4096 * 7168 * 4 == 469_762_048
    assert regions["records"] == 4 * 4096 * 4 * 16 == 1_048_576
    assert regions["progress"] == 4 * 4096 * 4
    assert s.area_bytes == 128 + 2 * 3 * 4 * 128 + 65_536 + 1_048_576 + 469_762_048 == 470_879_360
    assert s.area_bytes < 1024 << 20  # UBNEXT_POOL_MB's default
    assert s.max_rows == 4 * 4096 * 8 and s.output_bytes == 131072 * 7168 * 2
    low = layout.shape(4, 256, 7168, 4096, 8, "bfloat16", capacity=8192)
    assert low.area_bytes > 2.99 * s.area_bytes
    assert 64 * 4 * 4096 * 7168 * 2 > 15e9  # the padded output at C = N x M
    at8 = packed_layout.shape(8, 256, 7168, 4096, 8, "bfloat16")
    assert at8.region_bytes()["data"] == 2 * regions["data"]


def test_regions_follow_each_other_and_the_key_ignores_max_rows():
    s = packed_layout.shape(2, 6, 16, 5, 4, "float32", max_rows=7)
    offs, sizes = s.offsets(1000), s.region_bytes()
    assert list(offs) == list(packed_layout.REGIONS) and offs["rotation"] == 1000
    for a, b in zip(packed_layout.REGIONS, packed_layout.REGIONS[1:]):
        assert offs[b] == offs[a] + sizes[a]
    assert sizes["data"] == 2 * 5 * 16 * 4 and sizes["records"] == 2 * 5 * 2 * 16 and sizes["progress"] == 128
    aligned = s.offsets(0)
    assert aligned["progress"] % 128 == aligned["records"] % 128 == aligned["data"] % 16 == 0
    assert s.key == packed_layout.shape(2, 6, 16, 5, 4, "float32").key != layout.shape(2, 6, 16, 5, 4, "float32").key
    assert set(s.polled) == {"dispatch_headers", "combine_headers"}
    assert s.padded().capacity == 10 and s.padded().area_bytes > 0


@pytest.mark.parametrize("args,words", [
    ((4, 10, 64, 8, 2, "bfloat16", None), "PackedExpertParallel: num_experts \\(10\\) must be a multiple"),
    ((2, 8, 3, 8, 2, "bfloat16", None), "PackedExpertParallel: hidden \\(3\\)"),
    ((2, 8, 64, 8, 2, "float16", None), "PackedExpertParallel: dtype"),
    ((2, 8, 64, 8, 2, "bfloat16", 0), "PackedExpertParallel: max_rows must be an int in 1..32"),
    ((2, 8, 64, 8, 2, "bfloat16", 33), "max_rows must be an int in 1..32"),
    ((2, 4, 64, 8, 4, "bfloat16", True), "max_rows must be an int"),
])
def test_bad_sizes_raise_with_the_objects_name(args, words):
    with pytest.raises(UbnextError, match=f"^{words}" if words.startswith("Packed") else words):
        packed_layout.shape(*args)


def test_most_rows_is_every_slot_that_can_arrive():
    assert packed_layout.most_rows(4, 8, 10, 3) == 4 * 10 * 2  # L = 2 < K
    assert packed_layout.most_rows(4, 256, 4096, 8) == 4 * 4096 * 8


# -- the host reference's packed layout ---------------------------------------------------
def naive_packed(shape, g, xs, idxs, ws):
    """GPU g's packed rows walked from the routing: local experts in order, each with its
    (source, token) pairs in order; and where each valid slot of g lands."""
    lo, rows, where = shape.local_experts, [], {}
    for e in range(lo):
        for s, idx in enumerate(idxs):
            for t in range(len(idx)):
                for k in range(shape.top_k):
                    if idx[t, k] == g * lo + e and ref.valid_slots(idx, shape.num_experts)[t, k]:
                        where[s, t, k] = len(rows)
                        rows.append((s, t, ref.clear_negative_zero32(ws[s])[t, k]))
    return rows, where


@pytest.mark.parametrize("sizes,dtype,kind", list(cases()))
def test_packed_dispatch_matches_a_walk_of_the_routing(sizes, dtype, kind):
    shape = packed_layout.shape(dtype=dtype, **sizes)
    xs, idxs, ws = inputs(shape.padded(), kind, tokens_of(shape.padded()), seed=len(kind) + 3)
    m = shape.max_tokens
    for g, d in enumerate(pref.dispatch(shape, xs, idxs, ws)):
        rows, where = naive_packed(shape, g, xs, idxs, ws)
        assert not d.overflow and pref.offsets(d)[-1] == len(rows)
        for j, (s, t, w) in enumerate(rows):
            assert d.src[j] == s * m + t and d.weights[j].view(np.uint32) == np.float32(w).view(np.uint32)
            np.testing.assert_array_equal(d.recv_x[j].view(np.uint8), xs[s][t].view(np.uint8))
        assert (d.src[len(rows):] == -1).all()
        for s, idx in enumerate(idxs):
            for t in range(len(idx)):
                for k in range(shape.top_k):
                    assert d.route[s, t, k] == where.get((s, t, k), ref.ROUTE_ELSEWHERE)
        lo = shape.local_experts
        counts = [sum(1 for (s, t, k) in where if idxs[s][t, k] == g * lo + e) for e in range(lo)]
        np.testing.assert_array_equal(pref.offsets(d), np.concatenate([[0], np.cumsum(counts)]))


def test_rows_past_max_rows_are_dropped_and_routed_overflow():
    """Skewed routing (every token to expert 1): 4 ranks x 9 tokens reach GPU 0; R = 20
    keeps the first 20 by (source, token), the rest route ROUTE_OVERFLOW."""
    sizes = SHAPES["n4"]
    shape = packed_layout.shape(dtype="float32", max_rows=20, **sizes)
    xs, idxs, ws = inputs(shape.padded(), "skewed", [9, 9, 9, 9], seed=4)
    d = pref.dispatch(shape, xs, idxs, ws)[0]
    assert d.overflow and list(pref.offsets(d)) == [0, 0, 20, 20, 20]
    assert list(d.src) == [s * 9 + t for s in range(4) for t in range(9)][:20]
    assert (d.route[:, :, 0].reshape(-1)[20:] == ref.ROUTE_OVERFLOW).all()
    assert list(d.route[:, :, 0].reshape(-1)[:20]) == list(range(20))


@pytest.mark.parametrize("sizes,dtype,kind", list(cases()))
def test_packed_combine_equals_the_low_latency_one_on_the_padded_layout(sizes, dtype, kind):
    """The experts' outputs made packed, then spread to the padded [L, C, H] layout by the
    offsets: the packed combine gives the low-latency reference's bits, with the router's
    weights and with weights of their own."""
    shape = packed_layout.shape(dtype=dtype, **sizes)
    padded = shape.padded()
    xs, idxs, ws = inputs(padded, kind, tokens_of(padded), seed=len(kind) + 11)
    low, packed = ref.dispatch(padded, xs, idxs, ws), pref.dispatch(shape, xs, idxs, ws)
    rng = np.random.default_rng(5)
    ys = [rng.standard_normal((shape.max_rows, shape.hidden)).astype(NP[dtype]) for _ in idxs]
    for y in ys:
        y.flat[3::17], y.flat[5] = -0.0, np.nan
    own = [rng.random(shape.max_rows).astype(np.float32) for _ in idxs]
    spread, spread_w = [], []
    for g, d in enumerate(packed):
        first = pref.offsets(d)
        y_pad = np.zeros((shape.local_experts, padded.capacity, shape.hidden), NP[dtype])
        w_pad = np.zeros((shape.local_experts, padded.capacity), np.float32)
        for e in range(shape.local_experts):
            y_pad[e, :d.counts[e]] = ys[g][first[e]:first[e + 1]]
            w_pad[e, :d.counts[e]] = own[g][first[e]:first[e + 1]]
        spread.append(y_pad)
        spread_w.append(w_pad)
    for weights, low_weights in ((None, None), (own, spread_w)):
        got = pref.combine(shape, packed, ys, idxs, weights)
        want = ref.combine(padded, low, spread, idxs, low_weights)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# -- the host side ----------------------------------------------------------------------------
def fake(dtype="bfloat16", max_rows=None):
    """A PackedExpertParallel of 2 ranks, 8 experts, hidden 64, 5 tokens, top-2 (R = 20 by
    default), whose launches are recorded instead of made."""
    sig = {kind: signature.encode_moe(f"moe_packed_{kind}", dtype, 8, 2, 5, 64) for kind in ("dispatch", "combine")}
    return recording(object.__new__(PackedExpertParallel), packed_layout.shape(2, 8, 64, 5, 2, dtype, max_rows),
                     OUTPUTS, sig)


def operands(t=4, dtype="bfloat16"):
    return (np.ones((t, 64), NP[dtype]), np.tile(np.array([0, 5], np.int32), (t, 1)), np.ones((t, 2), np.float32))


def test_dispatch_launches_once_with_the_entry_points_arguments():
    ep = fake()
    x, idx, w = operands()
    recv_x, offsets, handle = ep.dispatch(x, idx, w)
    (kind, args), = ep.launches
    assert kind == "dispatch" and args[:3] == (7, THREADS["moe_packed_dispatch.cu"], STREAM)
    assert args[3:] == (x.ctypes.data, idx.ctypes.data, w.ctypes.data, 4, *(ep._ptr[k] for k in OUTPUTS),
                        ep._sig["dispatch"])
    assert (recv_x, offsets) == ("view of recv_x", "view of offsets")
    assert isinstance(handle, PackedHandle) and handle.tokens == 4 and handle.rows is None
    assert ep.shape.max_rows == 2 * 5 * 2


def test_combine_takes_r_rows_and_launches_with_the_dispatch_state():
    ep = fake("float32", max_rows=12)
    _, _, handle = ep.dispatch(*operands(3, "float32"))
    y = np.zeros((12, 64), np.float32)
    out = ep.combine(y, handle)
    kind, args = ep.launches[-1]
    assert kind == "combine" and out.shape == (3, 64) and args[:3] == (7, THREADS["moe_packed_combine.cu"], STREAM)
    assert args[3:] == (y.ctypes.data, *(ep._ptr[k] for k in ("weights", "route", "tokens", "dest")),
                        out.ctypes.data, ep._sig["combine"])
    ones = np.ones(12, np.float32)
    ep.combine(y, handle, weights=ones)
    assert ep.launches[-1][1][4] == ones.ctypes.data
    for bad, words in (((y[:11].copy(), handle), "y must be float32 of shape \\[12 x 64\\]"),
                       ((y, handle, None, ones[:5].copy()), "weights must be float32 of shape \\[12\\]"),
                       ((y, handle, np.zeros((4, 64), np.float32)), "out must be float32 of shape \\[3 x 64\\]")):
        with pytest.raises(UbnextError, match=f"^PackedExpertParallel.combine: {words}"):
            ep.combine(*bad)
    ep.dispatch(*operands(3, "float32"))
    with pytest.raises(UbnextError, match="^PackedExpertParallel.combine: the handle is not"):
        ep.combine(y, handle)


def test_a_synced_dispatch_cuts_its_outputs_to_the_rows_and_the_combine_takes_them(monkeypatch):
    from ubnext._moe import packed

    ep = fake()
    monkeypatch.setattr(packed.CUDA, "capture", lambda stream: 0)
    ep._views = {key: np.arange(40) for key in OUTPUTS}
    monkeypatch.setattr(ep, "_read_rows", lambda name, handle: 6)
    recv_x, offsets, handle = ep.dispatch(*operands(), sync=True)
    assert len(recv_x) == len(handle.src) == len(handle.weights) == handle.rows == 6 and len(offsets) == 40
    ep.combine(np.zeros((6, 64), NP["bfloat16"]), handle)
    with pytest.raises(UbnextError, match="y must be bfloat16 of shape \\[6 x 64\\]"):
        ep.combine(np.zeros((20, 64), NP["bfloat16"]), handle)


def test_a_synced_dispatch_refuses_capture(monkeypatch):
    from ubnext._moe import packed

    ep = fake()
    monkeypatch.setattr(packed.CUDA, "capture", lambda stream: 1)
    with pytest.raises(UbnextError, match="^PackedExpertParallel.dispatch: sync=True reads the row count"):
        ep.dispatch(*operands(), sync=True)
    ep.dispatch(*operands())  # sync=False is capturable
    assert len(ep.launches) == 1


@pytest.mark.parametrize("case,words", [
    ("x dtype", "x must be bfloat16 of shape \\[T x 64\\], got float32"),
    ("too many", "6 tokens; the object takes at most max_tokens=5"),
    ("idx dtype", "topk_idx must be int32 of shape \\[4 x 2\\], got int64"),
    ("w dtype", "topk_weights must be float32"),
])
def test_dispatch_refuses_before_any_launch(case, words):
    ep = fake()
    x, idx, w = operands()
    args = {"x dtype": (x.astype(np.float32), idx, w), "too many": (np.ones((6, 64), x.dtype), idx, w),
            "idx dtype": (x, idx.astype(np.int64), w), "w dtype": (x, idx, w.astype(np.float64))}[case]
    with pytest.raises(UbnextError, match=f"^PackedExpertParallel.dispatch: {words}"):
        ep.dispatch(*args)
    assert ep.launches == [] and ep._generation == 0


# -- the benchmark's mode flag ------------------------------------------------------------------
def test_the_benchmark_takes_the_packed_mode_and_sizes_max_rows_from_the_routing():
    from bench import moe_perf

    assert moe_perf.parse_args([]).mode == "low-latency"
    assert moe_perf.parse_args(["--mode", "packed", "-t", "4096"]).mode == "packed"
    idxs = [np.array([[0, 3], [3, 1]], np.int32), np.array([[2, 1]], np.int32)]  # 2 GPUs: experts 0, 1 | 2, 3
    assert moe_perf.most_rows(4, 2, idxs) == 3  # GPU 0: (0, 1, 1); GPU 1: (3, 3, 2)
    assert moe_perf.most_rows(4, 2, [np.zeros((0, 2), np.int32)]) == 1
