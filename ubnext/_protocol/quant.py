"""Quantized all-reduce (opt-in): the formats, their exact arithmetic, and its error bound.

The quantized two-shot (kernels/quant_twoshot.cu) moves each group of GROUP elements as
GROUP codes (one byte each in int8 and fp8, half a byte in int4) and one fp32 scale. The
arithmetic, which the kernel and the host emulation here compute alike, bit for bit (fp32
throughout, IEEE round to nearest even, no fused multiply-add):

* quantize a group ``x`` (fp32): ``amax = max |x|``; ``scale = amax / QMAX`` (fp32
  division); if any element is NaN or infinite, ``scale = NaN``. Where ``scale > 0``:
  ``y = min(max(x * inv, -QMAX), QMAX)`` with ``inv = 1 / scale`` (fp32 division once per
  group, one fp32 product per element; for a scale below fp32's normal range, whose
  reciprocal may overflow, ``x / scale`` instead) and the code is ``y`` rounded
  to the format: int8 and int4 ``rint(y)`` (ties to even), fp8 the e4m3 value nearest
  ``y`` (ties to even). Elsewhere (a group of zeros, a scale that underflows to 0, or a
  NaN scale) every code is 0.
* dequantize: ``code * scale`` (the code widened exactly to fp32, one fp32 product).
  A group with a NaN or infinity thus comes out as NaN, every element of it.
* the all-reduce of a group: every rank's group quantized and dequantized; the owner
  adds them in rank order 0..N-1 in fp32 (starting from rank 0's value), divides by N
  for ``avg``, quantizes the sum once, and every rank dequantizes that and rounds it to
  the input dtype once (to nearest even). A message's last group is padded with zeros.
* the reduce-scatter (its first half): the groups of each rank's slice r (grouped from
  the slice's start, its last group padded with zeros) quantized and dequantized, added
  in rank order in fp32 by rank r, divided by N for ``avg``, and the sum rounded once to
  the input dtype: rank r's output, not requantized.
* overflow, one rule for both: a group whose fp32 sum in rank order overflows (bfloat16
  inputs near fp32's top) is NaN throughout, as a group holding a NaN or infinity is
  (the all-reduce's requantization of it has a NaN scale; the reduce-scatter makes the
  group NaN before rounding it). A finite fp32 result beyond the output dtype's range
  (float16 past 65504) rounds to +-inf, that element only, in both. An overflow is thus
  never silent: it comes out NaN or inf, which a loss scaler's check for non-finite
  gradients sees.

The error bound (:func:`bound`) is stated per group, relative to ``M``, the sum over the
ranks of each rank's largest magnitude in the group (divided by N for ``avg``): every
element of a group's result differs from the exact (fp64) reduction of the inputs by at
most ``bound * M``. Its derivation is next to the function; bench/quant_error.py measures
it on random and heavy-tailed data (bench/results/quant_error.txt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ubnext._protocol.algorithms import compile_defines as _base_defines
from ubnext._protocol.constants import QUANT_GROUP, QUANT_UNIT_GROUPS, THREADS
from ubnext._protocol.errors import UbnextError
from ubnext._protocol.signature import COUNT_BITS

#: the kernel source
SOURCE = "quant_twoshot.cu"
#: collective -> its entry point in SOURCE: the all-reduce, and the reduce-scatter alone
ENTRIES = {"all_reduce": "ub_quant_twoshot", "reduce_scatter": "ub_quant_twoshot_rs"}
#: the collectives that take ``precision=`` (the all-gather reduces nothing: it stays exact)
COLLECTIVES = tuple(ENTRIES)
#: elements per group (one scale each)
GROUP = QUANT_GROUP
#: groups per unit: a warp's work and one record in the receive areas (its codes, then
#: its scales: kernels/quant.cuh)
UNIT_GROUPS = QUANT_UNIT_GROUPS
#: elements per unit
UNIT = GROUP * UNIT_GROUPS
#: bytes of a group's scale (fp32)
SCALE_BYTES = 4
#: the input dtypes the quantized all-reduce takes, and the ops
DTYPES = ("bfloat16", "float16")
OPS = ("sum", "avg")
#: precision values besides the formats: the communicator's choice, and full precision
AUTO, EXACT = "auto", "exact"
#: 16-bit input bytes that one launch takes: the quantized receive areas are sized for it
#: (quant_area_bytes); larger messages run in launches of this size (a reduce-scatter's:
#: of at most this many bytes over all its slices, slice_launch_elems)
LAUNCH_BYTES = 32 << 20
#: units of a slice that one block takes at least: one per warp of a block (a warp takes
#: a unit at a time), so short messages spread over many SMs
BLOCK_UNITS = THREADS[SOURCE] // 32
#: unit roundoff of the output dtypes (half an ulp, relative)
_UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
#: half of float16's subnormal spacing: the absolute error of rounding a tiny value to it
_ABS = {"bfloat16": 0.0, "float16": 2.0**-25}
_F32 = np.float32
#: the least normal fp32 (2^-126): a scale from here on has a finite reciprocal
_F32_MIN = np.finfo(np.float32).tiny


@dataclass(frozen=True)
class Format:
    """One quantized format.

    Attributes:
        name: the ``precision=`` value and ``UBNEXT_QUANTIZED`` value.
        kernel: the codec struct of kernels/quant.cuh (compiled in as UB_QFMT).
        bits: bits of a code (the codec's kBits; the kernel checks its record size against
            :func:`record_bytes`, passed as UB_QRECORD_BYTES).
        qmax: the largest code magnitude (the group's largest magnitude maps to it).
        step: the largest rounding error of one quantization, relative to the group's
            largest magnitude: an integer format half a code (int8 0.5 / 127, int4 0.5 / 7:
            its codes are 1/7 of the magnitude apart); e4m3 half the spacing of the codes
            just below 448 (16 / 448).
        min_arch: the least compute capability that converts to it in hardware.
        floating: codes are e4m3 values, else integers.
    """

    name: str
    kernel: str
    bits: int
    qmax: float
    step: float
    min_arch: int
    floating: bool = False

    def encode(self, y: np.ndarray) -> np.ndarray:
        """fp32 values ``y`` (already within +-qmax) rounded to codes, as fp32 values."""
        if self.floating:
            return y.astype(ml_dtypes.float8_e4m3fn).astype(_F32)
        return np.rint(y).astype(np.int8).astype(_F32)  # through int8: a code of -0.0 is +0


#: format name -> Format; the order numbers the formats in call signatures (:func:`signature`)
FORMATS = {f.name: f for f in (Format("int8", "QInt8", 8, 127.0, 0.5 / 127, 0),
                                Format("fp8", "QFp8", 8, 448.0, 16.0 / 448, 89, floating=True),
                                Format("int4", "QInt4", 4, 7.0, 0.5 / 7, 0))}
#: every value ``precision=`` takes
PRECISIONS = (AUTO, EXACT, *FORMATS)
#: the opt-in's values, for messages
_OPT_IN = "|".join(FORMATS)


def bytes_per_element(fmt: str) -> float:
    """Bytes that cross the links per element in ``fmt``: a code and a share of its scale."""
    return FORMATS[fmt].bits / 8 + SCALE_BYTES / GROUP


def record_bytes(fmt: str) -> int:
    """Bytes of a unit's record in ``fmt`` (kernels/quant.cuh, Record): UNIT codes, then
    UNIT_GROUPS scales; whole 128-byte lines."""
    return UNIT * FORMATS[fmt].bits // 8 + UNIT_GROUPS * SCALE_BYTES


def wire_fraction(fmt: str, dtype: str = "bfloat16") -> float:
    """The quantized two-shot's bytes over the full-precision two-shot's, per element."""
    return bytes_per_element(fmt) / {"bfloat16": 2, "float16": 2}[dtype]


def groups(count: int) -> int:
    """Groups of a message of ``count`` elements (the last one padded with zeros)."""
    return -(-count // GROUP)


def units(count: int) -> int:
    """Units of a message of ``count`` elements (the last one padded with zeros)."""
    return -(-count // UNIT)


def slice_launch_elems(nranks: int) -> int:
    """Elements of each of the N slices that one reduce-scatter launch takes: LAUNCH_BYTES
    of 16-bit input over the N slices, in whole units, so that every launch's groups are
    the slices' own (each slice is grouped from its start) and its slots fit those of an
    all-reduce launch (:func:`slots_bytes`)."""
    return LAUNCH_BYTES // 2 // nranks // UNIT * UNIT


def slots_bytes(nranks: int) -> int:
    """Bytes of the reduce-scatter slots (kernels/quant_twoshot.cu: QuantAreas) of the
    largest launch in any format: N slots of S unit records each, S = ceil(units / N) for
    a launch of LAUNCH_BYTES. They start the quantized receive areas; the all-gather area
    (:func:`gather_bytes`) follows at this offset, apart from the slots of every launch,
    which a peer's next launch fills while other ranks may still load this rank's
    all-gather area (the all-gather is by loads)."""
    return nranks * gather_bytes(nranks)


def gather_bytes(nranks: int) -> int:
    """Bytes of a rank's all-gather area: the S unit records of its own slice of the
    largest launch in any format (the all-gather is by loads: each rank stores only its
    own slice, which every rank then loads from it)."""
    slice_units = -(-units(LAUNCH_BYTES // 2) // nranks)
    return max(slice_units * record_bytes(f) for f in FORMATS)


def quant_area_bytes(nranks: int, setting: str) -> int:
    """The pool bytes of the quantized receive areas of a communicator whose
    ``Config.quantized`` is ``setting``: none where it is ``"off"``, else the slots and the
    all-gather area of a launch in any format (``precision=`` picks one per call):
    :func:`slots_bytes` + :func:`gather_bytes` (18 MiB + 18 / N MiB)."""
    return 0 if setting == "off" else slots_bytes(nranks) + gather_bytes(nranks)


def compile_defines(fmt: str, dtype: str, op: str, nranks: int) -> dict[str, str]:
    """Preprocessor definitions of an instantiation of kernels/quant_twoshot.cu."""
    return {**_base_defines(dtype, op, nranks), "UB_QFMT": FORMATS[fmt].kernel,
            "UB_QRECORD_BYTES": str(record_bytes(fmt))}


# ---- opt-in ------------------------------------------------------------------------------
def choose(name: str, precision: str, algorithm: str, dtype: str, op: str, nbytes: int, threshold: int | None,
           setting: str, kernels: bool, arch: Callable[[], int]) -> str | None:
    """The format a call runs in, or None for full precision. Pure.

    ``precision="auto"`` quantizes only where the communicator opted in (``setting``,
    ``Config.quantized``, is a format) and the call is one the quantized two-shot takes
    (``algorithm="auto"``, a dtype of DTYPES, an op of OPS, kernels on the pool) where it
    was measured to pay: ``nbytes`` at least ``threshold``, the selector table's size for
    this machine, world size, dtype and format (``Selector.quantized``: None where it
    never pays, was not measured, or at one rank); every other call keeps full precision.
    Every rank decides alike (the same call and the same agreed table everywhere).
    ``"exact"`` never quantizes; a format name asks for that format and raises where the
    call cannot have it.

    Args:
        name: the calling operation, for messages.
        precision: one of PRECISIONS.
        algorithm: the call's ``algorithm=``.
        dtype, op: the call's.
        nbytes: the message's bytes.
        threshold: the smallest message ``auto`` quantizes in ``setting``'s format for
            ``dtype``, or None: never.
        setting: ``Config.quantized``.
        kernels: whether the communicator runs kernels on a symmetric pool.
        arch: returns the device's compute capability (e.g. 90); called only where a
            format is chosen.

    Raises:
        UbnextError: an unknown precision; a format that the call cannot take, or that
            the communicator did not opt in to, or fp8 on a device before sm_89.
    """
    if precision not in PRECISIONS:
        raise UbnextError(f"{name}: unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == EXACT:
        return None
    if precision == AUTO:
        if (setting == "off" or algorithm != "auto" or not kernels or dtype not in DTYPES or op not in OPS
                or threshold is None or nbytes < threshold):
            return None
        fmt = setting
    else:
        fmt = precision
        problem = (f"it takes {' and '.join(DTYPES)}, not {dtype}" if dtype not in DTYPES else
                   f"it takes op {' or '.join(OPS)}, not {op!r}" if op not in OPS else
                   f"it is its own algorithm: pass algorithm='auto', not {algorithm!r}" if algorithm != "auto" else
                   f"the communicator opted out: set UBNEXT_QUANTIZED={_OPT_IN} (or Communicator(quantized=...)) "
                   "to reserve its buffers" if setting == "off" else
                   "this communicator runs NCCL only" if not kernels else None)
        if problem:
            raise UbnextError(f"{name}: precision={fmt!r} runs the quantized two-shot, but {problem}")
    have = arch()
    if have < FORMATS[fmt].min_arch:
        raise UbnextError(f"{name}: precision {fmt!r} needs compute capability {FORMATS[fmt].min_arch / 10:.1f} "
                          f"or newer (this device: {have / 10:.1f}); use int8 or int4")
    return fmt


def check_opt_in(op: str, setting: str, archs) -> None:
    """Refuse an opt-in (``Config.quantized``) to a format that a GPU of the node cannot
    convert to (fp8 before sm_89), so that ``auto`` never chooses it there. Pure; every
    rank passes the same ``archs`` (every local rank's compute capability, e.g. 80, in
    local rank order) and raises alike.

    Raises:
        UbnextError: one line naming the setting, the first such GPU and the formats it runs.
    """
    fmt = FORMATS.get(setting)
    short = [(r, arch) for r, arch in enumerate(archs) if fmt is not None and arch < fmt.min_arch]
    if short:
        rank, arch = short[0]
        usable = " or ".join(f for f, q in FORMATS.items() if q.min_arch <= min(archs))
        raise UbnextError(f"{op}: UBNEXT_QUANTIZED={setting} needs compute capability {fmt.min_arch / 10:.1f} or "
                          f"newer on every GPU of the node (local rank {rank}'s: {arch / 10:.1f}); use {usable}")


#: bits of a call signature's count field (``_signature``) above which the format is carried
TAG_SHIFT = COUNT_BITS - 4


def signature(sig: int, fmt: str) -> int:
    """A quantized call's signature: the plain one (``_signature.encode``) with the format's
    number (1, 2, 3: FORMATS' order) in the top 4 bits of its count field, so that ranks
    calling with different formats (which share the kernel's flags and areas) fail with
    CollectiveMismatchError instead of mixing codes; counts stay far below 2**TAG_SHIFT
    elements."""
    return sig | (list(FORMATS).index(fmt) + 1) << TAG_SHIFT


#: how describe() names each collective's quantized kernel
_KERNEL_NAMES = {"all_reduce": "the quantized two-shot", "reduce_scatter": "the quantized reduce-scatter"}


def describe(setting: str, kernels: bool, starts: dict[str, dict[str, tuple[int | None, str]]]) -> str:
    """One line for ``describe()``: whether and where ``auto`` quantizes. ``starts``: collective
    of COLLECTIVES -> dtype of DTYPES -> ``Selector.quantized(setting, dtype, collective)``
    (used where ``setting`` is a format)."""
    if setting == "off":
        return (f"off: auto never quantizes (opt in with UBNEXT_QUANTIZED={_OPT_IN}; then precision= "
                "picks per call)")
    if not kernels:
        return f"{setting} requested, but this communicator runs NCCL only: every call keeps full precision"
    where = {c: "; ".join(f"{dtype} {why}" for dtype, (_, why) in by_dtype.items()) for c, by_dtype in starts.items()}
    return (f"{setting}: auto reduces {'/'.join(OPS)} in the quantized two-shot where the selector table "
            f"says it pays: {where['all_reduce']}; reduce-scatters where it says so for them: "
            f"{where['reduce_scatter']} ({wire_fraction(setting):.0%} of the bytes; error <= "
            f"{bound(setting, 'bfloat16', 8):.4f} x the group's magnitude for bfloat16, "
            f"{bound(setting, 'bfloat16', 8, 'reduce_scatter'):.4f} in a reduce-scatter); precision='exact' "
            f"keeps a call exact")


def selection_note(setting: str, kernels: bool, dtype: str, nbytes: int, start: tuple[int | None, str],
                   collective: str = "all_reduce") -> str:
    """What ``describe()`` adds to the reason of ``auto``'s choice for ``nbytes`` of ``dtype``
    in ``collective`` (of COLLECTIVES) where the communicator opted in: whether its sums and
    averages run quantized instead, and why (``start``: ``Selector.quantized(setting, dtype,
    collective)``)."""
    if setting == "off" or not kernels or dtype not in DTYPES:
        return ""
    threshold, why = start
    if threshold is not None and nbytes >= threshold:
        return f"; {' and '.join(OPS)} run {_KERNEL_NAMES[collective]} in {setting} instead ({setting} {why})"
    return f"; {' and '.join(OPS)} too ({setting} {why})"


# ---- host emulation, bit for bit ----------------------------------------------------------
def quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Groups ``x`` (fp32, shape (G, GROUP)) -> (codes as fp32 values, fp32 scales (G,))."""
    f = FORMATS[fmt]
    x = np.asarray(x, _F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(x), axis=1)
        scale = amax / _F32(f.qmax)
        scale = np.where(np.all(np.isfinite(x), axis=1), scale, _F32(np.nan)).astype(_F32)
        ok = scale > 0
        normal = scale >= _F32_MIN  # the reciprocal is finite: one product per element
        safe = np.where(ok, scale, _F32(1)).astype(_F32)[:, None]
        inv = (_F32(1) / safe).astype(_F32)
        y = np.where(normal[:, None], x * inv, x / safe).astype(_F32)
        y = np.where(ok[:, None], y, _F32(0)).astype(_F32)
        y = np.minimum(np.maximum(y, _F32(-f.qmax)), _F32(f.qmax))
    return f.encode(y), scale


def dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes * scale per group, one fp32 product."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (codes * scale[:, None]).astype(_F32)


def _round_trip(x: np.ndarray, fmt: str) -> np.ndarray:
    return dequantize(*quantize(x, fmt))


def _grouped(a: np.ndarray) -> np.ndarray:
    """A flat array widened to fp32 and padded with zeros to whole groups: (G, GROUP)."""
    flat = np.asarray(a).reshape(-1).astype(_F32)
    out = np.zeros(groups(flat.size) * GROUP, _F32)
    out[:flat.size] = flat
    return out.reshape(-1, GROUP)


def _sum(grouped, fmt: str, op: str) -> np.ndarray:
    """The owner's sum (both collectives' first half): every rank's groups (fp32, (G, GROUP)
    each, in rank order) quantized and dequantized, added in rank order in fp32, divided by
    N for ``avg``; a group holding an infinity (a sum that overflowed) or a NaN is NaN
    throughout (the overflow rule of both collectives)."""
    parts = [_round_trip(g, fmt) for g in grouped]
    acc = parts[0]
    with np.errstate(invalid="ignore", over="ignore"):
        for p in parts[1:]:
            acc = (acc + p).astype(_F32)
        if op == "avg":
            acc = (acc / _F32(len(parts))).astype(_F32)
    return np.where(np.isfinite(acc).all(axis=1)[:, None], acc, _F32(np.nan)).astype(_F32)


def all_reduce(inputs, fmt: str, op: str = "sum") -> np.ndarray:
    """The quantized all-reduce of ``inputs`` (one bfloat16/float16 array per rank, in rank
    order), as every rank's kernel computes it: quantize, dequantize, add in rank order
    in fp32, quantize once, dequantize, round to the dtype. Returns x's dtype and shape."""
    first = np.asarray(inputs[0])
    acc = _sum([_grouped(x) for x in inputs], fmt, op)
    with np.errstate(invalid="ignore", over="ignore"):
        out = _round_trip(acc, fmt).reshape(-1)[:first.size].astype(first.dtype)
    return out.reshape(first.shape)


def reduce_scatter(inputs, fmt: str, op: str = "sum") -> list[np.ndarray]:
    """The quantized reduce-scatter of ``inputs`` (one bfloat16/float16 array of N x k
    elements per rank, in rank order), as the kernel computes it: rank r's output is slice
    r (elements [r k, (r + 1) k)) of every rank's input, grouped from the slice's start,
    quantized, dequantized, added in rank order in fp32 (avg: divided by N) and rounded
    once to the dtype. Returns every rank's k elements (1-D, x's dtype), in rank order."""
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    n = len(flat)
    if flat[0].size % n:
        raise ValueError(f"quant.reduce_scatter: {flat[0].size} elements are not {n} slices")
    k = flat[0].size // n
    with np.errstate(invalid="ignore", over="ignore"):
        return [_sum([_grouped(x[r * k:(r + 1) * k]) for x in flat], fmt, op).reshape(-1)[:k].astype(flat[0].dtype)
                for r in range(n)]


# ---- the error bound ----------------------------------------------------------------------
def bound(fmt: str, dtype: str, nranks: int, collective: str = "all_reduce") -> float:
    """The largest error of the quantized all-reduce (or of ``collective``, a key of
    ENTRIES), per group, relative to ``M`` (the sum over ranks of each rank's largest
    magnitude in the group; for ``avg``, M / N), for groups of finite values whose sum
    does not overflow.

    With c = FORMATS[fmt].step and u the output dtype's unit roundoff: each rank's
    dequantized group is off by at most c * A_r (its largest magnitude A_r), so the sum
    of them by c * M; the fp32 additions (and avg's division) add at most
    (N + 1) * 2^-24 * M(1 + c); the owner's quantization of a sum whose largest magnitude
    is at most M(1 + c) adds c * M(1 + c); the final rounding u * M(1 + c)^2. The fp32
    roundings of each quantization (inv = 1 / scale and x * inv: y off by at most 2^-23 |y|,
    so the value by 2^-23 of the group's largest magnitude) and of code * scale (2^-24 of
    it) add at most 1.5 * 2^-23 per quantization of its largest magnitude (times 1 + c):
    for the ranks' groups and the owner's sum together at most 3 * 2^-23 * M(1 + c)^2
    (the reduce-scatter: one of them, 1.5 * 2^-23 * M(1 + c)). Not covered: a float16
    result below its normal range
    (an absolute error up to 2^-25 more: :func:`absolute_slack`) and a group whose scale
    is below fp32's normal range (largest magnitude below qmax * 2^-126, about 1e-37 for
    int4 and 1e-36 for int8): the scale then rounds to a multiple of 2^-149, which adds an
    absolute error of that order (the clamp to +-qmax catching a scale that rounded
    down), and below about 1e-43 the group comes out as zeros.

    Per format, for a bfloat16 result (float16: about 0.004 less): int8, c = 0.5/127,
    about 0.0118; fp8 e4m3, c = 16/448, about 0.077; int4, whose codes -7..7 are 1/7 of
    the group's largest magnitude apart, so that rounding to one is off by at most half
    that (c = 0.5/7) before and again at the owner's requantization, about 0.152. The
    clamp to +-qmax moves a value by at most its fp32 roundings (scale = amax / qmax and
    inv are rounded, so |x| * inv may exceed qmax by two ulps), inside the quantizations'
    term.

    The reduce-scatter stops before the owner's quantization: its sum, of largest magnitude
    at most M(1 + c), is rounded once, so ``c + u(1 + c) + (N + 2.5) 2^-23 (1 + c)``: about
    0.0079 for int8 -> bfloat16, 0.040 for fp8 and 0.076 for int4 (one quantization each).
    """
    c, u = FORMATS[fmt].step, _UNIT[dtype]
    fp32 = (nranks + 1) * 2.0**-23 * (1 + c)
    if collective == "reduce_scatter":
        return c + u * (1 + c) + (nranks + 2.5) * 2.0**-23 * (1 + c)
    return c + c * (1 + c) + u * (1 + c) ** 2 + fp32 + 3 * 2.0**-23 * (1 + c) ** 2


def absolute_slack(dtype: str) -> float:
    """The absolute error that rounding to ``dtype`` may add beyond :func:`bound` (float16
    subnormals)."""
    return _ABS[dtype]


def group_errors(inputs, result: np.ndarray, op: str = "sum") -> np.ndarray:
    """Per group, the largest |result - exact| over ``M`` (see :func:`bound`); groups of
    zeros (M = 0) give 0. ``exact``: the inputs reduced in fp64."""
    x = np.stack([_grouped(a).astype(np.float64) for a in inputs])  # (N, G, GROUP)
    exact = x.sum(axis=0)
    m = np.abs(x).max(axis=2).sum(axis=0)
    if op == "avg":
        exact, m = exact / len(inputs), m / len(inputs)
    got = _grouped(result).astype(np.float64)
    err = np.abs(got - exact).max(axis=1)
    return np.where(m > 0, err / np.where(m > 0, m, 1.0), 0.0)
