"""ubnext.torch.moe on CPU: the ops' schemas and fakes (static shapes under FakeTensorMode,
torch.compile(fullgraph) with no graph break, equal to eager), and their autograd wiring at
1, 2 and 4 thread ranks, against the host references (tests/moe_support.py,
ubnext/_moe/reference.py) bit for bit: a host ExpertParallel (tests/moe_torch_support.py)
does the two calls with the reference over the thread ranks of tests/torch_fakes.py, so
what is tested is the torch layer: its copies and masks, its pairing of combine with
dispatch, its backward formulas and the gradient of the weights travelling back to the
tokens. The fakes, forward, gradient, compile and opcheck tests run in both modes
(``MODES``: the throughput mode's ops over a host PackedExpertParallel too); the
throughput mode's schemas and errors are tests/test_moe_packed_torch.py's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moe_support import NP, combine_backward, dispatch_backward, expert_outputs, moe_block_module, row_dims, \
    tokens_of  # noqa: E402
from moe_torch_support import TORCH, MODES, HostExpertParallel, rank_inputs, same_bits, to_numpy, to_torch  # noqa: E402
from torch_fakes import run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext._moe import layout  # noqa: E402
from ubnext import UbnextError  # noqa: E402


def test_schemas():
    ops = torch.ops.ubnext
    assert str(ops.moe_dispatch.default._schema) == (
        "ubnext::moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int ep) -> (Tensor, Tensor, Tensor, "
        "Tensor)")
    assert str(ops.moe_combine.default._schema) == (
        "ubnext::moe_combine(Tensor y, Tensor weights, Tensor topk_idx, int ep) -> Tensor")
    assert str(ops.moe_dispatch_backward.default._schema) == (
        "ubnext::moe_dispatch_backward(Tensor? grad_recv_x, Tensor? grad_weights, Tensor src, Tensor topk_idx, "
        "int ep) -> (Tensor, Tensor)")
    assert not hasattr(ops, "moe_gather_weights")  # one backward op (test_compiled_backward_...)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("nranks", [1, 2])
def test_fakes_give_the_static_shapes_and_run_nothing(nranks, mode):
    """recv_x [L, C, H] (packed: [R, H]), counts [L] (packed: offsets [L + 1]), src and
    weights a value per row; out and x's gradient [T, H], the weights' [T, K]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = MODES[mode]

    def body(comm):
        ep = m.host(comm, "small", "bfloat16")
        s, h = ep.shape, ut.handle(ep)
        rows, lo = row_dims(s), s.local_experts
        op = {call: getattr(torch.ops.ubnext, f"{m.prefix}_{call}")
              for call in ("dispatch", "combine", "dispatch_backward")}
        with FakeTensorMode():
            x = torch.empty(4, s.hidden, dtype=torch.bfloat16)
            idx, w = torch.empty(4, s.top_k, dtype=torch.int32), torch.empty(4, s.top_k)
            recv_x, control, src, weights = op["dispatch"](x, idx, w, h)
            out = op["combine"](recv_x, weights, idx, h)
            gx, gw = op["dispatch_backward"](recv_x, weights, src, *((control,) if mode == "packed" else ()), idx, h)
        got = [(tuple(t.shape), t.dtype) for t in (recv_x, control, src, weights, out, gx, gw)]
        assert got == [((*rows, s.hidden), torch.bfloat16), ((lo + (mode == "packed"),), torch.int32),
                       (rows, torch.int32), (rows, torch.float32), ((4, s.hidden), torch.bfloat16),
                       ((4, s.hidden), torch.bfloat16), ((4, s.top_k), torch.float32)]
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


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "dropped", "skewed"])
def test_forward_copies_masks_and_combines(nranks, dtype, kind, mode):
    """The op's outputs: the dispatch's rows (bit for bit), zero past the rows received (src
    -1, weight 0) where the object's buffers hold poison, its counts (packed: offsets); new
    tensors that a later dispatch leaves alone; the combine the reference's."""
    m = MODES[mode]

    def body(comm):
        ep = m.host(comm, "small", dtype)
        s, r = ep.shape, comm.rank
        (x, idx, w), (xs, idxs, ws) = rank_inputs(ep, kind, seed=nranks * 10 + len(kind))
        recv_x, control, handle = m.dispatch(x, idx, w, ep)
        want = m.ref.dispatch(s, xs, idxs, ws)[r]
        assert handle.packed == (mode == "packed") and np.array_equal(control.numpy(), m.control(want))
        assert same_bits(recv_x, want.recv_x) and same_bits(handle.weights, want.weights)
        assert np.array_equal(handle.src.numpy(), want.src)
        ys = expert_outputs(s, seed=7)
        out = ut.moe.combine(to_torch(ys[r]), handle)
        assert same_bits(out, m.ref.combine(s, m.ref.dispatch(s, xs, idxs, ws), ys, idxs)[r])
        kept = recv_x.clone()
        m.dispatch(torch.zeros_like(x), idx, w, ep)
        assert torch.equal(kept.view(torch.uint8), recv_x.view(torch.uint8))  # not the object's buffer
        return ep.calls

    assert run_ranks(nranks, body) == [["dispatch", "combine", "dispatch"]] * nranks


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_gradients_bit_for_bit(nranks, dtype, kind, mode):
    """out = combine(Y, dispatch(x, idx, w)) backward with G: Y's and w's gradients (w's
    through combine's weight gradient, then back to the tokens: packed, by the offsets);
    recv_x's backward with R: x's; every one against the host references of the
    backwards, bit for bit; and the calls each backward makes on the object."""
    m = MODES[mode]

    def body(comm):
        ep = m.host(comm, "small", dtype)
        s, r = ep.shape, comm.rank
        (x, idx, w), (xs, idxs, ws) = rank_inputs(ep, kind, seed=100 + nranks)
        rng = np.random.default_rng(5)
        gs = [rng.standard_normal((t, s.hidden)).astype(NP[dtype]) for t in tokens_of(s)]
        rs = [rng.standard_normal((*row_dims(s), s.hidden)).astype(NP[dtype]) for _ in range(nranks)]
        ys = expert_outputs(s, seed=8)
        x.requires_grad_()
        w.requires_grad_()
        y = to_torch(ys[r]).requires_grad_()
        recv_x, _, handle = m.dispatch(x, idx, w, ep)
        ut.moe.combine(y, handle).backward(to_torch(gs[r]), retain_graph=True)
        assert ep.calls == ["dispatch", "combine", "dispatch"] and x.grad is None
        (gx,) = torch.autograd.grad(recv_x, x, to_torch(rs[r]))
        assert ep.calls[3:] == ["dispatch", "combine"]  # the routing again, then the transpose

        dispatched = m.ref.dispatch(s, xs, idxs, ws)
        grads = combine_backward(s, m.ref.dispatch(s, gs, idxs, ws), ys, [d.weights for d in dispatched])
        back = dispatch_backward(s, dispatched, rs, [gw for _, gw in grads], idxs)
        assert same_bits(y.grad, grads[r][0]), "y"
        assert same_bits(w.grad, back[r][1]), "topk_weights"
        want_x = dispatch_backward(s, dispatched, rs, [np.zeros(row_dims(s), np.float32)] * nranks, idxs)[r][0]
        assert same_bits(gx, want_x), "x"
        return True

    assert all(run_ranks(nranks, body))


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_equals_eager_forward_and_backward(mode):
    """torch.compile(fullgraph=True) of dispatch, an elementwise expert and combine, with
    its backward: no graph break, the same bits as eager (one rank: dynamo is not
    thread-safe)."""
    torch._dynamo.reset()
    m = MODES[mode]

    def body(comm):
        ep = m.host(comm, "small", "float32")
        (x, idx, w), _ = rank_inputs(ep, "random", seed=3)
        scale = torch.linspace(0.5, 1.5, ep.shape.hidden)

        def fn(x, idx, w, scale):
            recv_x, _, handle = m.dispatch(x, idx, w, ep)
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


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_backward_makes_the_eager_collectives_in_order(mode, monkeypatch):
    """Inductor (caches off) compiles forward and backward on a rank with tokens and on one
    without (another graph: T = 0 is specialized); each makes eager's collectives in eager's
    order. Two independent collectives in a backward are ordered by the compiler, and a
    rank without tokens compiled them in another order than its peers (a deadlock, 2 ranks
    on one H200): the dispatch's two gradients are one op."""
    from ubnext.torch import _moe_ops

    torch._dynamo.reset()
    m = MODES[mode]
    gather = _moe_ops.all_gather_any

    def body(comm):
        ep = m.host(comm, "small", "float32")
        monkeypatch.setattr(_moe_ops, "all_gather_any", lambda c, t: (ep.calls.append("all_gather"), gather(c, t))[1])
        scale = torch.linspace(0.5, 1.5, ep.shape.hidden)

        def fn(x, idx, w):
            recv_x, _, handle = m.dispatch(x, idx, w, ep)
            return ut.moe.combine(torch.tanh(recv_x) * scale, handle)

        sequences = {}
        for tokens in (ep.shape.max_tokens, 0):
            (x, idx, w), _ = rank_inputs(ep, "random", seed=7)
            x, idx, w = x[:tokens], idx[:tokens], w[:tokens]
            for name, f in (("eager", fn), ("inductor", torch.compile(fn, fullgraph=True, backend="inductor"))):
                del ep.calls[:]
                out = f(x.clone().requires_grad_(), idx, w.clone().requires_grad_())
                out.backward(torch.ones_like(out))
                sequences[name, tokens] = list(ep.calls)
        return sequences

    with torch._inductor.config.patch(force_disable_caches=True):
        (sequences,) = run_ranks(1, body)
    want = ["dispatch", "combine", "dispatch", "dispatch", "combine", "all_gather"]
    assert sequences == {key: want for key in sequences}, sequences


@pytest.mark.parametrize("mode", list(MODES))
def test_opcheck(mode):
    """torch.library.opcheck of the forward ops: schema, autograd registration, fake
    tensors and the AOT dispatch (one rank)."""
    m = MODES[mode]

    def body(comm):
        ep = m.host(comm, "small", "float32")
        h = ut.handle(ep)
        (x, idx, w), _ = rank_inputs(ep, "random", seed=4)
        x = torch.nan_to_num(x, nan=0.5, posinf=2.0)  # opcheck compares with NaN unequal to itself
        dispatch, combine = (getattr(torch.ops.ubnext, f"{m.prefix}_{call}") for call in ("dispatch", "combine"))
        torch.library.opcheck(dispatch.default, (x.requires_grad_(), idx, w.requires_grad_(), h))
        recv_x, _, _, weights = dispatch(x.detach(), idx, w.detach(), h)
        torch.library.opcheck(combine.default, (recv_x.requires_grad_(), weights.requires_grad_(), idx, h))

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
