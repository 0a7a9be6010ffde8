"""ubnext.torch's custom ops on GPUs: torch.library.opcheck of every op, the in-place
torch.distributed form against Communicator.all_reduce bit for bit, and a function
compiled with torch.compile(fullgraph=True) captured in a CUDA graph and replayed with
results equal, bit for bit, to the same function run eagerly.

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
    from tp_support import gpu_communicator

    c = gpu_communicator(TOKENS * HIDDEN * 2, "bfloat16")
    yield c
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
    torch.library.opcheck(ops.all_reduce.default, (x, "sum", h))
    torch.library.opcheck(ops.all_reduce.default, (x.clone().requires_grad_(), "avg", h))
    torch.library.opcheck(ops.all_reduce_.default, (x.clone(), "max", h))
    torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, r, w, b, 1e-6, h))
    torch.library.opcheck(ops.all_reduce_add_rmsnorm.default,
                          (x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_(),
                           b.clone().requires_grad_(), 1e-6, h))
    torch.library.opcheck(ops.all_reduce_add_rmsnorm.default, (x, None, w, None, 0.0, h))
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


def test_compiled_function_replays_in_a_cuda_graph(comm):
    import torch

    import ubnext.torch as ut

    def step(x, residual, weight, bias):
        ut.all_reduce(x, group=comm)                                   # in place
        y = ut.functional.all_reduce(x * 2, "avg", group=comm)        # out of place
        return ut.functional.all_reduce_add_rmsnorm(y, residual, weight, bias, 1e-6, group=comm)

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
