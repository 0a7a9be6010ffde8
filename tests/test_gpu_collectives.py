"""The collectives of NCCL's set beyond the reductions on GPUs (ubnext/_api/collectives):
broadcast, reduce, all_to_all (even, uneven host and device splits), gather, scatter,
send/recv/batch_isend_irecv and barrier. Data movers are checked byte for byte against the
host reference on random bits of every dtype of ``ubnext.DTYPES`` (so -0.0, NaNs with
payloads, infinities and every integer pattern; element 1 -0.0 and element 2 all ones, a
NaN in every float format), outputs poisoned and bordered by canary bytes, inputs
unchanged; the reduce on small exact values (NCCL's order of reduction is its own).

broadcast, all_to_all (even splits), gather and scatter run on NCCL and on the pool's
copy form (``algorithm="copy"``, every test at every world size, ranks sharing a GPU
included; ``auto`` takes it where NCCL cannot run), broadcast also on the copy form's
bandwidth form (``algorithm="scatter_allgather"``, its messages over several rounds
too); the others run on NCCL only, which
refuses ranks sharing a GPU: there their tests are skipped and
``test_where_nccl_cannot_run_the_calls_raise`` checks that each raises UbnextError on
every rank before anything is launched where NCCL is named, while ``barrier`` (ubnext's
all-reduce) and the movers' ``auto`` (the copy form) run. The pool's point-to-point
kernel (send/recv, batches, uneven all-to-all) is tested in test_gpu_p2p.py.

The low-latency kernel (``algorithm="ll"``: broadcast and even all_to_all, parts up to
LL_MAX_BYTES) and the pool's point-to-point kernel (the ``ll`` cases of the uneven
all_to_all and of the batch ring) run on a communicator of their own with a 60 s timeout
(``ll_comm``), so that a failure of them leaves the other tests' communicator intact, made
anew after a test that broke it, so that the failure stays in that test; their tests are
the same bodies, plus back-to-back calls that alternate the buffers and a CUDA-graph
replay. The bodies wait with ``comm.synchronize()``, which raises what a kernel recorded
(a kernel's failure is raised at the next call or ``synchronize()``, not by torch's).

Run at 1 rank (plain pytest), at 2 and 4 ranks one per GPU, and with ranks sharing one
GPU: ``mpirun --oversubscribe -n 4 python -m pytest -q tests/test_gpu_collectives.py``;
skipped without a GPU.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from gpu_support import GUARD_BYTES, collected, communicator, seed_of, skip_where_nccl_cannot_run, torch_dtype

from ubnext._protocol.algorithms import DTYPES
from ubnext._protocol.constants import LL_MAX_BYTES
from ubnext._protocol.errors import UbnextError

pytestmark = pytest.mark.gpu

WIDTH = {name: width for name, (_, width) in DTYPES.items()}
FLOATS = ("bfloat16", "float16", "float32", "float64")
#: elements per rank's part: one, odd (parts not 16-byte aligned), 4099, about 1M (bfloat16 only)
SIZES = (1, 7, 4099)
BIG = (1 << 20) + 3
POISON = 0xA5

comm = pytest.fixture(scope="module", name="comm")(communicator)


@pytest.fixture
def nccl(comm):
    """Skips where NCCL cannot run (ranks sharing a GPU)."""
    skip_where_nccl_cannot_run(comm)
    return comm


#: the algorithms of the data movers (broadcast, even all_to_all, gather, scatter)
MOVERS = ("copy", "nccl")
#: and of the two that have a low-latency kernel (broadcast, even all_to_all)
LL_MOVERS = ("ll", "copy", "nccl")
#: broadcast's: those and its bandwidth form on the copy form's area
BROADCASTS = ("ll", "copy", "scatter_allgather", "nccl")


@pytest.fixture(scope="module")
def ll_holder():
    """Where the low-latency kernels' communicator lives between tests (``ll_comm``)."""
    holder = SimpleNamespace(comm=None)
    yield holder
    if holder.comm is not None:
        holder.comm.close()


