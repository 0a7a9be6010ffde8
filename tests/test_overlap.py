"""ubnext.torch's overlapped GEMMs on CPU (issue 38): the plan of their rounds through the
bounded area (as few rounds as fit, from half 0, every byte inside the area, the sizes of the
issue), the peers' orders, the ops' schemas, argument checks, fake implementations,
opcheck, torch.compile, and their gradients and the sequence-parallel layers against
single-process references at 1, 2 and 4 thread ranks (the thread communicators have no
pool: the ops run their unoverlapped path there; tests/test_gpu_overlap.py runs the
overlapped one)."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from torch_fakes import rank_order, run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import UbnextError  # noqa: E402
from ubnext.torch import _overlap_plan as plan  # noqa: E402
from ubnext.torch import _rmsnorm  # noqa: E402

#: float64 operands, but the thread communicators reduce in fp32 (rounded once to float64)
close = dict(rtol=1e-5, atol=1e-5)


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


def test_arguments_are_checked():
    def body(comm):
        a, b = torch.randn(4, 8), torch.randn(8, 3)
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

    reduce_scatter = all_gather


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_operands_off_the_communicators_device_raise_before_any_work(op, monkeypatch):
    """CPU operands (and those of another CUDA device, as torch.device compares them) for a
    communicator of CUDA device 1 raise on the unoverlapped path too (no pool), before any
    GEMM or collective."""
    comm = _CudaComm()
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: pytest.fail("a GEMM was queued"))
    with pytest.raises(UbnextError, match=f"ubnext::{op}: a and b are on cpu, the communicator on cuda:1"):
        getattr(ut, op)(torch.ones(4, 8), torch.ones(8, 3), group=comm)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fakes_have_the_real_shapes(size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def body(comm):
        h = ut.handle(comm)
        with FakeTensorMode():
            a, b = torch.empty(2 * size, 3, 8, dtype=torch.bfloat16), torch.empty(8, 5, dtype=torch.bfloat16)
            fakes = (*torch.ops.ubnext.all_gather_matmul(a, b, h), torch.ops.ubnext.matmul_reduce_scatter(a, b, h))
        calls = comm.calls
        a, b = torch.ones(2 * size, 3, 8, dtype=torch.bfloat16), torch.ones(8, 5, dtype=torch.bfloat16)
        real = (*ut.all_gather_matmul(a, b, group=comm), ut.matmul_reduce_scatter(a, b, group=comm))
        return fakes, real, calls

    for fakes, real, calls in run_ranks(size, body):
        assert calls == 0
        assert [t.shape for t in fakes] == [t.shape for t in real] == [
            (2 * size * size, 3, 8), (2 * size * size, 3, 5), (2, 3, 5)]
        assert all(t.dtype == torch.bfloat16 for t in (*fakes, *real))


@pytest.mark.parametrize("size", [1, 2])
def test_opcheck(size):
    utils = ["test_schema", "test_autograd_registration", "test_faketensor"]
    utils += ["test_aot_dispatch_dynamic"] if size == 1 else []

    def body(comm):
        h = ut.handle(comm)
        g = torch.Generator().manual_seed(comm.rank)
        a, b = torch.randn(2 * comm.size, 8, generator=g), torch.randn(8, 3, generator=g)
        for op, args in [(torch.ops.ubnext.all_gather_matmul, (a, b, h)),
                         (torch.ops.ubnext.all_gather_matmul, (a.clone().requires_grad_(), b.clone().requires_grad_(), h)),
                         (torch.ops.ubnext.matmul_reduce_scatter, (a, b, h)),
                         (torch.ops.ubnext.matmul_reduce_scatter, (a.clone().requires_grad_(), b.t().contiguous().t()
                                                                   .requires_grad_(), h))]:
            torch.library.opcheck(op.default, args, test_utils=utils)

    run_ranks(size, body)


def test_compiled_forward_and_backward_equal_eager():
    """One rank (Dynamo is not thread-safe): both ops traced with fullgraph, their
    backwards (each other's ops) in the backward graph."""
    torch._dynamo.reset()

    def fn(x, w1, w2, comm):
        _, h = ut.all_gather_matmul(x, w1, group=comm)
        return ut.matmul_reduce_scatter(torch.relu(h), w2, group=comm)

    def body(comm):
        g = torch.Generator().manual_seed(3)
        data = [torch.randn(*s, generator=g) for s in ((4, 8), (8, 6), (6, 8))]
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
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_sequence_parallel_blocks_match_the_unsharded_block(size, kind):
    """The sequence-parallel MLP and attention output at thread ranks, float64: each rank's
    rows of the outputs and of the input gradient, its weight shards' gradients, and the
    norm weight's and bias's gradients summed over the ranks, against the unsharded block."""
    from ubnext.torch import TensorParallelAttentionOutput, TensorParallelMLP

    tokens, hidden, inter, eps = 4 * size, 16, 32, 1e-5
    f64 = torch.float64
    g = torch.Generator().manual_seed(11)

    def rnd(*s):
        return torch.randn(*s, generator=g, dtype=f64)

    w = {"gate": rnd(inter, hidden), "up": rnd(inter, hidden), "down": rnd(hidden, inter) / 4,
         "o": rnd(hidden, inter) / 4, "bias": rnd(hidden), "norm": 1 + rnd(hidden) / 8}
    x, attention, residual = rnd(tokens, hidden), rnd(tokens, inter), rnd(tokens, hidden)
    grad_normed, grad_residual = rnd(tokens, hidden), rnd(tokens, hidden)
    rows_of = tokens // size

    def body(comm):
        r = comm.rank
        rows = slice(r * rows_of, (r + 1) * rows_of)
        if kind == "mlp":
            block = TensorParallelMLP(hidden, inter, comm, bias=True, eps=eps, dtype=f64, sequence_parallel=True)
            block.load_full(w["gate"], w["up"], w["down"], w["norm"], w["bias"])
            inp = x[rows].clone().requires_grad_()
        else:
            block = TensorParallelAttentionOutput(hidden, inter, comm, bias=True, eps=eps, dtype=f64,
                                                  sequence_parallel=True)
            block.proj.load_full(w["o"], w["bias"])
            with torch.no_grad():
                block.norm.weight.copy_(w["norm"])
            cols = inter // size
            inp = attention[:, r * cols:(r + 1) * cols].clone().requires_grad_()
        res = residual[rows].clone().requires_grad_()
        normed, res_out = block(inp, res)
        torch.autograd.backward((normed, res_out), (grad_normed[rows], grad_residual[rows]))
        return (normed.detach(), res_out.detach(), inp.grad, res.grad,
                {n: p.grad for n, p in block.named_parameters()})

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
        torch.testing.assert_close(got_n, normed.detach()[rows], **close)
        torch.testing.assert_close(got_res, res_out.detach()[rows], **close)
        torch.testing.assert_close(got_dres, rin.grad[rows], **close)
        if kind == "mlp":
            torch.testing.assert_close(got_dx, xin.grad[rows], **close)
            torch.testing.assert_close(got_params["gate_up.weight"], torch.cat([p["gate"].grad[shard],
                                                                                p["up"].grad[shard]]), **close)
            torch.testing.assert_close(got_params["down.weight"], p["down"].grad[:, shard], **close)
        else:
            torch.testing.assert_close(got_dx, ain.grad[:, shard], **close)
            torch.testing.assert_close(got_params["proj.weight"], p["o"].grad[:, shard], **close)
    bias_name = "down.bias" if kind == "mlp" else "proj.bias"
    torch.testing.assert_close(sum(res[4][bias_name] for res in results), p["bias"].grad, **close)
    torch.testing.assert_close(sum(res[4]["norm.weight"] for res in results), p["norm"].grad, **close)


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
    records what an overlapped call reaches."""

    rank, size, device, local_rank, pool = 0, 2, 0, 0, {}

    def __init__(self):
        self.reached = []

    def algorithms(self):
        return ["lamport"]

    def _symmetric_area(self, *args):
        self.reached.append("area")
        raise RuntimeError("the area was reached")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_a_first_overlapped_call_under_capture_raises_before_it_queues_anything(op, monkeypatch):
    """Captured before any call completed (none made, or the first one failed): a clear
    error, no side stream or flag made, nothing reached; eager, the call goes on; once a
    call completed, a captured one goes on too. (Thread communicators have no pool: their
    calls never overlap, so the capture check never applies; tests/test_gpu_overlap.py
    captures on GPUs.)"""
    from ubnext.torch import _overlap

    class Side:
        def __init__(self, device, size):
            self.ready = False

    capturing = [True]
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(_overlap, "_Side", Side)
    monkeypatch.setattr(torch, "matmul", lambda *a, **k: pytest.fail("a GEMM was queued"))
    comm, a, b = _PooledComm(), torch.ones(4, 8), torch.ones(8, 3)
    call = getattr(_overlap, op)
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
])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_the_path_depends_only_on_what_every_rank_agrees_on(op, shapes, overlapped, local_rank, monkeypatch):
    """The overlapped path or the unoverlapped one (collective: every rank must take the
    same one) is decided by the communicator's size, pool and algorithms, and by the
    operands' extents that every rank shares: not by this rank's own k (reduce-scatter)
    or n (all-gather), nor by its local rank."""
    from ubnext.torch import _overlap

    class Side:
        ready = True

        def __init__(self, device, size):
            pass

    class Comm(_PooledComm):
        def all_gather(self, a):
            self.reached.append("unoverlapped")
            return torch.cat([a] * self.size)

        def reduce_scatter(self, p):
            self.reached.append("unoverlapped")
            return p[:p.shape[0] // self.size]

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_overlap, "_Side", Side)
    comm = Comm()
    comm.local_rank = local_rank
    a, b = torch.ones(*shapes[0]), torch.ones(*shapes[1])
    try:
        getattr(_overlap, op)(comm, a, b)
    except RuntimeError as e:
        assert "the area was reached" in str(e)
    assert comm.reached == ["area" if overlapped else "unoverlapped"]
