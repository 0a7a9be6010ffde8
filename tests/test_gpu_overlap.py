"""ubnext.torch's overlapped GEMMs on GPUs (issue 38): ``all_gather_matmul`` and
``matmul_reduce_scatter`` bit for bit against the unoverlapped computation of the same
chunks (``torch.matmul`` of the same row blocks of the same operands on this GPU, the
reduce-scatter's blocks of every rank summed on the host in rank order in fp32, rounded
once), within the stated bf16 bound of the unchunked GEMM in float64, with the area
poisoned and the outputs' memory poisoned before each call, a canary buffer of the pool
untouched, in CUDA graphs (replays equal to eager, replays and eager calls interleaved),
and the sequence-parallel MLP's outputs and gradients against the unsharded block.

Run at 1, 2 and 4 ranks: ``mpirun --allow-run-as-root -n 2 python -m pytest -q
tests/test_gpu_overlap.py``; skipped without a GPU.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("torch", reason="ubnext.torch needs torch")

import torch  # noqa: E402
import tp_support as tp  # noqa: E402
from torch_fakes import rank_order  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext.torch import _overlap, _overlap_plan  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
#: the stated bound against the unchunked GEMM in float64: max |got - ref| / max |ref|.
#: all_gather_matmul: one bf16 rounding of each output (2^-9 relative) on either side of
#: fp32 accumulations in another order; matmul_reduce_scatter: each rank's product rounded
#: to bf16, then the fp32 sum rounded once
GATHER_BOUND, SCATTER_BOUND = 2.0 ** -7, 2.0 ** -6
#: (rows per rank, k, n): one row, odd rows, one round's worth, and more rows than two
#: rounds take (k or n of 8192: 16 KiB rows; three rounds: the last round's half, 0, is
#: the next call's first)
GATHER_SHAPES = [(1, 64, 32), (3, 128, 256), (512, 1024, 768), (4500, 8192, 256)]
SCATTER_SHAPES = [(1, 64, 32), (3, 128, 256), (512, 1024, 768), (2100, 256, 8192)]


@pytest.fixture(scope="module")
def comm():
    c = tp.gpu_communicator(1 << 20, "bfloat16")
    yield c
    c.close()


def operand(rank: int, shape, seed: int, scale: float = 1.0):
    """Rank ``rank``'s operand: the same bits on every rank that asks for it."""
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF16)


def bits(t):
    return t.contiguous().view(torch.int16)


def quiesce(comm) -> None:
    """Every rank's earlier work done (this device's, then every peer's through an
    all-reduce that follows it on each rank)."""
    torch.cuda.synchronize()
    t = torch.zeros(4, device="cuda")
    comm.all_reduce(t, out=t)
    torch.cuda.synchronize()


def poison(comm) -> None:
    """NaN (0xFFFF) in the overlap area and in a freed block of the caching allocator,
    which the next outputs are likely to get: a byte the ops leave unwritten shows."""
    if comm.size > 1:
        quiesce(comm)  # no peer reads the area any more
        area, _ = comm._symmetric_area(_overlap.AREA_KEY, _overlap_plan.AREA_BYTES, "torch")
        area.fill_(255)
    junk = torch.full((64 << 20,), -1, dtype=torch.int16, device="cuda")
    del junk


def gather_reference(comm, shards, b):
    """The same row blocks' GEMMs as all_gather_matmul's (one block at 1 rank)."""
    gathered = torch.cat(shards)
    out = torch.empty(gathered.shape[0], b.shape[1], dtype=BF16, device="cuda")
    if comm.size == 1:
        return gathered, torch.matmul(gathered, b, out=out)
    m = shards[0].shape[0]
    for r0, rows in _overlap_plan.gather_rounds(m, shards[0].shape[1] * 2).parts:
        for src in range(comm.size):
            first = src * m + r0
            torch.matmul(gathered[first:first + rows], b, out=out[first:first + rows])
    return gathered, out


