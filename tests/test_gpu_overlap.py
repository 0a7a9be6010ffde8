"""ubnext.torch's overlapped GEMMs on GPUs (issue 38): ``all_gather_matmul`` and
``matmul_reduce_scatter`` bit for bit against the unoverlapped computation of the same
chunks (``torch.matmul`` of the same row blocks of the same operands on this GPU, the
reduce-scatter's blocks of every rank summed on the host in rank order in fp32, rounded
once), within the stated bf16 bound of the unchunked GEMM in float64, with the area
poisoned and the outputs' memory poisoned before each call, a canary buffer of the pool
untouched, in CUDA graphs (replays equal to eager, replays and eager calls interleaved),
the sequence-parallel blocks' outputs and gradients against the unsharded block.

``matmul_reduce_scatter_add_rmsnorm``: its kernel (the slot sum + add + RMSNorm) bit for
bit against the host's slot sum followed by the separate add + RMSNorm kernel's
arithmetic (ubnext/_tools/reference.py, with the launch's row group), with -0.0, inf and
NaN among the slots, by vectors and element by element, canaries around its outputs; the
op bit for bit against ``matmul_reduce_scatter`` followed by the add in torch
(``residual_out``) and by that arithmetic (``normed``; torch's RMSNorm within
NORM_BOUND), in CUDA graphs, and through the sequence-parallel blocks' gradients.

Run at 1, 2 and 4 ranks: ``mpirun --allow-run-as-root -n 2 python -m pytest -q
tests/test_gpu_overlap.py``; skipped without a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import pytest

pytest.importorskip("torch", reason="ubnext.torch needs torch")

import torch  # noqa: E402
import tp_support as tp  # noqa: E402
from gpu_support import host, recorded_launches  # noqa: E402
from torch_fakes import rank_order  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext._tools import reference  # noqa: E402
from ubnext.torch import _overlap, _overlap_plan, _rmsnorm  # noqa: E402

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


def operand(rank: int, shape, seed: int, scale: float = 1.0, dtype=BF16):
    """Rank ``rank``'s operand: the same bits on every rank that asks for it."""
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


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


#: the add + RMSNorm's epsilon in these tests
EPS = 1e-5
#: the dtypes of the slot sum + add + RMSNorm
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@contextlib.contextmanager
def spied_norms(sums):
    """Yields a list that gets ``(rows, threads)`` of every slot sum + add + RMSNorm launch
    of ``sums`` (a SlotSum) in the block, the launches unchanged."""
    seen, real = [], dict(sums._norms)

    def spy(launcher):
        def launch(blocks, threads, stream, slots, stride, rows, *rest):
            seen.append((rows, threads))
            return launcher(blocks, threads, stream, slots, stride, rows, *rest)
        return launch

    sums._norms.update({dtype: spy(launcher) for dtype, launcher in real.items()})
    try:
        yield seen
    finally:
        sums._norms.update(real)


def by_vectors(hidden: int, dtype, *tensors) -> bool:
    """Whether the rows move as 16-byte vectors (kernels/rmsnorm.cuh: rows_by_vectors)."""
    return hidden * dtype.itemsize % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors if t is not None)


def host_or_none(t):
    return None if t is None else host(t)