def renewed_after_failure(holder, make, agree):
    """The body of a per-test fixture of a communicator kept in ``holder.comm`` between
    tests, made by ``make()`` at its first use. After the test every rank waits for its
    work and the ranks agree (``agree(flag)``: every rank's flag, collective) whether it
    failed on any of them: then every rank aborts it (local: a rank that saw nothing waits
    for none) and the next test gets a new one, and the test errors here on each rank
    where it failed, so that one failure stays in the test that caused it instead of
    failing every later one."""
    import ubnext

    if holder.comm is None:
        holder.comm = make()
    c = holder.comm
    yield c
    error = None
    try:
        c.synchronize()
    except ubnext.BrokenCommunicatorError as e:
        error = e
    if any(agree(error is not None)):
        holder.comm = None
        c.abort()
    if error is not None:
        pytest.fail(f"the communicator failed in this test (the next test gets a new one): {error!r}")


@pytest.fixture
def ll_comm(ll_holder, comm):
    """The low-latency kernels' communicator (a small pool, a 60 s timeout) for one test,
    renewed after a test that broke it (``renewed_after_failure``; the ranks agree over the
    module communicator's bootstrap)."""
    from gpu_support import SMALL

    import ubnext

    yield from renewed_after_failure(ll_holder, lambda: ubnext.Communicator(**SMALL, timeout_s=60),
                                     comm.bootstrap.allgather_obj)


def mover(comm, algo: str, request=None, nbytes: int = 0):
    """The communicator of a mover's test by ``algo`` (``ll``: ``ll_comm``, skipped past
    LL_MAX_BYTES per part); skips NCCL where it cannot run."""
    if algo == "nccl":
        skip_where_nccl_cannot_run(comm)
    if algo == "ll":
        if nbytes > LL_MAX_BYTES:
            pytest.skip(f"parts of {nbytes} bytes: past the low-latency kernel's {LL_MAX_BYTES}")
        return request.getfixturevalue("ll_comm")
    return comm


