"""ubnext.torch's overlapped GEMMs on CPU (issue 38): the plan of their rounds through the
bounded area (as few rounds as fit, from half 0, every byte inside the area, the sizes of the
issue), the peers' orders, the ops' schemas, argument checks, fake implementations,
opcheck, torch.compile, and their gradients and the sequence-parallel layers against
single-process references at 1, 2 and 4 thread ranks (the thread communicators have no
pool: the ops run their unoverlapped path there; tests/test_gpu_overlap.py runs the
overlapped one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch_fakes import rank_order, run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import ClosedError, UbnextError  # noqa: E402
from ubnext.torch import _overlap_plan as plan  # noqa: E402
from ubnext.torch import _rmsnorm  # noqa: E402

#: float64 operands, but the thread communicators reduce in fp32 (rounded once to float64)
close = dict(rtol=1e-5, atol=1e-5)
#: float32 operands (GEMMs in float32 too) against a float64 reference on the same values
close32 = dict(rtol=1e-4, atol=1e-4)


# ---- the plan -----------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 512, 4096, 5000, 70001])
@pytest.mark.parametrize("row_bytes, slots", [(2, 1), (16384, 1), (8192 * 2, 4), (4096 * 2, 8), (57344, 2)])
def test_rounds_cover_the_rows_in_as_few_rounds_as_fit_inside_the_area(rows, row_bytes, slots):
    r = plan.split(rows, row_bytes, slots)
    most = plan.half_bytes() // slots // plan.SLOT_ALIGN * plan.SLOT_ALIGN // row_bytes  # rows a half takes
    assert len(r.parts) == max(1, -(-rows // most))
    assert [p[0] for p in r.parts] == [sum(p[1] for p in r.parts[:j]) for j in range(len(r.parts))]
    assert sum(p[1] for p in r.parts) == rows
    sizes = [p[1] for p in r.parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert r.slot_bytes % plan.SLOT_ALIGN == 0 and r.slot_bytes >= max(sizes) * row_bytes
    for j in range(len(r.parts)):
        assert r.half(j) == j % 2
        assert r.offset(j) == (j % 2) * plan.half_bytes()
        # every slot of the round inside its half of the area
        assert r.offset(j, slots - 1) + r.slot_bytes <= (j % 2 + 1) * plan.half_bytes() <= plan.AREA_BYTES


def test_the_issue_sizes_fit_the_bounded_area():
    """16384 tokens of hidden 8192 in bf16 at 4 ranks: the 256 MiB gathered activation
    moves through 32 MiB halves (a rank's 64 MiB shard in 2 rounds, the reduce-scatter's
    4 slots of 8 MiB in 8 rounds)."""
    assert plan.AREA_BYTES == 64 << 20
    ag = plan.gather_rounds(16384 // 4, 8192 * 2)
    assert len(ag.parts) == 2 and ag.slot_bytes == 32 << 20
    rs = plan.scatter_rounds(16384 // 4, 8192 * 2, 4)
    assert len(rs.parts) == 8 and rs.slot_bytes == 8 << 20


def test_a_row_larger_than_a_half_raises():
    with pytest.raises(ValueError, match="does not fit"):
        plan.split(4, plan.half_bytes() + 1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        plan.split(4, plan.half_bytes() // 4 + 1, 4)
    with pytest.raises(ValueError):
        plan.split(-1, 2, 1)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_orders_start_at_the_next_rank_and_visit_each_once(size):
    for rank in range(size):
        pulls, pushes = plan.pull_order(rank, size), plan.push_order(rank, size)
        assert sorted(pulls) == [r for r in range(size) if r != rank]
        assert pushes[-1] == rank and sorted(pushes) == list(range(size))
        assert pulls == pushes[:-1] and (not pulls or pulls[0] == (rank + 1) % size)
    # at each step every rank reads from (writes to) a different rank
    for step in range(size - 1):
        assert sorted(plan.pull_order(r, size)[step] for r in range(size)) == list(range(size))


# ---- the ops ------------------------------------------------------------------------------
def test_schemas():
    ops = torch.ops.ubnext
    assert str(ops.all_gather_matmul.default._schema) == (
        "ubnext::all_gather_matmul(Tensor a, Tensor b, int group) -> (Tensor, Tensor)")
    assert str(ops.matmul_reduce_scatter.default._schema) == (
        "ubnext::matmul_reduce_scatter(Tensor a, Tensor b, int group) -> Tensor")
    assert str(ops.matmul_reduce_scatter_add_rmsnorm.default._schema) == (
        "ubnext::matmul_reduce_scatter_add_rmsnorm(Tensor a, Tensor b, Tensor? residual, Tensor weight, Tensor? bias, "
        "float eps, int group) -> (Tensor, Tensor)")


def test_arguments_are_checked():
    def body(comm):
        a, b = torch.randn(4, 8), torch.randn(8, 3)
        r, w = torch.randn(2, 3), torch.randn(3)

        def norm(a, b, residual=r, weight=w, bias=None, eps=1e-6):
            return ut.matmul_reduce_scatter_add_rmsnorm(a, b, residual, weight, bias, eps, group=comm)

        cases = [
            (lambda: ut.all_gather_matmul(a, b, gather_dim=1, group=comm), "gather_dim must be 0"),
            (lambda: ut.matmul_reduce_scatter(a, b, scatter_dim=1, group=comm), "scatter_dim must be 0"),
            (lambda: ut.matmul_reduce_scatter(a, b, reduce_op="max", group=comm), "reduce_op must be 'sum'"),
            (lambda: ut.all_gather_matmul(a, torch.randn(7, 3), group=comm), "do not multiply|needed"),
            (lambda: ut.all_gather_matmul(torch.randn(8), b, group=comm), "needed"),
            (lambda: ut.matmul_reduce_scatter(a, b.double(), group=comm), "share dtype"),
            (lambda: ut.matmul_reduce_scatter(torch.randn(3, 8), b, group=comm), "3 rows, which 2 ranks"),
            (lambda: ut.all_gather_matmul(a, b), "pass group"),
            (lambda: ut.all_gather_matmul(a.int(), b.int(), group=comm), "dtype torch.int32 is not taken"),
            (lambda: ut.matmul_reduce_scatter(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), group=comm),
             "float8_e4m3fn is not taken"),
            # the fused form: matmul_reduce_scatter's checks, then the add + RMSNorm's operands
            (lambda: norm(a, b.double()), "share dtype"),
            (lambda: norm(torch.randn(3, 8), b), "3 rows, which 2 ranks"),
            (lambda: norm(a.double(), b.double(), r.double(), w.double()),
             r"the add \+ RMSNorm takes torch.bfloat16, torch.float16, torch.float32, not torch.float64"),
            (lambda: norm(a, b, torch.randn(4, 3)), r"residual must be \(2, 3\) of a's dtype"),
            (lambda: norm(a, b, r.half()), r"residual must be .* got \(2, 3\) of torch.float16"),
            (lambda: norm(a, b, r, torch.randn(8)), r"weight must be \(3,\)"),
            (lambda: norm(a, b, r, w, w.half()), "bias must be"),
            (lambda: norm(a, b, r, w, eps=-1.0), "eps must be finite and >= 0"),
            (lambda: norm(a, b, r, w, eps=float("nan")), "eps must be finite"),
            (lambda: ut.matmul_reduce_scatter_add_rmsnorm(a, b, r, w), "pass group"),
        ]
        for call, match in cases:
            with pytest.raises(UbnextError, match=match):
                call()
        return comm.calls

    assert run_ranks(2, body) == [0, 0]  # raised before any collective


class _CudaComm:
    """A communicator of CUDA device 1 whose collectives must not be reached."""

    rank, size, device, local_rank, pool = 0, 2, 1, 0, None

    def all_gather(self, *args, **kwargs):
        pytest.fail("all_gather reached")

    reduce_scatter = reduce_scatter_add_rmsnorm = all_gather


#: the overlapped ops, by name
OVERLAPPED = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_reduce_scatter_add_rmsnorm"]
NORM_OP = "matmul_reduce_scatter_add_rmsnorm"


def _norm_operands(a, b, size: int) -> tuple:
    """Ones as the fused op's residual (this rank's rows of a @ b), weight and bias."""
    rows, n = a.shape[0] // size, b.shape[1]
    return torch.ones(rows, *a.shape[1:-1], n, dtype=a.dtype), torch.ones(n, dtype=a.dtype), torch.ones(n, dtype=a.dtype)


def _run(op: str, comm, a, b):
    """``_overlap``'s runner of ``op`` on a and b (the fused op: with ``_norm_operands``, eps 1e-6)."""
    from ubnext.torch import _overlap

    extra = (*_norm_operands(a, b, comm.size), 1e-6) if op == NORM_OP else ()
    return getattr(_overlap, op)(comm, a, b, *extra)


