"""Expert-parallel dispatch and combine on GPUs (ubnext.ExpertParallel, docs/moe.md),
bit for bit against the host reference (ubnext/_moe/reference.py) computed from every
rank's inputs: random routing, skewed routing (every token to one expert), no expert on
the last GPU, dropped (-1) slots, T = 0 on rank 1, -0.0 / inf / NaN payloads; several
calls in a row (the sets rotate), dispatches without a combine, CUDA-graph replay; bf16
partials (per call, between fp32 ones; by default, in a graph; ranks that differ raise);
the FP8 dispatch (e4m3 codes and per-128-channel scales);
canaries around every output (the object's buffer gaps, the rows past the counts, a
bordered ``out``); host-side errors before any launch, routing errors raised after the
call.

The same bodies run at any rank count: ``python -m pytest -q tests/test_gpu_moe.py`` (1
rank), ``mpirun -n 2|4 python -m pytest -q tests/test_gpu_moe.py`` (one GPU per rank, or
ranks sharing one GPU with ``--oversubscribe``); skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import Bordered, device, host, require_gpu_and_torch, seed_of
from moe_support import expert_outputs, inputs, tokens_of

from ubnext._moe import layout
from ubnext._moe import reference as ref
from ubnext._moe.base import CANARY

pytestmark = pytest.mark.gpu

#: a pool and a timeout for tests: a wrong kernel fails in seconds instead of hanging
SETTINGS = dict(pool_mb=256, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048, timeout_s=30.0)
#: (experts per GPU, hidden, max tokens, top-k): small odd sizes, and the issue's hidden
SIZES = {"small": (3, 136, 9, 3), "wide": (4, 7168, 6, 4), "k1": (2, 64, 5, 1)}
#: the FP8 dispatch's: hidden a multiple of 512 (four groups of 128 channels)
FP8_SIZES = {"fp8": (3, 512, 7, 3)}
KINDS = ("random", "skewed", "not_last_gpu", "dropped")


def communicator(**extra):
    require_gpu_and_torch()
    import torch

    import ubnext

    c = ubnext.Communicator(**{**SETTINGS, **extra})
    torch.cuda.set_device(c.device)
    return c


@pytest.fixture(scope="module")
def comm():
    c = communicator()
    yield c
    c.close()


def make(comm, size: str, dtype: str, capacity=None, partials="float32", fp8=False):
    import ubnext

    per_gpu, hidden, tokens, k = {**SIZES, **FP8_SIZES}[size]
    ep = ubnext.ExpertParallel(comm, per_gpu * comm.size, hidden, tokens, k, dtype, capacity=capacity,
                               framework="torch", partials=partials, fp8=fp8)
    return ep, layout.shape(comm.size, per_gpu * comm.size, hidden, tokens, k, dtype, capacity, fp8)


def to_device(a: np.ndarray):
    """A host array as a CUDA tensor of the same bits (int32 and float32 as they are)."""
    import torch

    if a.dtype in (np.int32, np.float32):
        return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")
    return device(a)


def poison_outputs(ep):
    """Every byte of the object's outputs the canary byte, so that rows a dispatch must not
    write are seen to keep it."""
    import torch

    ep._raw.fill(CANARY)
    torch.cuda.synchronize()


def check_gaps(ep, what: str):
    """The bytes between and around the object's arrays still hold the canary byte."""
    raw = ep._raw.get()
    ends = sorted((offset, offset + nbytes) for offset, nbytes in ep._slots.values())
    edges = [0] + [b for pair in ends for b in pair] + [raw.size]
    for lo, hi in zip(edges[::2], edges[1::2]):
        changed = np.flatnonzero(raw[lo:hi] != CANARY)
        assert changed.size == 0, f"{what}: {changed.size} canary bytes changed in [{lo}, {hi})"


