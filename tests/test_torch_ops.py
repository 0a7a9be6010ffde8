"""ubnext.torch's custom ops and torch.distributed-shaped API on CPU, with thread-rank
communicators (tests/torch_fakes.py): schemas and mutation annotations, opcheck, fake
implementations, zero graph breaks under torch._dynamo.explain, torch.compile(fullgraph)
equal to eager, ReduceOp, in place against out of place, and the gradients (the
sequence-parallel ones at 1, 2 and 4 ranks against single-process references)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_fakes import ThreadComm, _Group, rank_order, run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import UbnextError  # noqa: E402
from ubnext.torch import _rmsnorm, functional  # noqa: E402


def one_rank(fn):
    return run_ranks(1, fn)[0]


def test_schemas_and_mutations():
    ops = torch.ops.ubnext
    assert str(ops.all_reduce.default._schema) == (
        "ubnext::all_reduce(Tensor x, str op, str precision, int group) -> Tensor")
    assert str(ops.all_reduce_.default._schema) == (
        "ubnext::all_reduce_(Tensor(a!) x, str op, str precision, int group) -> ()")
    assert str(ops.all_reduce_add_rmsnorm.default._schema) == (
        "ubnext::all_reduce_add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, "
        "int group) -> (Tensor, Tensor)")
    assert str(ops.reduce_scatter.default._schema) == (
        "ubnext::reduce_scatter(Tensor x, str op, str precision, int group) -> Tensor")
    assert str(ops.all_gather.default._schema) == "ubnext::all_gather(Tensor x, int group) -> Tensor"
    assert str(ops.reduce_scatter_.default._schema) == (
        "ubnext::reduce_scatter_(Tensor(a!) out, Tensor x, str op, str precision, int group) -> ()")
    assert str(ops.all_gather_.default._schema) == "ubnext::all_gather_(Tensor(a!) out, Tensor x, int group) -> ()"
    assert str(ops.reduce_scatter_add_rmsnorm.default._schema) == (
        "ubnext::reduce_scatter_add_rmsnorm(Tensor x, Tensor? residual_shard, Tensor weight, Tensor? bias, "
        "float eps, int group) -> (Tensor, Tensor)")
    names = ("all_reduce", "all_reduce_", "all_reduce_add_rmsnorm", "reduce_scatter", "all_gather",
             "reduce_scatter_", "all_gather_", "reduce_scatter_add_rmsnorm")
    writes = {name: [a.name for a in getattr(ops, name).default._schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write]
              for name in names}
    assert writes == {"all_reduce": [], "all_reduce_": ["x"], "all_reduce_add_rmsnorm": [], "reduce_scatter": [],
                      "all_gather": [], "reduce_scatter_": ["out"], "all_gather_": ["out"],
                      "reduce_scatter_add_rmsnorm": []}


def test_no_dead_code_elimination_drops_an_op():
    """Every ubnext op (the MoE ones included) is side-effecting to torch.fx: a compiler
    keeps a call whose output nothing reads. Inductor dropped the MoE router-weight gather,
    whose output is zero-size on a rank without tokens, from that rank's backward only: the
    ranks then made different collectives (CollectiveMismatchError on one H200, 2 ranks)."""
    import torch.fx

    import ubnext.torch.moe  # noqa: F401 (registers the MoE ops)

    names = [n for n in dir(torch.ops.ubnext) if isinstance(getattr(torch.ops.ubnext, n), torch._ops.OpOverloadPacket)]
    assert {"all_reduce", "moe_dispatch_backward", "moe_dispatch"} <= set(names)
    for name in names:
        graph = torch.fx.Graph()
        call = graph.call_function(getattr(torch.ops.ubnext, name).default, ())
        graph.output(None)
        graph.eliminate_dead_code()
        assert call in graph.nodes, f"{name}: its unused call was eliminated"


def test_opcheck():
    def body(comm):
        h = ut.handle(comm)
        x = torch.randn(4, 16)
        r, w, b = torch.randn(4, 16), torch.randn(16), torch.randn(16)
        ops = torch.ops.ubnext
        torch.library.opcheck(ops.all_reduce.default, (x, "sum", "exact", h))
        torch.library.opcheck(ops.all_reduce.default, (x.requires_grad_(), "avg", "auto", h))
        torch.library.opcheck(ops.all_reduce_.default, (torch.randn(4, 16), "max", "exact", h))
        torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, r, w, b, 1e-6, h))
        torch.library.opcheck(ops.all_reduce_add_rmsnorm.default,
                              (x, r.requires_grad_(), w.requires_grad_(), b.requires_grad_(), 1e-6, h))
        torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, None, w, None, 0.0, h))

    one_rank(body)


@pytest.mark.parametrize("size", [1, 2])
def test_opcheck_sequence_parallel(size):
    """The ops of sequence parallelism at 1 and 2 ranks (every rank runs opcheck's calls
    in the same order); its AOT-dispatch test at 1 rank only (make_fx is not thread-safe)."""
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    utils += ["test_aot_dispatch_dynamic"] if size == 1 else []

    def body(comm):
        h = ut.handle(comm)
        g = torch.Generator().manual_seed(comm.rank)
        x, odd = torch.randn(4, 16, generator=g), torch.randn(3, 2, generator=g)
        r, w, b = torch.randn(4 // comm.size, 16), torch.randn(16), torch.randn(16)
        ops = torch.ops.ubnext
        for op, args in [
                (ops.reduce_scatter, (x, "sum", "exact", h)),
                (ops.reduce_scatter, (x.clone().requires_grad_(), "avg", "exact", h)),
                (ops.reduce_scatter, (odd.clone().requires_grad_(), "sum", "exact", h)),  # flat slices
                (ops.all_gather, (x.clone().requires_grad_(), h)),
                (ops.all_gather, (torch.randn((), generator=g).requires_grad_(), h)),
                (ops.reduce_scatter_, (torch.empty(4 // comm.size, 16), x, "max", "exact", h)),
                (ops.all_gather_, (torch.empty(4 * comm.size, 16), x, h)),
                (ops.reduce_scatter_add_rmsnorm, (x, r, w, b, 1e-6, h)),
                (ops.reduce_scatter_add_rmsnorm, (x.clone().requires_grad_(), r.requires_grad_(), w.requires_grad_(),
                                                  b.requires_grad_(), 1e-6, h)),
                (ops.reduce_scatter_add_rmsnorm, (x, None, w, None, 0.0, h))]:
            torch.library.opcheck(op.default, args, test_utils=utils)

    run_ranks(size, body)


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        h = ut.handle(comm)
        with FakeTensorMode():
            x = torch.empty(5, 24, dtype=torch.bfloat16)
            y = torch.ops.ubnext.all_reduce(x, "sum", "exact", h)
            n, r = torch.ops.ubnext.all_reduce_add_rmsnorm(x, x, torch.empty(24, dtype=torch.bfloat16), None, 1e-6, h)
            torch.ops.ubnext.all_reduce_(x, "sum", "exact", h)
        for t in (y, n, r):
            assert t.shape == (5, 24) and t.dtype == torch.bfloat16
        return comm.calls

    assert one_rank(body) == 0  # fake tensors run nothing


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("shape", [(8, 3), (8,), (6, 2), (2, 3, 4), ()])
def test_fake_shapes_of_sequence_parallel_ops(size, shape):
    """The fakes' shapes are Communicator's defaults: the reduce-scatter (shape[0] / size,
    *shape[1:]) where size divides shape[0], else flat (k,); the all-gather (size *
    shape[0], *shape[1:]), (size,) for 0-d; and they equal what the ops return."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    numel = torch.Size(shape).numel()
    scatters = numel % size == 0
    divides = bool(shape) and shape[0] % size == 0
    want_rs = (shape[0] // size, *shape[1:]) if divides else (numel // size,)
    want_ag = (size * shape[0], *shape[1:]) if shape else (size,)

    def body(comm):
        h = ut.handle(comm)
        with FakeTensorMode():
            x = torch.empty(shape, dtype=torch.bfloat16)
            fake_ag = torch.ops.ubnext.all_gather(x, h)
            fake_rs = torch.ops.ubnext.reduce_scatter(x, "sum", "exact", h) if scatters else None
        real_ag = functional.all_gather(torch.ones(shape, dtype=torch.bfloat16), group=comm)
        real_rs = functional.reduce_scatter(torch.ones(shape, dtype=torch.bfloat16), group=comm) if scatters else None
        return fake_ag, real_ag, fake_rs, real_rs

    for fake_ag, real_ag, fake_rs, real_rs in run_ranks(size, body):
        assert fake_ag.shape == real_ag.shape == want_ag and fake_ag.dtype == torch.bfloat16
        if scatters:
            assert fake_rs.shape == real_rs.shape == want_rs and fake_rs.dtype == torch.bfloat16


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fake_shapes_of_the_fused_sequence_parallel_op(size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        h = ut.handle(comm)
        with FakeTensorMode():
            x, w = torch.empty(8, 24, dtype=torch.bfloat16), torch.empty(24, dtype=torch.bfloat16)
            n, r = torch.ops.ubnext.reduce_scatter_add_rmsnorm(x, torch.empty(8 // size, 24, dtype=torch.bfloat16), w,
                                                               None, 1e-6, h)
        return n, r, comm.calls

    for n, r, calls in run_ranks(size, body):
        assert n.shape == r.shape == (8 // size, 24) and n.dtype == r.dtype == torch.bfloat16
        assert calls == 0


def _uses_every_form(comm):
    def fn(x, residual, weight):
        ut.all_reduce(x, op=ut.ReduceOp.SUM, group=comm)
        y = functional.all_reduce(functional.copy_to_group(x, comm) * 2, ut.ReduceOp.AVG, group=comm)
        return functional.all_reduce_add_rmsnorm(y, residual, weight, None, 1e-6, group=comm)

    return fn


def _uses_every_sequence_parallel_form(comm):
    def fn(x, residual_shard, weight):
        shard = functional.reduce_scatter(x, ut.ReduceOp.AVG, group=comm)
        full = functional.all_gather(shard * 2, group=comm)
        into = torch.empty_like(shard)
        ut.reduce_scatter_tensor(into, full, op=ut.ReduceOp.SUM, group=comm)
        gathered = torch.empty_like(full)
        ut.all_gather_into_tensor(gathered, into, group=comm)
        normed, residual = functional.reduce_scatter_add_rmsnorm(gathered, residual_shard, weight, None, 1e-6,
                                                                 group=comm)
        return normed, residual, gathered

    return fn


def test_dynamo_explain_has_no_graph_breaks():
    import tp_support as tp

    def body(comm):
        x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
        for fn in (_uses_every_form(comm), _uses_every_sequence_parallel_form(comm)):
            explained = torch._dynamo.explain(fn)(x.clone(), r, w)
            assert explained.graph_break_count == 0, explained.break_reasons
            assert explained.graph_count == 1
        for sp in (False, True):  # with sequence parallelism: sum_gradients' autograd.Function too
            m = tp.mlp(comm, tp.weights(16, 32, 16, torch.float32, "cpu"), torch.float32, "cpu", sequence_parallel=sp)
            explained = torch._dynamo.explain(m)(x.requires_grad_(), r)
            assert explained.graph_break_count == 0, explained.break_reasons

    one_rank(body)


def test_compiled_equals_eager():
    """One rank: Dynamo is not thread-safe (the GPU test compiles at N ranks, in N processes)."""
    torch._dynamo.reset()

    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        x, r, w = (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, generator=g))
        same = []
        for fn in (_uses_every_form(comm), _uses_every_sequence_parallel_form(comm)):
            want = fn(x.clone(), r, w)
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
            got = compiled(x.clone(), r, w)
            same += [torch.equal(a, b) for a, b in zip(got, want)]
        return all(same)

    assert one_rank(body)


def test_compiled_sequence_parallel_backward_equals_eager():
    """The sequence-parallel ops compiled (fullgraph) with their backwards (the transposed
    collectives traced into the backward graph): the same gradients as eager."""
    torch._dynamo.reset()

    def fn(x, residual_shard, weight, bias, comm):
        gathered = functional.all_gather(functional.reduce_scatter(x, "avg", group=comm), group=comm)
        return functional.reduce_scatter_add_rmsnorm(gathered * 2, residual_shard, weight, bias, 1e-6, group=comm)

    def body(comm):
        g = torch.Generator().manual_seed(1)
        data = [torch.randn(*s, generator=g) for s in ((4, 16), (4, 16), (16,), (16,))]
        grads = [torch.randn(4, 16, generator=g) for _ in range(2)]
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        results = []
        for f in (fn, compiled):
            leaves = [t.clone().requires_grad_() for t in data]
            torch.autograd.backward(f(*leaves, comm), grads)
            results.append([t.grad for t in leaves])
        return all(torch.equal(a, b) for a, b in zip(*results))

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


@pytest.mark.parametrize("name", ["all_reduce_", "reduce_scatter_", "all_gather_"])
def test_ops_that_write_in_place_bump_the_version_autograd_checks(name, monkeypatch):
    """The kernels write through raw pointers, which torch does not see: the ops bump the
    written tensor's version, so a tensor saved for backward and then overwritten raises
    instead of giving a wrong gradient. The fake collectives here write nothing (the
    fakes' own copy_ would bump the version itself)."""
    for method in ("all_reduce", "reduce_scatter", "all_gather"):
        monkeypatch.setattr(ThreadComm, method, lambda self, x, out=None, op="sum", precision="auto":
                            x if out is None else out)

    def body(comm):
        h = ut.handle(comm)
        a = torch.ones(8, requires_grad=True)
        b = a * 2
        c = b * b  # saves b for backward
        before = b._version
        op = getattr(torch.ops.ubnext, name)
        with torch.no_grad():
            if name == "all_reduce_":
                op(b, "sum", "exact", h)
            elif name == "reduce_scatter_":
                op(b, torch.ones(8), "sum", "exact", h)
            else:
                op(b, torch.ones(8), h)
        assert b._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            c.sum().backward()

    one_rank(body)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_distributed_forms_write_into_output(size):
    """reduce_scatter_tensor and all_gather_into_tensor write into output (torch.distributed's
    argument order) what the functional forms return."""
    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(2 * size, 3, generator=g)
        out = torch.full((2, 3), float("nan"))
        assert ut.reduce_scatter_tensor(out, x, op=ut.ReduceOp.MAX, group=comm) is None
        assert torch.equal(out, functional.reduce_scatter(x, "max", group=comm))
        gathered = torch.full((size * 2, 3), float("nan"))
        assert ut.all_gather_into_tensor(gathered, out, group=comm, async_op=True).wait()
        assert torch.equal(gathered, functional.all_gather(out, group=comm))
        flat = torch.full((size * 2 * 3,), float("nan"))
        ut.all_gather_into_tensor(flat, out, group=comm)  # any shapes of size x k elements
        assert torch.equal(flat, gathered.reshape(-1))
        return x, out, gathered

    results = run_ranks(size, body)
    reduced = rank_order([x for x, _, _ in results], "max")
    for r, (_, out, gathered) in enumerate(results):
        assert torch.equal(out, reduced[2 * r:2 * r + 2])
        assert torch.equal(gathered, torch.cat([o for _, o, _ in results]))


def test_distributed_forms_need_a_group():
    with pytest.raises(UbnextError, match="pass group="):
        ut.reduce_scatter_tensor(torch.ones(1), torch.ones(2))
    with pytest.raises(UbnextError, match="pass group="):
        ut.all_gather_into_tensor(torch.ones(2), torch.ones(1))
    with pytest.raises(UbnextError, match="unsupported reduce op"):
        one_rank(lambda comm: ut.reduce_scatter_tensor(torch.ones(1), torch.ones(1), op=ut.ReduceOp.PRODUCT,
                                                       group=comm))


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
        torch.ops.ubnext.all_reduce(torch.ones(2), "sum", "exact", 987654)


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


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_have_no_gradient(name, op):
    def body(comm):
        x = torch.randn(4, requires_grad=True)
        getattr(functional, name)(x, op, group=comm).sum().backward()

    with pytest.raises(RuntimeError, match=f"{name}: op '{op}' has no gradient"):
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


# ---- sequence-parallel gradients ----------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("shape", [(8, 3), (2, 6)])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_gradient_is_the_all_gather(size, shape, op):
    """Rank q's gradient of x is every rank's gradient of its slice, in rank order (avg:
    divided by the ranks): bit for bit, also where size does not divide shape[0] (flat slices)."""
    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(shape, generator=g, requires_grad=True)
        y = functional.reduce_scatter(x, op, group=comm)
        grad = torch.randn(y.shape, generator=g)
        y.backward(grad)
        return x.grad, grad

    results = run_ranks(size, body)
    want = torch.cat([grad.reshape(-1) for _, grad in results]).reshape(shape) / (size if op == "avg" else 1)
    for got, _ in results:
        assert torch.equal(got, want)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_all_gather_gradient_is_the_reduce_scatter(size):
    """Rank r's gradient of x is the sum, in rank order, of every rank's gradient of slice r."""
    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(3, 5, generator=g, requires_grad=True)
        y = functional.all_gather(x, group=comm)
        assert y.shape == (3 * size, 5)
        grad = torch.randn(y.shape, generator=g)
        y.backward(grad)
        return x.grad, grad

    results = run_ranks(size, body)
    for r, (got, _) in enumerate(results):
        assert torch.equal(got, rank_order([grad[3 * r:3 * r + 3] for _, grad in results]))


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("residual,bias", [(True, True), (True, False), (False, False)])
def test_fused_sequence_parallel_backward_matches_torch(size, residual, bias):
    """reduce_scatter_add_rmsnorm's gradients (float32) against autograd through the
    float64 unsharded computation (every rank's x summed, rows split among the ranks):
    x's gradient is the whole one on every rank (bit for bit the same, the gathered
    residual-shard gradients), the residual shard's its rows', and weight's and bias'
    partial sums of this rank's rows add up over the ranks to the whole gradient."""
    rows, hidden = 8, 32
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(rows, hidden, generator=g) for _ in range(size)]
    res, w, b, gn, gr = (torch.randn(*s, generator=g) for s in ((rows, hidden), (hidden,), (hidden,),
                                                                 (rows, hidden), (rows, hidden)))
    m = rows // size

    def body(comm):
        sl = slice(comm.rank * m, (comm.rank + 1) * m)
        lx, lr, lw, lb = (t.clone().requires_grad_() for t in (xs[comm.rank], res[sl], w, b))
        n, ro = functional.reduce_scatter_add_rmsnorm(lx, lr if residual else None, lw, lb if bias else None, 1e-5,
                                                      group=comm)
        torch.autograd.backward((n, ro), (gn[sl], gr[sl]))
        return lx.grad, lr.grad, lw.grad, lb.grad

    results = run_ranks(size, body)
    dxs = [t.double().requires_grad_() for t in xs]
    dr, dw, db = (t.double().requires_grad_() for t in (res, w, b))
    s = sum(dxs) + (db if bias else 0) + (dr if residual else 0)
    rn = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * dw
    torch.autograd.backward((rn, s), (gn.double(), gr.double()))

    def close(got, want):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    for r, (gx, grs, gw, gb) in enumerate(results):
        assert torch.equal(gx, results[0][0])
        close(gx, dxs[r].grad)
        if residual:
            assert torch.equal(grs, gx[r * m:(r + 1) * m])
            close(grs, dr.grad[r * m:(r + 1) * m])
        else:
            assert grs is None
        assert (gb is not None) == bias
    close(sum(gw for _, _, gw, _ in results), dw.grad)
    if bias:
        close(sum(gb for _, _, _, gb in results), db.grad)


def test_fused_sequence_parallel_forward_is_its_reference():
    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(4, 8, generator=g).bfloat16()
        r, w = torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16()
        got = functional.reduce_scatter_add_rmsnorm(x, r, w, None, 1e-6, group=comm)
        return x, r, w, got

    results = run_ranks(2, body)
    reduced = rank_order([x for x, _, _, _ in results])
    for rank, (_, r, w, got) in enumerate(results):
        want = _rmsnorm.add_rmsnorm(reduced[2 * rank:2 * rank + 2], r, w, None, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


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


def test_a_handle_carries_the_world_size_so_compiled_shapes_follow_it():
    """The reduce-scatter's and all-gather's fake shapes come from the handle alone (its
    low 16 bits), so graphs that torch.compile caches by their constants differ by world
    size: a graph compiled at 1 rank is not reused at 2 (it expected unsharded shapes)."""
    import ubnext.torch as ut
    from ubnext.torch import _ops, _registry

    comms = [ThreadComm(_Group(n), 0) for n in (1, 2, 4)]
    handles = [ut.handle(c) for c in comms]
    assert len(set(handles)) == 3
    assert [_registry.size_of(h) for h in handles] == [1, 2, 4]
    x = torch.empty(8, 3, device="meta")
    assert [tuple(_ops._reduce_scatter_fake(x, "sum", "exact", h).shape) for h in handles] == [(8, 3), (4, 3), (2, 3)]
    assert [tuple(_ops._all_gather_fake(x, h).shape) for h in handles] == [(8, 3), (16, 3), (32, 3)]


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("size", [2, 4])
def test_the_ops_quantize_only_where_asked(size):
    import tp_support as tp

    """On a communicator that opted in to the quantized collectives (the thread
    communicators' lossy emulation from any size), every differentiable form, forward and
    backward, and the in-place forms give the bits of one that did not; given
    ``precision="auto"`` (or a format), the all-reduce and reduce-scatter forms take the
    communicator's choice, its own calls' bits, which are lossy."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 32, generator=g).bfloat16() for _ in range(size)]
    w = torch.randn(32, 16, generator=g).bfloat16()

    def body(comm, opted_in: bool):
        x = xs[comm.rank]
        forms = tp.differentiable_forms(comm, x, w)
        if not opted_in:  # formats raise there
            return forms, None, None
        asked = {"functional.all_reduce": functional.all_reduce(x, group=comm, precision="auto"),
                 "communicator": comm.all_reduce(x),
                 "functional.reduce_scatter": functional.reduce_scatter(x, group=comm, precision="int8"),
                 "communicator_rs": comm.reduce_scatter(x, precision="int8")}
        in_place, into = x.clone(), torch.empty(x.numel() // comm.size, dtype=x.dtype)
        ut.all_reduce(in_place, group=comm, precision="auto")
        ut.reduce_scatter_tensor(into, x, group=comm, precision="int8")
        asked.update({"all_reduce": in_place, "reduce_scatter_tensor": into.view(-1, x.shape[1])})
        return forms, asked, comm.all_reduce(x, precision="exact")

    opted_in = run_ranks(size, lambda comm: body(comm, True), quantized="int8")
    plain = run_ranks(size, lambda comm: body(comm, False))
    for (forms, asked, exact), (want, _, _) in zip(opted_in, plain):
        for i, (a, b) in enumerate(zip(forms, want)):
            assert torch.equal(_bits(a), _bits(b)), f"form {i} quantized without being asked"
        assert not torch.equal(_bits(asked["communicator"]), _bits(exact)), "the emulation did not quantize"
        for name in ("functional.all_reduce", "all_reduce"):
            assert torch.equal(_bits(asked[name]), _bits(asked["communicator"])), name
        for name in ("functional.reduce_scatter", "reduce_scatter_tensor"):
            assert torch.equal(_bits(asked[name]), _bits(asked["communicator_rs"])), name


def test_a_precision_the_communicator_cannot_take_raises():
    """A format on a communicator that did not opt in raises (``Communicator.all_reduce``'s
    message), from every form that takes ``precision=``."""
    def body(comm):
        x = torch.ones(4, 8, dtype=torch.bfloat16)
        for call in (lambda: functional.all_reduce(x, group=comm, precision="int8"),
                     lambda: ut.all_reduce(x, group=comm, precision="int4"),
                     lambda: functional.reduce_scatter(x, group=comm, precision="int8"),
                     lambda: ut.reduce_scatter_tensor(x[:2].clone(), x, group=comm, precision="int8")):
            with pytest.raises(UbnextError, match="opted out"):
                call()
        with pytest.raises(UbnextError, match="unknown precision 'fast'"):
            functional.all_reduce(x, group=comm, precision="fast")

    run_ranks(2, body)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_sum_gradients_sums_each_incoming_gradient_once(size):
    """``sum_gradients``: the tensors' values forward; backward, the incoming gradients
    summed over the ranks in rank order, in one all-reduce for both tensors, each
    micro-batch's once (two backwards: ``.grad`` is the sum of the two sums); None passes
    through; without gradients, the tensors themselves and no collective."""
    g = torch.Generator().manual_seed(8)
    grads = [[(torch.randn(6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(size)] for _ in range(2)]

    def body(comm):
        a, b = torch.randn(6).requires_grad_(), torch.randn(2, 3).requires_grad_()
        for micro in grads:
            va, none, vb = functional.sum_gradients(a, None, b, group=comm)
            assert none is None and torch.equal(va, a) and torch.equal(vb, b)
            calls = comm.calls
            torch.autograd.backward((va, vb), micro[comm.rank])
            assert comm.calls == calls + 1
        with torch.no_grad():
            assert functional.sum_gradients(a, b, group=comm) == (a, b)
        plain = torch.ones(3)
        assert functional.sum_gradients(plain, group=comm)[0] is plain
        return a.grad, b.grad, comm.calls

    for ga, gb, calls in run_ranks(size, body):
        assert calls == 2
        for i, got in enumerate((ga, gb)):
            want = sum(rank_order([micro[r][i] for r in range(size)]) for micro in grads)
            assert torch.equal(got, want)