# ---- bytes on the host and on the device -----------------------------------------------------
def rank_bytes(count: int, dtype: str, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s ``count`` elements of ``dtype`` as random bytes (uint8, the same on any
    machine), with -0.0 at element 1 and all ones (NaN in the float formats) at element 2."""
    w = WIDTH[dtype]
    b = np.random.default_rng(seed * 1009 + rank).integers(0, 256, count * w, dtype=np.uint8)
    if count > 1:
        b[w:2 * w] = 0
        b[2 * w - 1] = 0x80
    if count > 2:
        b[2 * w:3 * w] = 0xFF
    return b


def on_device(b: np.ndarray, dtype: str, shape=None):
    import torch

    if b.size == 0:  # a rank that sends no rows (uneven splits): torch cannot view an empty array's bytes
        return torch.empty(shape or (0,), dtype=torch_dtype(dtype), device="cuda")
    t = torch.from_numpy(b).to("cuda").view(torch_dtype(dtype))
    return t if shape is None else t.view(shape)


def host_bytes(t) -> np.ndarray:
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()


class Bordered:
    """``count`` elements (``.view``) between random canary bytes, poisoned (every byte
    POISON) until written."""

    def __init__(self, count: int, dtype: str, seed: int, shape=None):
        import torch

        w = WIDTH[dtype]
        before = GUARD_BYTES // w
        self.base = torch.empty(before + count + GUARD_BYTES // w, dtype=torch_dtype(dtype), device="cuda")
        raw = self.base.view(torch.uint8)
        raw.fill_(POISON)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self._guards = (raw[:before * w], raw[(before + count) * w:])
        self._saved = []
        for guard in self._guards:
            guard.copy_(torch.randint(0, 256, guard.shape, generator=g, device="cuda", dtype=torch.uint8))
            self._saved.append(guard.clone())
        self.view = self.base[before:before + count].view(shape or (count,))

    def assert_intact(self, what: str) -> None:
        for saved, now, side in zip(self._saved, self._guards, ("before", "after")):
            changed = (saved != now).nonzero().flatten().tolist()
            assert not changed, f"{what}: the call changed {len(changed)} canary bytes {side} the array"


def assert_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: {got.shape} bytes, want {want.shape}"
    bad = np.flatnonzero(got != want)
    assert not bad.size, f"{what}: {bad.size} bytes differ, first at {bad[:8].tolist()}"


def cases():
    for dtype in DTYPES:
        for count in SIZES:
            yield pytest.param(dtype, count, id=f"{dtype}-{count}")
    yield pytest.param("bfloat16", BIG, id=f"bfloat16-{BIG}")


# ---- broadcast -------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", BROADCASTS)
@pytest.mark.parametrize("place", ["new", "out", "in"])
@pytest.mark.parametrize("dtype,count", list(cases()))
def test_broadcast_bit_for_bit(comm, dtype, count, place, algo, request):
    comm = mover(comm, algo, request, count * WIDTH[dtype])
    seed = seed_of("bcast", dtype, count, place)
    root = seed % comm.size
    mine = rank_bytes(count, dtype, comm.rank, seed)
    x = Bordered(count, dtype, seed + 1)
    x.view.copy_(on_device(mine, dtype))
    out = Bordered(count, dtype, seed + 2) if place == "out" else None
    result = comm.broadcast(x.view, root, out=x.view if place == "in" else None if out is None else out.view,
                            algorithm=algo)
    comm.synchronize()
    want = rank_bytes(count, dtype, root, seed)
    assert_bytes(host_bytes(result), want, f"broadcast from {root}")
    x.assert_intact("broadcast (x)")
    if place == "out":
        assert result is out.view
        out.assert_intact("broadcast (out)")
        assert_bytes(host_bytes(x.view), mine, "broadcast changed x")
    assert result.shape == x.view.shape and result.dtype == x.view.dtype


@pytest.mark.parametrize("algo", BROADCASTS)
def test_broadcast_of_cupy_arrays(comm, algo, request):
    import cupy

    comm = mover(comm, algo, request)
    x = cupy.arange(1000, dtype=cupy.float32) + comm.rank * 1000
    out = comm.broadcast(x, root=comm.size - 1, algorithm=algo)
    assert isinstance(out, cupy.ndarray)
    cupy.testing.assert_array_equal(out, cupy.arange(1000, dtype=cupy.float32) + (comm.size - 1) * 1000)


@pytest.mark.parametrize("algo", ["scatter_allgather", "copy"])
def test_broadcast_over_several_rounds_eager_and_replayed(comm, algo):
    """Messages of more rounds than the area's two halves hold (so the halves are reused
    within a call and across calls), from every root in turn: eagerly, two calls queued
    back to back, then captured after an eager call and replayed on new inputs; bit for
    bit, canaries intact, the root's x unchanged."""
    import torch

    from ubnext._api.collectives.pool_copy import AREA_BYTES

    n, me = comm.size, comm.rank
    count = 2 * n * AREA_BYTES + 12345  # uint8: 4 or 5 rounds of scatter_allgather, more of the copy form
    seed = seed_of("bcast-rounds", algo)
    xs = [Bordered(count, "uint8", seed + 10 * r) for r in range(n)]
    outs = [Bordered(count, "uint8", seed + 10 * r + 1) for r in range(n)]
    data = [rank_bytes(count, "uint8", me, seed + r) for r in range(n)]
    for r in range(n):
        xs[r].view.copy_(on_device(data[r], "uint8"))
    for r in range(n):  # every root in turn, queued without a wait between the calls
        comm.broadcast(xs[r].view, r, out=outs[r].view, algorithm=algo)
    torch.cuda.synchronize()
    failures = []
    for r in range(n):
        with collected(failures):
            assert_bytes(host_bytes(outs[r].view), rank_bytes(count, "uint8", r, seed + r), f"broadcast from {r}")
            assert_bytes(host_bytes(xs[r].view), data[r], "broadcast changed x")
            outs[r].assert_intact(f"broadcast from {r} (out)")
            xs[r].assert_intact(f"broadcast from {r} (x)")
    root = n - 1
    x, out = xs[0].view, outs[0].view
    graph = captured(lambda: comm.broadcast(x, root, out=out, algorithm=algo))
    for step in range(2):
        x.copy_(on_device(rank_bytes(count, "uint8", me, seed + 100 + step), "uint8"))
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        with collected(failures):
            assert_bytes(host_bytes(out), rank_bytes(count, "uint8", root, seed + 100 + step), f"replay {step}")
            outs[0].assert_intact("replayed broadcast (out)")
    assert not failures, failures


# ---- reduce ----------------------------------------------------------------------------------
def exact_values(count: int, dtype: str, rank: int, seed: int) -> np.ndarray:
    """Small values whose sums over 8 ranks are exact in every dtype (float64 on the host)."""
    rng = np.random.default_rng(seed * 1009 + rank + 7)
    lo = 0 if dtype.startswith("uint") else -8
    v = rng.integers(lo, 9, count).astype(np.float64)
    return v * 0.5 if dtype in FLOATS else v


def as_dtype(v: np.ndarray, dtype: str):
    """float64 host values as a CUDA tensor of ``dtype`` (exact: they are small)."""
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(v).to(torch.bfloat16).to("cuda")
    return torch.from_numpy(v.astype(dtype)).to("cuda")