@pytest.mark.parametrize("op", OVERLAPPED)
def test_operands_off_the_communicators_device_raise_before_any_work(op, monkeypatch):
    """CPU operands (and those of another CUDA device, as torch.device compares them) for a
    communicator of CUDA device 1 raise on the unoverlapped path too (no pool), before any
    GEMM or collective."""
    comm = _CudaComm()
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: pytest.fail("a GEMM was queued"))
    a, b = torch.ones(4, 8), torch.ones(8, 3)
    extra = _norm_operands(a, b, comm.size) if op == NORM_OP else ()
    with pytest.raises(UbnextError, match=f"ubnext::{op}: a and b are on cpu, the communicator on cuda:1"):
        getattr(ut, op)(a, b, *extra, group=comm)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fakes_have_the_real_shapes(size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        h = ut.handle(comm)
        with FakeTensorMode():
            a, b = torch.empty(2 * size, 3, 8, dtype=torch.bfloat16), torch.empty(8, 5, dtype=torch.bfloat16)
            fakes = (*torch.ops.ubnext.all_gather_matmul(a, b, h), torch.ops.ubnext.matmul_reduce_scatter(a, b, h),
                     *torch.ops.ubnext.matmul_reduce_scatter_add_rmsnorm(a, b, *_norm_operands(a, b, size), 1e-6, h))
        calls = comm.calls
        a, b = torch.ones(2 * size, 3, 8, dtype=torch.bfloat16), torch.ones(8, 5, dtype=torch.bfloat16)
        real = (*ut.all_gather_matmul(a, b, group=comm), ut.matmul_reduce_scatter(a, b, group=comm),
                *ut.matmul_reduce_scatter_add_rmsnorm(a, b, *_norm_operands(a, b, size), group=comm))
        return fakes, real, calls

    for fakes, real, calls in run_ranks(size, body):
        assert calls == 0
        assert [t.shape for t in fakes] == [t.shape for t in real] == [
            (2 * size * size, 3, 8), (2 * size * size, 3, 5), (2, 3, 5), (2, 3, 5), (2, 3, 5)]
        assert all(t.dtype == torch.bfloat16 for t in (*fakes, *real))


@pytest.mark.parametrize("size", [1, 2])
def test_opcheck(size):
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    utils += ["test_aot_dispatch_dynamic"] if size == 1 else []

    def body(comm):
        h = ut.handle(comm)
        g = torch.Generator().manual_seed(comm.rank)
        a, b = torch.randn(2 * comm.size, 8, generator=g), torch.randn(8, 3, generator=g)
        r, w, bias = torch.randn(2, 3, generator=g), torch.randn(3, generator=g), torch.randn(3, generator=g)
        for op, args in [(torch.ops.ubnext.all_gather_matmul, (a, b, h)),
                         (torch.ops.ubnext.all_gather_matmul, (a.clone().requires_grad_(), b.clone().requires_grad_(), h)),
                         (torch.ops.ubnext.matmul_reduce_scatter, (a, b, h)),
                         (torch.ops.ubnext.matmul_reduce_scatter, (a.clone().requires_grad_(), b.t().contiguous().t()
                                                                   .requires_grad_(), h)),
                         (torch.ops.ubnext.matmul_reduce_scatter_add_rmsnorm, (a, b, r, w, None, 1e-5, h)),
                         (torch.ops.ubnext.matmul_reduce_scatter_add_rmsnorm,
                          (a.clone().requires_grad_(), b.t().contiguous().t().requires_grad_(), r.clone().requires_grad_(),
                           w.clone().requires_grad_(), bias.clone().requires_grad_(), 1e-5, h))]:
            torch.library.opcheck(op.default, args, test_utils=utils)

    run_ranks(size, body)


def test_compiled_forward_and_backward_equal_eager():
    """One rank (Dynamo is not thread-safe): the three ops traced with fullgraph, their
    backwards (each other's ops) in the backward graph."""
    torch._dynamo.reset()

    def fn(x, w1, w2, w3, residual, norm_weight, bias, comm):
        _, h = ut.all_gather_matmul(x, w1, group=comm)
        y = ut.matmul_reduce_scatter(torch.relu(h), w2, group=comm)
        normed, res = ut.matmul_reduce_scatter_add_rmsnorm(torch.relu(h), w3, residual, norm_weight, bias, 1e-5,
                                                           group=comm)
        return y + normed * res

    def body(comm):
        g = torch.Generator().manual_seed(3)
        data = [torch.randn(*s, generator=g) for s in ((4, 8), (8, 6), (6, 8), (6, 8), (4, 8), (8,), (8,))]
        grad = torch.randn(4, 8, generator=g)
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            leaves = [t.clone().requires_grad_() for t in data]
            y = f(*leaves, comm)
            y.backward(grad)
            results.append([y.detach(), *(t.grad for t in leaves)])
        return all(torch.equal(p, q) for p, q in zip(*results))

    assert run_ranks(1, body)[0]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gradients_are_each_others_ops(size):
    """all_gather_matmul and matmul_reduce_scatter at ``size`` thread ranks, forward and
    backward, against one process holding every rank's operands (float64 operands)."""
    m, k, n = 3, 8, 5
    g = torch.Generator().manual_seed(7)
    shards = [torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(size)]
    bs = [torch.randn(k, n, generator=g, dtype=torch.float64) for _ in range(size)]
    grads = [torch.randn(size * m, n, generator=g, dtype=torch.float64) for _ in range(size)]
    parts = [torch.randn(size * m, k, generator=g, dtype=torch.float64) for _ in range(size)]
    grads_rs = [torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(size)]

    def body(comm):
        r = comm.rank
        a, b = shards[r].clone().requires_grad_(), bs[r].clone().requires_grad_()
        gathered, out = ut.all_gather_matmul(a, b, group=comm)
        out.backward(grads[r])
        x, w = parts[r].clone().requires_grad_(), bs[r].clone().requires_grad_()
        y = ut.matmul_reduce_scatter(x, w, group=comm)
        y.backward(grads_rs[r])
        return gathered, out, a.grad, b.grad, y, x.grad, w.grad

    full = torch.cat(shards)
    for r, (gathered, out, da, db, y, dx, dw) in enumerate(run_ranks(size, body)):
        rows = slice(r * m, (r + 1) * m)
        assert torch.equal(gathered, full)
        torch.testing.assert_close(out, full @ bs[r], **close)
        torch.testing.assert_close(da, sum(grads[q] @ bs[q].T for q in range(size))[rows], **close)
        torch.testing.assert_close(db, full.T @ grads[r], **close)
        torch.testing.assert_close(y, sum(parts[q] @ bs[q] for q in range(size))[rows], **close)
        all_grads = torch.cat(grads_rs)
        torch.testing.assert_close(dx, all_grads @ bs[r].T, **close)
        torch.testing.assert_close(dw, parts[r].T @ all_grads, **close)


def test_the_gathered_outputs_gradient_reaches_the_shard():
    def body(comm):
        a = torch.ones(2, 4, requires_grad=True)
        gathered, out = ut.all_gather_matmul(a, torch.ones(4, 3), group=comm)
        (gathered.sum() + out.sum()).backward()
        return a.grad

    for grad in run_ranks(2, body):
        assert torch.equal(grad, torch.full((2, 4), 2.0 * (1 + 3)))  # both ranks, both outputs


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_fused_op_is_matmul_reduce_scatter_then_the_add_rmsnorm(size):
    """matmul_reduce_scatter_add_rmsnorm at thread ranks (bf16; a, the residual and the
    results with a middle dimension) equals matmul_reduce_scatter followed by the add +
    RMSNorm reference, bit for bit. The thread communicators have no pool: this is the
    unoverlapped path (the GEMM, then the communicator's reduce_scatter_add_rmsnorm);
    tests/test_gpu_overlap.py checks the overlapped one."""
    shared = torch.Generator().manual_seed(99)
    w, bias = torch.randn(5, generator=shared).bfloat16(), torch.randn(5, generator=shared).bfloat16()

    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        a, b = torch.randn(2 * comm.size, 3, 8, generator=g).bfloat16(), torch.randn(8, 5, generator=g).bfloat16()
        residual = torch.randn(2, 3, 5, generator=g).bfloat16()
        got = ut.matmul_reduce_scatter_add_rmsnorm(a, b, residual, w, bias, 1e-5, group=comm)
        y = ut.matmul_reduce_scatter(a, b, group=comm)
        want = _rmsnorm.add_rmsnorm(y.reshape(6, 5), residual.reshape(6, 5), w, bias, 1e-5)
        return got, want

    for got, want in run_ranks(size, body):
        assert [t.shape for t in got] == [(2, 3, 5)] * 2 and all(t.dtype == torch.bfloat16 for t in got)
        assert all(torch.equal(g_.reshape(6, 5), w_) for g_, w_ in zip(got, want))


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("residual, bias", [(True, True), (True, False), (False, False)])
def test_the_fused_ops_gradients_match_the_unsharded_computation(size, residual, bias):
    """matmul_reduce_scatter_add_rmsnorm's outputs and gradients (float32, thread ranks)
    against autograd through the float64 unsharded computation (every rank's a @ b summed,
    plus bias and residual, RMSNorm; rows split among the ranks): a's and b's gradients
    those of this rank's partial product, the residual's its rows', and weight's and bias's
    partial sums of this rank's rows adding up over the ranks to the whole gradient."""
    m, k, n, eps = 3, 8, 16, 1e-5
    g = torch.Generator().manual_seed(13)
    parts = [torch.randn(size * m, k, generator=g) for _ in range(size)]
    bs = [torch.randn(k, n, generator=g) / 2 for _ in range(size)]
    res, w, bb = torch.randn(size * m, n, generator=g), 1 + torch.randn(n, generator=g) / 8, torch.randn(n, generator=g)
    gn, gr = torch.randn(size * m, n, generator=g), torch.randn(size * m, n, generator=g)

    def body(comm):
        r = comm.rank
        rows = slice(r * m, (r + 1) * m)
        la, lb, lr, lw, lbias = (t.clone().requires_grad_() for t in (parts[r], bs[r], res[rows], w, bb))
        normed, res_out = ut.matmul_reduce_scatter_add_rmsnorm(la, lb, lr if residual else None, lw,
                                                               lbias if bias else None, eps, group=comm)
        torch.autograd.backward((normed, res_out), (gn[rows], gr[rows]))
        return normed.detach(), res_out.detach(), la.grad, lb.grad, lr.grad, lw.grad, lbias.grad

    results = run_ranks(size, body)
    da, db = [t.double().requires_grad_() for t in parts], [t.double().requires_grad_() for t in bs]
    dr, dw, dbias = (t.double().requires_grad_() for t in (res, w, bb))
    total = sum(x @ y for x, y in zip(da, db)) + (dbias if bias else 0) + (dr if residual else 0)
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * dw
    torch.autograd.backward((normed, total), (gn.double(), gr.double()))

    def near(got, want):
        torch.testing.assert_close(got.double(), want, **close32)

    for r, (got_n, got_res, ga, gb, glr, _, gbias) in enumerate(results):
        rows = slice(r * m, (r + 1) * m)
        near(got_n, normed.detach()[rows])
        near(got_res, total.detach()[rows])
        near(ga, da[r].grad)
        near(gb, db[r].grad)
        if residual:
            near(glr, dr.grad[rows])
        else:
            assert glr is None
        assert (gbias is not None) == bias
    near(sum(res_[5] for res_ in results), dw.grad)
    if bias:
        near(sum(res_[6] for res_ in results), dbias.grad)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_sequence_parallel_blocks_match_the_unsharded_block(size, kind):
    """The sequence-parallel MLP and attention output at thread ranks, float32 (their
    matmul + reduce-scatter + add + RMSNorm takes the add + RMSNorm's dtypes): each rank's
    rows of the outputs and of the input gradient, its weight shards' gradients, and the
    norm weight's and bias's gradients (complete on every rank), against the unsharded
    block in float64 on the same values."""
    from ubnext.torch import TensorParallelAttentionOutput, TensorParallelMLP

    tokens, hidden, inter, eps = 4 * size, 16, 32, 1e-5
    f32 = torch.float32
    g = torch.Generator().manual_seed(11)

    def rnd(*s):  # float64 values that float32 holds exactly
        return torch.randn(*s, generator=g, dtype=f32).double()

    w = {"gate": rnd(inter, hidden), "up": rnd(inter, hidden), "down": rnd(hidden, inter) / 4,
         "o": rnd(hidden, inter) / 4, "bias": rnd(hidden), "norm": 1 + rnd(hidden) / 8}
    x, attention, residual = rnd(tokens, hidden), rnd(tokens, inter), rnd(tokens, hidden)
    grad_normed, grad_residual = rnd(tokens, hidden), rnd(tokens, hidden)
    rows_of = tokens // size

    def body(comm):
        r = comm.rank
        rows = slice(r * rows_of, (r + 1) * rows_of)
        w32 = {k_: v.to(f32) for k_, v in w.items()}
        if kind == "mlp":
            block = TensorParallelMLP(hidden, inter, comm, bias=True, eps=eps, dtype=f32, sequence_parallel=True)
            block.load_full(w32["gate"], w32["up"], w32["down"], w32["norm"], w32["bias"])
            inp = x[rows].to(f32).requires_grad_()
        else:
            block = TensorParallelAttentionOutput(hidden, inter, comm, bias=True, eps=eps, dtype=f32,
                                                  sequence_parallel=True)
            block.proj.load_full(w32["o"], w32["bias"])
            with torch.no_grad():
                block.norm.weight.copy_(w32["norm"])
            cols = inter // size
            inp = attention[:, r * cols:(r + 1) * cols].to(f32).requires_grad_()
        res = residual[rows].to(f32).requires_grad_()
        normed, res_out = block(inp, res)
        torch.autograd.backward((normed, res_out), (grad_normed[rows].to(f32), grad_residual[rows].to(f32)))
        return tuple(t.double() for t in (normed.detach(), res_out.detach(), inp.grad, res.grad)) + (
            {n: p.grad.double() for n, p in block.named_parameters()},)

    results = run_ranks(size, body)
    # the unsharded block
    p = {k_: v.clone().requires_grad_() for k_, v in w.items()}
    xin, ain, rin = x.clone().requires_grad_(), attention.clone().requires_grad_(), residual.clone().requires_grad_()
    if kind == "mlp":
        y = torch.nn.functional.silu(xin @ p["gate"].T) * (xin @ p["up"].T) @ p["down"].T
    else:
        y = ain @ p["o"].T
    normed, res_out = _rmsnorm.add_rmsnorm(y, rin, p["norm"], p["bias"], eps)
    torch.autograd.backward((normed, res_out), (grad_normed, grad_residual))
    n = inter // size
    for r, (got_n, got_res, got_dx, got_dres, got_params) in enumerate(results):
        rows, shard = slice(r * rows_of, (r + 1) * rows_of), slice(r * n, (r + 1) * n)
        torch.testing.assert_close(got_n, normed.detach()[rows], **close32)
        torch.testing.assert_close(got_res, res_out.detach()[rows], **close32)
        torch.testing.assert_close(got_dres, rin.grad[rows], **close32)
        if kind == "mlp":
            torch.testing.assert_close(got_dx, xin.grad[rows], **close32)
            torch.testing.assert_close(got_params["gate_up.weight"], torch.cat([p["gate"].grad[shard],
                                                                                p["up"].grad[shard]]), **close32)
            torch.testing.assert_close(got_params["down.weight"], p["down"].grad[:, shard], **close32)
        else:
            torch.testing.assert_close(got_dx, ain.grad[:, shard], **close32)
            torch.testing.assert_close(got_params["proj.weight"], p["o"].grad[:, shard], **close32)
    bias_name = "down.bias" if kind == "mlp" else "proj.bias"
    for res in results:  # complete on every rank: summed over the ranks in backward
        torch.testing.assert_close(res[4][bias_name], p["bias"].grad, **close32)
        torch.testing.assert_close(res[4]["norm.weight"], p["norm"].grad, **close32)


@pytest.mark.parametrize("size", [2, 4])
def test_column_then_row_parallel_in_sequence_parallel_mode(size):
    """ColumnParallelLinear and RowParallelLinear with sequence_parallel: gathered rows in,
    scattered rows out; the row-parallel output reduced in rank order (the thread
    communicators' order), bf16."""
    from ubnext.torch import ColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    w1, w2 = torch.randn(16, 8, generator=g).to(bf), torch.randn(8, 16, generator=g).to(bf)
    x = torch.randn(2 * size, 8, generator=g).to(bf)

    def body(comm):
        col = ColumnParallelLinear(8, 16, comm, dtype=bf, sequence_parallel=True)
        row = RowParallelLinear(16, 8, comm, dtype=bf, sequence_parallel=True)
        col.load_full(w1)
        row.load_full(w2)
        with torch.no_grad():
            return row(col(x[2 * comm.rank:2 * comm.rank + 2]))

    n = 16 // size
    partials = [(x @ w1[r * n:(r + 1) * n].T) @ w2[:, r * n:(r + 1) * n].T for r in range(size)]
    want = rank_order(partials)
    for r, got in enumerate(run_ranks(size, body)):
        assert torch.equal(got, want[2 * r:2 * r + 2])


def test_benchmark_defaults_and_the_hidden_share():
    from bench import overlap_perf

    args = overlap_perf.parse_args([])
    assert args.tokens == [2048, 4096, 8192, 16384] and args.shapes == "8192/28672,4096/14336"
    assert overlap_perf.hidden_share({"overlapped": 110.0, "gemm": 100.0, "comm": 40.0}) == pytest.approx(0.75)
    assert overlap_perf.hidden_share({"overlapped": 140.0, "gemm": 100.0, "comm": 40.0}) == pytest.approx(0.0)


def test_the_report_prints_the_fused_norms_ratio_on_the_reduce_scatter_side(monkeypatch, capsys):
    """overlap_perf's table: every candidate's median, and on the reduce-scatter side the
    fused epilogue's time over the unfused one's (``fused/unf``); the all-gather side,
    which has no norm candidates, prints no such column."""
    from types import SimpleNamespace

    from bench import _torchbench, overlap_perf

    assert overlap_perf.NORM_PAIR == ("rs+norm fused", "rs, norm")
    assert set(overlap_perf.NORM_PAIR) < set(overlap_perf.CANDIDATES)
    assert overlap_perf.fused_ratio({"rs+norm fused": 90.0, "rs, norm": 120.0}) == pytest.approx(0.75)
    times = {"overlapped": 110.0, "gemm": 100.0, "chunks": 104.0, "comm": 40.0, "ubnext+gemm": 140.0,
             "nccl+gemm": 150.0, "rs+norm fused": 111.0, "rs, norm": 125.0}
    records = [{"hidden": 64, "intermediate": 128, "tokens": 8, "side": side, "candidate": c, "times_us": [t],
                "median_us": t, "rel_err_vs_unoverlapped": 0.0, "rel_err_fused_norm_vs_unfused": None}
               for side in overlap_perf.SIDES for c, t in times.items()
               if side == "rs" or c not in overlap_perf.NORM_PAIR]
    monkeypatch.setattr(_torchbench, "save_report", lambda *a, **k: ("/tmp/x", {"machine": {"gpu": "G"}}))
    monkeypatch.setattr(_torchbench, "plot_lines", lambda path, *a, **k: path)
    comm = SimpleNamespace(size=2)
    overlap_perf.report(comm, SimpleNamespace(tokens=[8]), [], records, [(64, 128)], None)
    lines = capsys.readouterr().out.splitlines()
    ag, rs = (next(i for i, line in enumerate(lines) if line.startswith(f"# {side}:")) for side in ("ag", "rs"))
    assert "fused/unf" not in lines[ag + 1] and lines[rs + 1].split()[-1] == "fused/unf"
    assert float(lines[rs + 2].split()[-1]) == pytest.approx(111.0 / 125.0, abs=1e-3)
    assert "rs+norm fused" in lines[rs + 1] and "rs, norm" in lines[rs + 1]


def test_the_trace_summary_counts_time_under_two_gemm_kernels_once(tmp_path):
    """overlap_perf --trace: a copy's time under two overlapping GEMMs counts once, and so
    does the GEMMs' own time; ubnext's kernels and torch's elementwise kernels are not
    GEMMs; the span runs from the first GPU event's start to the last one's end."""
    import json

    from bench import overlap_perf

    events = [{"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 100},
              {"cat": "kernel", "name": "sm90_gemm", "ts": 50, "dur": 100},
              {"cat": "kernel", "name": "ub_lamport", "ts": 0, "dur": 500},
              {"cat": "kernel", "name": "vectorized_elementwise_kernel", "ts": 200, "dur": 200},
              {"cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 90, "dur": 80},
              {"cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 300, "dur": 10},
              {"cat": "gpu_memset", "name": "Memset", "ts": 600, "dur": 5},
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": -50, "dur": 10}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert overlap_perf.timeline(str(path)) == {"span": 605, "gemms": 150, "copies": 90, "under": 60}


# ---- a first overlapped call under CUDA graph capture --------------------------------------
class _PooledComm:
    """A communicator that would overlap (2 ranks, a pool, the barrier's algorithm) and
    records what an overlapped call reaches; its launch section records whether it is held."""

    rank, size, device, local_rank, pool = 0, 2, 0, 0, {}

    def __init__(self):
        self.reached = []
        self.held = 0
        comm = self

        class Section:
            def __enter__(self):
                comm.held += 1

            def __exit__(self, *exc):
                comm.held -= 1

        self._order = SimpleNamespace(composite=Section)
        self.closed = False

    def _check_open(self, name):
        if self.closed:
            raise ClosedError(f"{name}: the communicator is closed")

    def algorithms(self):
        return ["lamport"]

    def _symmetric_area(self, *args):
        self.reached.append("area")
        raise RuntimeError("the area was reached")


CALLER = 0x7000  # the raw handle of torch's current stream in these tests


def _fake_streams(monkeypatch, capturing=lambda stream: 0):
    """torch's current stream (CALLER) and the runtime calls of the overlapped ops' events
    (a FakeCuda whose capture answers ``capturing``), without a GPU."""
    from stream_fakes import FakeCuda

    from ubnext._interop import streams as _streams
    from ubnext.torch import _overlap

    cuda = FakeCuda()
    cuda.capture = capturing
    monkeypatch.setattr(_streams, "CUDA", cuda)
    monkeypatch.setattr(_overlap, "_current", lambda device: CALLER)
    return cuda


@pytest.mark.parametrize("op", OVERLAPPED)
def test_a_first_overlapped_call_under_capture_raises_before_it_queues_anything(op, monkeypatch):
    """Captured before any call completed (none made, or the first one failed): a clear
    error, no side stream or flag made, nothing reached; eager, the call goes on; once a
    call completed, a captured one goes on too. (Thread communicators have no pool: their
    calls never overlap, so the capture check never applies; tests/test_gpu_overlap.py
    captures on GPUs.)"""
    from ubnext.torch import _overlap

    class Side:
        handle = 0x7100

        def __init__(self, comm):
            self.ready = False

    capturing = [True]
    _fake_streams(monkeypatch, lambda stream: 5 if capturing[0] and stream == CALLER else 0)
    monkeypatch.setattr(_overlap, "_Side", Side)
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: pytest.fail("a GEMM was queued"))
    comm, a, b = _PooledComm(), torch.ones(4, 8), torch.ones(8, 3)

    def call(comm, a, b):
        return _run(op, comm, a, b)

    with pytest.raises(UbnextError, match=f"ubnext::{op}: the first overlapped call .* make one eager call first"):
        call(comm, a, b)
    assert comm not in _overlap._SIDES and comm.reached == []
    capturing[0] = False
    with pytest.raises(RuntimeError, match="the area was reached"):  # eager: goes on (and fails here)
        call(comm, a, b)
    capturing[0] = True
    with pytest.raises(UbnextError, match="first overlapped call"):  # the first call did not complete
        call(comm, a, b)
    _overlap._SIDES[comm].ready = True
    with pytest.raises(RuntimeError, match="the area was reached"):
        call(comm, a, b)
    assert comm.reached == ["area", "area"]


# ---- the overlapped-or-not decision: the same on every rank ---------------------------------
@pytest.mark.parametrize("op, shapes, overlapped", [
    ("all_gather_matmul", ((0, 8), (8, 3)), False),  # no rows (a: the same shape on every rank)
    ("all_gather_matmul", ((4, 0), (0, 3)), False),  # no columns of a
    ("all_gather_matmul", ((4, 8), (8, 0)), True),  # n: b is this rank's own (may differ)
    ("matmul_reduce_scatter", ((0, 8), (8, 3)), False),  # no rows (the same on every rank)
    ("matmul_reduce_scatter", ((4, 8), (8, 0)), False),  # n: the output's, the same everywhere
    ("matmul_reduce_scatter", ((4, 0), (0, 3)), True),  # k: this rank's own (may differ)
    ("all_gather_matmul", ((4, 8), (8, 3)), True),
    (NORM_OP, ((0, 8), (8, 3)), None),  # no rows: empty results, no collective
    (NORM_OP, ((4, 8), (8, 0)), None),  # no columns of the output
    (NORM_OP, ((4, 0), (0, 3)), True),
    (NORM_OP, ((4, 8), (8, 3)), True),
])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_the_path_depends_only_on_what_every_rank_agrees_on(op, shapes, overlapped, local_rank, monkeypatch):
    """The overlapped path or the unoverlapped one (collective: every rank must take the
    same one) is decided by the communicator's size, pool and algorithms, and by the
    operands' extents that every rank shares: not by this rank's own k (reduce-scatter)
    or n (all-gather), nor by its local rank. (The fused op with empty operands takes
    neither: empty results, no collective; ``overlapped`` None.)"""
    from ubnext.torch import _overlap

    class Side:
        ready, handle = True, 0x7100

        def __init__(self, comm):
            pass

    class Comm(_PooledComm):
        def all_gather(self, a):
            self.reached.append("unoverlapped")
            return torch.cat([a] * self.size)

        def reduce_scatter(self, p, precision="auto"):
            assert precision == "exact"  # the unoverlapped path never quantizes
            self.reached.append("unoverlapped")
            return p[:p.shape[0] // self.size]

        def reduce_scatter_add_rmsnorm(self, p, *args, **kwargs):
            self.reached.append("unoverlapped")
            return p[:p.shape[0] // self.size], p[:p.shape[0] // self.size]

    _fake_streams(monkeypatch)
    monkeypatch.setattr(_overlap, "_Side", Side)
    comm = Comm()
    comm.local_rank = local_rank
    a, b = torch.ones(*shapes[0]), torch.ones(*shapes[1])
    try:
        _run(op, comm, a, b)
    except RuntimeError as e:
        assert "the area was reached" in str(e)
    assert comm.reached == ([] if overlapped is None else ["area" if overlapped else "unoverlapped"])


# ---- the fused op's rounds -------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 4])
def test_the_fused_op_finishes_each_round_in_its_reduction(size, monkeypatch):
    """The fused op on the overlapped path (several rounds) takes matmul_reduce_scatter's
    rounds, and launches per round the slot sum's add + RMSNorm where that launches the sum:
    the same slots, stride and rows (hidden n), on the caller's stream, with the round's rows
    of the residual and of both outputs, the same weight, bias and eps every round."""
    from ubnext.torch import _overlap

    monkeypatch.setattr(plan, "AREA_BYTES", 2048)
    _fake_streams(monkeypatch)
    monkeypatch.setattr(_overlap, "_copy", lambda *args: None)
    monkeypatch.setattr(_overlap, "_barrier", lambda comm, side: None)

    class Sum:  # the slot sum's launches, recorded
        def __init__(self):
            self.launches = []

        def __call__(self, *args):
            self.launches.append(("sum", *args))

        def add_rmsnorm(self, *args):
            self.launches.append(("add_rmsnorm", *args))

    class Side:
        ready, handle = True, 100

        def __init__(self, comm):
            self.sum = Sum()

    monkeypatch.setattr(_overlap, "_Side", Side)

    class Comm(_PooledComm):
        def _symmetric_area(self, key, nbytes, framework):
            return torch.empty(nbytes, dtype=torch.uint8), tuple((1 << 40) + (q << 24) for q in range(self.size))

    rows, n = 10, 16
    rounds = plan.scatter_rounds(rows, n * 4, size)  # in the small area
    assert len(rounds.parts) > 1
    for rank in range(size):
        comm = Comm()
        comm.rank, comm.size = rank, size
        _run("matmul_reduce_scatter", comm, torch.ones(size * rows, 8), torch.ones(8, n))
        _run(NORM_OP, comm, torch.ones(size * rows, 8), torch.ones(8, n))
        launches = _overlap._SIDES[comm].sum.launches
        k = len(rounds.parts)
        assert [entry[0] for entry in launches] == ["sum"] * k + ["add_rmsnorm"] * k
        sums, norms = launches[:k], launches[k:]
        firsts = norms[0][6]
        for (r0, m), s_, n_ in zip(rounds.parts, sums, norms):
            _, dtype, slots, stride, count, out, stream = s_
            _, dtype2, slots2, stride2, rows2, hidden, norm, eps, stream2 = n_
            assert (dtype2, slots2, stride2, rows2 * hidden, stream2) == (dtype, slots, stride, count, stream)
            assert (dtype, hidden, rows2, eps, stream) == ("float32", n, m, 1e-6, CALLER)
            assert out - sums[0][5] == r0 * n * 4
            residual, bias, weight, normed, res_out = norm
            assert (bias, weight) == firsts[1:3]
            for ptr, first in ((residual, firsts[0]), (normed, firsts[3]), (res_out, firsts[4])):
                assert ptr - first == r0 * n * 4  # the round's rows
        assert len({firsts[0], firsts[3], firsts[4]}) == 3 and 0 not in firsts


# ---- every launch inside the section; the side stream joined back, also on an error -----------
class _AreaComm(_PooledComm):
    """A pooled communicator whose area is host memory (the copies are recorded, not run)."""

    def _symmetric_area(self, key, nbytes, framework):
        self.reached.append(("area", self.held))
        return torch.empty(nbytes, dtype=torch.uint8), tuple((1 << 40) + (q << 24) for q in range(self.size))


def _recording_side(monkeypatch, comm, fail_barrier: int | None = None):
    """Fakes of the side state, the copies, the barrier and the slot sum that record in
    ``comm.reached`` whether the section is held when each is launched (the barrier
    number ``fail_barrier`` raises, as a broken communicator's does)."""
    from ubnext.torch import _overlap

    class Sum:
        def __call__(self, *args):
            comm.reached.append(("sum", comm.held))

        def add_rmsnorm(self, *args):
            comm.reached.append(("sum", comm.held))

    class Side:
        ready, handle = True, 0x7100

        def __init__(self, comm):
            self.sum = Sum()

    barriers = []

    def barrier(comm_, side):
        barriers.append(None)
        if len(barriers) == fail_barrier:
            raise UbnextError("all_reduce: a collective of this communicator failed")
        comm.reached.append(("barrier", comm.held))

    real = torch.matmul

    def matmul(*args, **kwargs):
        comm.reached.append(("gemm", comm.held))
        return real(*args, **kwargs)

    monkeypatch.setattr(_overlap, "_Side", Side)
    monkeypatch.setattr(_overlap, "_copy", lambda *args: comm.reached.append(("copy", comm.held)))
    monkeypatch.setattr(_overlap, "_barrier", barrier)
    monkeypatch.setattr(torch, "matmul", matmul)


@pytest.mark.parametrize("op", OVERLAPPED)
def test_every_launch_of_an_overlapped_call_is_inside_the_section(op, monkeypatch):
    """The area, the GEMMs, the copies, the barriers and the slot sums all come while the
    communicator's launch section is held (so a close or abort of another thread waits for
    them or comes first); the side stream forked from the caller's first and joined back
    last; every event destroyed."""
    cuda = _fake_streams(monkeypatch)
    comm = _AreaComm()
    _recording_side(monkeypatch, comm)
    _run(op, comm, torch.ones(2 * 4, 8), torch.ones(8, 3))
    kinds = {kind for kind, _ in comm.reached}
    assert {"area", "gemm", "copy", "barrier"} <= kinds and ("sum" in kinds) == (op != "all_gather_matmul")
    assert [held for _, held in comm.reached] == [1] * len(comm.reached), comm.reached
    assert comm.held == 0
    first = cuda.calls[:3]
    assert [c[0] for c in first] == ["event", "record", "wait"] and first[1][2] == CALLER and first[2][1] == 0x7100
    assert _side_joined(cuda.calls)
    assert cuda.live == set()


def _side_joined(calls) -> bool:
    """Whether the caller's stream waits for an event recorded on the side stream after
    the side stream's last work (its last record)."""
    last = max(i for i, c in enumerate(calls) if c[0] == "record" and c[2] == 0x7100)
    return ("wait", CALLER, calls[last][1]) in calls[last:]


@pytest.mark.parametrize("op", OVERLAPPED)
@pytest.mark.parametrize("fail", [1, 2])
def test_a_failing_overlapped_call_joins_the_side_stream_before_it_raises(op, fail, monkeypatch):
    """A barrier that raises (a broken communicator; the opening one, or a round's): the
    caller's stream waits for the side stream (whose copies may be queued) before the
    error reaches the caller, every event is destroyed and the section is left."""
    cuda = _fake_streams(monkeypatch)
    comm = _AreaComm()
    _recording_side(monkeypatch, comm, fail_barrier=fail)
    with pytest.raises(UbnextError, match="a collective of this communicator failed"):
        _run(op, comm, torch.ones(2 * 4, 8), torch.ones(8, 3))
    assert _side_joined(cuda.calls)
    assert cuda.live == set() and comm.held == 0
    assert cuda.names()[-1] == "destroy"


@pytest.mark.parametrize("op", OVERLAPPED)
def test_an_overlapped_call_after_close_raises_before_anything_is_queued(op, monkeypatch):
    """A close of another thread that came first (the call then enters the section after
    it): ClosedError, nothing made, queued or launched, the section left."""
    cuda = _fake_streams(monkeypatch)
    comm = _AreaComm()
    _recording_side(monkeypatch, comm)
    comm.closed = True
    with pytest.raises(ClosedError, match=f"ubnext::{op}: the communicator is closed"):
        _run(op, comm, torch.ones(2 * 4, 8), torch.ones(8, 3))
    assert comm.reached == [] and cuda.calls == [] and comm.held == 0


@pytest.mark.parametrize("pdl", [True, False])
def test_the_slot_sum_launches_as_config_pdl_says_and_keeps_its_arguments_across_threads(pdl, monkeypatch):
    """Its launchers are dependent ones exactly where Config.pdl (and the device) says so,
    and calls from several threads each launch with their own arguments (one argument pack
    per launcher: the slot sum's own lock keeps pack and launch together)."""
    import threading
    import time

    from stream_fakes import FakeDriver, fake_kernel

    from ubnext._engine import launch as _launch
    from ubnext._engine import slot_sum as _slot_sum

    class Module:
        def get_function(self, name):
            return fake_kernel()

    monkeypatch.setattr(_slot_sum, "compile_module", lambda source, defines, device: Module())
    monkeypatch.setattr(_slot_sum, "programmatic", lambda on, device: on)
    inside, seen, wrong = threading.Lock(), [], []

    def on_launch(stream, read):
        if not inside.acquire(blocking=False):
            wrong.append(("overlap", stream))
            return
        try:
            time.sleep(0)  # invite a thread switch between pack and launch
            if read() != [stream, stream + 16, 4, stream + 48]:
                wrong.append(stream)
            seen.append(stream)
        finally:
            inside.release()

    driver = FakeDriver(4, on_launch)
    monkeypatch.setattr(_launch, "_cupy_driver", driver)
    monkeypatch.setattr(_launch, "_launch_ex", driver.launch_ex)
    sums = _slot_sum.SlotSum(0, 132, 2, pdl)
    launchers = [*sums._launchers.values(), *sums._norms.values()]
    assert launchers and all(launcher.dependent is pdl for launcher in launchers)

    def calls(handle):
        for _ in range(200):
            sums("float32", handle, handle + 16, 4, handle + 48, handle)

    workers = [threading.Thread(target=calls, args=(0x1000 * (t + 1),)) for t in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not wrong and len(seen) == 800