def scatter_reference(comm, parts, bs):
    """Every rank's products of this rank's row blocks, as matmul_reduce_scatter computes
    them, summed on the host in rank order in fp32, rounded once."""
    size, rank = comm.size, comm.rank
    m = parts[0].shape[0] // size
    if size == 1:
        return torch.matmul(parts[0], bs[0])
    rounds = _overlap_plan.scatter_rounds(m, bs[0].shape[1] * 2, size)
    products = []
    for a, b in zip(parts, bs):
        p = torch.empty(m, b.shape[1], dtype=BF16, device="cuda")
        for r0, rows in rounds.parts:
            torch.matmul(a[rank * m + r0:rank * m + r0 + rows], b, out=p[r0:r0 + rows])
        products.append(p.cpu())
    return rank_order(products).cuda()


def ratio(got, ref) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("m, k, n", GATHER_SHAPES)
def test_all_gather_matmul_equals_its_chunks(comm, m, k, n):
    shards = [operand(r, (m, k), 1) for r in range(comm.size)]
    b = operand(comm.rank, (k, n), 2, k ** -0.5)
    poison(comm)
    gathered, out = ut.all_gather_matmul(shards[comm.rank], b, group=comm)
    want_gathered, want = gather_reference(comm, shards, b)
    assert gathered.shape == (comm.size * m, k) and out.shape == (comm.size * m, n)
    assert torch.equal(bits(gathered), bits(want_gathered))
    assert not out.isnan().any(), "rows of the product were never written"
    assert torch.equal(bits(out), bits(want)), f"{int((out != want).sum())} elements differ from the chunks' GEMMs"
    assert ratio(out, want_gathered.double() @ b.double()) <= GATHER_BOUND


@pytest.mark.parametrize("m, k, n", SCATTER_SHAPES)
def test_matmul_reduce_scatter_equals_its_chunks_in_rank_order(comm, m, k, n):
    parts = [operand(r, (comm.size * m, k), 3) for r in range(comm.size)]
    bs = [operand(r, (k, n), 4, k ** -0.5) for r in range(comm.size)]
    poison(comm)
    y = ut.matmul_reduce_scatter(parts[comm.rank], bs[comm.rank], group=comm)
    want = scatter_reference(comm, parts, bs)
    assert y.shape == (m, n)
    assert not y.isnan().any(), "rows of the result were never written"
    assert torch.equal(bits(y), bits(want)), f"{int((y != want).sum())} elements differ from the chunks' sum"
    rows = slice(comm.rank * m, (comm.rank + 1) * m)
    full = sum(a.double() @ b.double() for a, b in zip(parts, bs))[rows]
    assert ratio(y, full) <= SCATTER_BOUND


def test_matmul_reduce_scatter_sums_float64_in_float64(comm):
    """float64 operands of integers whose products and sums need more than fp32's 24 bits
    (below 2**53: exact in float64): the result equals the exact sum, which an fp32
    accumulation would round."""
    m, k, n = 5, 16, 8

    def integers(rank, shape, seed, high):
        g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
        return torch.randint(-high, high, shape, generator=g, device="cuda").double()

    parts = [integers(r, (comm.size * m, k), 5, 1 << 20) for r in range(comm.size)]
    bs = [integers(r, (k, n), 6, 1 << 12) for r in range(comm.size)]
    poison(comm)
    y = ut.matmul_reduce_scatter(parts[comm.rank], bs[comm.rank], group=comm)
    rows = slice(comm.rank * m, (comm.rank + 1) * m)
    want = sum(a.cpu() @ b.cpu() for a, b in zip(parts, bs))[rows]
    assert y.dtype == torch.float64 and torch.equal(y.cpu(), want)
    assert not torch.equal(want.float().double(), want)  # fp32 could not hold it


#: the slot sum's dtypes, with the bits of each element as an integer tensor's
SUM_DTYPES = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
              torch.float64: torch.int64}