@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reduce_on_the_root_only(nccl, dtype, op):
    import torch

    comm = nccl
    if op == "avg" and (dtype not in FLOATS or comm.size & (comm.size - 1) or dtype == "bfloat16"):
        pytest.skip("an average exact in any order: floating types of 11+ bits, a power-of-two world")
    count = 4099
    seed = seed_of("reduce", dtype, op)
    root = seed % comm.size
    values = [exact_values(count, dtype, r, seed) for r in range(comm.size)]
    x = as_dtype(values[comm.rank], dtype)
    kept = x.clone()
    out = Bordered(count, dtype, seed + 2)
    got = comm.reduce(x, root, op=op, out=out.view)
    torch.cuda.synchronize()
    stack = np.stack(values)
    want = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0), "avg": stack.sum(0) / comm.size}[op]
    if comm.rank == root:
        assert got is out.view
        assert_bytes(host_bytes(out.view), host_bytes(as_dtype(want, dtype)), f"reduce {op} to {root}")
    else:
        assert got is None
        assert_bytes(host_bytes(out.view), np.full(count * WIDTH[dtype], POISON, np.uint8), "reduce wrote off the root")
    out.assert_intact("reduce (out)")
    assert_bytes(host_bytes(x), host_bytes(kept), "reduce changed x")
    new = comm.reduce(x, root, op=op)
    torch.cuda.synchronize()
    assert (new is None) == (comm.rank != root)


# ---- all-to-all -------------------------------------------------------------------------------
def rows_between(i: int, j: int, seed: int) -> int:
    """Rows rank i sends rank j in the uneven cases (0 included), known to every rank."""
    return (i * 3 + j * 5 + seed) % 4


@pytest.mark.parametrize("splits", ["even:ll", "even:copy", "even:nccl", "host", "device", "host:ll", "device:ll"])
@pytest.mark.parametrize("dtype,count", list(cases()))
def test_all_to_all_bit_for_bit(comm, dtype, count, splits, request):
    """Even splits on every mover; uneven ones (host lists, device arrays) on NCCL and on
    the pool's point-to-point kernel (``ll``: any size, the bfloat16 case's parts of up to
    6 MiB in chunks; device splits read by the kernel, no host sync)."""
    import torch

    splits, _, algo = splits.partition(":")
    comm = mover(comm, algo or "nccl", request, 2 * count * WIDTH[dtype] if splits == "even" else 0)
    n, me = comm.size, comm.rank
    seed = seed_of("a2a", dtype, count, splits)
    row = count  # elements per row
    if splits == "even":
        send = [[2] * n for _ in range(n)]
    else:
        send = [[rows_between(i, j, seed) for j in range(n)] for i in range(n)]
    rows_in = [sum(send[i]) for i in range(n)]
    spare = 3 if splits == "device" else 0  # a caller-sized out: rows past what arrives stay poisoned
    rows_out = sum(send[j][me] for j in range(n)) + spare
    data = [rank_bytes(rows_in[i] * row, dtype, i, seed) for i in range(n)]
    x = Bordered(rows_in[me] * row, dtype, seed + 1, shape=(rows_in[me], row))
    x.view.copy_(on_device(data[me], dtype, (rows_in[me], row)))
    out = Bordered(rows_out * row, dtype, seed + 2, shape=(rows_out, row))
    kwargs = {}
    if splits == "host":
        kwargs = dict(in_splits=send[me], out_splits=[send[j][me] for j in range(n)])
    elif splits == "device":  # two dtypes: torch.tensor's int64 default and int32, each read at its own width
        kwargs = dict(in_splits=torch.tensor(send[me], device="cuda"),
                      out_splits=torch.tensor([send[j][me] for j in range(n)], device="cuda", dtype=torch.int32))
    result = comm.all_to_all(x.view, out.view, algorithm=algo or "auto", **kwargs)
    comm.synchronize()  # raises what the kernel found (device splits on "ll": SplitError)
    w = WIDTH[dtype] * row
    want = []
    for j in range(n):
        start = sum(send[j][:me])
        want.append(data[j][start * w:(start + send[j][me]) * w])
    want.append(np.full(spare * w, POISON, np.uint8))
    assert result is out.view
    assert_bytes(host_bytes(out.view), np.concatenate(want), f"all_to_all ({splits})")
    out.assert_intact("all_to_all (out)")
    x.assert_intact("all_to_all (x)")
    assert_bytes(host_bytes(x.view), data[me], "all_to_all changed x")


