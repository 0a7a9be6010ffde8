"""ubnext.torch.moe on GPUs: the ops on a real ExpertParallel, forward and backward bit for
bit against the host references (ubnext/_moe/reference.py, tests/moe_support.py) with
-0.0 / inf / NaN payloads and T = 0 on rank 1; and examples/moe_block.py's block against
its single-process reference, eager, under torch.compile(fullgraph=True) and replayed
in a CUDA graph (forward and backward captured together).

The same bodies run at any rank count: ``python -m pytest -q tests/test_gpu_moe_torch.py``
(1 rank), ``mpirun -n 2|4 python -m pytest -q tests/test_gpu_moe_torch.py`` (one GPU per
rank, or ranks sharing one GPU with ``--oversubscribe``); skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import host, seed_of
from moe_support import NP, combine_backward, dispatch_backward, expert_outputs, inputs, moe_block_module, row_dims, \
    tokens_of
from moe_torch_support import MODES
from test_gpu_moe import communicator, ref_mismatches, to_device

from ubnext._moe import layout

pytestmark = pytest.mark.gpu

#: (experts per GPU, hidden, max tokens, top-k) of the ops' test, and of the block's (with
#: its experts' inner size)
OPS_SIZE = (3, 136, 9, 3)
BLOCK_SIZE, FFN = (2, 64, 12, 2), 96
#: the block against its reference: max |diff| / max |ref| (the GEMMs' orders differ)
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


#: the ranks compile their graphs (Inductor, lazily for the backward) at different speeds, a
#: rank without tokens a differently specialized graph, so a peer may wait minutes at a first
#: compiled call: the bound of a long step (the library's default is 600 s), not the 30 s of
#: the other MoE tests (it broke the compile test with 2 and 4 ranks sharing one H200)
COMPILE_SKEW_S = 300.0


@pytest.fixture(scope="module")
def comm():
    c = communicator(timeout_s=COMPILE_SKEW_S)
    yield c
    c.close()


def expert_parallel(comm, size, dtype: str):
    import ubnext

    per_gpu, hidden, tokens, k = size
    ep = ubnext.ExpertParallel(comm, per_gpu * comm.size, hidden, tokens, k, dtype, framework="torch")
    return ep, ep.shape


def same_bits(got, want: np.ndarray) -> bool:
    return ref_mismatches(host(got), np.asarray(want)).size == 0


def check_ops(comm, ep, s, mode, data, seed: int) -> None:
    """``mode``'s ops (``moe_torch_support.MODES``: its dispatch, the combine of its handle)
    on ``ep`` (of shape ``s``), this rank's part of ``data`` (every rank's xs, idxs, ws),
    forward and backward, bit for bit against the mode's host references: the dispatch
    (rows not received zero) and its control (counts, or offsets), combine, and the
    gradients: y's and topk_weights' from out's gradient G (through combine's weight
    gradient, brought back to the tokens), x's from recv_x's gradient R. Both modes'
    tests call it."""
    import torch

    import ubnext.torch as ut

    xs, idxs, ws = data
    r, n = comm.rank, comm.size
    rng = np.random.default_rng(seed + 1)
    gs = [rng.standard_normal((t, s.hidden)).astype(NP[s.dtype]) for t in tokens_of(s)]
    rs = [rng.standard_normal((*row_dims(s), s.hidden)).astype(NP[s.dtype]) for _ in range(n)]
    ys = expert_outputs(s, seed + 2)
    x, w, y = (to_device(a).clone().requires_grad_() for a in (xs[r], ws[r], ys[r]))
    recv_x, control, handle = mode.dispatch(x, to_device(idxs[r]), w, ep)
    out = ut.moe.combine(y, handle)
    out.backward(to_device(gs[r]), retain_graph=True)
    (gx,) = torch.autograd.grad(recv_x, x, to_device(rs[r]))
    torch.cuda.synchronize()
    comm.synchronize()

    dispatched = mode.ref.dispatch(s, xs, idxs, ws)
    d = dispatched[r]
    assert not d.overflow
    assert np.array_equal(control.cpu().numpy(), mode.control(d))
    assert same_bits(recv_x.detach(), d.recv_x), "recv_x (zero past the rows received)"
    assert np.array_equal(handle.src.cpu().numpy(), d.src) and same_bits(handle.weights.detach(), d.weights)
    assert same_bits(out.detach(), mode.ref.combine(s, dispatched, ys, idxs)[r]), "out"
    grads = combine_backward(s, mode.ref.dispatch(s, gs, idxs, ws), ys, [e.weights for e in dispatched])
    back = dispatch_backward(s, dispatched, rs, [gw for _, gw in grads], idxs)
    assert same_bits(y.grad, grads[r][0]), "y.grad"
    assert same_bits(w.grad, back[r][1]), "topk_weights.grad"
    assert same_bits(gx, back[r][0]), "x.grad"


@pytest.mark.parametrize("kind", ["random", "dropped", "skewed"])
@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_ops_forward_and_backward_bit_for_bit(comm, dtype, kind):
    """dispatch (rows past the counts zero), combine and the gradients (check_ops)."""
    ep, s = expert_parallel(comm, OPS_SIZE, dtype)
    seed = seed_of("moe_torch", dtype, kind)
    check_ops(comm, ep, s, MODES["low-latency"], inputs(s, kind, tokens_of(s), seed), seed)


def block_data(comm, s, dtype: str, seed: int):
    """Every rank's tokens and output gradients (T = 0 on rank 1), on the device."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = getattr(torch, dtype)
    xs = [torch.randn(n, s.hidden, generator=g).to("cuda", t) for n in tokens_of(s)]
    grads = [torch.randn(n, s.hidden, generator=g).to("cuda", t) for n in tokens_of(s)]
    return xs, grads


