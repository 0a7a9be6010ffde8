"""ubnext.torch.moe's throughput mode on GPUs: ``packed_dispatch`` and ``combine`` of its
handle (``torch.ops.ubnext.moe_packed_*``) on a real PackedExpertParallel, forward and
backward bit for bit against the host references (ubnext/_moe/packed_reference.py,
tests/moe_support.py) with -0.0 / inf / NaN payloads and T = 0 on rank 1, at the default R
and at the tightest (the most rows a GPU receives in the run); under
torch.compile(fullgraph=True) (Inductor) and replayed in a CUDA graph (forward and backward
captured together), each the same bits as eager.

The same bodies run at any rank count: ``python -m pytest -q tests/test_gpu_moe_packed_torch.py``
(1 rank), ``mpirun -n 2|4 python -m pytest -q tests/test_gpu_moe_packed_torch.py`` (one GPU
per rank, or ranks sharing one GPU with ``--oversubscribe``); skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import host, seed_of
from moe_support import NP, inputs, tokens_of
from moe_torch_support import MODES
from test_gpu_moe import communicator, to_device
from test_gpu_moe_torch import COMPILE_SKEW_S, OPS_SIZE, check_ops, same_bits

from ubnext._moe import layout, packed_layout

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def comm():
    c = communicator(timeout_s=COMPILE_SKEW_S)
    yield c
    c.close()


def make(comm, dtype: str, idxs=None):
    """The PackedExpertParallel of OPS_SIZE and its shape: R the default, or with ``idxs``
    (every rank's routing) the most rows any GPU receives from it."""
    import ubnext

    per_gpu, hidden, tokens, k = OPS_SIZE
    e = per_gpu * comm.size
    rows = None
    if idxs is not None:  # a row per (token, expert) slot: GPU g's rows, its experts' slots
        rows = max(1, max(sum(int(((i >= g * per_gpu) & (i < (g + 1) * per_gpu)).sum()) for i in idxs)
                          for g in range(comm.size)))
    ep = ubnext.PackedExpertParallel(comm, e, hidden, tokens, k, dtype, max_rows=rows, framework="torch")
    return ep, packed_layout.shape(comm.size, e, hidden, tokens, k, dtype, rows)


@pytest.mark.parametrize("rows", ["default", "tight"])
@pytest.mark.parametrize("kind", ["random", "dropped", "skewed"])
@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_ops_forward_and_backward_bit_for_bit(comm, dtype, kind, rows):
    """packed_dispatch (rows from offsets[L] on zero), combine and the gradients
    (test_gpu_moe_torch.check_ops), at the default R and at the tightest."""
    n = comm.size
    seed = seed_of("moe_packed_torch", dtype, kind, rows)
    probe = packed_layout.shape(n, OPS_SIZE[0] * n, *OPS_SIZE[1:], dtype)
    xs, idxs, ws = inputs(probe, kind, tokens_of(probe), seed)
    ep, s = make(comm, dtype, idxs if rows == "tight" else None)
    check_ops(comm, ep, s, MODES["packed"], (xs, idxs, ws), seed)


def forward(ep):
    """out = combine(2 * packed_dispatch(x)) on ``ep`` (the doubling exact: compiled,
    captured and eager agree bit for bit)."""
    import ubnext.torch as ut

    def fn(x, idx, w):
        recv_x, _, handle = ut.moe.packed_dispatch(x, idx, w, ep)
        return ut.moe.combine(recv_x * 2, handle)

    return fn


def step(fn, x, idx, w, g):
    """``fn``'s output, backward with g (x's and w's gradients)."""
    out = fn(x, idx, w)
    out.backward(g)
    return out


def leaves(xs, idxs, ws, gs, r):
    x, w = to_device(xs[r]).clone().requires_grad_(), to_device(ws[r]).clone().requires_grad_()
    return x, to_device(idxs[r]), w, to_device(gs[r])


def data(comm, s, dtype: str, seed: int):
    xs, idxs, ws = inputs(s, "random", tokens_of(s), seed)
    rng = np.random.default_rng(seed + 1)
    return xs, idxs, ws, [rng.standard_normal((t, s.hidden)).astype(NP[dtype]) for t in tokens_of(s)]


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_compiled_equals_eager(comm, dtype):
    """torch.compile(fullgraph=True) (Inductor) of a packed step: forward and backward the
    same bits as eager (NaN as a class), two steps (the second without recompiling; the
    weights' gradient sums float64 products, exact for these sizes up to the last bits of
    a double, so Inductor's order of the sum rounds to the same float32)."""
    import torch

    ep, s = make(comm, dtype)
    eager = forward(ep)
    compiled = torch.compile(eager, fullgraph=True)
    for i in range(2):
        xs, idxs, ws, gs = data(comm, s, dtype, seed=seed_of("moe_packed_compile", dtype, i))
        results = []
        for f in (eager, compiled):
            x, idx, w, g = leaves(xs, idxs, ws, gs, comm.rank)
            out = step(f, x, idx, w, g)
            results.append([out.detach(), x.grad, w.grad])
        torch.cuda.synchronize()
        for what, a, b in zip(("out", "x.grad", "w.grad"), *results):  # NaN as a class: Inductor's NaN payloads
            assert same_bits(b, host(a)), f"step {i}: {what}"
    comm.synchronize()


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_forward_and_backward_in_a_cuda_graph(comm, dtype):
    """A packed step (forward and backward) captured in one CUDA graph after eager warm-up
    steps on the capture's stream, replayed with new tokens, routing, weights and gradients
    copied into the captured ones: every replay the same bits as an eager step."""
    import torch

    ep, s = make(comm, dtype)
    fn, r = forward(ep), comm.rank
    x, idx, w, g = leaves(*data(comm, s, dtype, seed=seed_of("moe_packed_graph", dtype)), r)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(fn, x, idx, w, g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(fn, x, idx, w, g)
    for replay in range(3):
        new = leaves(*data(comm, s, dtype, seed=seed_of("moe_packed_graph", dtype, replay + 1)), r)
        with torch.no_grad():
            for captured, value in zip((x, idx, w, g), new):
                captured.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone(), x.grad.clone(), w.grad.clone()]
        eager = step(fn, *new)
        torch.cuda.synchronize()
        want = [eager.detach(), new[0].grad, new[2].grad]
        for what, a, b in zip(("out", "x.grad", "w.grad"), got, want):  # bytes, flat: a rank without tokens
            # has zero-size tensors, whose strides may be 0, which a dtype view refuses
            assert a.shape == b.shape, f"replay {replay}: {what}'s shape"
            a, b = (t.reshape(-1).view(torch.uint8) for t in (a, b))
            assert torch.equal(a, b), f"replay {replay}: {what}"
    comm.synchronize()


def test_host_visible_errors_raise_before_any_launch(comm):
    import torch

    import ubnext.torch as ut
    from ubnext import UbnextError

    ep, s = make(comm, "bfloat16")
    x = torch.zeros((2, s.hidden), device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros((2, s.top_k), device="cuda", dtype=torch.int32)
    w = torch.zeros((2, s.top_k), device="cuda")
    with pytest.raises(UbnextError, match="^ubnext::moe_packed_dispatch: x must be bfloat16"):
        ut.moe.packed_dispatch(x.float(), idx, w, ep)
    with pytest.raises(UbnextError, match="^ubnext::moe_packed_combine: no dispatch of this object"):
        torch.ops.ubnext.moe_packed_combine(torch.zeros((s.max_rows, s.hidden), device="cuda", dtype=torch.bfloat16),
                                            torch.zeros((s.max_rows,), device="cuda"), idx, ut.handle(ep))
    torch.cuda.synchronize()
    comm.synchronize()  # nothing was launched: the communicator is intact
