"""Helpers of the GPU tests: one communicator per module, inputs every rank regenerates
for every other rank, outputs poisoned and bordered by canary bytes, the kernel launches
of a call recorded, and every output element compared bit for bit with the host
reference (ubnext/_tools/reference.py) computed from every rank's inputs in the order of the
kernels that ran.

The same test bodies run at 1 rank (plain pytest) and at N ranks
(``mpirun -n N python -m pytest tests``); without a usable GPU they are skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import zlib

import numpy as np
import pytest

from ubnext._tools import reference

DTYPES = tuple(reference.DTYPES)
WIDTH = {name: dtype.itemsize for name, dtype in reference.DTYPES.items()}
#: canary bytes on each side of every output (and input) view: more than a 16-byte vector
GUARD_BYTES = 64
#: rank id of the operands that every rank shares (residual, weight, bias)
SHARED = 10**6
#: order probes (reference.order_probe) at every PROBE_STRIDE-th element from PROBE_START
PROBE_START, PROBE_STRIDE = 8, 1024


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def require_gpu_and_torch():
    if gpu_count() == 0:
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("torch", reason="the GPU tests build their inputs with torch")


def communicator():
    """A Communicator of every rank, closed at the end: the generator of a test module's
    ``comm`` fixture (``pytest.fixture(scope="module", name="comm")(communicator)``); skips
    without a GPU and torch."""
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator()
    yield c
    c.close()


#: buffers for a module's many small calls: every kernel takes a test's sizes in one launch
SMALL = dict(pool_mb=128, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)


def small_torch_communicator():
    """A Communicator of every rank on SMALL buffers with torch's current device set to its
    own, closed at the end: the generator of a module's ``comm`` fixture; skips without a
    GPU and torch."""
    require_gpu_and_torch()
    import torch

    import ubnext

    c = ubnext.Communicator(**SMALL)
    torch.cuda.set_device(c.device)
    yield c
    c.close()


def seed_of(*parts) -> int:
    """A seed from a test's parameters, the same on every rank."""
    return zlib.crc32("-".join(map(str, parts)).encode()) % 100000


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# ---- inputs ------------------------------------------------------------------------------
def small_integers(comm, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's input of ``count`` small integers (float32, below 61 + seed + size) and
    the sum over the ranks, exact in float32 in any order of reduction: host arrays."""
    base = (np.arange(count, dtype=np.float32) * (seed + 3)) % 61
    return base + seed + comm.rank, base * comm.size + seed * comm.size + sum(range(comm.size))


def make_input(count: int, dtype: str, rank: int, seed: int, specials: bool):
    """Rank ``rank``'s input of a test: random normal values, the same on any GPU, never
    zero (values that round to zero are replaced by 1).

    With ``specials``: -0.0 on every rank at every 97th element and at a rank-dependent
    31st; +inf at element 3 on rank 0 and -inf there on rank 1 (NaN from two ranks on);
    NaN at element 5 on rank 0; the dtype's largest finite value at element 6 (overflow
    from two ranks on); an order probe (reference.order_probe) at every PROBE_STRIDE-th
    element from PROBE_START.
    """
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed * 1009 + rank)
    x = torch.randn(count, generator=g, device="cuda", dtype=torch.float32).to(torch_dtype(dtype))
    x[x == 0] = 1
    if specials:
        x[1::97] = -0.0
        x[(2 + rank)::31] = -0.0
        specials_at = {3: {0: float("inf"), 1: float("-inf")}.get(rank), 5: float("nan") if rank == 0 else None,
                       6: torch.finfo(x.dtype).max}
        for i, value in specials_at.items():
            if value is not None and count > i:
                x[i] = value
        x[PROBE_START::PROBE_STRIDE] = reference.order_probe(dtype, rank)
    return x


def make_exact_input(count: int, dtype: str, rank: int, seed: int):
    """Rank ``rank``'s input for NCCL, whose reduction order is its own: nonzero multiples
    of 1/2 up to 8 in magnitude, so that every partial sum is exact in any order
    (reference.exact)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed * 1009 + rank + 77)
    k = torch.randint(1, 17, (count,), generator=g, device="cuda")
    sign = torch.randint(0, 2, (count,), generator=g, device="cuda") * 2 - 1
    return (k * sign * 0.5).to(torch_dtype(dtype))