def check_dispatch(comm, ep, shape, recv_x, counts, handle, want: ref.Dispatched, what: str):
    import torch

    torch.cuda.synchronize()
    comm.synchronize()
    got_counts = counts.cpu().numpy()
    np.testing.assert_array_equal(got_counts, want.counts, err_msg=f"{what}: counts")
    if shape.fp8:  # e4m3 codes (as bytes) and their scales
        codes, scales = recv_x
        got_x, bits, got_s = codes.view(torch.uint8).cpu().numpy(), np.uint8, scales.cpu().numpy()
    else:
        got_x, bits, got_s = host(recv_x), {2: np.uint16, 4: np.uint32}[shape.width], None
    got_src, got_w = handle.src.cpu().numpy(), handle.weights.cpu().numpy()
    canary32 = np.frombuffer(bytes([CANARY]) * 4, np.uint32)[0]
    for e in range(shape.local_experts):
        n = want.counts[e]
        ref_bits = want.recv_x[e, :n].reshape(-1).view(bits)
        got_bits = got_x[e, :n].reshape(-1).view(bits)
        bad = np.flatnonzero(got_bits != ref_bits)
        assert bad.size == 0, f"{what}: expert {e}: {bad.size} elements of its rows differ (first at {bad[:4]})"
        np.testing.assert_array_equal(got_src[e, :n], want.src[e, :n], err_msg=f"{what}: src of expert {e}")
        np.testing.assert_array_equal(got_w[e, :n].view(np.uint32), want.weights[e, :n].view(np.uint32),
                                      err_msg=f"{what}: weights of expert {e}")
        rest = got_x[e, n:].reshape(-1).view(np.uint8)
        assert (rest == CANARY).all(), f"{what}: rows of expert {e} past its count were written"
        assert (got_src[e, n:].view(np.uint32) == canary32).all(), f"{what}: src past the count written"
        if got_s is not None:
            bad = ref_mismatches(got_s[e, :n], want.scales[e, :n])
            assert bad.size == 0, f"{what}: expert {e}: {bad.size} scales differ (first at {bad[:4]})"
            assert (got_s[e, n:].view(np.uint32) == canary32).all(), f"{what}: scales past the count written"
    check_gaps(ep, what)


def run_round(comm, ep, shape, kind: str, seed: int, partials: str = "float32"):
    """One dispatch and combine (with ``partials``) checked against the reference."""
    xs, idxs, ws = inputs(shape, kind, tokens_of(shape), seed)
    r = comm.rank
    poison_outputs(ep)
    recv_x, counts, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
    want = ref.dispatch(shape, xs, idxs, ws)
    check_dispatch(comm, ep, shape, recv_x, counts, handle, want[r], f"dispatch {kind} seed {seed}")
    ys = expert_outputs(shape, seed + 1)
    out = Bordered(len(idxs[r]) * shape.hidden, shape.dtype, seed=seed, shape=(len(idxs[r]), shape.hidden))
    ep.combine(to_device(ys[r]), handle, out=out.view, partials=partials)
    import torch

    torch.cuda.synchronize()
    comm.synchronize()
    got = host(out.view)
    want_out = ref.combine(shape, want, ys, idxs, partials=partials)[r]
    bad = ref_mismatches(got, want_out)
    assert bad.size == 0, f"combine {kind} seed {seed}: {bad.size} elements differ (first at {bad[:4]})"
    out.assert_intact(f"combine {kind} seed {seed}")
    check_gaps(ep, f"combine {kind} seed {seed}")