@pytest.mark.parametrize("algo", LL_MOVERS)
def test_all_to_all_default_out_has_the_rows_received(comm, algo, request):
    import torch

    comm = mover(comm, algo, request)
    n = comm.size
    x = torch.arange(2 * n * 3, dtype=torch.int64, device="cuda").view(2 * n, 3) + 1000 * comm.rank
    out = comm.all_to_all(x, algorithm=algo)
    assert tuple(out.shape) == (2 * n, 3)
    want = torch.cat([torch.arange(2 * n * 3, device="cuda").view(2 * n, 3)[2 * comm.rank:2 * comm.rank + 2] + 1000 * j
                      for j in range(n)])
    assert torch.equal(out, want)
    if algo != "nccl":
        return  # uneven splits: NCCL's
    uneven = comm.all_to_all(x, in_splits=[2 * n] + [0] * (n - 1),  # everything to rank 0
                             out_splits=[2 * n] * n if comm.rank == 0 else [0] * n)
    assert tuple(uneven.shape) == ((2 * n * n, 3) if comm.rank == 0 else (0, 3))


def test_device_split_errors_raise_on_every_rank_and_write_nothing(nccl):
    import torch

    comm = nccl
    n = comm.size
    x = torch.zeros(n, 2, dtype=torch.float32, device="cuda")
    out = Bordered(n * 2, "float32", 5, shape=(n, 2))
    ins = [1] * n
    if comm.rank == 0:
        ins[-1] = 1 + n  # past rank 0's n rows, and more than the last rank expects
    with pytest.raises(UbnextError, match=r"^all_to_all: rank 0's in_splits .* past its .*; nothing was moved"):
        comm.all_to_all(x, out.view, torch.tensor(ins, device="cuda"), torch.ones(n, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    assert_bytes(host_bytes(out.view), np.full(n * 2 * 4, POISON, np.uint8), "a refused all_to_all wrote out")
    out.assert_intact("a refused all_to_all")
    comm.all_to_all(x, out.view)  # the communicator goes on
    torch.cuda.synchronize()


# ---- gather and scatter ------------------------------------------------------------------------
@pytest.mark.parametrize("algo", MOVERS)
@pytest.mark.parametrize("place", ["new", "out", "in"])
@pytest.mark.parametrize("dtype,count", list(cases()))
def test_gather_bit_for_bit(comm, dtype, count, place, algo):
    import torch

    comm = mover(comm, algo)
    n = comm.size
    seed = seed_of("gather", dtype, count, place)
    root = seed % n
    data = [rank_bytes(count, dtype, r, seed) for r in range(n)]
    out = Bordered(n * count, dtype, seed + 2, shape=(n, count))
    if place == "in" and comm.rank == root:
        x_view, x = out.view[root], None
    else:
        x = Bordered(count, dtype, seed + 1)
        x_view = x.view
    x_view.copy_(on_device(data[comm.rank], dtype))
    result = comm.gather(x_view, root, out=None if place == "new" else out.view, algorithm=algo)
    torch.cuda.synchronize()
    failures = []
    with collected(failures):
        if comm.rank != root:
            assert result is None
            assert_bytes(host_bytes(out.view), np.full(n * count * WIDTH[dtype], POISON, np.uint8),
                         "gather wrote off the root")
        else:
            assert tuple(result.shape) == (n, count)
            assert_bytes(host_bytes(result), np.concatenate(data), f"gather to {root}")
        out.assert_intact("gather (out)")
        if x is not None:
            x.assert_intact("gather (x)")
            assert_bytes(host_bytes(x.view), data[comm.rank], "gather changed x")
    assert not failures, failures


@pytest.mark.parametrize("algo", MOVERS)
@pytest.mark.parametrize("place", ["new", "out", "in"])
@pytest.mark.parametrize("dtype,count", list(cases()))
def test_scatter_bit_for_bit(comm, dtype, count, place, algo):
    import torch

    comm = mover(comm, algo)
    n = comm.size
    seed = seed_of("scatter", dtype, count, place)
    root = seed % n
    whole = rank_bytes(n * count, dtype, root, seed)
    x = None
    if comm.rank == root:
        x = Bordered(n * count, dtype, seed + 1, shape=(n, count))
        x.view.copy_(on_device(whole, dtype, (n, count)))
    if place == "in" and comm.rank == root:
        out, out_view = None, x.view[root]
    elif place == "new" and comm.rank == root:
        out, out_view = None, None
    else:
        out = Bordered(count, dtype, seed + 2)
        out_view = out.view
    result = comm.scatter(None if x is None else x.view, root, out=out_view, algorithm=algo)
    torch.cuda.synchronize()
    w = count * WIDTH[dtype]
    failures = []
    with collected(failures):
        assert tuple(result.shape) == (count,)
        assert_bytes(host_bytes(result), whole[comm.rank * w:(comm.rank + 1) * w], f"scatter from {root}")
        if out is not None:
            out.assert_intact("scatter (out)")
        if x is not None:
            x.assert_intact("scatter (x)")
            assert_bytes(host_bytes(x.view), whole, "scatter changed x")
    assert not failures, failures


# ---- point-to-point ----------------------------------------------------------------------------
def isend():
    pass


def irecv():
    pass


@pytest.mark.parametrize("algo", ["ll", "nccl"])
@pytest.mark.parametrize("form", ["tuples", "p2pops"])
@pytest.mark.parametrize("dtype,count", list(cases()))
def test_batch_ring_bit_for_bit(comm, dtype, count, form, algo, request):
    """Each rank sends to the next and receives from the previous in one batch (at one
    rank: to and from itself), plus a second pair of buffers the other way round; on NCCL
    and on the pool's point-to-point kernel (``ll``: the bfloat16 case of 2 MiB in chunks)."""
    comm = mover(comm, algo, request)
    n, me = comm.size, comm.rank
    seed = seed_of("ring", dtype, count, form)
    nxt, prev = (me + 1) % n, (me - 1) % n
    data = [rank_bytes(count, dtype, r, seed) for r in range(n)]
    back = [rank_bytes(count, dtype, r, seed + 1) for r in range(n)]
    x, y = Bordered(count, dtype, seed + 1), Bordered(count, dtype, seed + 2)
    x.view.copy_(on_device(data[me], dtype))
    y.view.copy_(on_device(back[me], dtype))
    got, got_back = Bordered(count, dtype, seed + 3), Bordered(count, dtype, seed + 4)
    entries = [("recv", got.view, prev), ("send", x.view, nxt), ("send", y.view, prev), ("recv", got_back.view, nxt)]
    if form == "p2pops":
        kinds = {"send": isend, "recv": irecv}
        entries = [SimpleNamespace(op=kinds[k], tensor=t, peer=p) for k, t, p in entries]
    assert comm.batch_isend_irecv(entries, algorithm=algo) is None
    comm.synchronize()
    failures = []
    with collected(failures):
        assert_bytes(host_bytes(got.view), data[prev], "batch: received from the previous rank")
        assert_bytes(host_bytes(got_back.view), back[nxt], "batch: received from the next rank")
        for b, what in ((got, "got"), (got_back, "got_back"), (x, "x"), (y, "y")):
            b.assert_intact(f"batch ({what})")
        assert_bytes(host_bytes(x.view), data[me], "batch changed a send buffer")
    assert not failures, failures


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_send_recv_pairs(nccl, dtype):
    """Even ranks send two arrays to the next odd rank, which receives them in order (the
    k-th send matches the k-th receive); a last rank without a partner takes no part."""
    import torch

    comm = nccl
    if comm.size < 2:
        pytest.skip("a send needs another rank")
    me = comm.rank
    seed = seed_of("sendrecv", dtype)
    count = 4099
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= comm.size:
        return
    first, second = (rank_bytes(count, dtype, min(me, peer), seed + k) for k in (0, 1))
    if me % 2 == 0:
        comm.send(on_device(first, dtype), peer)
        comm.send(on_device(second, dtype), peer)
    else:
        a, b = Bordered(count, dtype, seed + 2), Bordered(count, dtype, seed + 3)
        assert comm.recv(a.view, peer) is a.view
        comm.recv(b.view, peer)
        torch.cuda.synchronize()
        assert_bytes(host_bytes(a.view), first, "the first recv")
        assert_bytes(host_bytes(b.view), second, "the second recv")
        a.assert_intact("recv (a)")
        b.assert_intact("recv (b)")
    torch.cuda.synchronize()


# ---- graphs --------------------------------------------------------------------------------------
def captured(calls):
    """``calls()`` run once eagerly (which sets everything up), then captured in a CUDA graph."""
    import torch

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def replayed(graph, x, me: int, steps: int):
    """Replays ``graph`` ``steps`` times, x set before each to ``base + 100 * me``; yields
    each step's ``base`` (float32 ``arange(x.numel()) + 10000 * step``) after its replay."""
    import torch

    for step in range(steps):
        base = torch.arange(x.numel(), device="cuda", dtype=torch.float32) + 10000 * step
        x.copy_(base + 100 * me)
        graph.replay()
        torch.cuda.synchronize()
        yield base
@pytest.mark.parametrize("algo", MOVERS)
def test_graph_replay(comm, algo):
    """broadcast, all_to_all with host splits (even ones by the copy form), gather, scatter,
    a batch (NCCL) and barrier captured after eager calls, replayed on new inputs."""
    import torch

    comm = mover(comm, algo)
    n, me = comm.size, comm.rank
    x = torch.zeros(n * 4, dtype=torch.float32, device="cuda")
    b, a, g = torch.empty_like(x), torch.empty_like(x), torch.empty(n, n * 4, device="cuda")
    s, r = torch.empty(4, device="cuda"), torch.empty_like(x)

    def calls():
        comm.broadcast(x, 0, out=b, algorithm=algo)
        if algo == "nccl":
            comm.all_to_all(x, a, [4] * n, [4] * n)
            comm.batch_isend_irecv([("send", x, (me + 1) % n), ("recv", r, (me - 1) % n)])
        else:
            comm.all_to_all(x, a, algorithm=algo)
        comm.gather(x, 0, out=g, algorithm=algo)
        comm.scatter(x, 0, out=s, algorithm=algo)
        comm.barrier(stream=torch.cuda.current_stream())

    failures = []
    for base in replayed(captured(calls), x, me, 3):
        with collected(failures):
            assert torch.equal(b, base)
            assert torch.equal(a, torch.cat([base[4 * me:4 * me + 4] + 100 * j for j in range(n)]))
            if me == 0:
                assert torch.equal(g, torch.stack([base + 100 * j for j in range(n)]))
            assert torch.equal(s, base[4 * me:4 * me + 4])
            if algo == "nccl":
                assert torch.equal(r, base + 100 * ((me - 1) % n))
    assert not failures, failures


def test_first_copy_and_barrier_calls_refuse_a_capture():
    """A new communicator's first copy-form call and first barrier allocate and zero a flag
    and wait on the host: under a CUDA graph capture each raises UbnextError before it
    queues anything, so the capture ends cleanly; after one eager call both are captured
    and replayed."""
    import torch
    from gpu_support import SMALL, require_gpu_and_torch

    import ubnext

    require_gpu_and_torch()
    comm = ubnext.Communicator(**SMALL)
    try:
        x = torch.arange(4, dtype=torch.float32, device="cuda") + 100 * comm.rank
        out = torch.zeros_like(x)
        calls = {"broadcast": lambda: comm.broadcast(x, 0, out=out, algorithm="copy"),
                 "barrier": lambda: comm.barrier(stream=torch.cuda.current_stream())}
        for name, call in calls.items():
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(UbnextError, match=f"^{name}: the first such call on a communicator cannot be "
                                                  f"captured in a CUDA graph .*make one eager call first"):
                with torch.cuda.graph(graph):
                    call()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.zeros_like(x))  # nothing ran
        graph = captured(lambda: [call() for call in calls.values()])
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.arange(4, dtype=torch.float32, device="cuda"))
        comm.synchronize()
    finally:
        comm.close()