def make_other_input(count: int, dtype: str, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input of a dtype of ``reference.TWOSHOT_ONLY``, on the host (numpy), the
    same on any machine. Integers: uniform over the whole type, the type's extremes at
    elements 0 and 1 (so that sums wrap around). float64: random normal values, never zero,
    with make_input's specials: -0.0 at every 97th element and at a rank-dependent 31st,
    +inf / -inf at element 3 on ranks 0 / 1, NaN at element 5 on rank 0, the largest finite
    value at element 6, and an order probe at every PROBE_STRIDE-th element from PROBE_START
    (+2**60 on rank 0, -2**60 on rank 1, a small value on the others: lost in any order that
    adds it to +-2**60 first)."""
    rng = np.random.default_rng(seed * 1009 + rank)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
        a[:2] = ((info.max, info.min) if rank % 2 == 0 else (info.max - 1, info.min + 1))[:count]
        return a
    a = rng.standard_normal(count)
    a[a == 0] = 1
    a[1::97] = -0.0
    a[(2 + rank)::31] = -0.0
    specials_at = {3: {0: np.inf, 1: -np.inf}.get(rank), 5: np.nan if rank == 0 else None, 6: np.finfo(dt).max}
    for i, value in specials_at.items():
        if value is not None and count > i:
            a[i] = value
    a[PROBE_START::PROBE_STRIDE] = 2.0**60 if rank == 0 else -2.0**60 if rank == 1 else 1 + rank / 8
    return a.astype(dt)


def host(t) -> np.ndarray:
    """A copy of the torch tensor ``t`` on the host, as a numpy array of reference.DTYPES."""
    import torch

    ints = t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return ints.cpu().numpy().view(reference.DTYPES[str(t.dtype).replace("torch.", "")])


def device(a: np.ndarray):
    """The numpy array ``a`` (reference.DTYPES) as a new CUDA torch tensor, same bits."""
    import torch

    name = next(n for n, d in reference.DTYPES.items() if d == a.dtype)
    ints = torch.from_numpy(np.ascontiguousarray(reference.bits(a)).view({2: np.int16, 4: np.int32}[a.itemsize]))
    return ints.to("cuda").view(torch_dtype(name))


def rank_inputs(count: int, dtype: str, nranks: int, seed: int, specials: bool = True, exact: bool = False):
    """Every rank's input (``make_input``, or ``make_exact_input`` with ``exact``), on the
    host, in rank order."""
    if exact:
        return [host(make_exact_input(count, dtype, r, seed)) for r in range(nranks)]
    return [host(make_input(count, dtype, r, seed, specials)) for r in range(nranks)]


def reduced_by_nccl(comm, algorithm: str, nbytes: int, dtype: str, fused: bool = False) -> bool:
    """Whether NCCL may reduce a call (then its inputs must be exact): named, chosen by
    ``auto``, or, for a fused call, the all-reduce of its unfused path."""
    if algorithm != "auto":
        return algorithm == "nccl"
    choices = {comm.select(nbytes, dtype)} | ({comm.select(nbytes, dtype, fused=True)} if fused else set())
    return "nccl" in choices


def _clashes(comm) -> dict:
    """The GPUs that several ranks of ``comm`` share. Collective (an allgather)."""
    from ubnext._environment import devices as _devices

    return _devices.shared(comm.bootstrap.allgather_obj(_devices.device_uuid(comm.device)))


def ranks_share_a_gpu(comm) -> bool:
    """Whether ranks of ``comm`` share a GPU: they then take turns on it (time slices of
    milliseconds), so when a kernel starts says nothing about launches. Collective."""
    return bool(_clashes(comm))


def skip_where_nccl_cannot_run(comm) -> None:
    """Skips a test that NCCL must reduce where ranks share a GPU, which NCCL refuses
    (ubnext._engine.nccl raises). Collective (an allgather)."""
    clashes = _clashes(comm)
    if clashes:
        pytest.skip(f"NCCL cannot serve several ranks on one GPU (ranks {sorted(clashes.values())[0]} share one)")


def skip_unless_exact_avg(comm, exact: bool, op: str) -> None:
    if exact and op == "avg" and comm.size & (comm.size - 1):
        pytest.skip(f"NCCL's average over {comm.size} ranks (not a power of two) has no order-free bits")


# ---- outputs -----------------------------------------------------------------------------
class Bordered:
    """A view of ``count`` elements (``.view``) inside a larger buffer whose bytes before and
    after it hold random canary bytes: a kernel that writes outside the view changes them.

    Args:
        count: elements of the view.
        dtype: a key of ``DTYPES``.
        seed: seed of the canary bytes (give neighbouring buffers different ones).
        offset: extra elements before the view (1: a view that is not 16-byte aligned).
        comm: allocate from ``comm.empty()`` (symmetric memory, next to other data) instead
            of torch's allocator.
        shape: the view's shape (default ``(count,)``).
    """

    def __init__(self, count: int, dtype: str, seed: int, offset: int = 0, comm=None, shape=None):
        import torch

        width = WIDTH[dtype]
        before = GUARD_BYTES // width + offset
        total = before + count + GUARD_BYTES // width
        if comm is None:
            self.base = torch.empty(total, dtype=torch_dtype(dtype), device="cuda")
        else:
            self.base = comm.empty((total,), dtype, framework="torch")
        self._ends = (before * width, (before + count) * width)  # the view's bytes in the buffer
        g = torch.Generator(device="cuda").manual_seed(seed)
        self._saved = []
        for guard in self._guards():
            guard.copy_(torch.randint(0, 256, guard.shape, generator=g, device="cuda", dtype=torch.uint8))
            self._saved.append(guard.clone())
        self.view = self.base[before:before + count].view(shape or (count,))

    def _guards(self):
        import torch

        raw = self.base.view(torch.uint8)
        return raw[:self._ends[0]], raw[self._ends[1]:]

    def assert_intact(self, what: str) -> None:
        """Raises AssertionError naming the changed canary bytes (offsets from the view)."""
        for saved, now, side in zip(self._saved, self._guards(), ("before", "after")):
            changed = (saved != now).nonzero().flatten().tolist()
            if changed:
                where = (f"at byte offsets {[i - saved.numel() for i in changed][:8]} from its start"
                         if side == "before" else f"at byte offsets {changed[:8]} past its end")
                raise AssertionError(f"{what}: the call changed {len(changed)} bytes {side} the array, {where}")


def as_framework(t, framework: str):
    """``t`` (a torch tensor) as a CuPy array sharing its memory, or itself."""
    if framework == "torch":
        return t
    import cupy
    import torch

    from ubnext._interop.arrays import _cupy_dtype

    ints = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return cupy.from_dlpack(ints).view(_cupy_dtype(str(t.dtype).replace("torch.", "")))


def to_torch(a):
    """A torch view of a CuPy or torch array."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    ints = a.view({2: "int16", 4: "int32"}[a.dtype.itemsize])
    return torch.from_dlpack(ints).view(torch_dtype(a.dtype.name))


def digest(t) -> bytes:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).digest()


