"""Throughput-mode expert-parallel dispatch and combine on GPUs (ubnext.PackedExpertParallel,
docs/moe.md "Throughput mode"), bit for bit against the host reference laid out packed
(ubnext/_moe/packed_reference.py) computed from every rank's inputs: random routing,
skewed routing (every token to one expert), no expert on the last GPU, dropped (-1)
slots, T = 0 on rank 1, -0.0 / inf / NaN payloads; several calls in a row (the one set of
the area is reused), dispatches without a combine, sync=True and sync=False, CUDA-graph
replay; canaries around every output (the object's buffer gaps, the rows past offsets[L],
a bordered ``out``); host-side errors before any launch, routing errors and max_rows
exceeded raised after the call.

The same bodies run at any rank count: ``python -m pytest -q tests/test_gpu_moe_packed.py``
(1 rank), ``mpirun -n 2|4 python -m pytest -q tests/test_gpu_moe_packed.py`` (one GPU per
rank, or ranks sharing one GPU with ``--oversubscribe``); skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import Bordered, host, seed_of
from moe_support import NP, inputs, tokens_of
from test_gpu_moe import captured_replays, check_bad_routing, check_gaps, communicator, poison_outputs, raised, \
    ref_mismatches, to_device

from ubnext._moe import layout, packed_layout
from ubnext._moe import packed_reference as pref
from ubnext._moe.base import CANARY

pytestmark = pytest.mark.gpu

#: (experts per GPU, hidden, max tokens, top-k): small odd sizes, the issue's hidden and
#: top-k, and many tokens (several per warp of the grid, thousands of rows)
SIZES = {"small": (3, 136, 9, 3), "wide": (4, 7168, 6, 4), "k1": (2, 64, 5, 1), "many": (8, 256, 1500, 8)}
KINDS = ("random", "skewed", "not_last_gpu", "dropped")


@pytest.fixture(scope="module")
def comm():
    c = communicator()
    yield c
    c.close()


def make(comm, size: str, dtype: str, max_rows=None):
    import ubnext

    per_gpu, hidden, tokens, k = SIZES[size]
    ep = ubnext.PackedExpertParallel(comm, per_gpu * comm.size, hidden, tokens, k, dtype, max_rows=max_rows,
                                     framework="torch")
    return ep, packed_layout.shape(comm.size, per_gpu * comm.size, hidden, tokens, k, dtype, max_rows)


def expert_outputs(shape, seed: int) -> list[np.ndarray]:
    """Every GPU's experts' outputs ``[R, H]``: normal values, -0.0 at every 17th, +inf at
    element 9 and NaN at 29 of every GPU's."""
    rng = np.random.default_rng(seed)
    ys = []
    for _ in range(shape.nranks):
        y = rng.standard_normal((shape.max_rows, shape.hidden)).astype(NP[shape.dtype])
        y.flat[5::17] = -0.0
        y.flat[9] = np.inf
        y.flat[29] = np.nan
        ys.append(y)
    return ys


