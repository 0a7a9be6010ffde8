"""Host reference of ubnext's kernel arithmetic, bit for bit (numpy and ml_dtypes only).

The bits a kernel stores are a function of its inputs and of the order and precision in
which it combines them. Each function here computes them in the kernels' own order and
rounding, so that the GPU tests and ``python -m ubnext selftest`` compare every output
element bit for bit (``assert_same_bits``) instead of within a tolerance. Read from the
kernel sources:

* Elements are widened to fp32 exactly (``Elem<T>::load``), combined in fp32 and rounded
  once to their dtype, to nearest even (``cvt.rn``), after ``Op::finish``: avg divides the
  fp32 sum by ``(float)N`` (IEEE division); max and min are ``fmaxf`` / ``fminf``, which
  return the other operand where one is NaN, like ``np.fmax`` / ``np.fmin``
  (kernels/common.cuh: ``reduce_vectors``). The sign of max/min of +0.0 and -0.0 is not
  specified for ``fmaxf``: inputs meant for exact checks hold no +0.0.
* Lamport one-shot (kernels/lamport.cu): every input's -0.0 elements are pushed as +0.0
  (kernels/lamport.cuh: ``clear_sentinel``); every rank reduces in rank order 0..N-1.
* Lamport two-shot (kernels/lamport_twoshot.cu): the same, and the owner clears the
  reduced result of -0.0 again before it stores it everywhere (step 3).
* Barrier two-shot (kernels/twoshot.cu): nothing is cleared; vector i of a launch of
  ``nvec`` vectors belongs to rank ``o = i // ceil(nvec / N)``, which reduces it in the
  order o, o+1, ..., N-1, 0, ..., o-1 (kernels/transport.cuh: ``Unicast::peer``). A
  message in several launches (the staging slot's chunks) is sliced launch by launch.
  It alone also takes the ``TWOSHOT_ONLY`` dtypes, each in its ``accumulator``: float64
  in float64 (``fmax``/``fmin``; avg divides the sum once by N), integers in their own
  type, a sum wrapping around modulo 2**bits (any order gives the same bits).
* Residual add + RMSNorm (kernels/rmsnorm.cuh, ``add_rmsnorm``): from the all-reduced
  rows ``a`` as stored, ``res = round((a + bias) + residual)`` (missing operands read as
  +0.0), the row's sum of squares of ``res`` in the kernels' tree (``row_sums``),
  ``scale = 1 / sqrt(sumsq / hidden + eps)`` with every step rounded (``rms_scale``) and
  ``normed = round((res * scale) * weight)``.
* Quantized two-shot (kernels/quant_twoshot.cu, opt-in): groups quantized, dequantized,
  added in rank order 0..N-1 in fp32, quantized once, dequantized and rounded once; its
  reduce-scatter stops after the sum, rounded once; the arithmetic is stated and emulated
  in ubnext/_protocol/quant.py (``quantized``, ``quantized_reduce_scatter``).
* NCCL reduces in an order of its own: ``exact`` predicts its bits only for inputs whose
  every partial result is exact, where any order gives the same bits.
* NCCL reduces the ``TWOSHOT_ONLY`` dtypes as the barrier two-shot does (``integer``:
  every order gives the same bits; float64 in float64, ``exact`` on exact inputs). Its
  float64 average multiplies every input by 1/N before it adds them (NCCL's PreMulSum),
  where ubnext's kernels divide the sum once: the same bits wherever N is a power of two
  (a scaling by 2**-k commutes with rounding, barring underflow) and the order is the same.

NaN payloads are not specified: a NaN is compared as a class (any NaN equals any NaN);
every other value, -0.0 against +0.0 included, must match bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from ubnext._protocol import quant as _quant
from ubnext._protocol.constants import SENTINEL_BITS, VEC_BYTES

#: ubnext's dtype names -> numpy dtypes
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
          "float32": np.dtype(np.float32)}
#: the dtypes that among ubnext's kernels only the barrier two-shot reduces
#: (ubnext._protocol.algorithms.TWOSHOT_ONLY_DTYPES): float64 and the 8-, 32- and 64-bit integers
TWOSHOT_ONLY = {name: np.dtype(name) for name in ("float64", "int8", "uint8", "int32", "uint32", "int64", "uint64")}
#: every dtype name of ubnext -> its numpy dtype
ALL_DTYPES = {**DTYPES, **TWOSHOT_ONLY}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_F32 = np.float32
#: values whose sums ``exact`` predicts in any order are multiples of this
EXACT_QUANTUM = 0.5


# ---- element types ---------------------------------------------------------------------
def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of ``a`` (an unsigned integer view of the same width)."""
    return a.view(_UINT[a.dtype.itemsize])


