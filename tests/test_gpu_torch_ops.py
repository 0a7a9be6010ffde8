"""ubnext.torch's custom ops on GPUs: torch.library.opcheck of every op, the
torch.distributed forms and the functional ones against Communicator.all_reduce,
reduce_scatter, all_gather and reduce_scatter_add_rmsnorm bit for bit (and the
sequence-parallel gradients against the collectives they are), every form, forward and
backward, on a communicator that opted in to the quantized collectives giving the bits of
one that did not (and the communicator's choice where given ``precision=``), the Communicator's own
collectives compiled (torch.compile traces them into the ops), and a function compiled
with torch.compile(fullgraph=True) captured in a CUDA graph and replayed with results
equal, bit for bit, to the same function run eagerly.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_torch_ops.py``
(ranks may share a GPU); skipped without a GPU.
"""

from __future__ import annotations

import pytest
from gpu_support import require_gpu_and_torch

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN = 8, 256


@pytest.fixture(scope="module")
def comm():
    require_gpu_and_torch()
    from gpu_support import skip_where_nccl_cannot_run
    from tp_support import gpu_communicator

    nbytes = TOKENS * HIDDEN * 2
    c = gpu_communicator(nbytes, "bfloat16")
    if "nccl" in (c.select(nbytes, "bfloat16", collective=k) for k in ("reduce_scatter", "all_gather")):
        skip_where_nccl_cannot_run(c)
    yield c
    c.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(plain, opted_in)``: alike but for the quantized opt-in (``tp_support.quantized_pair``)."""
    from tp_support import quantized_pair

    both = quantized_pair(tmp_path_factory.mktemp("tune"))
    yield both
    for c in both:
        c.close()


def operands(comm, seed: int):
    """x of this rank, and the residual, weight and bias every rank shares."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    shared = [torch.randn(*s, generator=g, device="cuda").bfloat16() for s in ((TOKENS, HIDDEN), (HIDDEN,), (HIDDEN,))]
    g.manual_seed(seed * 101 + comm.rank)
    return (torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").bfloat16(), *shared)


def test_opcheck(comm):
    import torch

    import ubnext.torch as ut

    h = ut.handle(comm)
    x, r, w, b = operands(comm, 1)
    ops = torch.ops.ubnext
    torch.library.opcheck(ops.all_reduce.default, (x, "sum", "exact", h))
    torch.library.opcheck(ops.all_reduce.default, (x.clone().requires_grad_(), "avg", "auto", h))
    torch.library.opcheck(ops.all_reduce_.default, (x.clone(), "max", "exact", h))
    torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, r, w, b, 1e-6, h))
    torch.library.opcheck(ops.all_reduce_add_rmsnorm.default,
                          (x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_(),
                           b.clone().requires_grad_(), 1e-6, h))
    torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, None, w, None, 0.0, h))
    shard = (TOKENS // comm.size, HIDDEN)
    rs = r[:shard[0]]
    torch.library.opcheck(ops.reduce_scatter.default, (x, "sum", "exact", h))
    torch.library.opcheck(ops.reduce_scatter.default, (x.clone().requires_grad_(), "avg", "exact", h))
    torch.library.opcheck(ops.all_gather.default, (x[:2].clone().requires_grad_(), h))
    torch.library.opcheck(ops.reduce_scatter_.default,
                          (torch.empty(shard, dtype=x.dtype, device="cuda"), x, "max", "exact", h))
    torch.library.opcheck(ops.all_gather_.default, (torch.empty(comm.size * 2, HIDDEN, dtype=x.dtype, device="cuda"),
                                                    x[:2], h))
    torch.library.opcheck(ops.reduce_scatter_add_rmsnorm.default, (x, rs, w, b, 1e-6, h))
    torch.library.opcheck(ops.reduce_scatter_add_rmsnorm.default,
                          (x.clone().requires_grad_(), rs.clone().requires_grad_(), w.clone().requires_grad_(),
                           b.clone().requires_grad_(), 1e-6, h))
    torch.library.opcheck(ops.reduce_scatter_add_rmsnorm.default, (x, None, w, None, 0.0, h))
    comm.synchronize()


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "MIN"])
def test_in_place_equals_communicator(comm, op):
    import torch

    import ubnext.torch as ut

    x = operands(comm, 2)[0]
    want = comm.all_reduce(x, op=op.lower())
    t = x.clone()
    assert ut.all_reduce(t, op=getattr(ut.ReduceOp, op), group=comm) is None
    y = ut.functional.all_reduce(x, getattr(ut.ReduceOp, op), group=comm)
    assert torch.equal(t.view(torch.int16), want.view(torch.int16))
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def bits(t):
    import torch

    return t.view(torch.int16)


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "MIN"])
def test_sequence_parallel_forms_equal_communicator(comm, op):
    """reduce_scatter_tensor / all_gather_into_tensor (into NaN-filled outputs) and the
    functional forms give Communicator.reduce_scatter's and all_gather's bits."""
    import torch

    import ubnext.torch as ut

    x = operands(comm, 6)[0]
    want = comm.reduce_scatter(x, op=op.lower())
    out = torch.full((TOKENS // comm.size, HIDDEN), float("nan"), dtype=x.dtype, device="cuda")
    assert ut.reduce_scatter_tensor(out, x, op=getattr(ut.ReduceOp, op), group=comm) is None
    assert torch.equal(bits(out), bits(want))
    assert torch.equal(bits(ut.functional.reduce_scatter(x, getattr(ut.ReduceOp, op), group=comm)), bits(want))
    gathered = comm.all_gather(want)
    into = torch.full((TOKENS, HIDDEN), float("nan"), dtype=x.dtype, device="cuda")
    assert ut.all_gather_into_tensor(into, out, group=comm) is None
    assert torch.equal(bits(into), bits(gathered))
    assert torch.equal(bits(ut.functional.all_gather(out, group=comm)), bits(gathered))
    comm.synchronize()


@pytest.mark.parametrize("residual,bias", [(True, True), (False, False)])
def test_fused_sequence_parallel_equals_communicator(comm, residual, bias):
    """Forward: Communicator.reduce_scatter_add_rmsnorm's bits. Backward: x's gradient is
    the all-gather of the residual shard's (the gradient of the pre-norm sum)."""
    import torch

    import ubnext.torch as ut

    x, r, w, b = operands(comm, 7)
    rs = r[comm.rank * (TOKENS // comm.size):(comm.rank + 1) * (TOKENS // comm.size)].clone()
    want = comm.reduce_scatter_add_rmsnorm(x, rs if residual else None, w, eps=1e-6, bias=b if bias else None)
    leaves = [t.clone().requires_grad_() for t in (x, rs, w, b)]
    lx, lr, lw, lb = leaves
    got = ut.functional.reduce_scatter_add_rmsnorm(lx, lr if residual else None, lw, lb if bias else None, 1e-6,
                                                   group=comm)
    for g, expected in zip(got, want):
        assert torch.equal(bits(g), bits(expected))
    torch.autograd.backward(got, [torch.randn(got[0].shape, device="cuda").bfloat16() for _ in range(2)])
    if residual:
        assert torch.equal(bits(lx.grad), bits(comm.all_gather(lr.grad)))
    assert lx.grad.shape == x.shape and lw.grad.shape == w.shape and (lb.grad is not None) == bias
    comm.synchronize()


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_sequence_parallel_gradients_are_the_transposed_collectives(comm, op):
    """reduce_scatter's gradient is the all-gather of its gradient (avg: / size),
    all_gather's the reduce-scatter (sum) of its gradient, bit for bit."""
    import torch

    import ubnext.torch as ut

    x = operands(comm, 8)[0].requires_grad_()
    y = ut.functional.reduce_scatter(x, op, group=comm)
    g = operands(comm, 9)[0][:y.shape[0]].contiguous()
    y.backward(g)
    want = comm.all_gather(g)
    assert torch.equal(bits(x.grad), bits(want if op == "sum" else want / comm.size))
    s = operands(comm, 10)[0][:2].clone().requires_grad_()
    gathered = ut.functional.all_gather(s, group=comm)
    gg = operands(comm, 11)[0][:gathered.shape[0]].contiguous()
    gathered.backward(gg)
    assert torch.equal(bits(s.grad), bits(comm.reduce_scatter(gg)))
    comm.synchronize()


def test_compiled_function_replays_in_a_cuda_graph(comm):
    import torch

    import ubnext.torch as ut

    def step(x, residual, weight, bias):
        ut.all_reduce(x, group=comm)                                   # in place
        y = ut.functional.all_reduce(x * 2, "avg", group=comm)        # out of place
        normed, res = ut.functional.all_reduce_add_rmsnorm(y, residual, weight, bias, 1e-6, group=comm)
        # sequence parallelism: every form of the reduce-scatter and all-gather
        shard = ut.functional.reduce_scatter(normed, "sum", group=comm)
        into = torch.empty_like(shard)
        ut.reduce_scatter_tensor(into, res, group=comm)
        gathered = torch.empty_like(normed)
        ut.all_gather_into_tensor(gathered, into, group=comm)
        sp_normed, sp_res = ut.functional.reduce_scatter_add_rmsnorm(ut.functional.all_gather(shard, group=comm),
                                                                     into, weight, bias, 1e-6, group=comm)
        return normed, res, gathered, sp_normed, sp_res

    explained = torch._dynamo.explain(step)(*[t.clone() for t in operands(comm, 3)])
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    static = [t.clone() for t in operands(comm, 3)]
    for _ in range(2):  # compiles the graph and every kernel, outside the capture
        compiled(*[t.clone() for t in static])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = compiled(*static)
    for seed in (4, 5):
        fresh = operands(comm, seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        want = step(*[f.clone() for f in fresh])
        for got, w in zip(outputs, want):
            assert torch.equal(got.view(torch.int16), w.view(torch.int16))
        assert torch.equal(static[0].view(torch.int16), comm.all_reduce(fresh[0]).view(torch.int16))  # mutated
    comm.synchronize()


def test_communicator_methods_compile_to_the_ops(comm):
    """The Communicator's own collectives under torch.compile(fullgraph=True): no graph
    break (each becomes its torch.ops.ubnext op, out= the mutating one), and the compiled
    function's results equal, bit for bit, the same function run eagerly."""
    import torch

    def step(x, residual, weight, bias):
        y = comm.all_reduce(x * 2) + 1
        comm.all_reduce(y, out=y, op="max")
        normed, res = comm.all_reduce_add_rmsnorm(y, residual, weight, eps=1e-6, bias=bias)
        shard = comm.reduce_scatter(normed, op="avg")
        into = torch.empty_like(shard)
        comm.reduce_scatter(res, out=into)
        gathered = comm.all_gather(into)
        flat = torch.empty(gathered.numel(), dtype=gathered.dtype, device=gathered.device)
        comm.all_gather(shard, out=flat)
        sp_normed, sp_res = comm.reduce_scatter_add_rmsnorm(gathered, into, weight, eps=1e-6, bias=bias)
        return y, normed, res, shard, gathered, flat, sp_normed, sp_res

    explained = torch._dynamo.explain(step)(*operands(comm, 6))
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    for seed in (7, 8):
        args = operands(comm, seed)
        want = step(*args)
        got = compiled(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g.view(torch.int16), w.view(torch.int16))
    comm.synchronize()


def test_the_ops_quantize_only_where_asked(pair):
    """On a communicator that opted in to int8 from 1 KiB (every call here is above it),
    every differentiable form, forward and backward (copy_to_group's, all_gather's and the
    gathered output's gradient of all_gather_matmul reduce), and the in-place forms give
    the bits of a communicator that did not; given ``precision="auto"`` (or a format), the
    all-reduce and reduce-scatter forms take the opted-in communicator's choice: its own
    calls' bits, quantized at 2 ranks or more."""
    import torch

    import tp_support as tp
    import ubnext.torch as ut

    plain, opted_in = pair
    g = torch.Generator().manual_seed(40 + opted_in.rank)
    x = torch.randn(16, 256, generator=g).bfloat16().cuda()
    w = (torch.randn(256, 64, generator=torch.Generator().manual_seed(41)) / 16).bfloat16().cuda()
    forms = [tp.differentiable_forms(c, x, w) for c in pair]
    exact = opted_in.all_reduce(x, precision="exact")
    auto, auto_rs = opted_in.all_reduce(x), opted_in.reduce_scatter(x, precision="int8")
    in_place, into = x.clone(), x.new_empty(x.numel() // opted_in.size)
    ut.all_reduce(in_place, group=opted_in, precision="auto")
    ut.reduce_scatter_tensor(into, x, group=opted_in, precision="int8")
    asked = {"functional.all_reduce": (ut.functional.all_reduce(x, group=opted_in, precision="auto"), auto),
             "all_reduce": (in_place, auto),
             "functional.reduce_scatter": (ut.functional.reduce_scatter(x, group=opted_in, precision="int8"), auto_rs),
             "reduce_scatter_tensor": (into.view(auto_rs.shape), auto_rs)}
    torch.cuda.synchronize()
    assert torch.equal(bits(auto), bits(exact)) == (opted_in.size == 1), "auto did not quantize: the test shows nothing"
    for i, (a, b) in enumerate(zip(*forms)):
        assert torch.equal(bits(a), bits(b)), f"form {i} quantized without being asked"
    for name, (got, want) in asked.items():
        assert torch.equal(bits(got), bits(want)), name
    for c in pair:
        c.synchronize()