def check_dispatch(comm, ep, shape, recv_x, offsets, handle, want, what: str, sync: bool):
    """recv_x, offsets, src and weights against the reference bit for bit; the rows past
    offsets[L] (all R of them in the object's buffer) and the buffer's gaps keep the canary."""
    import torch

    torch.cuda.synchronize()
    comm.synchronize()
    rows = int(pref.offsets(want)[-1])
    np.testing.assert_array_equal(offsets.cpu().numpy(), pref.offsets(want), err_msg=f"{what}: offsets")
    assert tuple(recv_x.shape) == ((rows if sync else shape.max_rows), shape.hidden), f"{what}: recv_x's shape"
    assert handle.rows == (rows if sync else None)
    full = ep._views
    got_x, got_src, got_w = host(full["recv_x"]), full["src"].cpu().numpy(), full["weights"].cpu().numpy()
    bits = {2: np.uint16, 4: np.uint32}[shape.width]
    bad = np.flatnonzero(got_x[:rows].reshape(-1).view(bits) != want.recv_x[:rows].reshape(-1).view(bits))
    assert bad.size == 0, f"{what}: {bad.size} elements of the packed rows differ (first at {bad[:4]})"
    np.testing.assert_array_equal(got_src[:rows], want.src[:rows], err_msg=f"{what}: src")
    np.testing.assert_array_equal(got_w[:rows].view(np.uint32), want.weights[:rows].view(np.uint32),
                                  err_msg=f"{what}: weights")
    assert (got_x[rows:].reshape(-1).view(np.uint8) == CANARY).all(), f"{what}: rows past offsets[L] written"
    assert (got_src[rows:].view(np.uint8) == CANARY).all() and (got_w[rows:].view(np.uint8) == CANARY).all()
    check_gaps(ep, what)


def combine_and_check(comm, ep, shape, handle, want, idxs, ys, what: str, weights=None):
    import torch

    r = comm.rank
    out = Bordered(len(idxs[r]) * shape.hidden, shape.dtype, seed=len(what), shape=(len(idxs[r]), shape.hidden))
    w = None if weights is None else to_device(weights[r])
    ep.combine(to_device(ys[r]), handle, out=out.view, weights=w)
    torch.cuda.synchronize()
    comm.synchronize()
    bad = ref_mismatches(host(out.view), pref.combine(shape, want, ys, idxs, weights)[r])
    assert bad.size == 0, f"{what}: {bad.size} elements of the combine differ (first at {bad[:4]})"
    out.assert_intact(what)
    check_gaps(ep, what)