def norm_slot_values(count: int, rows: int, hidden: int, dtype, seed: int):
    """``count`` slots of rows x hidden values (flat): row 0 as ``slot_values`` makes them
    (-0.0, +-inf and NaN among them: its norm is NaN, as the host's), the other rows
    random and finite, with a sum of negative zeros in row 1 (-0.0, before the add)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(count, rows, hidden, generator=g, dtype=torch.float64)
    parts[parts == 0] = 0.5
    parts[:, 0] = slot_values(count, hidden, dtype, seed).double()
    if rows > 1:
        parts[:, 1, hidden // 2] = -0.0
    return parts.to(dtype).reshape(count, rows * hidden)


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("count", [2, 3, 4, 8])
@pytest.mark.parametrize("rows, hidden, misaligned", [(1, 8, False), (3, 4096, False), (5, 1000, False),
                                                      (7, 12, False), (2, 5, False), (200, 8192, False),
                                                      (4, 1024, True)])
@pytest.mark.parametrize("operands", ["residual+bias", "none"])
def test_the_slot_sum_add_rmsnorm_is_the_slot_sum_then_the_norm(slot_sums, dtype, count, rows, hidden, misaligned,
                                                                  operands):
    """The overlapped reduce-scatter + add + RMSNorm's kernel (kernels/slot_sum.cu:
    ub_slot_sum_add_rmsnorm) bit for bit against the host: the slots added in slot order
    in fp32, rounded once (as the slot sum), then the separate add + RMSNorm kernel's
    arithmetic with the launch's row group (reference.add_rmsnorm). By vectors, and element
    by element (hidden not a multiple of the vector width, or outputs off 16-byte
    alignment); a thread per vector and several (200 rows of 8192); -0.0, +-inf and NaN
    among the first row's slots (NaN through its norm, as the host's), a sum of -0.0 in
    the second; every output element written, the bytes around both outputs, the slots
    and the operands untouched."""
    name = str(dtype).removeprefix("torch.")
    n = rows * hidden
    parts = norm_slot_values(count, rows, hidden, dtype, seed=count * 7 + n)
    size = parts.element_size()
    stride = -(-n * size // 256) * 256 + 256
    area = torch.full((count * stride,), 0x7B, dtype=torch.uint8, device="cuda")
    for s in range(count):
        area[s * stride:s * stride + n * size].copy_(parts[s].view(torch.uint8).cuda())
    kept = area.clone()
    g = torch.Generator().manual_seed(n + count)
    weight = (1 + torch.randn(hidden, generator=g) / 8).to(dtype).cuda()
    residual = bias = None
    if operands == "residual+bias":
        residual = torch.randn(rows, hidden, generator=g).to(dtype).cuda()
        bias = (torch.randn(hidden, generator=g) / 4).to(dtype).cuda()
    inputs = [t.clone() for t in (residual, bias, weight) if t is not None]
    shift = size if misaligned else 0
    canvases = [torch.full((shift + n * size + 64,), SUM_POISON, dtype=torch.uint8, device="cuda") for _ in range(2)]
    normed, res_out = (c[shift:shift + n * size].view(dtype).view(rows, hidden) for c in canvases)
    sums = slot_sums(count)
    norm = (0 if residual is None else residual.data_ptr(), 0 if bias is None else bias.data_ptr(),
            weight.data_ptr(), normed.data_ptr(), res_out.data_ptr())
    with spied_norms(sums) as launches:
        sums.add_rmsnorm(name, area.data_ptr(), stride, rows, hidden, norm, EPS,
                         torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert [r for r, _ in launches] == [rows]
    summed = host(host_sum(parts)).reshape(rows, hidden)
    want_normed, want_res = reference.add_rmsnorm(
        summed, host_or_none(residual), host_or_none(bias), host(weight), EPS, launches[0][1],
        by_vectors=by_vectors(hidden, dtype, normed, res_out))
    reference.assert_same_bits(host(res_out), want_res, f"{name} residual_out")
    reference.assert_same_bits(host(normed), want_normed, f"{name} normed")
    for c in canvases:
        assert bool((c[:shift] == SUM_POISON).all()) and bool((c[shift + n * size:] == SUM_POISON).all()), \
            "bytes around an output written"
    assert torch.equal(area, kept), "the slots changed"
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(inputs, (t for t in (residual, bias, weight)
                                                                     if t is not None))), "an operand changed"


@contextlib.contextmanager
def row_groups(comm):
    """Yields a list that gets ``(rows, group threads)`` of every add + RMSNorm launch of
    the block, in order: the slot sum's (overlapped: the communicator's side state made by
    an earlier overlapped call) or the separate kernel's (unoverlapped: one rank, or NCCL)."""
    side = _overlap._SIDES.get(comm)
    if side is not None:
        with spied_norms(side.sum) as launches:
            yield launches
        return
    groups: list = []
    with recorded_launches(comm) as launches:
        yield groups
    groups.extend((launch.rows, launch.group_threads) for launch in launches if launch.kernel == "add_rmsnorm")