def raised(call):
    """The exception ``call()`` raised, or None: the failure tests decide after every rank
    has taken its part in the exchanges, so that no rank leaves one early."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 (returned to the test, which asserts on it)
        return e
    return None


def ref_mismatches(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Flat indices where got and want differ in bits (NaN as a class)."""
    from ubnext._tools import reference

    return reference.mismatches(got.reshape(-1), want.reshape(-1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
@pytest.mark.parametrize("size", list(SIZES))
def test_dispatch_and_combine_bit_for_bit(comm, size, dtype, kind):
    """Four rounds in a row: every set of the rotation and both parities."""
    if kind == "not_last_gpu" and comm.size == 1:
        pytest.skip("one GPU holds every expert")
    ep, shape = make(comm, size, dtype)
    for round_ in range(4):
        run_round(comm, ep, shape, kind, seed_of(size, dtype, kind, round_))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", list(SIZES))
def test_bf16_partials_bit_for_bit(comm, size, kind):
    """Combines whose partials cross as bf16, between combines with fp32 ones on the same
    object (the two share the partial area and its poison): four rounds, both parities."""
    if kind == "not_last_gpu" and comm.size == 1:
        pytest.skip("one GPU holds every expert")
    ep, shape = make(comm, size, "bfloat16")
    for round_, partials in enumerate(("bfloat16", "float32", "bfloat16", "bfloat16")):
        run_round(comm, ep, shape, kind, seed_of(size, "bf16-partials", kind, round_), partials)


def test_ranks_whose_partials_differ_raise_on_every_rank(comm):
    """Rank 0 combines with bf16 partials, the others with fp32: the signatures differ, so
    every rank raises (CollectiveMismatchError where it compared them itself) and holds
    poison, not a sum of misread partials."""
    import torch

    import ubnext

    if comm.size == 1:
        pytest.skip("needs 2 or more ranks")
    c = communicator(device=comm.device)  # a communicator of its own: the failure breaks it
    try:
        ep, shape = make(c, "small", "bfloat16")
        r = c.rank
        xs, idxs, ws = inputs(shape, "random", tokens_of(shape), seed=330)
        _, _, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
        out = ep.combine(to_device(expert_outputs(shape, 331)[r]), handle,
                         partials="bfloat16" if r == 0 else "float32")
        torch.cuda.synchronize()
        caught = raised(c.synchronize)
        assert isinstance(caught, ubnext.BrokenCommunicatorError), caught
        assert isinstance(caught, ubnext.CollectiveMismatchError) or "failed first" in str(caught), str(caught)
        assert bool(torch.isnan(out.float()).all().item()), f"rank {r} got a result from mismatched combines"
    finally:
        c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_dispatch_bit_for_bit(comm, kind):
    """fp8=True: every row arrives as the e4m3 codes and fp32 scales of the host's
    quantization (inf and NaN rows: a NaN scale, codes 0), canaries past the counts; the
    combine of bf16 expert outputs after it as ever. Three rounds: both parities."""
    if kind == "not_last_gpu" and comm.size == 1:
        pytest.skip("one GPU holds every expert")
    ep, shape = make(comm, "fp8", "bfloat16", fp8=True)
    for round_ in range(3):
        run_round(comm, ep, shape, kind, seed_of("fp8", kind, round_))


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_dispatches_without_combine_and_a_smaller_capacity(comm, dtype):
    """Five dispatches back to back (no combine between: the rows' sets alternate on their
    own), then one combine of the last; the capacity one below N x M, which the dropped
    routing never reaches (every 5th token has no expert)."""
    ep, shape = make(comm, "small", dtype, capacity=comm.size * SIZES["small"][2] - 1)
    r = comm.rank
    for i in range(5):
        xs, idxs, ws = inputs(shape, "dropped", tokens_of(shape), seed=50 + i)
        poison_outputs(ep)
        recv_x, counts, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
        want = ref.dispatch(shape, xs, idxs, ws)
        assert not any(d.overflow for d in want)
        check_dispatch(comm, ep, shape, recv_x, counts, handle, want[r], f"dispatch {i}")
    ys = expert_outputs(shape, 77)
    out = ep.combine(to_device(ys[r]), handle)
    import torch

    torch.cuda.synchronize()
    assert tuple(out.shape) == (len(idxs[r]), shape.hidden)
    bad = ref_mismatches(host(out), ref.combine(shape, want, ys, idxs)[r])
    assert bad.size == 0


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_combine_with_weights_of_its_own(comm, dtype):
    """weights=ones (the dispatch's transpose: each token's rows summed) and weights=2 w
    (every product twice the router's, exactly), against the reference with those weights."""
    import torch

    ep, shape = make(comm, "small", dtype)
    r = comm.rank
    xs, idxs, ws = inputs(shape, "random", tokens_of(shape), seed=60)
    _, _, handle = ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
    want = ref.dispatch(shape, xs, idxs, ws)
    ys = expert_outputs(shape, 61)
    for what, weights in (("ones", [np.ones((shape.local_experts, shape.capacity), np.float32)] * comm.size),
                          ("twice", [2 * d.weights for d in want])):
        out = ep.combine(to_device(ys[r]), handle, weights=to_device(weights[r]))
        torch.cuda.synchronize()
        bad = ref_mismatches(host(out), ref.combine(shape, want, ys, idxs, weights)[r])
        assert bad.size == 0, f"{what}: {bad.size} elements differ"


def captured_replays(comm, ep, shape, in_shape):
    """dispatch + combine of ``ep`` (bfloat16) captured once in a CUDA graph after a warm-up
    on the capture's stream, then replayed three times (routing random, dropped, skewed)
    with new inputs copied into the captured buffers and the outputs poisoned first
    (``in_shape``: the shape the inputs are drawn for). Yields, after each replay, its
    name, every rank's (xs, idxs, ws) and ys, and the captured (recv_x, control, handle)
    and out. Shared by both modes' graph tests."""
    import torch

    r, tokens = comm.rank, tokens_of(in_shape)
    xs, idxs, ws = inputs(in_shape, "random", tokens, seed=90)
    x, idx, w = to_device(xs[r]), to_device(idxs[r]), to_device(ws[r])
    y = to_device(expert_outputs(shape, 91)[r])
    out = torch.empty((tokens[r], shape.hidden), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm up on the capture's stream
        ep.combine(y, ep.dispatch(x, idx, w)[2], out=out)
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        dispatched = ep.dispatch(x, idx, w)
        ep.combine(y, dispatched[2], out=out)
    torch.cuda.synchronize()
    for replay in range(3):
        xs, idxs, ws = inputs(in_shape, ("random", "dropped", "skewed")[replay], tokens, seed=100 + replay)
        ys = expert_outputs(shape, 200 + replay)
        for dst, src in ((x, xs[r]), (idx, idxs[r]), (w, ws[r]), (y, ys[r])):
            dst.copy_(to_device(src))
        poison_outputs(ep)
        graph.replay()
        yield f"replay {replay}", (xs, idxs, ws), ys, dispatched, out


@pytest.mark.parametrize("partials", list(layout.PARTIALS))
def test_cuda_graph_replay(comm, partials):
    """dispatch + combine captured once, replayed with new inputs copied into the captured
    buffers: every replay matches the reference (the kernels advance their own state); the
    combine's partials the object's default (``ExpertParallel(..., partials=)``)."""
    ep, shape = make(comm, "small", "bfloat16", partials=partials)
    for what, (xs, idxs, ws), ys, (recv_x, counts, handle), out in captured_replays(comm, ep, shape, shape):
        want = ref.dispatch(shape, xs, idxs, ws)
        check_dispatch(comm, ep, shape, recv_x, counts, handle, want[comm.rank], what)
        bad = ref_mismatches(host(out), ref.combine(shape, want, ys, idxs, partials=partials)[comm.rank])
        assert bad.size == 0, f"{what}: {bad.size} elements of the combine differ"


def test_host_visible_errors_raise_before_any_launch(comm):
    import torch

    from ubnext import UbnextError

    ep, shape = make(comm, "small", "bfloat16")
    r, t, k, h = comm.rank, 4, shape.top_k, shape.hidden
    x = torch.ones((t, h), device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros((t, k), device="cuda", dtype=torch.int32)
    idx[:, :] = torch.arange(k, device="cuda", dtype=torch.int32)
    w = torch.ones((t, k), device="cuda", dtype=torch.float32)
    cases = [
        ((x.float(), idx, w), "x must be bfloat16"),
        ((x[:, :-8].contiguous(), idx, w), "x must be bfloat16 of shape"),
        ((torch.ones((shape.max_tokens + 1, h), device="cuda", dtype=torch.bfloat16), idx, w), "max_tokens"),
        ((x, idx.long(), w), "topk_idx must be int32"),
        ((x, idx[:2].contiguous(), w), "topk_idx must be int32 of shape"),
        ((x, idx, w.half()), "topk_weights must be float32"),
        ((x, idx.t(), w), "not contiguous"),
        ((torch.ones(t * h + 1, device="cuda", dtype=torch.bfloat16)[1:].view(t, h), idx, w), "16-byte aligned"),
    ]
    for args, words in cases:
        with pytest.raises(UbnextError, match=f"^ExpertParallel.dispatch: .*{words}"):
            ep.dispatch(*args)
    recv_x, counts, handle = ep.dispatch(x, idx, w)  # the communicator is intact
    y = torch.zeros_like(recv_x)
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: y must be"):
        ep.combine(y[:, :, :8].contiguous(), handle)
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: out must be"):
        ep.combine(y, handle, out=torch.empty((t + 1, h), device="cuda", dtype=torch.bfloat16))
    out = ep.combine(y, handle)
    ep.dispatch(x, idx, w)
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: the handle is not"):
        ep.combine(y, handle)  # an earlier dispatch's
    torch.cuda.synchronize()
    comm.synchronize()
    assert tuple(out.shape) == (t, h) and r == comm.rank


def check_bad_routing(comm, problem: str, make, routed=lambda shape: shape) -> None:
    """One bad slot on every rank (``problem``: an expert id out of range, or one expert
    twice), on an object of ``make`` (its inputs drawn for ``routed(shape)``) over a
    communicator of its own: every rank raises BrokenCommunicatorError at its next call,
    RoutingError naming the problem on one rank at least, and the gaps keep their canary."""
    import torch

    import ubnext

    c = communicator(device=comm.device)  # a communicator of its own: the failure breaks it
    try:
        ep, shape = make(c, "small", "float32")
        xs, idxs, ws = inputs(routed(shape), "random", [shape.max_tokens] * c.size, seed=5)
        idx = idxs[c.rank].copy()
        idx[2, 1] = shape.num_experts + 3 if problem == "out_of_range" else idx[2, 0]
        poison_outputs(ep)
        ep.dispatch(to_device(xs[c.rank]), to_device(idx), to_device(ws[c.rank]))
        torch.cuda.synchronize()
        caught = raised(c.synchronize)
        routing = c.bootstrap.allgather_obj(isinstance(caught, ubnext.RoutingError))
        assert isinstance(caught, ubnext.BrokenCommunicatorError), caught
        words = {"out_of_range": "an expert id out of range", "repeated": "one expert twice"}[problem]
        assert not isinstance(caught, ubnext.RoutingError) or words in str(caught)
        assert any(routing)
        check_gaps(ep, problem)
    finally:
        c.close()


@pytest.mark.parametrize("problem", ["out_of_range", "repeated"])
def test_bad_routing_raises_on_every_rank_after_the_call(comm, problem):
    """Every rank passes one bad slot: every rank's kernel finds it, writes nothing out of
    bounds, every wait completes, and every rank raises at its next call: RoutingError where
    its own kernel recorded it first (a rank whose kernel saw another rank's failure
    announced first records that one: BrokenCommunicatorError), on one rank at least."""
    check_bad_routing(comm, problem, make)


def test_capacity_exceeded_raises_where_it_is_found_and_breaks_the_others(comm):
    """Every token of every rank to expert 1 (on rank 0) with a capacity of 2: rank 0's
    kernel finds it and raises RoutingError; after a host barrier, the other ranks' next
    call finds the communicator broken."""
    import torch

    import ubnext

    c = communicator(device=comm.device)  # a communicator of its own: the failure breaks it
    try:
        ep, shape = make(c, "small", "bfloat16", capacity=2)
        xs, idxs, ws = inputs(shape, "skewed", [shape.max_tokens] * c.size, seed=6)
        r = c.rank
        poison_outputs(ep)
        ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
        torch.cuda.synchronize()
        found = raised(c.synchronize) if r == 0 else None
        c.bootstrap.barrier()  # rank 0 has announced the failure before the others go on
        if r != 0:
            def again():
                ep.dispatch(to_device(xs[r]), to_device(idxs[r]), to_device(ws[r]))
                torch.cuda.synchronize()
                c.synchronize()
            found = raised(again)
        if r == 0:
            assert isinstance(found, ubnext.RoutingError) and "capacity" in str(found), found
            check_gaps(ep, "capacity")
        else:
            assert isinstance(found, ubnext.BrokenCommunicatorError), found
    finally:
        c.close()