def run_round(comm, ep, shape, kind: str, seed: int, sync: bool):
    """One dispatch and combine checked against the reference."""
    xs, idxs, ws = inputs(shape.padded(), kind, tokens_of(shape.padded()), seed)
    r = comm.rank
    poison_outputs(ep)
    recv_x, offsets, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]), sync=sync)
    want = pref.dispatch(shape, xs, idxs, ws)
    assert not any(d.overflow for d in want)
    what = f"{kind} seed {seed} sync {sync}"
    check_dispatch(comm, ep, shape, recv_x, offsets, handle, want[r], f"dispatch {what}", sync)
    rows = [int(pref.offsets(d)[-1]) for d in want]
    ys = expert_outputs(shape, seed + 1)
    if sync:  # y of exactly the rows received, as recv_x
        ys = [y[:n] for y, n in zip(ys, rows)]
    combine_and_check(comm, ep, shape, handle, want, idxs, ys, f"combine {what}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
@pytest.mark.parametrize("size", list(SIZES))
def test_dispatch_and_combine_bit_for_bit(comm, size, dtype, kind):
    """Four rounds in a row, sync=False and sync=True in turn: the one set of records and
    rows reused by every launch."""
    if kind == "not_last_gpu" and comm.size == 1:
        pytest.skip("one GPU holds every expert")
    ep, shape = make(comm, size, dtype)
    for round_ in range(4):
        run_round(comm, ep, shape, kind, seed_of(size, dtype, kind, round_), sync=round_ % 2 == 1)


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_dispatches_without_combine_and_a_tight_max_rows(comm, dtype):
    """Five dispatches back to back (no combine between), then one combine of the last;
    max_rows just large enough for every rank's rows of every round (computed from the
    reference first), so the rows past it are the canary's."""
    per_gpu, hidden, tokens, k = SIZES["small"]
    loose = packed_layout.shape(comm.size, per_gpu * comm.size, hidden, tokens, k, dtype)
    rounds = [inputs(loose.padded(), "dropped", tokens_of(loose.padded()), seed=50 + i) for i in range(5)]
    most = max(int(pref.offsets(d)[-1]) for xs, idxs, ws in rounds for d in pref.dispatch(loose, xs, idxs, ws))
    ep, shape = make(comm, "small", dtype, max_rows=most)
    r = comm.rank
    for i, (xs, idxs, ws) in enumerate(rounds):
        poison_outputs(ep)
        recv_x, offsets, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
        want = pref.dispatch(shape, xs, idxs, ws)
        assert not any(d.overflow for d in want)
        check_dispatch(comm, ep, shape, recv_x, offsets, handle, want[r], f"dispatch {i}", False)
    combine_and_check(comm, ep, shape, handle, want, idxs, expert_outputs(shape, 77), "combine of the last")


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_combine_with_weights_of_its_own(comm, dtype):
    """weights=ones (the dispatch's transpose: each token's rows summed) and weights=2 w
    (every product twice the router's, exactly), against the reference with those weights."""
    ep, shape = make(comm, "small", dtype)
    r = comm.rank
    xs, idxs, ws = inputs(shape.padded(), "random", tokens_of(shape.padded()), seed=60)
    _, _, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
    want = pref.dispatch(shape, xs, idxs, ws)
    ys = expert_outputs(shape, 61)
    for what, weights in (("ones", [np.ones(shape.max_rows, np.float32)] * comm.size),
                          ("twice", [2 * d.weights for d in want])):
        combine_and_check(comm, ep, shape, handle, want, idxs, ys, what, weights)


def test_cuda_graph_replay(comm):
    """dispatch (sync=False) + combine captured once, replayed with new inputs copied into
    the captured buffers: every replay matches the reference."""
    ep, shape = make(comm, "small", "bfloat16")
    for what, (xs, idxs, ws), ys, (recv_x, offsets, handle), out in captured_replays(comm, ep, shape,
                                                                                      shape.padded()):
        want = pref.dispatch(shape, xs, idxs, ws)
        check_dispatch(comm, ep, shape, recv_x, offsets, handle, want[comm.rank], what, False)
        bad = ref_mismatches(host(out), pref.combine(shape, want, ys, idxs)[comm.rank])
        assert bad.size == 0, f"{what}: {bad.size} elements of the combine differ"


def test_host_visible_errors_raise_before_any_launch(comm):
    import torch

    from ubnext import UbnextError

    ep, shape = make(comm, "small", "bfloat16")
    t, k, h = 4, shape.top_k, shape.hidden
    x = torch.ones((t, h), device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(k, device="cuda", dtype=torch.int32).repeat(t, 1)
    w = torch.ones((t, k), device="cuda", dtype=torch.float32)
    cases = [
        ((x.float(), idx, w), "x must be bfloat16"),
        ((torch.ones((shape.max_tokens + 1, h), device="cuda", dtype=torch.bfloat16), idx, w), "max_tokens"),
        ((x, idx.long(), w), "topk_idx must be int32"),
        ((x, idx, w.half()), "topk_weights must be float32"),
        ((x, idx.t(), w), "not contiguous"),
    ]
    for args, words in cases:
        with pytest.raises(UbnextError, match=f"^PackedExpertParallel.dispatch: .*{words}"):
            ep.dispatch(*args)
    recv_x, offsets, handle = ep.dispatch(x, idx, w)  # the communicator is intact
    y = torch.zeros_like(recv_x)
    with pytest.raises(UbnextError, match="^PackedExpertParallel.combine: y must be"):
        ep.combine(y[:-1].contiguous(), handle)
    out = ep.combine(y, handle)
    ep.dispatch(x, idx, w)
    with pytest.raises(UbnextError, match="^PackedExpertParallel.combine: the handle is not"):
        ep.combine(y, handle)  # an earlier dispatch's
    torch.cuda.synchronize()
    comm.synchronize()
    assert tuple(out.shape) == (t, h)


@pytest.mark.parametrize("problem", ["out_of_range", "repeated"])
def test_bad_routing_raises_on_every_rank_after_the_call(comm, problem):
    """Every rank passes one bad slot: every rank's kernel finds it, writes nothing out of
    bounds, every wait completes, and every rank raises at its next call: RoutingError where
    its own kernel recorded it first, on one rank at least."""
    check_bad_routing(comm, problem, make, routed=lambda shape: shape.padded())


def test_max_rows_exceeded_raises_where_it_is_found_and_breaks_the_others(comm):
    """Every token of every rank to expert 1 (on rank 0) with max_rows 2: rank 0's kernel
    finds it (a sync=True dispatch raises it at once), writes its offsets bounded by 2 and
    nothing out of bounds; after a host barrier, the other ranks' next call finds the
    communicator broken."""
    import torch

    import ubnext

    c = communicator(device=comm.device)  # a communicator of its own: the failure breaks it
    try:
        ep, shape = make(c, "small", "bfloat16", max_rows=2)
        xs, idxs, ws = inputs(shape.padded(), "skewed", [shape.max_tokens] * c.size, seed=6)
        r = c.rank
        poison_outputs(ep)
        found = raised(lambda: ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]), sync=True))
        torch.cuda.synchronize()
        c.bootstrap.barrier()  # rank 0 has announced the failure before the others go on
        if r != 0 and found is None:
            def again():
                ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
                torch.cuda.synchronize()
                c.synchronize()
            found = raised(again)
        if r == 0:  # the rows laid out before the failure stopped the waits are not checked: the call failed
            assert isinstance(found, ubnext.RoutingError) and "max_rows" in str(found), found
            want = pref.dispatch(shape, xs, idxs, ws)[0]
            np.testing.assert_array_equal(ep._views["offsets"].cpu().numpy(), pref.offsets(want))
            check_gaps(ep, "max_rows")
        else:
            assert isinstance(found, ubnext.BrokenCommunicatorError), found
    finally:
        c.close()