def assert_same_bits_everywhere(comm, t) -> None:
    digests = comm.bootstrap.allgather(digest(t))
    assert all(d == digests[0] for d in digests), "ranks got different bits"


@contextlib.contextmanager
def collected(failures: list):
    """Records an AssertionError of the block in ``failures`` instead of raising it, so that
    a rank whose check fails still makes the collective calls that follow (the other
    ranks wait for them); the test asserts ``failures`` is empty at the end."""
    try:
        yield
    except AssertionError as e:
        failures.append(str(e))


# ---- the kernels a call launched ---------------------------------------------------------
#: where a plain all-reduce launch's varying arguments hold its element count
_COUNT_ARG = {"lamport": 2, "lamport_twoshot": 2, "twoshot": 3}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of ubnext.

    Attributes:
        kernel: the algorithm of an all-reduce kernel (plain or fused), or ``"add_rmsnorm"``
            for the separate residual add + RMSNorm kernel.
        fused: the fused all-reduce + add + RMSNorm entry point.
        threads: threads per block.
        cluster: blocks per thread-block cluster (1: none).
        args: the launch's varying arguments (``Launcher.__call__``'s values, as
            ubnext._engine.engine.Engine passes them, or a call plan's ``Packed.values``):
            ``x, out, n, sig`` (Lamport kernels), ``buf_off, src, dst, n, sig`` (two-shot),
            ``x, rows, hidden, ...`` (fused and separate add + RMSNorm).
        collective: the plain entry point's collective (``ubnext._protocol.algorithms.COLLECTIVES``;
            the reduce-scatter's and all-gather's ``n`` is elements per rank).
    """

    kernel: str
    fused: bool
    threads: int
    cluster: int
    args: tuple
    collective: str = "all_reduce"

    @property
    def buffers(self) -> tuple:
        """A plain all-reduce launch's arguments before its element count: where it reads
        and writes (``x, out``; two-shot: ``buf_off, src, dst``)."""
        return self.args[:_COUNT_ARG[self.kernel]]

    @property
    def count(self) -> int:
        """Elements of a plain all-reduce launch."""
        return self.args[_COUNT_ARG[self.kernel]]

    @property
    def rows(self) -> int:
        """Rows of an add + RMSNorm launch."""
        return self.args[1]

    @property
    def group_threads(self) -> int:
        """Threads of the row group that finishes a row: a block's, times its cluster's blocks."""
        return self.threads * self.cluster


@contextlib.contextmanager
def recorded_launches(comm):
    """Records every kernel launch of ubnext in the block, through a launcher's argument
    pack or a call plan's (``_launch.Packed``); yields the list of ``Launch``, filled when
    the block ends (collective calls run unchanged; graphs capture them)."""
    from ubnext._engine import launch as _launch

    raw = []
    real, real_packed = _launch.Launcher.__call__, _launch.Packed.__call__

    def spy(launcher, blocks, threads, stream, *args):
        raw.append((launcher, threads, args))
        return real(launcher, blocks, threads, stream, *args)

    def spy_packed(packed, stream):
        raw.append((packed.launcher, packed.threads, packed.values))
        return real_packed(packed, stream)

    _launch.Launcher.__call__, _launch.Packed.__call__ = spy, spy_packed
    log: list[Launch] = []
    try:
        yield log
    finally:
        _launch.Launcher.__call__, _launch.Packed.__call__ = real, real_packed
    log.extend(_identify(comm, launcher, threads, args) for launcher, threads, args in raw)


def _identify(comm, launcher, threads: int, args: tuple) -> Launch:
    node = comm._node
    if node is not None:
        for (algorithm, _dtype, _op, fused, cluster, collective), known in node.engine._launchers.items():
            if known is launcher:
                return Launch(algorithm, fused, threads, cluster, args, collective)
    epilogue = comm._dispatch._epilogue
    if epilogue is not None and any(known is launcher for known in epilogue._launchers.values()):
        return Launch("add_rmsnorm", False, threads, 1, args)
    raise AssertionError("a launch of a kernel the test does not know")


def ran(launches) -> str:
    """The all-reduce algorithm of recorded launches: the plain kernels' or the fused
    kernel's, ``"nccl"`` where no ubnext all-reduce kernel ran."""
    names = {launch.kernel for launch in launches if launch.kernel != "add_rmsnorm"}
    assert len(names) <= 1, f"one call launched several algorithms: {names}"
    return names.pop() if names else "nccl"