#: normed against torch's RMSNorm (``_rmsnorm.add_rmsnorm``: rsqrt, torch's reduction
#: order) on the same residual_out: max |got - torch| / max |torch|, about a rounding of
#: the dtype (bf16: 2^-8) either way
NORM_BOUND = 2.0 ** -7
#: (rows per rank, k, n, dtype, residual, bias): one row, hidden not a multiple of the
#: vector width (elements, bf16; vectors, float32), a thread per vector, several rounds
#: of rows (16 KiB rows at several ranks) with two vectors per thread
NORM_CASES = [(1, 64, 32, BF16, True, True), (3, 128, 12, BF16, True, False), (3, 128, 12, torch.float32, False, False),
              (5, 64, 40, torch.float16, True, True), (512, 1024, 768, BF16, False, True),
              (512, 1024, 768, torch.float32, True, True), (77, 256, 4096, torch.float16, True, False),
              (2100, 256, 8192, BF16, True, True)]


@pytest.mark.parametrize("m, k, n, dtype, with_residual, with_bias", NORM_CASES)
def test_matmul_reduce_scatter_add_rmsnorm_is_matmul_reduce_scatter_then_the_norm(comm, m, k, n, dtype,
                                                                                    with_residual, with_bias):
    """The fused op against ``matmul_reduce_scatter`` of the same operands (the same
    chunks' sum: test_matmul_reduce_scatter_equals_its_chunks_in_rank_order) followed by
    the add + RMSNorm: ``residual_out`` bit for bit the add in torch (``_rmsnorm.add_rmsnorm``),
    ``normed`` bit for bit the separate kernel's arithmetic with each launch's row group
    (one launch per round) and within NORM_BOUND of torch's RMSNorm; the area and the
    outputs' memory poisoned before the call."""
    rank = comm.rank
    parts = [operand(r, (comm.size * m, k), 3, dtype=dtype) for r in range(comm.size)]
    bs = [operand(r, (k, n), 4, k ** -0.5, dtype=dtype) for r in range(comm.size)]
    residual = operand(rank, (m, n), 5, dtype=dtype) if with_residual else None
    weight = (1 + operand(0, (n,), 6, 0.1, dtype=torch.float32)).to(dtype)
    bias = operand(0, (n,), 7, 0.1, dtype=dtype) if with_bias else None
    y = ut.matmul_reduce_scatter(parts[rank], bs[rank], group=comm)  # also makes the side state
    poison(comm)
    with row_groups(comm) as launches:
        normed, res_out = ut.matmul_reduce_scatter_add_rmsnorm(parts[rank], bs[rank], residual, weight, bias, EPS,
                                                               group=comm)
    torch.cuda.synchronize()
    assert normed.shape == res_out.shape == (m, n) and normed.dtype == res_out.dtype == dtype
    torch_normed, want_res = _rmsnorm.add_rmsnorm(y, residual, weight, bias, EPS)
    assert torch.equal(bits(res_out), bits(want_res)), \
        f"{int((res_out != want_res).sum())} residual sums differ from matmul_reduce_scatter + the add"
    if comm.size > 1 and comm.pool is not None:  # a launch per round
        assert [r for r, _ in launches] == [r for _, r in _overlap_plan.scatter_rounds(m, n * y.element_size(),
                                                                                     comm.size).parts]
    assert sum(r for r, _ in launches) == m
    first = 0
    for rows, threads in launches:
        block = slice(first, first + rows)
        want_normed, want_round = reference.add_rmsnorm(
            host(y[block]), host_or_none(None if residual is None else residual[block]), host_or_none(bias),
            host(weight), EPS, threads, by_vectors=by_vectors(n, dtype))
        reference.assert_same_bits(host(res_out[block]), want_round, f"residual_out rows {first}+{rows}")
        reference.assert_same_bits(host(normed[block]), want_normed, f"normed rows {first}+{rows}")
        first += rows
    assert ratio(normed, torch_normed.double()) <= NORM_BOUND


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
        ut.matmul_reduce_scatter_add_rmsnorm(operand(comm.rank, (comm.size * m, k), 9), operand(0, (k, n), 10),
                                             operand(comm.rank, (m, n), 11), operand(0, (n,), 12), None, EPS,
                                             group=comm)
    quiesce(comm)
    assert bool((canary == 0x5A5A5A5A).all())
    del canary


