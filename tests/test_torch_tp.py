"""ubnext.torch.tp on CPU at 1, 2 and 4 ranks (threads with rank-order communicators):
forward and backward bit for bit against the single-process emulation of the shards,
and within the stated bf16 bound of the unsharded float64 model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tp_support as tp  # noqa: E402
from torch_fakes import rank_order, run_ranks  # noqa: E402

from ubnext.torch import BufferPlan, _rmsnorm  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS_FEATURES, TOKENS = 64, 128, 64, 12


def _fused(parts, residual, weight, bias, eps):
    return _rmsnorm.add_rmsnorm(rank_order(parts), residual, weight, bias, eps)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_matches_emulation_and_unsharded(kind, size, dtype):
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cpu")

    def rank(comm):
        make = tp.mlp if kind == "mlp" else tp.attention_output
        got = tp.run_block(kind, make(comm, w, dtype, "cpu"), comm.rank, comm.size, data)
        return got, comm.calls

    results = run_ranks(size, rank)
    for r, (got, calls) in enumerate(results):
        assert calls == (2 if kind == "mlp" else 1)  # the fused epilogue; the MLP input's gradient
        tp.assert_equal_bits(got, tp.emulate(kind, w, data, r, size, _fused, rank_order))
        tp.assert_close_to(got, tp.unsharded(kind, w, data, r, size),
                           tp.BF16_BOUND if dtype == torch.bfloat16 else 2.0 ** -16)


@pytest.mark.parametrize("size", [1, 2])
def test_planned_buffers_give_the_same_bits(size):
    """Without gradient, the row-parallel GEMM writes into the planned buffer: same results."""
    dtype = torch.bfloat16
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cpu")

    def rank(comm):
        plan = BufferPlan(comm, TOKENS, {"mlp": HIDDEN, "attention-output": HIDDEN}, dtype)
        m = tp.mlp(comm, w, dtype, "cpu", plan)
        with torch.no_grad():
            planned = tp.run_block("mlp", m, comm.rank, comm.size, data, backward=False)
            m.down.plan = None
            plain = tp.run_block("mlp", m, comm.rank, comm.size, data, backward=False)
        return planned, plain

    for planned, plain in run_ranks(size, rank):
        tp.assert_equal_bits(planned, plain)


@pytest.mark.parametrize("reuse_output", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_row_parallel_forward_planned_in_place(bias, reuse_output):
    """RowParallelLinear.forward on the planned path reduces in place in the buffer: the
    same bits as the plain path; the result is a view of the planned buffer only without
    bias and with ``reuse_output=True`` (by default it is a tensor of its own)."""
    from ubnext.torch import RowParallelLinear

    g = torch.Generator().manual_seed(5)
    weight, b = torch.randn(HIDDEN, INTERMEDIATE, generator=g), torch.randn(HIDDEN, generator=g)
    x = torch.randn(TOKENS, INTERMEDIATE, generator=g)

    def rank(comm):
        plan = BufferPlan(comm, TOKENS, {"row": HIDDEN}, torch.float32)
        layer = RowParallelLinear(INTERMEDIATE, HIDDEN, comm, bias=bias, plan=plan, key="row",
                                  reuse_output=reuse_output)
        layer.load_full(weight, b)
        cols = INTERMEDIATE // comm.size
        xs = x[:, comm.rank * cols:(comm.rank + 1) * cols]
        with torch.no_grad():
            planned = layer(xs)
            in_buffer = planned._base is plan.buffers[0]
            planned = planned.clone()
            layer.plan = None
            plain = layer(xs)
        return planned, plain, in_buffer

    for planned, plain, in_buffer in run_ranks(2, rank):
        assert torch.equal(planned, plain)
        assert in_buffer == (reuse_output and not bias)


@pytest.mark.parametrize("size", [1, 2])
def test_row_parallel_output_survives_the_next_planned_call(size):
    """A bias-less planned RowParallelLinear's output is the caller's to keep: the layer's
    next call, which reduces in the same planned buffer, leaves it as it was (it used to
    be a view of the buffer, silently overwritten). With ``reuse_output=True`` it is that
    view, and the next call overwrites it, as documented."""
    from ubnext.torch import RowParallelLinear

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(HIDDEN, INTERMEDIATE, generator=g)
    first, second = torch.randn(TOKENS, INTERMEDIATE, generator=g), torch.randn(TOKENS, INTERMEDIATE, generator=g)

    def rank(comm):
        plan = BufferPlan(comm, TOKENS, {"row": HIDDEN}, torch.float32, buffers=1)
        layers = {}
        for reuse in (False, True):
            layers[reuse] = RowParallelLinear(INTERMEDIATE, HIDDEN, comm, plan=plan, key=f"row-{reuse}",
                                              reuse_output=reuse)
            layers[reuse].load_full(weight)
        cols = INTERMEDIATE // comm.size
        a, b = (t[:, comm.rank * cols:(comm.rank + 1) * cols] for t in (first, second))
        with torch.no_grad():
            want_a, want_b = layers[False](a).clone(), layers[False](b).clone()
            out = {}
            for reuse, layer in layers.items():
                y = layer(a)
                layer(b)  # the next planned call: the same buffer
                out[reuse] = y
        return want_a, want_b, out

    for want_a, want_b, out in run_ranks(size, rank):
        assert not torch.equal(want_a, want_b)
        assert torch.equal(out[False], want_a)  # kept
        assert torch.equal(out[True], want_b)  # reuse_output: overwritten by the next call