def expected_all_reduce(launches, inputs, op: str) -> np.ndarray:
    """What the plain all-reduce launches of one call store, from every rank's inputs
    (reference.exact where NCCL reduced: no ubnext kernel ran)."""
    plain = [launch for launch in launches if launch.kernel != "add_rmsnorm" and not launch.fused]
    if not plain:
        return reference.exact(inputs, op)
    counts = [launch.count for launch in plain]
    assert sum(counts) == inputs[0].size, f"the launches reduced {sum(counts)} of {inputs[0].size} elements"
    return reference.all_reduce(ran(plain), inputs, op, counts)


def expected_add_rmsnorm(launches, inputs, residual, bias, weight, eps: float, by_vectors: bool):
    """(normed, residual_out) of one all_reduce_add_rmsnorm call from its launches: the
    fused kernel's, or the all-reduce's followed by the separate kernel's (``by_vectors``:
    its rows move as 16-byte vectors, kernels/rmsnorm.cu)."""
    rows, hidden = inputs[0].shape
    fused = [launch for launch in launches if launch.fused]
    if fused:
        return reference.fused(ran(fused), inputs, residual, bias, weight, eps,
                               [(launch.rows, launch.group_threads) for launch in fused])
    separate = [launch for launch in launches if launch.kernel == "add_rmsnorm"]
    assert len(separate) == 1 and separate[0].rows == rows, f"expected one separate kernel launch, got {launches}"
    ar = expected_all_reduce(launches, [x.reshape(-1) for x in inputs], "sum").reshape(rows, hidden)
    return reference.add_rmsnorm(ar, residual, bias, weight, eps, separate[0].threads, by_vectors=by_vectors)


