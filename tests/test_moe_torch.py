"""ubnext.torch.moe on CPU: the ops' schemas and fakes (static shapes under FakeTensorMode,
torch.compile(fullgraph) with no graph break, equal to eager), and their autograd wiring at
1, 2 and 4 thread ranks, against the host references (tests/moe_support.py,
ubnext/_moe/reference.py) bit for bit: a host ExpertParallel (``HostExpertParallel``) does
the two calls with the reference over the thread ranks of tests/torch_fakes.py, so what is
tested is the torch layer: its copies and masks, its pairing of combine with dispatch, its
backward formulas and the gradient of the weights travelling back to the tokens."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_support import (NP, combine_backward, dispatch_backward, expert_outputs, inputs,  # noqa: E402
                         moe_block_module, tokens_of)
from torch_fakes import run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import UbnextError  # noqa: E402
from ubnext._api import handles  # noqa: E402
from ubnext._moe import layout  # noqa: E402
from ubnext._moe import reference as ref  # noqa: E402
from ubnext._moe.expert_parallel import Handle  # noqa: E402

#: (experts per rank, hidden, max tokens, top-k)
SIZES = {"small": (3, 8, 5, 3), "k1": (2, 4, 4, 1)}
TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32}
POISON = {"bfloat16": float("nan"), "float32": float("nan")}


def to_numpy(t) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(NP["bfloat16"])
    return t.numpy().copy()


def to_torch(a: np.ndarray):
    if a.dtype == NP["bfloat16"]:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class HostExpertParallel:
    """ExpertParallel's calls on the thread ranks of a ``run_ranks`` group, by the host
    reference: the same outputs (its own buffers, rows past the counts left poisoned as the
    kernel leaves them unwritten), the same pairing of a combine with the latest dispatch."""

    def __init__(self, comm, size: str, dtype: str):
        per, hidden, tokens, k = SIZES[size]
        self.comm, self.size = comm, comm.size  # ExpertParallel's properties
        self.shape = layout.shape(comm.size, per * comm.size, hidden, tokens, k, dtype)
        self._generation = 0
        self.calls: list[str] = []
        handles.assign(self)

    def _all(self, t) -> list[np.ndarray]:
        return [to_numpy(p) for p in self.comm._gather(t)]

    def dispatch(self, x, topk_idx, topk_weights):
        self.calls.append("dispatch")
        s, r = self.shape, self.comm.rank
        self._idxs = self._all(topk_idx)
        self._dispatched = ref.dispatch(s, self._all(x), self._idxs, self._all(topk_weights))
        d = self._dispatched[r]
        recv_x = torch.full((s.local_experts, s.capacity, s.hidden), POISON[s.dtype], dtype=TORCH[s.dtype])
        src = torch.full((s.local_experts, s.capacity), 0x5A5A5A5A, dtype=torch.int32)
        weights = torch.full((s.local_experts, s.capacity), float("nan"))
        kept = torch.from_numpy(np.arange(s.capacity)[None, :] < d.counts[:, None])
        recv_x[kept] = to_torch(d.recv_x)[kept]
        src[kept], weights[kept] = torch.from_numpy(d.src)[kept], torch.from_numpy(d.weights)[kept]
        self._generation += 1
        return recv_x, torch.from_numpy(d.counts), Handle(src, weights, x.shape[0], self,
                                                          self._generation)

    def combine(self, y, handle, weights=None):
        self.calls.append("combine")
        if handle._owner is not self or handle._generation != self._generation:
            raise UbnextError("ExpertParallel.combine: the handle is not this object's latest dispatch's")
        ws = None if weights is None else self._all(weights)
        out = ref.combine(self.shape, self._dispatched, self._all(y), self._idxs, ws)[self.comm.rank]
        return to_torch(out)


def rank_inputs(ep, kind: str, seed: int):
    """This rank's (x, topk_idx, topk_weights) and every rank's numpy ones."""
    xs, idxs, ws = inputs(ep.shape, kind, tokens_of(ep.shape), seed)
    r = ep.comm.rank
    return (to_torch(xs[r]), torch.from_numpy(idxs[r]), torch.from_numpy(ws[r])), (xs, idxs, ws)


def same_bits(got, want: np.ndarray) -> bool:
    from ubnext._tools import reference

    return reference.mismatches(to_numpy(got).reshape(-1), np.asarray(want).reshape(-1)).size == 0


def test_schemas():
    ops = torch.ops.ubnext
    assert str(ops.moe_dispatch.default._schema) == (
        "ubnext::moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int ep) -> (Tensor, Tensor, Tensor, "
        "Tensor)")
    assert str(ops.moe_combine.default._schema) == (
        "ubnext::moe_combine(Tensor y, Tensor weights, Tensor topk_idx, int ep) -> Tensor")
    assert str(ops.moe_dispatch_backward.default._schema) == (
        "ubnext::moe_dispatch_backward(Tensor grad_recv_x, Tensor topk_idx, int ep) -> Tensor")
    assert str(ops.moe_gather_weights.default._schema) == (
        "ubnext::moe_gather_weights(Tensor grad_weights, Tensor src, Tensor topk_idx, int ep) -> Tensor")


@pytest.mark.parametrize("nranks", [1, 2])
def test_fakes_give_the_static_shapes_and_run_nothing(nranks):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        ep = HostExpertParallel(comm, "small", "bfloat16")
        s, h = ep.shape, ut.handle(ep)
        lo, c = s.local_experts, s.capacity
        with FakeTensorMode():
            x = torch.empty(4, s.hidden, dtype=torch.bfloat16)
            idx, w = torch.empty(4, s.top_k, dtype=torch.int32), torch.empty(4, s.top_k)
            recv_x, counts, src, weights = torch.ops.ubnext.moe_dispatch(x, idx, w, h)
            out = torch.ops.ubnext.moe_combine(recv_x, weights, idx, h)
            gx = torch.ops.ubnext.moe_dispatch_backward(recv_x, idx, h)
            gw = torch.ops.ubnext.moe_gather_weights(weights, src, idx, h)
        got = [(tuple(t.shape), t.dtype) for t in (recv_x, counts, src, weights, out, gx, gw)]
        assert got == [((lo, c, s.hidden), torch.bfloat16), ((lo,), torch.int32), ((lo, c), torch.int32),
                       ((lo, c), torch.float32), ((4, s.hidden), torch.bfloat16), ((4, s.hidden), torch.bfloat16),
                       ((4, s.top_k), torch.float32)]
        return ep.calls + [comm.calls]

    assert run_ranks(nranks, body) == [[0]] * nranks  # fake tensors call nothing


def test_bad_shapes_raise_naming_the_op():
    def body(comm):
        ep = HostExpertParallel(comm, "small", "bfloat16")
        s, h = ep.shape, ut.handle(ep)
        x, idx, w = (torch.zeros(2, s.hidden, dtype=torch.bfloat16), torch.zeros(2, s.top_k, dtype=torch.int32),
                     torch.zeros(2, s.top_k))
        cases = [(lambda: ut.moe.dispatch(x.float(), idx, w, ep), "moe_dispatch: x must be bfloat16"),
                 (lambda: ut.moe.dispatch(x, idx[:1], w, ep), r"moe_dispatch: topk_idx must be int32 of shape \[2 x"),
                 (lambda: ut.moe.dispatch(x, idx, w.double(), ep), "moe_dispatch: topk_weights must be float32"),
                 (lambda: ut.moe.dispatch(torch.zeros(s.max_tokens + 1, s.hidden, dtype=torch.bfloat16),
                                          torch.zeros(s.max_tokens + 1, s.top_k, dtype=torch.int32),
                                          torch.zeros(s.max_tokens + 1, s.top_k), ep), "at most max_tokens"),
                 (lambda: torch.ops.ubnext.moe_combine(torch.zeros(1), torch.zeros(1), idx, h), "moe_combine: y must"),
                 (lambda: torch.ops.ubnext.moe_combine(
                     torch.zeros(s.local_experts, s.capacity, s.hidden, dtype=torch.bfloat16),
                     torch.zeros(s.local_experts, s.capacity), idx, h), "no dispatch of this object")]
        for call, words in cases:
            with pytest.raises(UbnextError, match=f"^ubnext::{words}" if words.startswith("moe") else words):
                call()
        return ep.calls

    assert run_ranks(1, body) == [[]]  # nothing reached the object


def test_an_fp8_object_is_refused_before_its_dispatch_runs():
    """An fp8 object's dispatch returns (codes, scales), which the ops do not take: the op
    raises before the object is called (not a TypeError after its collective ran)."""
    def body(comm):
        ep = HostExpertParallel(comm, "small", "bfloat16")
        ep.shape = s = layout.shape(comm.size, ep.shape.num_experts, layout.FP8_HIDDEN_MULTIPLE, ep.shape.max_tokens,
                                    ep.shape.top_k, "bfloat16", fp8=True)
        x, idx, w = (torch.zeros(2, s.hidden, dtype=torch.bfloat16), torch.zeros(2, s.top_k, dtype=torch.int32),
                     torch.zeros(2, s.top_k))
        with pytest.raises(UbnextError, match="^ubnext::moe_dispatch: .*fp8"):
            ut.moe.dispatch(x, idx, w, ep)
        return ep.calls

    assert run_ranks(1, body) == [[]]  # nothing reached the object


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "dropped", "skewed"])
def test_forward_copies_masks_and_combines(nranks, dtype, kind):
    """The op's outputs: the dispatch's rows (bit for bit), zero past the counts (src -1,
    weight 0) where the object's buffers hold poison; new tensors that a later dispatch
    leaves alone; the combine the reference's."""
    def body(comm):
        ep = HostExpertParallel(comm, "small", dtype)
        s, r = ep.shape, comm.rank
        (x, idx, w), (xs, idxs, ws) = rank_inputs(ep, kind, seed=nranks * 10 + len(kind))
        recv_x, counts, handle = ut.moe.dispatch(x, idx, w, ep)
        want = ref.dispatch(s, xs, idxs, ws)[r]
        assert np.array_equal(counts.numpy(), want.counts)
        assert same_bits(recv_x, want.recv_x) and same_bits(handle.weights, want.weights)
        assert np.array_equal(handle.src.numpy(), want.src)
        ys = expert_outputs(s, seed=7)
        out = ut.moe.combine(to_torch(ys[r]), handle)
        assert same_bits(out, ref.combine(s, ref.dispatch(s, xs, idxs, ws), ys, idxs)[r])
        kept = recv_x.clone()
        ut.moe.dispatch(torch.zeros_like(x), idx, w, ep)
        assert torch.equal(kept.view(torch.uint8), recv_x.view(torch.uint8))  # not the object's buffer
        return ep.calls

    assert run_ranks(nranks, body) == [["dispatch", "combine", "dispatch"]] * nranks


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_gradients_bit_for_bit(nranks, dtype, kind):
    """out = combine(Y, dispatch(x, idx, w)) backward with G: Y's and w's gradients (w's
    through combine's weight gradient, then back to the tokens); recv_x's backward with
    R: x's; every one against the host references of the backwards, bit for bit; and the
    calls each backward makes on the object."""
    def body(comm):
        ep = HostExpertParallel(comm, "small", dtype)
        s, r = ep.shape, comm.rank
        (x, idx, w), (xs, idxs, ws) = rank_inputs(ep, kind, seed=100 + nranks)
        rng = np.random.default_rng(5)
        gs = [rng.standard_normal((t, s.hidden)).astype(NP[dtype]) for t in tokens_of(s)]
        rs = [rng.standard_normal((s.local_experts, s.capacity, s.hidden)).astype(NP[dtype]) for _ in range(nranks)]
        ys = expert_outputs(s, seed=8)
        x.requires_grad_()
        w.requires_grad_()
        y = to_torch(ys[r]).requires_grad_()
        recv_x, _, handle = ut.moe.dispatch(x, idx, w, ep)
        ut.moe.combine(y, handle).backward(to_torch(gs[r]), retain_graph=True)
        assert ep.calls == ["dispatch", "combine", "dispatch"] and x.grad is None
        (gx,) = torch.autograd.grad(recv_x, x, to_torch(rs[r]))
        assert ep.calls[3:] == ["dispatch", "combine"]  # the routing again, then the transpose

        dispatched = ref.dispatch(s, xs, idxs, ws)
        grads = combine_backward(s, ref.dispatch(s, gs, idxs, ws), ys, [d.weights for d in dispatched])
        back = dispatch_backward(s, dispatched, rs, [gw for _, gw in grads], idxs)
        assert same_bits(y.grad, grads[r][0]), "y"
        assert same_bits(w.grad, back[r][1]), "topk_weights"
        want_x = dispatch_backward(s, dispatched, rs, [np.zeros((s.local_experts, s.capacity), np.float32)] * nranks,
                                   idxs)[r][0]
        assert same_bits(gx, want_x), "x"
        return True

    assert all(run_ranks(nranks, body))