def block(comm, dtype: str):
    import torch

    mb = moe_block_module()
    ep, s = expert_parallel(comm, BLOCK_SIZE, dtype)
    weights = mb.make_weights(s.num_experts, s.hidden, FFN, seed=4)
    return mb, mb.MoEBlock(ep, weights, torch.device("cuda", comm.device)), weights, s


def assert_close(errors: dict, dtype: str, what: str) -> None:
    assert max(errors.values()) <= TOLERANCE[dtype], f"{what}: {errors}"


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_block_matches_its_single_process_reference(comm, dtype):
    mb, moe, weights, s = block(comm, dtype)
    for step in range(2):
        xs, grads = block_data(comm, s, dtype, seed=10 + step)
        assert_close(mb.check(moe, xs, grads, weights, comm.rank), dtype, f"eager step {step}")


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_block_under_torch_compile(comm, dtype):
    """torch.compile(fullgraph=True) (inductor) of the block: forward and backward
    within the tolerance of the reference, two steps (the second without recompiling)."""
    import torch

    mb, moe, weights, s = block(comm, dtype)
    compiled = torch.compile(moe, fullgraph=True)
    for step in range(2):
        xs, grads = block_data(comm, s, dtype, seed=20 + step)
        x = xs[comm.rank].clone().requires_grad_()
        moe.zero_grad(set_to_none=True)
        out = compiled(x)
        out.backward(grads[comm.rank])
        assert_close(mb.compare(moe, out, x.grad, xs, grads, weights, comm.rank), dtype, f"compiled step {step}")


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_block_forward_in_a_cuda_graph(comm, dtype):
    """The forward alone (no autograd) captured after eager warm-up calls, replayed with new
    tokens copied into the captured ones: every replay's output within the tolerance of
    the reference."""
    import torch

    mb, moe, weights, s = block(comm, dtype)
    r = comm.rank
    xs, _ = block_data(comm, s, dtype, seed=40)
    x = xs[r].clone()
    ref_weights = mb.placed(weights, x.dtype, x.device)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        for replay in range(3):
            xs, _ = block_data(comm, s, dtype, seed=41 + replay)
            x.copy_(xs[r])
            graph.replay()
            torch.cuda.synchronize()
            want = mb.reference(xs, ref_weights["router"], ref_weights["w1"], ref_weights["w2"], s.top_k)[r]
            error = mb.relative_error(out, want)
            assert error <= TOLERANCE[dtype], f"replay {replay}: {error}"
    comm.synchronize()


@pytest.mark.parametrize("dtype", list(layout.MOE_DTYPES))
def test_block_in_a_cuda_graph(comm, dtype):
    """Forward and backward captured in one CUDA graph (after eager warm-up steps on the
    capture's stream), replayed with new tokens and gradients copied into the captured
    ones: every replay within the tolerance of the reference (routing, counts and all)."""
    import torch

    mb, moe, weights, s = block(comm, dtype)
    r = comm.rank
    xs, grads = block_data(comm, s, dtype, seed=30)
    x, g = xs[r].clone().requires_grad_(), grads[r].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            moe(x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    moe.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
        out.backward(g)
    for replay in range(3):
        xs, grads = block_data(comm, s, dtype, seed=31 + replay)
        with torch.no_grad():
            x.copy_(xs[r])
            g.copy_(grads[r])
        graph.replay()
        torch.cuda.synchronize()
        assert_close(mb.compare(moe, out, x.grad, xs, grads, weights, r), dtype, f"replay {replay}")


def test_host_visible_errors_raise_before_any_launch(comm):
    import torch

    import ubnext.torch as ut
    from ubnext import UbnextError

    ep, s = expert_parallel(comm, OPS_SIZE, "bfloat16")
    x = torch.zeros((2, s.hidden), device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros((2, s.top_k), device="cuda", dtype=torch.int32)
    w = torch.zeros((2, s.top_k), device="cuda")
    with pytest.raises(UbnextError, match="^ubnext::moe_dispatch: x must be bfloat16"):
        ut.moe.dispatch(x.float(), idx, w, ep)
    with pytest.raises(UbnextError, match="^ubnext::moe_combine: no dispatch of this object"):
        torch.ops.ubnext.moe_combine(torch.zeros((s.local_experts, s.capacity, s.hidden), device="cuda",
                                                 dtype=torch.bfloat16),
                                     torch.zeros((s.local_experts, s.capacity), device="cuda"), idx, ut.handle(ep))
    torch.cuda.synchronize()
    comm.synchronize()  # nothing was launched: the communicator is intact
