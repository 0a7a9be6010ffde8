"""ubnext.torch.moe's throughput mode on CPU (``packed_dispatch``, ``combine`` of its handle:
``torch.ops.ubnext.moe_packed_*``): schemas and fakes (static ``[R, H]`` shapes under
FakeTensorMode, torch.compile(fullgraph) with no graph break, equal to eager), and autograd
at 1, 2 and 4 thread ranks against the host references (ubnext/_moe/packed_reference.py,
tests/moe_support.py) bit for bit: a host PackedExpertParallel (``HostPackedExpertParallel``)
does the two calls with the reference over the thread ranks of tests/torch_fakes.py, so
what is tested is the torch layer, as tests/test_moe_torch.py tests the low-latency one."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_support import NP, combine_backward, dispatch_backward, expert_outputs, inputs, tokens_of  # noqa: E402
from test_moe_torch import POISON, SIZES, TORCH, same_bits, to_numpy, to_torch  # noqa: E402
from torch_fakes import run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import UbnextError  # noqa: E402
from ubnext._api import handles  # noqa: E402
from ubnext._moe import packed_layout  # noqa: E402
from ubnext._moe import packed_reference as pref  # noqa: E402
from ubnext._moe.packed import PackedHandle  # noqa: E402


class HostPackedExpertParallel:
    """PackedExpertParallel's calls (``sync=False``) on the thread ranks of a ``run_ranks``
    group, by the host reference: its own buffers (rows from ``offsets[L]`` on left poisoned,
    as the kernel leaves them unwritten), the same pairing of a combine with the latest
    dispatch. ``max_rows``: R below the default (the routing of these tests fits)."""

    def __init__(self, comm, size: str, dtype: str, max_rows: int | None = None):
        per, hidden, tokens, k = SIZES[size]
        self.comm, self.size = comm, comm.size  # PackedExpertParallel's properties
        self.shape = packed_layout.shape(comm.size, per * comm.size, hidden, tokens, k, dtype, max_rows)
        self._generation = 0
        self.calls: list[str] = []
        handles.assign(self)

    def _all(self, t) -> list[np.ndarray]:
        return [to_numpy(p) for p in self.comm._gather(t)]

    def dispatch(self, x, topk_idx, topk_weights, sync=False):
        assert not sync  # the ops' form
        self.calls.append("dispatch")
        s, r = self.shape, self.comm.rank
        self._idxs = self._all(topk_idx)
        self._dispatched = pref.dispatch(s, self._all(x), self._idxs, self._all(topk_weights))
        d = self._dispatched[r]
        assert not d.overflow
        rows = int(d.counts.sum())
        recv_x = torch.full((s.max_rows, s.hidden), POISON[s.dtype], dtype=TORCH[s.dtype])
        src = torch.full((s.max_rows,), 0x5A5A5A5A, dtype=torch.int32)
        weights = torch.full((s.max_rows,), float("nan"))
        recv_x[:rows] = to_torch(d.recv_x)[:rows]
        src[:rows], weights[:rows] = torch.from_numpy(d.src)[:rows], torch.from_numpy(d.weights)[:rows]
        self._generation += 1
        offsets = torch.from_numpy(pref.offsets(d))
        return recv_x, offsets, PackedHandle(offsets, src, weights, x.shape[0], None, self, self._generation)

    def combine(self, y, handle, weights=None):
        self.calls.append("combine")
        if handle._owner is not self or handle._generation != self._generation:
            raise UbnextError("PackedExpertParallel.combine: the handle is not this object's latest dispatch's")
        ws = None if weights is None else self._all(weights)
        return to_torch(pref.combine(self.shape, self._dispatched, self._all(y), self._idxs, ws)[self.comm.rank])


def rank_inputs(ep, kind: str, seed: int):
    """This rank's (x, topk_idx, topk_weights) and every rank's numpy ones."""
    xs, idxs, ws = inputs(ep.shape, kind, tokens_of(ep.shape), seed)
    r = ep.comm.rank
    return (to_torch(xs[r]), torch.from_numpy(idxs[r]), torch.from_numpy(ws[r])), (xs, idxs, ws)


def test_schemas():
    ops = torch.ops.ubnext
    assert str(ops.moe_packed_dispatch.default._schema) == (
        "ubnext::moe_packed_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int ep) -> (Tensor, Tensor, "
        "Tensor, Tensor)")
    assert str(ops.moe_packed_combine.default._schema) == (
        "ubnext::moe_packed_combine(Tensor y, Tensor weights, Tensor topk_idx, int ep) -> Tensor")
    assert str(ops.moe_packed_dispatch_backward.default._schema) == (
        "ubnext::moe_packed_dispatch_backward(Tensor grad_recv_x, Tensor topk_idx, int ep) -> Tensor")
    assert str(ops.moe_packed_gather_weights.default._schema) == (
        "ubnext::moe_packed_gather_weights(Tensor grad_weights, Tensor src, Tensor offsets, Tensor topk_idx, "
        "int ep) -> Tensor")


def test_every_op_is_side_effecting():
    """A rank without tokens has zero-size outputs: no compiler may drop its calls."""
    import torch.fx.node

    for name in ("dispatch", "combine", "dispatch_backward", "gather_weights"):
        assert getattr(torch.ops.ubnext, f"moe_packed_{name}").default in torch.fx.node._side_effectful_functions


@pytest.mark.parametrize("nranks", [1, 2])
def test_fakes_give_the_static_shapes_and_run_nothing(nranks):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", "bfloat16")
        s, h = ep.shape, ut.handle(ep)
        r, lo = s.max_rows, s.local_experts
        with FakeTensorMode():
            x = torch.empty(4, s.hidden, dtype=torch.bfloat16)
            idx, w = torch.empty(4, s.top_k, dtype=torch.int32), torch.empty(4, s.top_k)
            recv_x, offsets, src, weights = torch.ops.ubnext.moe_packed_dispatch(x, idx, w, h)
            out = torch.ops.ubnext.moe_packed_combine(recv_x, weights, idx, h)
            gx = torch.ops.ubnext.moe_packed_dispatch_backward(recv_x, idx, h)
            gw = torch.ops.ubnext.moe_packed_gather_weights(weights, src, offsets, idx, h)
        got = [(tuple(t.shape), t.dtype) for t in (recv_x, offsets, src, weights, out, gx, gw)]
        assert got == [((r, s.hidden), torch.bfloat16), ((lo + 1,), torch.int32), ((r,), torch.int32),
                       ((r,), torch.float32), ((4, s.hidden), torch.bfloat16), ((4, s.hidden), torch.bfloat16),
                       ((4, s.top_k), torch.float32)]
        return ep.calls + [comm.calls]

    assert run_ranks(nranks, body) == [[0]] * nranks  # fake tensors call nothing


def test_bad_shapes_raise_naming_the_op():
    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", "float32")
        s, h = ep.shape, ut.handle(ep)
        x, idx, w = torch.zeros(2, s.hidden), torch.zeros(2, s.top_k, dtype=torch.int32), torch.zeros(2, s.top_k)
        rows = torch.zeros(s.max_rows, s.hidden)
        cases = [(lambda: ut.moe.packed_dispatch(x.double(), idx, w, ep), "moe_packed_dispatch: x must be float32"),
                 (lambda: ut.moe.packed_dispatch(x, idx[:1], w, ep),
                  r"moe_packed_dispatch: topk_idx must be int32 of shape \[2 x"),
                 (lambda: torch.ops.ubnext.moe_packed_combine(rows[:-1], torch.zeros(s.max_rows), idx, h),
                  rf"moe_packed_combine: y must be float32 of shape \[{s.max_rows} x {s.hidden}\]"),
                 (lambda: torch.ops.ubnext.moe_packed_combine(rows, torch.zeros(s.max_rows - 1), idx, h),
                  rf"moe_packed_combine: weights must be float32 of shape \[{s.max_rows}\]"),
                 (lambda: torch.ops.ubnext.moe_packed_gather_weights(
                     torch.zeros(s.max_rows), torch.zeros(s.max_rows, dtype=torch.int32),
                     torch.zeros(s.local_experts, dtype=torch.int32), idx, h),
                  rf"moe_packed_gather_weights: offsets must be int32 of shape \[{s.local_experts + 1}\]"),
                 (lambda: torch.ops.ubnext.moe_packed_combine(rows, torch.zeros(s.max_rows), idx, h),
                  "moe_packed_combine: no dispatch of this object")]
        for call, words in cases:
            with pytest.raises(UbnextError, match=f"^ubnext::{words}"):
                call()
        return ep.calls

    assert run_ranks(1, body) == [[]]  # nothing reached the object


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "dropped", "skewed"])
def test_forward_copies_masks_and_combines(nranks, dtype, kind):
    """The op's outputs: the packed rows (bit for bit) and offsets, zero from offsets[L] on
    (src -1, weight 0) where the object's buffers hold poison; new tensors that a later
    dispatch leaves alone; the combine the reference's."""
    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", dtype)
        s, r = ep.shape, comm.rank
        (x, idx, w), (xs, idxs, ws) = rank_inputs(ep, kind, seed=nranks * 10 + len(kind))
        recv_x, offsets, handle = ut.moe.packed_dispatch(x, idx, w, ep)
        want = pref.dispatch(s, xs, idxs, ws)[r]
        assert handle.packed and np.array_equal(offsets.numpy(), pref.offsets(want))
        assert same_bits(recv_x, want.recv_x) and same_bits(handle.weights, want.weights)
        assert np.array_equal(handle.src.numpy(), want.src)
        ys = expert_outputs(s, seed=7)
        out = ut.moe.combine(to_torch(ys[r]), handle)
        assert same_bits(out, pref.combine(s, pref.dispatch(s, xs, idxs, ws), ys, idxs)[r])
        kept = recv_x.clone()
        ut.moe.packed_dispatch(torch.zeros_like(x), idx, w, ep)
        assert torch.equal(kept.view(torch.uint8), recv_x.view(torch.uint8))  # not the object's buffer
        return ep.calls

    assert run_ranks(nranks, body) == [["dispatch", "combine", "dispatch"]] * nranks


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_gradients_bit_for_bit(nranks, dtype, kind):
    """out = combine(Y, packed_dispatch(x, idx, w)) backward with G: Y's and w's gradients
    (w's through combine's weight gradient, then back to the tokens through the offsets);
    recv_x's backward with R: x's; every one against the host references, bit for bit."""
    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", dtype)
        s, r = ep.shape, comm.rank
        (x, idx, w), (xs, idxs, ws) = rank_inputs(ep, kind, seed=100 + nranks)
        rng = np.random.default_rng(5)
        gs = [rng.standard_normal((t, s.hidden)).astype(NP[dtype]) for t in tokens_of(s)]
        rs = [rng.standard_normal((s.max_rows, s.hidden)).astype(NP[dtype]) for _ in range(nranks)]
        ys = expert_outputs(s, seed=8)
        x.requires_grad_()
        w.requires_grad_()
        y = to_torch(ys[r]).requires_grad_()
        recv_x, _, handle = ut.moe.packed_dispatch(x, idx, w, ep)
        ut.moe.combine(y, handle).backward(to_torch(gs[r]), retain_graph=True)
        assert ep.calls == ["dispatch", "combine", "dispatch"] and x.grad is None
        (gx,) = torch.autograd.grad(recv_x, x, to_torch(rs[r]))
        assert ep.calls[3:] == ["dispatch", "combine"]  # the routing again, then the transpose

        dispatched = pref.dispatch(s, xs, idxs, ws)
        grads = combine_backward(s, pref.dispatch(s, gs, idxs, ws), ys, [d.weights for d in dispatched])
        back = dispatch_backward(s, dispatched, rs, [gw for _, gw in grads], idxs)
        assert same_bits(y.grad, grads[r][0]), "y"
        assert same_bits(w.grad, back[r][1]), "topk_weights"
        want_x = dispatch_backward(s, dispatched, rs, [np.zeros(s.max_rows, np.float32)] * nranks, idxs)[r][0]
        assert same_bits(gx, want_x), "x"
        return True

    assert all(run_ranks(nranks, body))