def test_ll_back_to_back_alternates_its_buffers(ll_comm):
    """Sixty calls of the low-latency kernel queued without a wait, broadcasts (every rank
    the root in turn) and all-to-alls of changing sizes, each into an output of its own:
    every one bit for bit (a rank one launch ahead pushes into the other buffer; lines of
    older launches carry older flags)."""
    import torch

    comm = ll_comm
    n, me = comm.size, comm.rank
    made = []
    for k in range(60):
        count = (1, 7, 4099, 8192, 33)[k % 5]
        seed = seed_of("ll-b2b", k)
        if k % 2:
            data = [rank_bytes(n * count, "float32", r, seed) for r in range(n)]
            out = torch.empty(n * count, dtype=torch.float32, device="cuda")
            comm.all_to_all(on_device(data[me], "float32"), out, algorithm="ll")
            w = count * 4
            want = np.concatenate([data[j][me * w:(me + 1) * w] for j in range(n)])
        else:
            root = k // 2 % n
            out = comm.broadcast(on_device(rank_bytes(count, "bfloat16", me, seed), "bfloat16"), root, algorithm="ll")
            want = rank_bytes(count, "bfloat16", root, seed)
        made.append((k, out, want))
    comm.synchronize()
    for k, out, want in made:
        assert_bytes(host_bytes(out), want, f"call {k}")