def test_compiled_equals_eager_forward_and_backward():
    """torch.compile(fullgraph=True) of dispatch, an elementwise expert and combine, with
    its backward: no graph break, the same bits as eager (one rank: dynamo is not
    thread-safe)."""
    torch._dynamo.reset()

    def body(comm):
        ep = HostExpertParallel(comm, "small", "float32")
        (x, idx, w), _ = rank_inputs(ep, "random", seed=3)
        scale = torch.linspace(0.5, 1.5, ep.shape.hidden)

        def fn(x, idx, w, scale):
            recv_x, counts, handle = ut.moe.dispatch(x, idx, w, ep)
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
        ep = HostExpertParallel(comm, "small", "float32")
        h = ut.handle(ep)
        (x, idx, w), _ = rank_inputs(ep, "random", seed=4)
        x = torch.nan_to_num(x, nan=0.5, posinf=2.0)  # opcheck compares with NaN unequal to itself
        ops = torch.ops.ubnext
        torch.library.opcheck(ops.moe_dispatch.default, (x.requires_grad_(), idx, w.requires_grad_(), h))
        recv_x, _, _, weights = ops.moe_dispatch(x.detach(), idx, w.detach(), h)
        torch.library.opcheck(ops.moe_combine.default, (recv_x.requires_grad_(), weights.requires_grad_(), idx, h))

    run_ranks(1, body)


