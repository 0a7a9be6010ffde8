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


def _batches(steps: int, micro: int, dtype, seed: int = 30) -> list:
    return [[tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cpu", seed + 10 * s + m) for m in range(micro)]
            for s in range(steps)]


@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_parallel_block_trains_as_the_plain_one(kind, size, dtype):
    """Three SGD steps of a sequence-parallel block, each over 2 micro-batches (gradients
    accumulated), against the same block without sequence parallelism on the same
    communicators: outputs, gradients (the replicated norm weight's and bias's complete on
    every rank, each micro-batch counted once) and parameters within the reduction order's
    tolerance after every step; the replicated parameters and their gradients bit for bit
    the same on every rank. The parameters carry no ``sequence_parallel`` mark (nothing is
    left for a framework to sum)."""
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    batches = _batches(3, 2, dtype)

    def rank(comm):
        out = {}
        for sp in (True, False):
            block = tp.block(kind, comm, w, dtype, "cpu", sequence_parallel=sp)
            assert not any(getattr(p, "sequence_parallel", False) for p in block.parameters())
            out[sp] = tp.train(kind, block, comm.rank, comm.size, batches, sp)
        return out

    results = run_ranks(size, rank)
    bound = tp.BF16_BOUND if dtype == torch.bfloat16 else 2.0 ** -16
    for r, out in enumerate(results):
        for got, plain in zip(out[True], out[False]):
            tp.assert_close_to(got, tp.rows_of_plain(kind, plain, r, size), bound)
    tp.assert_replicated_alike([out[True] for out in results], kind)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_opting_out_leaves_partial_gradients_and_marks_them(kind):
    """``reduce_replicated_grads=False``: the replicated parameters' gradients are this
    rank's rows' partial sums (summed over the ranks: the default's complete gradient) and
    those parameters, and only those, carry ``sequence_parallel = True`` (Megatron-LM's mark
    for the gradients its finalize step sums over the tensor-parallel group)."""
    size, dtype = 2, torch.float32
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    batches = _batches(1, 1, dtype)

    def rank(comm):
        out = {}
        for reduce in (True, False):
            block = tp.block(kind, comm, w, dtype, "cpu", sequence_parallel=True, reduce_replicated_grads=reduce)
            marked = {n for n, p in block.named_parameters() if getattr(p, "sequence_parallel", False)}
            out[reduce] = tp.train(kind, block, comm.rank, comm.size, batches, True)[0], marked
        return out

    results = run_ranks(size, rank)
    for out in results:
        assert out[True][1] == set() and out[False][1] == set(tp.REPLICATED[kind])
    for name in tp.REPLICATED[kind]:
        key = f"grad:{name}"
        partial = [out[False][0][key] for out in results]
        assert not torch.equal(partial[0], partial[1])
        tp.assert_close_to({key: sum(partial)}, {key: results[0][True][0][key]}, 2.0 ** -20)


@pytest.mark.parametrize("size", [2, 4])
def test_sequence_parallel_row_parallel_bias_gradient_is_complete(size):
    """RowParallelLinear(sequence_parallel=True): its bias's gradient, over 2 micro-batches,
    is the whole batch's on every rank (bit for bit alike), as without sequence parallelism."""
    from ubnext.torch import RowParallelLinear

    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(HIDDEN, INTERMEDIATE, generator=g), torch.randn(HIDDEN, generator=g)
    xs = [torch.randn(TOKENS, INTERMEDIATE, generator=g) for _ in range(2)]
    grads = [torch.randn(TOKENS, HIDDEN, generator=g) for _ in range(2)]

    def rank(comm):
        cols, rows = INTERMEDIATE // comm.size, TOKENS // comm.size
        out = {}
        for sp in (True, False):
            layer = RowParallelLinear(INTERMEDIATE, HIDDEN, comm, bias=True, sequence_parallel=sp)
            layer.load_full(weight, bias)
            for x, grad in zip(xs, grads):
                y = layer(x[:, comm.rank * cols:(comm.rank + 1) * cols])
                y.backward(grad[comm.rank * rows:(comm.rank + 1) * rows] if sp else grad)
            out[sp] = layer.bias.grad
        return out

    results = run_ranks(size, rank)
    for out in results:
        tp.assert_close_to({"bias": out[True]}, {"bias": out[False]}, 2.0 ** -20)
        assert torch.equal(out[True], results[0][True])


@pytest.mark.parametrize("kind", ["mlp", "attention", "linears"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_an_opted_in_communicator_leaves_the_layers_exact(kind, sequence_parallel, size):
    """A communicator that opted in to the quantized collectives (``quantized="int8"``,
    which the thread communicators emulate lossily from any size) gives a tensor-parallel
    block, and a column-parallel + row-parallel pair, the bits of one that did not: outputs,
    gradients and parameters over two SGD steps. Its own ``all_reduce`` (precision "auto")
    does quantize: the opt-in serves the communicator's calls only."""
    dtype = torch.bfloat16
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    batches = _batches(2, 1, dtype)

    def rank(comm):
        x = batches[0][0]["x"]
        lossy = not torch.equal(comm.all_reduce(x), comm.all_reduce(x, precision="exact"))
        if kind == "linears":
            return tp.train_linears(comm, w, batches, sequence_parallel), lossy
        block = tp.block(kind, comm, w, dtype, "cpu", sequence_parallel=sequence_parallel)
        return tp.train(kind, block, comm.rank, comm.size, batches, sequence_parallel), lossy

    opted_in, plain = run_ranks(size, rank, quantized="int8"), run_ranks(size, rank)
    for (got, lossy), (want, _) in zip(opted_in, plain):
        assert lossy, "the thread communicators' opt-in did not quantize: the test shows nothing"
        for step_got, step_want in zip(got, want):
            tp.assert_equal_bits(step_got, step_want)


def test_compiled_sequence_parallel_block_trains_as_eager():
    """A sequence-parallel MLP under torch.compile(fullgraph=True) (the gradient sum's
    autograd.Function traced into the backward graph): two SGD steps of 2 micro-batches
    with eager's bits. One rank: dynamo is not thread-safe (the GPU tests compile at N
    ranks, in N processes)."""
    torch._dynamo.reset()
    dtype = torch.float32
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    batches = _batches(2, 2, dtype)

    def rank(comm):
        out = []
        for compiled in (False, True):
            block = tp.block("mlp", comm, w, dtype, "cpu", sequence_parallel=True)
            if compiled:
                block = torch.compile(block, fullgraph=True, backend="aot_eager")
            out.append([{k.replace("_orig_mod.", ""): v for k, v in step.items()}
                        for step in tp.train("mlp", block, comm.rank, comm.size, batches, True)])
        return out

    eager, compiled = run_ranks(1, rank)[0]
    for got, want in zip(compiled, eager):
        tp.assert_equal_bits(got, want)
