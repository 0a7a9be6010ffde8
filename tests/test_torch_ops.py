"""ubnext.torch's custom ops and torch.distributed-shaped API on CPU, with thread-rank
communicators (tests/torch_fakes.py): schemas and mutation annotations, opcheck, fake
implementations, zero graph breaks under torch._dynamo.explain, torch.compile(fullgraph)
equal to eager, ReduceOp, in place against out of place, and the gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ubnext.torch as ut  # noqa: E402
from torch_fakes import rank_order, run_ranks  # noqa: E402
from ubnext import UbnextError  # noqa: E402
from ubnext.torch import _rmsnorm, functional  # noqa: E402


def one_rank(fn):
    return run_ranks(1, fn)[0]


def test_schemas_and_mutations():
    ops = torch.ops.ubnext
    assert str(ops.all_reduce.default._schema) == "ubnext::all_reduce(Tensor x, str op, int group) -> Tensor"
    assert str(ops.all_reduce_.default._schema) == "ubnext::all_reduce_(Tensor(a!) x, str op, int group) -> ()"
    assert str(ops.all_reduce_add_rmsnorm.default._schema) == (
        "ubnext::all_reduce_add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, "
        "int group) -> (Tensor, Tensor)")
    writes = {name: [a.name for a in getattr(ops, name).default._schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write]
              for name in ("all_reduce", "all_reduce_", "all_reduce_add_rmsnorm")}
    assert writes == {"all_reduce": [], "all_reduce_": ["x"], "all_reduce_add_rmsnorm": []}


def test_opcheck():
    def body(comm):
        h = ut.handle(comm)
        x = torch.randn(4, 16)
        r, w, b = torch.randn(4, 16), torch.randn(16), torch.randn(16)
        ops = torch.ops.ubnext
        torch.library.opcheck(ops.all_reduce.default, (x, "sum", h))
        torch.library.opcheck(ops.all_reduce.default, (x.requires_grad_(), "avg", h))
        torch.library.opcheck(ops.all_reduce_.default, (torch.randn(4, 16), "max", h))
        torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, r, w, b, 1e-6, h))
        torch.library.opcheck(ops.all_reduce_add_rmsnorm.default,
                              (x, r.requires_grad_(), w.requires_grad_(), b.requires_grad_(), 1e-6, h))
        torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, None, w, None, 0.0, h))

    one_rank(body)


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        h = ut.handle(comm)
        with FakeTensorMode():
            x = torch.empty(5, 24, dtype=torch.bfloat16)
            y = torch.ops.ubnext.all_reduce(x, "sum", h)
            n, r = torch.ops.ubnext.all_reduce_add_rmsnorm(x, x, torch.empty(24, dtype=torch.bfloat16), None, 1e-6, h)
            torch.ops.ubnext.all_reduce_(x, "sum", h)
        for t in (y, n, r):
            assert t.shape == (5, 24) and t.dtype == torch.bfloat16
        return comm.calls

    assert one_rank(body) == 0  # fake tensors run nothing


def _uses_every_form(comm):
    def fn(x, residual, weight):
        ut.all_reduce(x, op=ut.ReduceOp.SUM, group=comm)
        y = functional.all_reduce(functional.copy_to_group(x, comm) * 2, ut.ReduceOp.AVG, group=comm)
        return functional.all_reduce_add_rmsnorm(y, residual, weight, None, 1e-6, group=comm)

    return fn


def test_dynamo_explain_has_no_graph_breaks():
    import tp_support as tp

    def body(comm):
        x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
        explained = torch._dynamo.explain(_uses_every_form(comm))(x, r, w)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
        m = tp.mlp(comm, tp.weights(16, 32, 16, torch.float32, "cpu"), torch.float32, "cpu")
        explained = torch._dynamo.explain(m)(x, r)
        assert explained.graph_break_count == 0, explained.break_reasons

    one_rank(body)


def test_compiled_equals_eager():
    """One rank: Dynamo is not thread-safe (the GPU test compiles at N ranks, in N processes)."""
    torch._dynamo.reset()

    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        x, r, w = (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, generator=g))
        fn = _uses_every_form(comm)
        want = fn(x.clone(), r, w)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        got = compiled(x.clone(), r, w)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert one_rank(body)


def test_compiled_block_equals_eager_forward_and_backward():
    """The TP MLP compiled (fullgraph) against eager: forward with planned buffers (eager
    takes them, compiled code does not), and forward + backward, the same bits."""
    import tp_support as tp

    torch._dynamo.reset()

    def body(comm):
        w = tp.weights(16, 32, 16, torch.float32, "cpu")
        data = tp.inputs(4, 16, 16, torch.float32, "cpu")
        planned = tp.mlp(comm, w, torch.float32, "cpu", ut.BufferPlan(comm, 8, {"mlp": 16}, torch.float32))
        with torch.no_grad():
            want = planned(data["x"], data["residual"])
            got = torch.compile(planned, fullgraph=True, backend="aot_eager")(data["x"], data["residual"])
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        block = tp.mlp(comm, w, torch.float32, "cpu")
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        want = tp.run_block("mlp", block, 0, 1, data)
        block.zero_grad(set_to_none=True)
        got = tp.run_block("mlp", compiled, 0, 1, data)
        tp.assert_equal_bits(got, want)

    one_rank(body)


def test_in_place_and_out_of_place():
    def body(comm):
        t = torch.full((6,), float(comm.rank + 1))
        y = functional.all_reduce(t, "sum", group=comm)
        assert torch.equal(t, torch.full((6,), float(comm.rank + 1)))  # out of place: unchanged
        assert ut.all_reduce(t, group=comm) is None
        work = ut.all_reduce(t, op=ut.ReduceOp.MAX, group=comm, async_op=True)
        assert work.wait()
        return y, t

    for y, t in run_ranks(2, body):
        assert torch.equal(y, torch.full((6,), 3.0)) and torch.equal(t, torch.full((6,), 3.0))


@pytest.mark.parametrize("op,name", [("SUM", "sum"), ("AVG", "avg"), ("MAX", "max"), ("MIN", "min")])
def test_reduce_ops_accepted(op, name):
    assert ut.op_name(getattr(ut.ReduceOp, op)) == name
    assert ut.op_name(name.upper()) == name


@pytest.mark.parametrize("op", ["PRODUCT", "BAND", "BOR", "BXOR"])
def test_other_reduce_ops_raise(op):
    with pytest.raises(UbnextError, match="unsupported reduce op.*SUM, AVG, MAX and MIN"):
        one_rank(lambda comm: ut.all_reduce(torch.ones(2), op=getattr(ut.ReduceOp, op), group=comm))


def test_group_required_and_dead_handles():
    with pytest.raises(UbnextError, match="pass group="):
        ut.all_reduce(torch.ones(2))
    with pytest.raises(UbnextError, match="no open communicator has handle 987654"):
        torch.ops.ubnext.all_reduce(torch.ones(2), "sum", 987654)


def test_handles_are_stable():
    def body(comm):
        h = ut.handle(comm)
        assert ut.handle(comm) == h and ut.handle(h) == h
        return h

    a, b = run_ranks(2, body)
    assert a != b


# ---- gradients ---------------------------------------------------------------------------
@pytest.mark.parametrize("op,scale", [("sum", 1.0), ("avg", 0.5)])
def test_all_reduce_gradient_passes_through(op, scale):
    def body(comm):
        x = torch.randn(3, 5, requires_grad=True)
        g = torch.randn(3, 5)
        functional.all_reduce(x, op, group=comm).backward(g)
        return torch.equal(x.grad, g * scale)

    assert all(run_ranks(2, body))


def test_max_has_no_gradient():
    def body(comm):
        x = torch.randn(3, requires_grad=True)
        functional.all_reduce(x, "max", group=comm).sum().backward()

    with pytest.raises(RuntimeError, match="'max' has no gradient"):
        one_rank(body)


def test_copy_to_group_all_reduces_the_gradient():
    def body(comm):
        x = torch.ones(4, requires_grad=True)
        y = functional.copy_to_group(x, comm)
        assert torch.equal(y, x)
        (y * (comm.rank + 1)).sum().backward()
        return x.grad

    for grad in run_ranks(4, body):
        assert torch.equal(grad, torch.full((4,), 10.0))


@pytest.mark.parametrize("residual,bias", [(True, True), (True, False), (False, False)])
def test_fused_backward_matches_torch(residual, bias):
    """The fused op's gradients (float32, one rank) against autograd through the float64
    torch reference."""
    def body(comm):
        g = torch.Generator().manual_seed(3)
        x, r, w, b, gn, gr = (torch.randn(*s, generator=g) for s in ((6, 32), (6, 32), (32,), (32,), (6, 32), (6, 32)))
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        lx, lr, lw, lb = leaves
        n, ro = functional.all_reduce_add_rmsnorm(lx, lr if residual else None, lw, lb if bias else None, 1e-5,
                                                  group=comm)
        torch.autograd.backward((n, ro), (gn, gr))
        ref = [t.double().requires_grad_() for t in (x, r, w, b)]
        dx, dr, dw, db = ref
        s = dx + (db if bias else 0) + (dr if residual else 0)
        rn = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * dw
        torch.autograd.backward((rn, s), (gn.double(), gr.double()))
        for got, want, used in zip(leaves, ref, (True, residual, True, bias)):
            if not used:
                assert got.grad is None
                continue
            torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)

    one_rank(body)


def test_fused_forward_is_its_reference():
    def body(comm):
        x, r, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(8)
        got = functional.all_reduce_add_rmsnorm(x, r, w.bfloat16(), None, 1e-6, group=comm)
        want = _rmsnorm.add_rmsnorm(rank_order([x]), r, w.bfloat16(), None, 1e-6)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert one_rank(body)


# ---- planned buffers ---------------------------------------------------------------------
def test_plan_assigns_keys_strictly_and_falls_back_once(monkeypatch):
    from ubnext.torch import _planner

    logged = []
    real = _planner.log_once
    monkeypatch.setattr(_planner, "log_once", lambda key, msg: logged.append(msg) if real(key, msg) else None)

    def body(comm):
        plan = ut.BufferPlan(comm, max_tokens=8, widths={"mlp": 16, "attention": 32}, dtype=torch.bfloat16)
        assert plan.capacity == 8 * 32 and len(plan.buffers) == 2
        assert [plan.assign(k) for k in ("a", "b", "oversized", "a", "b")] == [0, 1, 0, 0, 1]
        v = plan.view("a", 8, 32, torch.bfloat16)
        assert v.data_ptr() == plan.buffers[0].data_ptr() and v.shape == (8, 32)
        assert plan.view("b", 2, 16, torch.bfloat16).data_ptr() == plan.buffers[1].data_ptr()
        assert plan.view("oversized", 9, 32, torch.bfloat16) is None
        assert plan.view("oversized", 9, 32, torch.bfloat16) is None

    one_rank(body)
    assert len(logged) == 1 and "'oversized'" in logged[0] and "staging copy" in logged[0]