def slot_values(count: int, n: int, dtype, seed: int):
    """``count`` slots of ``n`` random values of ``dtype`` with -0.0, +-inf and NaN among
    them (never a zero otherwise), and in float64 1 and 2**-40 (their sum exact only
    in float64)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(count, n, generator=g, dtype=torch.float64)
    parts[parts == 0] = 0.5
    special = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    for s in range(count):
        where = torch.randperm(n, generator=g)[:min(n, 4)]
        parts[s, where] = special[torch.randint(0, 4, (len(where),), generator=g)]
    if n > 5:
        parts[:, 5] = -0.0  # a sum of negative zeros: -0.0
    if dtype == torch.float64 and n > 6:
        parts[:, 6] = 0.0
        parts[0, 6], parts[1, 6] = 1.0, 2.0 ** -40
    return parts.to(dtype)


def host_sum(parts):
    """The slots added in order in fp32 (float64 in float64), rounded once."""
    if parts.dtype != torch.float64:
        return rank_order(list(parts))
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc


@pytest.fixture(scope="module")
def slot_sums(comm):
    """count -> a SlotSum of that many slots on this GPU, made once (each compiles four modules)."""
    from ubnext._engine.slot_sum import SlotSum

    sms = torch.cuda.get_device_properties(comm.device).multi_processor_count
    return functools.cache(lambda count: SlotSum(comm.device, sms, count))


#: bytes written around the slot sum's output, and into it before the launch (no sum gives them)
SUM_POISON = 0x5A


@pytest.mark.parametrize("dtype", list(SUM_DTYPES), ids=str)
@pytest.mark.parametrize("count", [2, 3, 4, 8])
@pytest.mark.parametrize("n, misaligned", [(1, False), (7, False), (8 * 1024 + 3, False), (300001, False),
                                           (1001, True), (1 << 22 | 5, False)])
def test_the_slot_sum_adds_in_slot_order_rounding_once(slot_sums, dtype, count, n, misaligned):
    """The overlapped reduce-scatter's reduction (kernels/slot_sum.cu) bit for bit against
    the host's sum in slot order, rounded once: by vectors (a partial last one where n is
    not a multiple of the width; 4M elements: more vectors than the grid has threads, so
    its loop turns) and element by element (an output off 16-byte alignment); every output
    element written, the slots left as they were, the bytes around the output untouched."""
    parts = slot_values(count, n, dtype, seed=count * 7 + n)
    size = parts.element_size()
    stride = -(-n * size // 256) * 256 + 256  # a gap between the slots, as the area's
    area = torch.full((count * stride,), 0x7B, dtype=torch.uint8, device="cuda")
    for s in range(count):
        area[s * stride:s * stride + n * size].copy_(parts[s].view(torch.uint8).cuda())
    kept = area.clone()
    shift = size if misaligned else 0  # bytes before the output (canaries, as after it)
    canvas = torch.full((shift + n * size + 64,), SUM_POISON, dtype=torch.uint8, device="cuda")
    out = canvas[shift:shift + n * size].view(dtype)
    assert (out.data_ptr() % 16 != 0) == misaligned
    slot_sums(count)(str(dtype).removeprefix("torch."), area.data_ptr(), stride, n, out.data_ptr(),
                     torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    want, got = host_sum(parts), out.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    ints = SUM_DTYPES[dtype]
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(ints), want[finite].view(ints)), \
        f"{int((got[finite] != want[finite]).sum())} of {n} sums differ from the host's"
    assert bool((canvas[:shift] == SUM_POISON).all()) and bool((canvas[shift + n * size:] == SUM_POISON).all()), \
        "bytes around the output written"
    assert torch.equal(area, kept), "the slots changed"
    if dtype == torch.float64 and n > 6:
        assert got[6] == 1 + 2.0 ** -40


def test_a_canary_in_the_pool_stays_untouched(comm):
    """A user buffer of the pool, allocated once the area exists, keeps its bytes through
    calls of several rounds."""
    ut.all_gather_matmul(operand(comm.rank, (8, 64), 5), operand(0, (64, 32), 6), group=comm)  # the area exists
    canary = comm.empty((1 << 20,), "int32", framework="torch")
    canary.fill_(0x5A5A5A5A)
    for m, k, n in GATHER_SHAPES[-1:]:
        ut.all_gather_matmul(operand(comm.rank, (m, k), 7), operand(0, (k, n), 8), group=comm)
    for m, k, n in SCATTER_SHAPES[-1:]:
        ut.matmul_reduce_scatter(operand(comm.rank, (comm.size * m, k), 9), operand(0, (k, n), 10), group=comm)
    quiesce(comm)
    assert bool((canary == 0x5A5A5A5A).all())
    del canary


def test_cuda_graph_replays_equal_eager(comm):
    """Both ops captured in one graph after an eager call; replays with new inputs equal
    eager calls bit for bit, with replays back to back and eager calls between them (the
    area's halves alternate across both)."""
    m, k, n = 300, 512, 1024
    a, b = operand(comm.rank, (m, k), 11), operand(comm.rank, (k, n), 12, k ** -0.5)
    x, w = operand(comm.rank, (comm.size * m, n), 13), operand(comm.rank, (n, k), 14, n ** -0.5)

    def step():
        gathered, out = ut.all_gather_matmul(a, b, group=comm)
        return gathered, out, ut.matmul_reduce_scatter(x, w, group=comm)

    step()  # the first call allocates the area and plans the barrier
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for trial, eager_between in enumerate((False, False, True, True)):
        for t, seed in ((a, 21), (b, 22), (x, 23), (w, 24)):
            t.copy_(operand(comm.rank, t.shape, seed + 10 * trial, t.shape[0] ** -0.5))
        graph.replay()
        if eager_between:
            eager = step()
        else:
            graph.replay()  # twice in a row: the same inputs, the same bits
            eager = step()
        for got, want in zip(captured, eager):
            assert torch.equal(bits(got), bits(want)), f"trial {trial}: a replay differs from eager"
    torch.cuda.synchronize()


def test_a_first_call_under_capture_raises_and_the_capture_stays_usable():
    """A new communicator's first overlapped call under CUDA graph capture raises before it
    queues anything (the area is allocated and the barrier compiled at a first eager
    call); after an eager call, the same call captured and replayed equals it."""
    from ubnext import UbnextError

    c = tp.gpu_communicator(1 << 20, "bfloat16")
    try:
        if c.size == 1 or c.pool is None:
            pytest.skip("the ops overlap at 2 ranks or more, with a pool")
        m, k, n = 8, 64, 32
        a, b = operand(c.rank, (m, k), 31), operand(c.rank, (k, n), 32, k ** -0.5)
        with pytest.raises(UbnextError, match="make one eager call first"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                ut.matmul_reduce_scatter(torch.cat([a] * c.size), b, group=c)
        eager = ut.all_gather_matmul(a, b, group=c)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ut.all_gather_matmul(a, b, group=c)
        graph.replay()
        for got, want in zip(captured, eager):
            assert torch.equal(bits(got), bits(want))
        torch.cuda.synchronize()
    finally:
        c.close()


def test_sequence_parallel_mlp_matches_the_unsharded_block(comm):
    """The sequence-parallel MLP, bf16, forward and backward: this rank's rows of the
    outputs and input gradient, its weight shards' gradients, and the norm weight's and
    bias's gradients summed over the ranks, within tp.BF16_BOUND of the unsharded float64
    block."""
    from ubnext.torch import TensorParallelMLP

    tokens, hidden, inter = 64 * comm.size, 512, 1024
    w = tp.weights(hidden, inter, hidden, BF16, "cuda")
    data = tp.inputs(tokens, hidden, hidden, BF16, "cuda")
    block = TensorParallelMLP(hidden, inter, comm, bias=True, eps=tp.EPS, dtype=BF16, device="cuda",
                              sequence_parallel=True)
    block.load_full(w["gate"], w["up"], w["down"], w["mlp_norm"], w["down_bias"])
    rows = slice(comm.rank * 64, (comm.rank + 1) * 64)
    x = data["x"][rows].clone().requires_grad_()
    residual = data["residual"][rows].clone().requires_grad_()
    normed, res = block(x, residual)
    torch.autograd.backward((normed, res), (data["grad_normed"][rows], data["grad_residual"][rows]))
    grads = {n_: p.grad for n_, p in block.named_parameters()}
    for name in ("norm.weight", "down.bias"):  # this rank's rows' partial sums: summed over the ranks
        grads[name] = comm.all_reduce(grads[name].float().contiguous()).to(BF16)
    got = {"normed": normed.detach(), "residual_out": res.detach(), "grad_x": x.grad, "grad_residual": residual.grad,
           **{f"grad:{n_}": g for n_, g in grads.items()}}
    want = tp.unsharded("mlp", w, data, comm.rank, comm.size)
    for name in ("normed", "residual_out", "grad_x", "grad_residual"):
        want[name] = want[name][rows]
    tp.assert_close_to(got, want)