def test_objects_sharing_an_area_and_a_low_latency_one_interleave(comm):
    """Two packed objects of one shape (one pool area, one rotation; max_rows apart) and a
    low-latency object of the same sizes, their calls interleaved: each dispatch and combine
    matches the reference (a combine reads its own object's outputs, not the shared area)."""
    import ubnext
    from ubnext._moe import layout as low_layout
    from ubnext._moe import reference as ref

    per_gpu, hidden, tokens, k = SIZES["small"]
    e = per_gpu * comm.size
    first, shape = make(comm, "small", "bfloat16")
    second, tight = make(comm, "small", "bfloat16", max_rows=shape.max_rows - 1)
    low = ubnext.ExpertParallel(comm, e, hidden, tokens, k, "bfloat16", framework="torch")
    low_shape = low_layout.shape(comm.size, e, hidden, tokens, k, "bfloat16")
    r = comm.rank
    rounds = [inputs(shape.padded(), "dropped", tokens_of(shape.padded()), seed=300 + i) for i in range(3)]
    handles = []
    for ep, sh, (xs, idxs, ws) in zip((first, second, low), (shape, tight, low_shape), rounds):
        handles.append(ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))[2])
    for ep, sh, (xs, idxs, ws), handle in zip((second, low, first), (tight, low_shape, shape), rounds[1:] + rounds[:1],
                                              handles[1:] + handles[:1]):
        packed = ep is not low
        want = (pref if packed else ref).dispatch(sh, xs, idxs, ws)
        if packed:
            assert not any(d.overflow for d in want)
            combine_and_check(comm, ep, sh, handle, want, idxs, expert_outputs(sh, 310), f"object {sh}")
        else:
            import torch

            ys = [np.ones((sh.local_experts, sh.capacity, hidden), NP["bfloat16"]) for _ in range(comm.size)]
            out = ep.combine(to_device(ys[r]), handle)
            torch.cuda.synchronize()
            assert ref_mismatches(host(out), ref.combine(sh, want, ys, idxs)[r]).size == 0