# ---- whole checks ------------------------------------------------------------------------
def check_all_reduce(comm, count: int, dtype: str, seed: int, *, algorithm: str = "auto", op: str = "sum",
                     place: str = "out", framework: str = "torch", x_memory: str = "plain",
                     out_memory: str = "plain", offset: int = 0, specials: bool = True, shape=None):
    """One ``all_reduce`` checked element by element.

    Every rank's input (``make_input``; ``make_exact_input`` where NCCL may reduce) in a
    bordered view; the output a poisoned (NaN) bordered view (``place="out"``), the input
    itself (``"in"``) or new (``"new"``). Checks: the result object, that ``algorithm``
    (or ``auto``'s choice) ran, every element's bits against the reference for the launches
    that ran, no byte outside the views changed, the input unchanged (out of place), the
    same bits on every rank.

    Args:
        x_memory, out_memory: ``"plain"`` (torch's allocator) or ``"symmetric"``
            (``comm.empty()``).
        offset: elements the views start past 16-byte alignment.
        shape: shape of the arrays passed (default ``(count,)``).

    Returns:
        ``(result as a torch tensor, the call's launches)``.
    """
    import torch

    exact = reduced_by_nccl(comm, algorithm, count * WIDTH[dtype], dtype)
    if exact:
        skip_where_nccl_cannot_run(comm)
    skip_unless_exact_avg(comm, exact, op)
    inputs = rank_inputs(count, dtype, comm.size, seed, specials, exact)
    symmetric = {"plain": None, "symmetric": comm}
    x = Bordered(count, dtype, seed + 1, offset, symmetric[x_memory], shape)
    x.view.copy_(device(inputs[comm.rank]).view(x.view.shape))
    out = x if place == "in" else None
    if place == "out":
        out = Bordered(count, dtype, seed + 2, offset, symmetric[out_memory], shape)
        out.view.fill_(float("nan"))
    arg = as_framework(x.view, framework)
    out_arg = None if out is None else arg if out is x else as_framework(out.view, framework)
    with recorded_launches(comm) as launches:
        result = comm.all_reduce(arg, out=out_arg, op=op, algorithm=algorithm)
    if out_arg is not None:
        assert result is out_arg
    assert type(result) is type(arg) and tuple(result.shape) == tuple(x.view.shape)
    got = to_torch(result)
    torch.cuda.synchronize()
    assert_same_bits_everywhere(comm, got)  # collective: before any check that one rank alone may fail
    want = algorithm if algorithm != "auto" else comm.select(count * WIDTH[dtype], dtype)
    assert ran(launches) == want, f"all_reduce ran {ran(launches)}, expected {want}"
    reference.assert_same_bits(host(got).reshape(-1), expected_all_reduce(launches, inputs, op), f"all_reduce {op}")
    x.assert_intact("all_reduce (input)")
    if out is not None and out is not x:
        out.assert_intact("all_reduce (output)")
    if place != "in":
        reference.assert_same_bits(host(x.view).reshape(-1), inputs[comm.rank], "all_reduce modified its input")
    return got, launches


def norm_operands(comm, tokens: int, hidden: int, dtype: str, seed: int, residual: bool = True,
                  bias: bool = True, exact: bool = False):
    """Host operands of a fused call: every rank's x (``make_input`` with specials, or
    exact inputs), the shared residual and bias (random, -0.0 at every 97th element) and
    weight (around 1)."""
    n = tokens * hidden

    def shared(count, seed):
        a = host(make_input(count, dtype, SHARED, seed, False))
        a[1::97] = -0.0
        return a

    inputs = [x.reshape(tokens, hidden) for x in rank_inputs(n, dtype, comm.size, seed, True, exact)]
    res = shared(n, seed + 1).reshape(tokens, hidden) if residual else None
    w = host((1 + 0.25 * make_input(hidden, "float32", SHARED, seed + 2, False)).to(torch_dtype(dtype)))
    b = shared(hidden, seed + 3) if bias else None
    return inputs, res, w, b