def widen(a: np.ndarray) -> np.ndarray:
    """``a`` (a dtype of ``DTYPES``) in fp32, exactly (each is a subset of fp32)."""
    return a.astype(np.float32)


def accumulator(dtype: np.dtype) -> np.dtype:
    """The type the kernels reduce ``dtype`` in (kernels/common.cuh: ``Elem<T>::Acc``):
    fp32 for ``DTYPES``, the dtype itself for ``TWOSHOT_ONLY``."""
    return np.dtype(np.float32) if dtype in DTYPES.values() else np.dtype(dtype)


def narrow(f: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """fp32 values rounded to ``dtype``, to nearest even (``cvt.rn``; overflow gives inf)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(f, np.float32).astype(dtype)


def clear_negative_zero(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` with every -0.0 (the Lamport sentinel) replaced by +0.0
    (kernels/common.cuh: ``clear_sentinel``, ``settle``); integers unchanged."""
    if a.dtype.kind in "iu":
        return a.copy()
    b = bits(a)
    zero = b.dtype.type(0)
    negative_zero = SENTINEL_BITS.get(a.dtype.itemsize, 1 << (8 * a.dtype.itemsize - 1))
    return np.where(b == negative_zero, zero, b).view(a.dtype)


def nan_mask(a: np.ndarray) -> np.ndarray:
    """Where ``a`` is NaN, read from its bits (exponent all ones, fraction not zero);
    nowhere for integers."""
    if a.dtype.kind in "iu":
        return np.zeros(a.shape, bool)
    b = bits(a)
    sign = b.dtype.type(1 << (8 * a.dtype.itemsize - 1))
    inf = bits(np.array(np.inf, a.dtype))
    return (b & ~sign) > inf


def order_probe(dtype: str, rank: int) -> float:
    """An input value at which the reduction order shows in every dtype, not only fp32
    (sums of a few random 16-bit values are exact in fp32, so their order hardly ever
    changes the result): +B on rank 0, -B on rank 1, a small value s on the others. In rank
    order B - B cancels first and the small values add up exactly; an order that adds a
    small value to +-B first loses it (fp32's spacing at B is over twice any sum of them)."""
    big, small = (2.0**15, 2.0**-12) if dtype == "float16" else (2.0**30, 1.0)
    return big if rank == 0 else -big if rank == 1 else small * (1 + rank / 8)


# ---- all-reduce ------------------------------------------------------------------------
_COMBINE = {"sum": np.add, "avg": np.add, "max": np.fmax, "min": np.fmin}


def reduce_fp32(parts: Sequence[np.ndarray], op: str, order: Sequence[int]) -> np.ndarray:
    """``parts`` (one array per rank in its ``accumulator`` type: fp32, float64 or an
    integer type) combined in ``order`` and finished, as ``reduce_vectors`` does
    (kernels/common.cuh): avg divides the sum by the rank count; integer sums wrap around."""
    combine = _COMBINE[op]
    acc = parts[order[0]]
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, overflow: IEEE results
        for r in order[1:]:
            acc = combine(acc, parts[r])
        if op == "avg":
            acc = acc / acc.dtype.type(len(parts))
    return acc


def owner_order(owner: int, nranks: int) -> list[int]:
    """The ranks in the order in which ``owner`` visits them (kernels/transport.cuh:
    ``Unicast::peer``): itself first, then the next ones, wrapping around."""
    return [(owner + k) % nranks for k in range(nranks)]


#: elements reduced at a time: fp32 temporaries of this size stay cheap to allocate and in cache
_BLOCK = 1 << 20


def _reduce_owned(inputs: Sequence[np.ndarray], op: str, owners, clear: bool = False) -> np.ndarray:
    """Flat ``inputs`` reduced range by range: ``owners`` is (owner, start, end) of ranges
    that cover the message, each reduced in its owner's order. ``clear``: -0.0 in the
    inputs is pushed as +0.0 (the Lamport kernels)."""
    out = np.empty(inputs[0].size, inputs[0].dtype)
    acc = accumulator(out.dtype)
    covered = 0
    for owner, start, end in owners:
        order = owner_order(owner, len(inputs))
        for lo in range(start, end, _BLOCK):
            hi = min(lo + _BLOCK, end)
            parts = [(clear_negative_zero(x[lo:hi]) if clear else x[lo:hi]).astype(acc) for x in inputs]
            with np.errstate(invalid="ignore", over="ignore"):
                out[lo:hi] = reduce_fp32(parts, op, order).astype(out.dtype)  # to nearest even
        covered += end - start
    if covered != out.size:
        raise ValueError(f"reference: the owners' ranges cover {covered} of {out.size} elements")
    return out


def _flat(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    shapes = {x.shape for x in inputs}
    dtypes = {x.dtype for x in inputs}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"reference: every rank's input must have one shape and dtype, got {shapes} {dtypes}")
    return [x.reshape(-1) for x in inputs]


def lamport(inputs: Sequence[np.ndarray], op: str = "sum") -> np.ndarray:
    """What the Lamport one-shot stores: -0.0 pushed as +0.0, rank order 0..N-1.

    Args:
        inputs: every rank's input, in rank order (one shape, one dtype of ``DTYPES``).
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    Returns:
        The result, with the inputs' shape and dtype.
    """
    flat = _flat(inputs)
    return _reduce_owned(flat, op, [(0, 0, flat[0].size)], clear=True).reshape(inputs[0].shape)


def lamport_twoshot(inputs: Sequence[np.ndarray], op: str = "sum") -> np.ndarray:
    """What the Lamport two-shot stores: the one-shot's result, cleared of -0.0 again."""
    return clear_negative_zero(lamport(inputs, op))


def owner_ranges(count: int, itemsize: int, nranks: int) -> list[tuple[int, int, int]]:
    """(owner, first element, end) of every rank's slice of a barrier two-shot launch of
    ``count`` elements: slices of ceil(nvec / N) 16-byte vectors (kernels/twoshot.cu)."""
    per = VEC_BYTES // itemsize
    nvec = -(-count // per)
    slice_vecs = -(-nvec // nranks)
    ranges = [(o, o * slice_vecs * per, min((o + 1) * slice_vecs * per, count)) for o in range(nranks)]
    return [(o, lo, hi) for o, lo, hi in ranges if lo < hi]


def twoshot(inputs: Sequence[np.ndarray], op: str = "sum", launches: Sequence[int] | None = None) -> np.ndarray:
    """What the barrier two-shot stores: each slice reduced in its owner's order, no clearing.

    Args:
        inputs: every rank's input, in rank order.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        launches: elements of each launch in message order (the staging slot's chunks);
            default one launch of everything.

    Raises:
        ValueError: the launches do not add up to the message.
    """
    flat = _flat(inputs)
    count = flat[0].size
    launches = [count] if launches is None else list(launches)
    if sum(launches) != count:
        raise ValueError(f"reference: launches of {sum(launches)} elements for a message of {count}")
    owners, start = [], 0
    for n in launches:
        owners += [(o, start + lo, start + hi) for o, lo, hi in owner_ranges(n, flat[0].itemsize, len(flat))]
        start += n
    return _reduce_owned(flat, op, owners).reshape(inputs[0].shape)


#: all-reduce algorithm -> its reference
ALL_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "lamport": lamport, "lamport_twoshot": lamport_twoshot, "twoshot": twoshot}


def all_reduce(algorithm: str, inputs: Sequence[np.ndarray], op: str = "sum",
               launches: Sequence[int] | None = None) -> np.ndarray:
    """What ``algorithm``'s kernel stores (``launches``: elements per launch; only the
    barrier two-shot's order depends on them)."""
    if algorithm == "twoshot":
        return twoshot(inputs, op, launches)
    return ALL_REDUCE[algorithm](inputs, op)


def quantized(inputs: Sequence[np.ndarray], fmt: str, op: str = "sum") -> np.ndarray:
    """What the quantized two-shot in ``fmt`` stores on every rank (``_quant.all_reduce``;
    launches of whole groups do not change it)."""
    return _quant.all_reduce(inputs, fmt, op)


def quantized_reduce_scatter(inputs: Sequence[np.ndarray], fmt: str, op: str = "sum") -> list[np.ndarray]:
    """What the quantized reduce-scatter in ``fmt`` stores on each rank, in rank order
    (``_quant.reduce_scatter``; launches of whole units of every slice do not change it)."""
    return _quant.reduce_scatter(inputs, fmt, op)


# ---- reduce-scatter and all-gather ------------------------------------------------------
def reduce_scatter(algorithm: str, inputs: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """What ``algorithm``'s reduce-scatter stores on every rank (kernels/lamport_twoshot.cu,
    kernels/twoshot.cu): rank r's k elements are elements [r * k, (r + 1) * k) of the
    reduction, reduced by the Lamport two-shot in rank order with -0.0 pushed and stored as
    +0.0, by the barrier two-shot in rank r's order (``owner_order``), nothing cleared.

    Args:
        algorithm: ``"lamport_twoshot"`` or ``"twoshot"``.
        inputs: every rank's input (size x k elements), in rank order.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    Returns:
        Every rank's output (k elements, flat), in rank order.
    """
    flat = _flat(inputs)
    n = len(flat)
    k = flat[0].size // n
    pushed = algorithm == "lamport_twoshot"
    owners = [(0 if pushed else r, r * k, (r + 1) * k) for r in range(n)]
    reduced = _reduce_owned(flat, op, owners, clear=pushed)
    if pushed:
        reduced = clear_negative_zero(reduced)
    return [reduced[r * k:(r + 1) * k] for r in range(n)]


def all_gather(algorithm: str, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """What ``algorithm``'s all-gather stores on every rank: every rank's input in rank
    order, with -0.0 as +0.0 where the Lamport two-shot pushes it (``"lamport_twoshot"``);
    the barrier two-shot and NCCL copy the bits."""
    gathered = np.concatenate(_flat(inputs))
    return clear_negative_zero(gathered) if algorithm == "lamport_twoshot" else gathered


def exact(inputs: Sequence[np.ndarray], op: str = "sum") -> np.ndarray:
    """The result of any reduction order (NCCL's included) for inputs where every order
    gives the same bits: finite, nonzero multiples of EXACT_QUANTUM whose absolute sum
    fits the dtype's precision (so every partial sum is exact); for avg, a power-of-two
    rank count (the quotient is then exact too).

    Raises:
        ValueError: the inputs are not of that kind (no order-free result exists).
    """
    flat = _flat(inputs)
    dtype, nranks = flat[0].dtype, len(flat)
    digits = ml_dtypes.finfo(dtype).nmant + 1
    total = np.zeros(flat[0].size, np.float64)
    acc = None
    for x in flat:
        f = x.astype(np.float64)  # exact
        if not (np.isfinite(f).all() and (f != 0).all() and (f / EXACT_QUANTUM == np.round(f / EXACT_QUANTUM)).all()):
            raise ValueError("reference.exact: inputs must be finite nonzero multiples of "
                             f"{EXACT_QUANTUM} (no reduction order is implied for others)")
        total += np.abs(f)
        acc = f if acc is None else (acc + f if op in ("sum", "avg") else _COMBINE[op](acc, f))
    if (total > EXACT_QUANTUM * 2.0**digits).any():
        raise ValueError(f"reference.exact: sums of up to {total.max()} leave {dtype}'s precision")
    if op == "avg":
        if nranks & (nranks - 1):
            raise ValueError(f"reference.exact: avg over {nranks} ranks (not a power of two) is not exact")
        acc = acc / nranks
    if dtype.itemsize < 8:  # through fp32, as ml_dtypes narrows from it
        acc = acc.astype(np.float32)
    return acc.astype(dtype).reshape(inputs[0].shape)


_INTEGER_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def integer(inputs: Sequence[np.ndarray], op: str = "sum") -> np.ndarray:
    """An integer all-reduce as NCCL computes it: in the inputs' own type, a sum wrapping
    around modulo 2**bits (so every order gives the same bits), max and min exactly. No
    avg (``ubnext._protocol.algorithms.op_problem``)."""
    flat = _flat(inputs)
    if flat[0].dtype.kind not in "iu" or op not in _INTEGER_COMBINE:
        raise ValueError(f"reference.integer: {flat[0].dtype} with op {op!r}")
    acc = flat[0].copy()
    for x in flat[1:]:
        _INTEGER_COMBINE[op](acc, x, out=acc)  # in the dtype: wraps, no warning
    return acc.reshape(inputs[0].shape)


# ---- residual add + RMSNorm --------------------------------------------------------------
def fma32(a, b, c) -> np.ndarray:
    """``fma.rn.f32``: ``a * b + c`` (fp32 arrays) rounded once to fp32, exactly.

    The product is exact in fp64 (24 + 24 bits); the sum is rounded to odd in fp64 (53 >=
    24 + 2 bits) from its exact error (TwoSum), which makes the final rounding to fp32 the
    only one (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums").
    """
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
        c = np.asarray(c, np.float64)
        s = p + c
        z = s - p
        err = (p - (s - z)) + (c - z)
        inexact = np.isfinite(s) & (err != 0) & ((np.asarray(s).view(np.int64) & 1) == 0)
        s = np.where(inexact, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def vector_squares(res: np.ndarray) -> np.ndarray:
    """Per 16-byte vector of rows ``res`` (fp32 values of elements of ``itemsize`` bytes,
    shape rows x vectors x elements per vector): ``sum_squares`` of kernels/rmsnorm.cuh,
    ``s = fma(f, f, s)`` over the vector's elements from ``s = 0``."""
    s = np.zeros(res.shape[:-1], np.float32)
    for e in range(res.shape[-1]):
        s = fma32(res[..., e], res[..., e], s)
    return s


def per_thread(terms: np.ndarray, threads: int, step: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """Each thread's running value over the terms of its row (rows x terms): term j goes to
    thread j % threads, in increasing j, ``acc = step(acc, term)`` from ``acc = +0.0``.
    Threads with fewer terms see +0.0 ones, which leave a non-negative value unchanged."""
    rows, m = terms.shape
    k = -(-m // threads)
    padded = np.zeros((rows, k * threads), np.float32)
    padded[:, :m] = terms
    padded = padded.reshape(rows, k, threads)
    acc = np.zeros((rows, threads), np.float32)
    for j in range(k):
        acc = step(acc, padded[:, j])
    return acc


def _butterfly(lanes: np.ndarray) -> np.ndarray:
    """A warp's ``v += __shfl_xor_sync(v, o)`` for o = 16, 8, 4, 2, 1 over the last axis
    (32 lanes); every lane ends with the same value, which is returned."""
    index = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[..., index ^ o]
    return lanes[..., 0]


def row_sums(partials: np.ndarray) -> np.ndarray:
    """``row_sum`` of kernels/rmsnorm.cuh over a row group of G threads (rows x G, thread
    t = the group's thread rank * block threads + threadIdx.x): each warp's butterfly, then
    lane l of a warp takes warp total l (+0.0 past the group's warps) and a second
    butterfly adds them. Only G matters: a cluster's blocks number their warps in turn."""
    rows, group = partials.shape
    if group % 32 or not 32 <= group <= 1024:
        raise ValueError(f"reference: a row group has 32..1024 threads in whole warps, got {group}")
    warps = _butterfly(partials.reshape(rows, group // 32, 32))
    lanes = np.zeros((rows, 32), np.float32)
    lanes[:, :group // 32] = warps
    return _butterfly(lanes)


def rms_scale(sumsq: np.ndarray, hidden: int, eps: float) -> np.ndarray:
    """``1 / sqrt(sumsq / hidden + eps)``, each step rounded to nearest fp32 (IEEE division,
    square root and reciprocal: kernels/rmsnorm.cuh ``rms_scale``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _F32(1) / np.sqrt(sumsq / _F32(hidden) + _F32(eps))


def add_rmsnorm(ar: np.ndarray, residual: np.ndarray | None, bias: np.ndarray | None, weight: np.ndarray,
                eps: float, group_threads: int, by_vectors: bool = True, clear: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """The residual add + RMSNorm epilogue of rows ``ar`` (all-reduced, as stored).

    Args:
        ar: rows x hidden, a dtype of ``DTYPES``.
        residual: rows x hidden, or None (reads as +0.0).
        bias: hidden elements, or None (reads as +0.0).
        weight: hidden elements.
        eps: as passed to the kernel (rounded to fp32).
        group_threads: threads of the row group that finishes a row (a block's threads
            times the blocks of its cluster).
        by_vectors: rows move as 16-byte vectors (every fused kernel; the separate kernel
            when hidden is a multiple of the vector width and every array is aligned): a
            thread adds each vector's ``sum_squares``; otherwise (the separate kernel's
            element path) it accumulates ``fma(x, x, ss)`` element by element.
        clear: the residual sums are cleared of -0.0 before they are stored and normalized
            (the fused Lamport two-shot pushes them as Lamport data).

    Returns:
        ``(normed, residual_out)``, both rows x hidden in ar's dtype.
    """
    dtype = ar.dtype
    rows, hidden = ar.shape
    b = _F32(0) if bias is None else widen(bias)
    r = _F32(0) if residual is None else widen(residual)
    with np.errstate(invalid="ignore", over="ignore"):
        res = narrow((widen(ar) + b) + r, dtype)
    if clear:
        res = clear_negative_zero(res)
    f = widen(res)
    if by_vectors:
        per = VEC_BYTES // dtype.itemsize
        terms = vector_squares(f.reshape(rows, hidden // per, per))
        partials = per_thread(terms, group_threads, np.add)
    else:
        partials = per_thread(f, group_threads, lambda acc, x: fma32(x, x, acc))
    scale = rms_scale(row_sums(partials), hidden, eps)
    with np.errstate(invalid="ignore", over="ignore"):
        normed = narrow((f * scale[:, None]) * widen(weight), dtype)
    return normed, res


#: the algorithms with a fused all-reduce + residual add + RMSNorm kernel
FUSED = ("lamport", "lamport_twoshot", "twoshot")


def fused(algorithm: str, inputs: Sequence[np.ndarray], residual: np.ndarray | None, bias: np.ndarray | None,
          weight: np.ndarray, eps: float, launches: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """What a fused all-reduce + residual add + RMSNorm kernel stores.

    The Lamport kernels reduce pushed (-0.0 cleared) rows in rank order; the fused Lamport
    two-shot clears the residual sums, which it pushes, of -0.0. The barrier two-shot's
    rank r reduces rows [r * rpr, (r + 1) * rpr) of a launch (rpr = ceil(rows / N)) in its
    order, with nothing cleared.

    Args:
        algorithm: ``"lamport"``, ``"lamport_twoshot"`` or ``"twoshot"``.
        inputs: every rank's rows x hidden.
        residual, bias, weight, eps: as for ``add_rmsnorm``.
        launches: (rows, row group threads) of each launch, in row order.

    Returns:
        ``(normed, residual_out)``.
    """
    if algorithm not in FUSED:
        raise ValueError(f"reference: no fused kernel {algorithm!r}")
    rows, hidden = inputs[0].shape
    nranks = len(inputs)
    if sum(n for n, _ in launches) != rows:
        raise ValueError(f"reference: launches of {sum(n for n, _ in launches)} rows for {rows}")
    normed, res = np.empty_like(inputs[0]), np.empty_like(inputs[0])
    first = 0
    for n, group_threads in launches:
        rows_of = slice(first, first + n)
        part = [x[rows_of] for x in inputs]
        if algorithm == "twoshot":
            rpr = -(-n // nranks)
            owners = [(o, o * rpr * hidden, min((o + 1) * rpr, n) * hidden) for o in range(nranks) if o * rpr < n]
            ar = _reduce_owned(_flat(part), "sum", owners).reshape(n, hidden)
        else:
            ar = lamport(part, "sum")
        normed[rows_of], res[rows_of] = add_rmsnorm(
            ar, None if residual is None else residual[rows_of], bias, weight, eps, group_threads,
            clear=algorithm == "lamport_twoshot")
        first += n
    return normed, res


# ---- comparison --------------------------------------------------------------------------
def mismatches(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Flat indices where ``got`` differs from ``want``: bits differ, unless both are NaN."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"reference: comparing {got.dtype}{got.shape} with {want.dtype}{want.shape}")
    g, w = got.reshape(-1), want.reshape(-1)
    return np.flatnonzero((bits(g) != bits(w)) & ~(nan_mask(g) & nan_mask(w)))


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "result") -> None:
    """Every element of ``got`` has the bits of ``want`` (NaN as a class).

    Raises:
        AssertionError: naming how many elements differ and the first few, with bits.
    """
    bad = mismatches(got, want)
    if bad.size:
        g, w = got.reshape(-1), want.reshape(-1)
        width = 2 * got.dtype.itemsize
        shown = "; ".join(f"[{i}] got {g[i]} ({int(bits(g[i:i + 1])[0]):0{width}x}) "
                          f"want {w[i]} ({int(bits(w[i:i + 1])[0]):0{width}x})" for i in bad[:5])
        raise AssertionError(f"{what}: {bad.size} of {g.size} elements differ from the reference: {shown}")