def test_compiled_equals_eager_forward_and_backward():
    """torch.compile(fullgraph=True) of packed_dispatch, an elementwise expert and combine,
    with its backward: no graph break, the same bits as eager (one rank)."""
    torch._dynamo.reset()

    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", "float32")
        (x, idx, w), _ = rank_inputs(ep, "random", seed=3)
        scale = torch.linspace(0.5, 1.5, ep.shape.hidden)

        def fn(x, idx, w, scale):
            recv_x, offsets, handle = ut.moe.packed_dispatch(x, idx, w, ep)
            return ut.moe.combine(torch.tanh(recv_x) * scale, handle)

        explained = torch._dynamo.explain(fn)(x, idx, w, scale)
        assert explained.graph_break_count == 0, explained.break_reasons
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), scale.clone().requires_grad_()]
            out = f(leaves[0], idx, leaves[1], leaves[2])
            out.backward(torch.cos(out.detach()))
            results.append([out] + [t.grad for t in leaves])
        return all(same_bits(a, to_numpy(b)) for a, b in zip(*results))

    assert run_ranks(1, body) == [True]


def test_opcheck():
    """torch.library.opcheck of the forward ops: schema, autograd registration, fake
    tensors and the AOT dispatch (one rank)."""
    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", "float32")
        h = ut.handle(ep)
        (x, idx, w), _ = rank_inputs(ep, "random", seed=4)
        x = torch.nan_to_num(x, nan=0.5, posinf=2.0)  # opcheck compares with NaN unequal to itself
        ops = torch.ops.ubnext
        torch.library.opcheck(ops.moe_packed_dispatch.default, (x.requires_grad_(), idx, w.requires_grad_(), h))
        recv_x, _, _, weights = ops.moe_packed_dispatch(x.detach(), idx, w.detach(), h)
        torch.library.opcheck(ops.moe_packed_combine.default, (recv_x.requires_grad_(), weights.requires_grad_(),
                                                               idx, h))

    run_ranks(1, body)