def check_add_rmsnorm(comm, tokens: int, hidden: int, dtype: str, seed: int, *, algorithm: str = "auto",
                      residual: bool = True, bias: bool = True, place: str = "out", framework: str = "torch",
                      eps: float = 1e-6, offset: int = 0):
    """One ``all_reduce_add_rmsnorm`` checked element by element.

    x, residual, out and residual_out are bordered views (``offset`` elements past
    alignment; weight and bias aligned), out and residual_out poisoned, residual_out the
    residual itself with ``place="in"``. Checks: that ``algorithm`` ran (fused, or its
    all-reduce before the separate kernel), both outputs' bits against the reference for
    the launches that ran, no byte outside the views changed, x (and an out-of-place
    residual) unchanged, the same bits on every rank.

    Returns:
        ``(normed, residual_out)`` as torch tensors.
    """
    import torch

    shape = (tokens, hidden)
    n = tokens * hidden
    nbytes = n * WIDTH[dtype]
    exact = reduced_by_nccl(comm, algorithm, nbytes, dtype, fused=True)
    if algorithm == "nccl" or (algorithm == "auto" and comm.select(nbytes, dtype, fused=True) == "nccl"):
        skip_where_nccl_cannot_run(comm)  # NCCL surely reduces (on the unfused path only, it may)
    inputs, res, weight, b = norm_operands(comm, tokens, hidden, dtype, seed, residual, bias, exact)
    x = Bordered(n, dtype, seed + 10, offset, shape=shape)
    x.view.copy_(device(inputs[comm.rank]))
    rb = None
    if res is not None:
        rb = Bordered(n, dtype, seed + 11, offset, shape=shape)
        rb.view.copy_(device(res))
    out = Bordered(n, dtype, seed + 12, offset, shape=shape)
    out.view.fill_(float("nan"))
    if place == "in" and rb is not None:
        rout = rb
    else:
        rout = Bordered(n, dtype, seed + 13, offset, shape=shape)
        rout.view.fill_(float("nan"))
    w_dev, b_dev = device(weight), None if b is None else device(b)
    f = lambda t: None if t is None else as_framework(t, framework)  # noqa: E731
    with recorded_launches(comm) as launches:
        normed, rsum = comm.all_reduce_add_rmsnorm(f(x.view), f(None if rb is None else rb.view), f(w_dev), eps=eps,
                                                   bias=f(b_dev), out=f(out.view), residual_out=f(rout.view),
                                                   algorithm=algorithm)
    got_n, got_r = to_torch(normed), to_torch(rsum)
    torch.cuda.synchronize()
    assert_same_bits_everywhere(comm, got_n)  # collective: before any check that one rank alone may fail
    assert_same_bits_everywhere(comm, got_r)
    if algorithm != "auto":
        assert ran(launches) == algorithm, f"all_reduce_add_rmsnorm ran {ran(launches)}, expected {algorithm}"
    # the separate kernel's arrays (its x is out, which holds the all-reduce): by vectors if
    # hidden is a multiple of the vector width and every one is aligned (kernels/rmsnorm.cu)
    arrays = (out.view, rout.view, w_dev, None if rb is None else rb.view, b_dev)
    by_vectors = hidden % (reference.VEC_BYTES // WIDTH[dtype]) == 0 and all(
        t.data_ptr() % reference.VEC_BYTES == 0 for t in arrays if t is not None)
    want_n, want_r = expected_add_rmsnorm(launches, inputs, res, b, weight, eps, by_vectors)
    reference.assert_same_bits(host(got_r), want_r, f"residual_out ({ran(launches)})")
    reference.assert_same_bits(host(got_n), want_n, f"normed ({ran(launches)})")
    for buf, what in ((x, "x"), (rb, "residual"), (out, "out"), (rout, "residual_out")):
        if buf is not None:
            buf.assert_intact(f"all_reduce_add_rmsnorm ({what})")
    reference.assert_same_bits(host(x.view), inputs[comm.rank], "all_reduce_add_rmsnorm modified x")
    if rb is not None and rout is not rb:
        reference.assert_same_bits(host(rb.view), res, "all_reduce_add_rmsnorm modified residual")
    return got_n, got_r


def cuda_core_api() -> tuple:
    """cuda.core's ``Device`` and ``StridedMemoryView`` (from ``cuda.core``, or in older
    releases ``cuda.core.experimental``); skips where the package is missing or its view
    is no DLPack producer."""
    pytest.importorskip("cuda.core")
    try:
        from cuda.core import Device
        from cuda.core.utils import StridedMemoryView
    except ImportError:
        try:
            from cuda.core.experimental import Device
            from cuda.core.experimental.utils import StridedMemoryView
        except ImportError as e:
            pytest.skip(f"this cuda.core has no Device/StridedMemoryView ({e})")
    if not hasattr(StridedMemoryView, "from_buffer") or not hasattr(StridedMemoryView, "__dlpack__"):
        pytest.skip("this cuda.core's StridedMemoryView is no DLPack producer (from_buffer, __dlpack__)")
    return Device, StridedMemoryView


def jax_gpu_devices(device: int) -> tuple:
    """(JAX's first GPU, JAX's device of CUDA ordinal ``device``); skips where JAX, its GPU
    backend or that device is missing."""
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        pytest.skip(f"jax has no GPU backend here ({e})")
    mine = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == device]
    if not mine:
        pytest.skip(f"jax does not see device {device} (it sees {gpus})")
    return gpus[0], mine[0]