def test_ll_graph_replay(ll_comm):
    import torch

    comm = ll_comm
    n, me = comm.size, comm.rank
    x = torch.zeros(n * 4, dtype=torch.float32, device="cuda")
    b, a = torch.empty_like(x), torch.empty_like(x)

    def calls():
        comm.broadcast(x, n - 1, out=b, algorithm="ll")
        comm.all_to_all(x, a, algorithm="ll")

    failures = []
    for base in replayed(captured(calls), x, me, 4):
        with collected(failures):
            assert torch.equal(b, base + 100 * (n - 1))
            assert torch.equal(a, torch.cat([base[4 * me:4 * me + 4] + 100 * j for j in range(n)]))
    comm.synchronize()
    assert not failures, failures


# ---- barrier ------------------------------------------------------------------------------------
def test_barrier_orders_the_stream_without_blocking_the_host(comm):
    """Rank 0 queues 200 ms of sleep before its barrier; every other rank's stream passes its
    barrier only after that, while no rank's host waits in the call."""
    import cupy
    import torch

    stream = torch.cuda.current_stream()
    comm.barrier(stream=stream)  # the first call allocates its element
    torch.cuda.synchronize()
    cycles = int(0.2 * cupy.cuda.Device(comm.device).attributes["ClockRate"] * 1000)
    comm.bootstrap.allgather(b"")  # start together
    start = time.perf_counter()
    if comm.rank == 0:
        torch.cuda._sleep(cycles)
    issue = time.perf_counter()
    comm.barrier(stream=stream)
    issued = time.perf_counter() - issue
    torch.cuda.synchronize()
    waited = time.perf_counter() - start
    comm.synchronize()
    assert issued < 0.1, f"barrier blocked the host for {issued:.3f} s"
    if comm.rank:
        assert waited > 0.15, f"rank {comm.rank} passed the barrier after {waited:.3f} s, before rank 0 arrived"