@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_example_block_matches_its_single_process_reference(nranks, dtype, tolerance):
    """examples/moe_block.py's block on the host calls (T = 0 on rank 1): forward and
    backward against its single-process reference, within the tolerance of the experts'
    GEMMs' orders (float32: 1e-5, bfloat16: 2e-2 of the largest magnitude)."""
    mb = moe_block_module()

    def body(comm):
        ep = HostExpertParallel(comm, "small", dtype)
        s = ep.shape
        weights = mb.make_weights(s.num_experts, s.hidden, 12, seed=2)
        block = mb.MoEBlock(ep, weights, torch.device("cpu"))
        g = torch.Generator().manual_seed(3)
        steps = []
        for _ in range(2):  # the second step's gradients are its own (nothing accumulates)
            xs = [torch.randn(t, s.hidden, generator=g).to(TORCH[dtype]) for t in tokens_of(s)]
            grads = [torch.randn(t, s.hidden, generator=g).to(TORCH[dtype]) for t in tokens_of(s)]
            steps.append(mb.check(block, xs, grads, weights, comm.rank))
        return steps

    for steps in run_ranks(nranks, body):
        for errors in steps:
            assert max(errors.values()) <= tolerance, errors


def test_example_block_compiles_without_a_graph_break():
    """examples/moe_block.py's block under torch.compile(fullgraph=True) (aot_eager, one
    rank): no graph break, forward and backward the same bits as eager."""
    torch._dynamo.reset()
    mb = moe_block_module()

    def body(comm):
        ep = HostExpertParallel(comm, "small", "float32")
        s = ep.shape
        block = mb.MoEBlock(ep, mb.make_weights(s.num_experts, s.hidden, 12, seed=5), torch.device("cpu"))
        g = torch.Generator().manual_seed(6)
        x, grad = torch.randn(s.max_tokens, s.hidden, generator=g), torch.randn(s.max_tokens, s.hidden, generator=g)
        explained = torch._dynamo.explain(block)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        results = []
        for f in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
            block.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            out = f(leaf)
            out.backward(grad)
            results.append([out, leaf.grad] + [p.grad for p in block.parameters()])
        return all(torch.equal(a, b) for a, b in zip(*results))

    assert run_ranks(1, body) == [True]
