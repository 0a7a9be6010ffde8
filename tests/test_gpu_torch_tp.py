"""ubnext.torch.tp on GPUs: the tensor-parallel Llama MLP and attention output projection,
forward and backward (on autograd's threads), bit for bit against a single-process
emulation of the shards (every shard's GEMMs, the partial sums reduced by the host
reference in the order of the kernels that ran) and within the stated bf16 bound of the
unsharded float64 model; the planned symmetric buffers (same bits, no copy kernel on the
planned path, shown with torch.profiler); the block compiled with
torch.compile(fullgraph=True) and replayed in a CUDA graph; the sequence-parallel blocks
trained against the plain ones (the replicated parameters' gradients complete, alike on
every rank); and a communicator that opted in to the quantized collectives giving the
layers the bits of one that did not.

Run at 1, 2 and 4 ranks: ``mpirun --oversubscribe -n 4 python -m pytest -q
tests/test_gpu_torch_tp.py`` (ranks may share a GPU); skipped without a GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="ubnext.torch needs torch")

import tp_support as tp  # noqa: E402
from gpu_support import (  # noqa: E402
    collected,
    device,
    digest,
    expected_add_rmsnorm,
    expected_all_reduce,
    host,
    ran,
    recorded_launches,
)

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN, INTERMEDIATE, HEADS_FEATURES = 16, 512, 1024, 512


@pytest.fixture(scope="module")
def comm():
    c = tp.gpu_communicator(TOKENS * HIDDEN * 4, "float32")
    yield c
    c.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(plain, opted_in)``: alike but for the quantized opt-in (``tp.quantized_pair``)."""
    both = tp.quantized_pair(tmp_path_factory.mktemp("tune"))
    yield both
    for c in both:
        c.close()


def _host_or_none(t):
    return None if t is None else host(t)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_block_matches_emulation_and_unsharded(comm, kind):
    import torch

    dtype = torch.bfloat16
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cuda")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cuda")
    block = (tp.mlp if kind == "mlp" else tp.attention_output)(comm, w, dtype, "cuda")
    tp.run_block(kind, block, comm.rank, comm.size, data)  # compiles the kernels
    block.zero_grad(set_to_none=True)
    with recorded_launches(comm) as launches:
        got = tp.run_block(kind, block, comm.rank, comm.size, data)  # backward on autograd's thread
        torch.cuda.synchronize()
    fused = [launch for launch in launches if launch.fused]
    if not fused:
        pytest.skip(f"the epilogue did not run a fused kernel ({ran(launches)}): no kernel order to emulate")

    def fused_reference(parts, residual, weight, bias, eps):
        normed, res = expected_add_rmsnorm(fused, [host(p) for p in parts], _host_or_none(residual),
                                           _host_or_none(bias), host(weight), eps, False)
        return device(normed), device(res)

    def all_reduce_reference(parts):
        plain = [launch for launch in launches if not launch.fused]
        assert ran(plain) != "nccl", "the input gradient's all-reduce went to NCCL: no kernel order to emulate"
        return device(expected_all_reduce(plain, [host(p).reshape(-1) for p in parts], "sum")).reshape(parts[0].shape)

    tp.assert_equal_bits(got, tp.emulate(kind, w, data, comm.rank, comm.size, fused_reference, all_reduce_reference))
    tp.assert_close_to(got, tp.unsharded(kind, w, data, comm.rank, comm.size))