# ---- where NCCL cannot run ------------------------------------------------------------------------
def test_where_nccl_cannot_run_the_calls_raise(comm):
    """Ranks sharing a GPU: the calls that only NCCL serves (and NCCL named) raise on every
    rank before anything is launched; the movers' ``auto`` takes the copy form, ``barrier``
    runs (point-to-point and uneven all-to-alls take the pool's kernel: test_gpu_p2p.py)."""
    import torch

    if comm.selector.nccl_problem is None:
        pytest.skip("NCCL runs here")
    n = comm.size
    x = torch.arange(n * 2, dtype=torch.float32, device="cuda") + 10 * comm.rank
    out = Bordered(n * 2, "float32", 9)
    ones = [1] * n
    calls = {"reduce": lambda: comm.reduce(x, 0, out=out.view),
             "all_to_all": lambda: comm.all_to_all(x[:n], out.view[:n], ones, ones, algorithm="nccl"),
             "send": lambda: comm.send(x, (comm.rank + 1) % n, algorithm="nccl"),
             "recv": lambda: comm.recv(out.view, (comm.rank + 1) % n, algorithm="nccl"),
             "batch_isend_irecv": lambda: comm.batch_isend_irecv([("send", x, comm.rank)], algorithm="nccl"),
             "broadcast": lambda: comm.broadcast(x, 0, out=out.view, algorithm="nccl")}
    for name, call in calls.items():
        with pytest.raises(UbnextError, match=f"^{name}: [^,]+, and NCCL, which runs it, "
                                              f"cannot run here"):
            call()
    torch.cuda.synchronize()
    assert_bytes(host_bytes(out.view), np.full(n * 2 * 4, POISON, np.uint8), "a refused call wrote out")
    got = comm.broadcast(x, 0)  # auto: the copy form
    comm.barrier(stream=torch.cuda.current_stream())  # ubnext's all-reduce: runs
    torch.cuda.synchronize()
    assert torch.equal(got, torch.arange(n * 2, dtype=torch.float32, device="cuda"))