def test_cuda_graph_replays_equal_eager(comm):
    """The three ops captured in one graph after an eager call; replays with new inputs equal
    eager calls bit for bit, with replays back to back and eager calls between them (the
    area's halves alternate across them)."""
    m, k, n = 300, 512, 1024
    a, b = operand(comm.rank, (m, k), 11), operand(comm.rank, (k, n), 12, k ** -0.5)
    x, w = operand(comm.rank, (comm.size * m, n), 13), operand(comm.rank, (n, k), 14, n ** -0.5)
    residual, norm_weight, bias = operand(comm.rank, (m, k), 15), operand(0, (k,), 16), operand(0, (k,), 17)

    def step():
        gathered, out = ut.all_gather_matmul(a, b, group=comm)
        normed, res_out = ut.matmul_reduce_scatter_add_rmsnorm(x, w, residual, norm_weight, bias, EPS, group=comm)
        return gathered, out, ut.matmul_reduce_scatter(x, w, group=comm), normed, res_out

    step()  # the first call allocates the area and plans the barrier
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for trial, eager_between in enumerate((False, False, True, True)):
        for t, seed in ((a, 21), (b, 22), (x, 23), (w, 24), (residual, 25), (norm_weight, 26), (bias, 27)):
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


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_sequence_parallel_blocks_match_the_unsharded_block(comm, kind):
    """The sequence-parallel MLP and attention output (their row-parallel GEMMs' reduce-
    scatter + add + RMSNorm one op), bf16, forward and backward: this rank's rows of the
    outputs, the input gradient (the attention's: every token, this rank's heads), its weight
    shards' gradients, and the norm weight's and bias's gradients (complete on every rank),
    within tp.BF16_BOUND of the unsharded float64 block."""
    from ubnext.torch import TensorParallelAttentionOutput, TensorParallelMLP

    tokens, hidden, inter = 64 * comm.size, 512, 1024
    w = tp.weights(hidden, inter, inter, BF16, "cuda")
    data = tp.inputs(tokens, hidden, inter, BF16, "cuda")
    rows = slice(comm.rank * 64, (comm.rank + 1) * 64)
    if kind == "mlp":
        block = TensorParallelMLP(hidden, inter, comm, bias=True, eps=tp.EPS, dtype=BF16, device="cuda",
                                  sequence_parallel=True)
        block.load_full(w["gate"], w["up"], w["down"], w["mlp_norm"], w["down_bias"])
        x = data["x"][rows].clone().requires_grad_()
    else:
        block = TensorParallelAttentionOutput(hidden, inter, comm, bias=True, eps=tp.EPS, dtype=BF16, device="cuda",
                                              sequence_parallel=True)
        block.proj.load_full(w["o"], w["o_bias"])
        with torch.no_grad():
            block.norm.weight.copy_(w["attn_norm"])
        heads = inter // comm.size
        x = data["attention"][:, comm.rank * heads:(comm.rank + 1) * heads].clone().requires_grad_()
    residual = data["residual"][rows].clone().requires_grad_()
    normed, res = block(x, residual)
    torch.autograd.backward((normed, res), (data["grad_normed"][rows], data["grad_residual"][rows]))
    grads = {n_: p.grad for n_, p in block.named_parameters()}  # norm weight and bias: complete on every rank
    got = {"normed": normed.detach(), "residual_out": res.detach(), "grad_x": x.grad, "grad_residual": residual.grad,
           **{f"grad:{n_}": g for n_, g in grads.items()}}
    want = tp.unsharded(kind, w, data, comm.rank, comm.size)
    for name in ("normed", "residual_out", "grad_residual") + (("grad_x",) if kind == "mlp" else ()):
        want[name] = want[name][rows]
    tp.assert_close_to(got, want)