def test_planned_buffers_same_bits_and_no_copy_kernel(comm):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ubnext.torch import BufferPlan, RowParallelLinear

    dtype = torch.bfloat16
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cuda")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cuda")
    plan = BufferPlan(comm, TOKENS, {"mlp": HIDDEN, "attention-output": HIDDEN, "row": HIDDEN}, dtype)
    layers = [tp.mlp(comm, w, dtype, "cuda", plan), tp.attention_output(comm, w, dtype, "cuda", plan)]
    # reuse_output: the buffer's view (by default a bias-less layer copies it out, one copy kernel)
    row = RowParallelLinear(INTERMEDIATE, HIDDEN, comm, plan=plan, key="row", dtype=dtype, device="cuda",
                            reuse_output=True)
    row.load_full(w["down"])
    cols = INTERMEDIATE // comm.size
    act = data["x"].repeat(1, INTERMEDIATE // HIDDEN)[:, comm.rank * cols:(comm.rank + 1) * cols].contiguous()
    assert [plan.assign(k) for k in ("mlp", "attention-output", "row")] == [0, 1, 0]  # as constructed
    heads = HEADS_FEATURES // comm.size
    attention = data["attention"][:, comm.rank * heads:(comm.rank + 1) * heads].contiguous()
    x, residual = data["x"], data["residual"]

    def run():
        with torch.no_grad():
            outs = [layers[0](x, residual), layers[1](attention, residual), row(act)]
            return outs

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        planned = run()
        torch.cuda.synchronize()
    planned = [t.clone() for pair in planned[:2] for t in pair] + [planned[2].clone()]
    copies = sorted({e.name for e in prof.events() if "memcpy" in e.name.lower() or "copy" in e.name.lower()})
    assert not copies, f"copies on the planned path: {copies}"
    for m in (*layers, row):
        for sub in m.modules():
            if hasattr(sub, "plan"):
                sub.plan = None
    plain = run()
    plain = [t for pair in plain[:2] for t in pair] + [plain[2]]
    for a, b in zip(planned, plain):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_compiled_block_replays_in_a_cuda_graph(comm):
    import torch

    dtype = torch.bfloat16
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cuda")
    block = tp.mlp(comm, w, dtype, "cuda")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cuda")
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(data["x"], data["residual"])
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(block, fullgraph=True)
        static_x, static_res = data["x"].clone(), data["residual"].clone()
        for _ in range(2):
            compiled(static_x, static_res)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            normed, res = compiled(static_x, static_res)
        for seed in (7, 8):
            fresh = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cuda", seed)
            static_x.copy_(fresh["x"])
            static_res.copy_(fresh["residual"])
            graph.replay()
            want = compiled(fresh["x"], fresh["residual"])
            eager = block(fresh["x"], fresh["residual"])
            for got, wc, we in zip((normed, res), want, eager):
                assert torch.equal(got.view(torch.int16), wc.view(torch.int16))  # graph replay == compiled eager
                assert (got.double() - we.double()).abs().max() <= tp.BF16_BOUND * we.double().abs().max()
    comm.synchronize()


def _batches(steps: int, micro: int, dtype, seed: int = 30) -> list:
    return [[tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cuda", seed + 10 * s + m) for m in range(micro)]
            for s in range(steps)]


@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_sequence_parallel_block_trains_as_the_plain_one(comm, kind, dtype_name):
    """Three SGD steps of a sequence-parallel block (the overlapped GEMMs), each over 2
    micro-batches, against the same block without sequence parallelism: outputs, every
    gradient (the norm weight's and bias's complete, each micro-batch counted once) and the
    parameters within the reduction order's tolerance after every step; the replicated
    parameters and their gradients bit for bit alike on every rank after every step."""
    import torch

    dtype = getattr(torch, dtype_name)
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cuda")
    batches = _batches(3, 2, dtype)
    records = {}
    for sp in (True, False):
        block = tp.block(kind, comm, w, dtype, "cuda", sequence_parallel=sp)
        records[sp] = tp.train(kind, block, comm.rank, comm.size, batches, sp)
    torch.cuda.synchronize()
    bound = tp.BF16_BOUND if dtype == torch.bfloat16 else 2.0 ** -14
    failures = []
    for step, (got, plain) in enumerate(zip(records[True], records[False])):
        with collected(failures):
            tp.assert_close_to(got, tp.rows_of_plain(kind, plain, comm.rank, comm.size), bound)
        for name in tp.REPLICATED[kind]:
            for what in ("param", "grad"):
                key = f"{what}:{name}"
                digests = comm.bootstrap.allgather(digest(got[key]))  # every rank makes each exchange
                with collected(failures):
                    assert all(d == digests[0] for d in digests), f"step {step}: {key} differs between the ranks"
    assert not failures, failures
    comm.synchronize()


@pytest.mark.parametrize("kind", ["mlp", "attention", "linears"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_an_opted_in_communicator_leaves_the_layers_exact(pair, kind, sequence_parallel):
    """The tensor-parallel blocks, and a column-parallel + row-parallel pair, bfloat16, two
    SGD steps on a communicator that opted in to int8 from 1 KiB (a tune file's
    thresholds: every all-reduce and reduce-scatter here is above them) give, bit for bit,
    the outputs, gradients and parameters of the same on a communicator that did not; the
    opted-in communicator's own all-reduce does quantize (at 2 ranks or more)."""
    import torch

    dtype = torch.bfloat16
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cuda")
    batches = _batches(2, 1, dtype)
    records = []
    for c in pair:
        if kind == "linears":
            records.append(tp.train_linears(c, w, batches, sequence_parallel))
        else:
            block = tp.block(kind, c, w, dtype, "cuda", sequence_parallel=sequence_parallel)
            records.append(tp.train(kind, block, c.rank, c.size, batches, sequence_parallel))
    x = batches[0][0]["x"]
    lossy = not torch.equal(tp.bits(pair[1].all_reduce(x)), tp.bits(pair[1].all_reduce(x, precision="exact")))
    torch.cuda.synchronize()
    assert lossy == (pair[1].size > 1), "the opted-in communicator's auto did not quantize: the test shows nothing"
    for got, want in zip(records[1], records[0]):
        tp.assert_equal_bits(got, want)
    for c in pair:
        c.synchronize()
