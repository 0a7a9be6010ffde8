"""Host reference of the expert-parallel dispatch and combine, bit for bit (numpy only).

Computed for every rank at once, from every rank's inputs, in the kernels' own order and
rounding (docs/moe.md; kernels/moe_dispatch.cu, kernels/moe_combine.cu):

* A routing slot is valid when its id is in ``0..E-1`` and no earlier slot of its row
  holds the same id; -1 is dropped; any other slot is an error the kernel records
  (``slot_errors``) and drops.
* dispatch: the rows of local expert e of rank g are the tokens (s, t) whose row holds
  expert ``g * L + e``, by source rank s, then token index t; rows past the capacity are
  dropped (an error). The payload moves bit for bit; a weight of -0.0 arrives as +0.0.
  An FP8 dispatch moves each row's e4m3 codes and per-128-channel fp32 scales, quantized
  once at the source as the quantized two-shot quantizes (``_protocol.quant.quantize``).
* combine: GPU g's fp32 partial of token (s, t) is ``acc = +0.0``, then for each slot k
  in top-k order whose expert is on g and kept: ``acc = acc + w * y`` (the product
  rounded to fp32, then the sum: no fused multiply-add); the token's result is ``acc =
  +0.0``, then ``acc = acc + partial_g`` for every GPU g holding one of its valid slots,
  in rank order, rounded once to the dtype. With bf16 partials (a bfloat16 payload only),
  each GPU's partial is rounded to bfloat16 (to nearest even) before it is added: a second
  rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ubnext._moe.layout import FP8_GROUP, PARTIALS, Shape
from ubnext._protocol import quant as _quant
from ubnext._protocol.constants import MOE_ROUTE_ELSEWHERE as ROUTE_ELSEWHERE
from ubnext._protocol.constants import MOE_ROUTE_OVERFLOW as ROUTE_OVERFLOW

_F32 = np.float32


def slot_errors(idx: np.ndarray, num_experts: int) -> np.ndarray:
    """Which slots of ``idx`` ``[T, K]`` the kernel records as errors: an id below -1 or
    at least ``num_experts``, or an id a previous slot of its row already holds."""
    idx = np.asarray(idx, np.int64)
    bad = (idx < -1) | (idx >= num_experts)
    for k in range(1, idx.shape[1]):
        bad[:, k] |= (idx[:, k] >= 0) & (idx[:, :k] == idx[:, k:k + 1]).any(axis=1)
    return bad


def valid_slots(idx: np.ndarray, num_experts: int) -> np.ndarray:
    """Which slots of ``idx`` carry their token to an expert."""
    return (np.asarray(idx) >= 0) & ~slot_errors(idx, num_experts)


def clear_negative_zero32(w: np.ndarray) -> np.ndarray:
    """fp32 ``w`` with -0.0 written as +0.0 (the sentinel's bit pattern never travels)."""
    w = np.array(w, _F32)
    w[(w == 0) & np.signbit(w)] = 0.0
    return w


@dataclass
class Dispatched:
    """What one rank's dispatch holds (docs/moe.md, "The calls").

    Attributes:
        recv_x: ``[L, C, H]``, rows past ``counts`` zero here (the kernel leaves them);
            float8_e4m3fn codes for an FP8 dispatch.
        counts: ``[L]`` int32, rows of each local expert (at most C).
        src: ``[L, C]`` int32, ``source_rank * M + token`` of each row (-1 past counts).
        weights: ``[L, C]`` float32 (0 past counts).
        route: ``[N, M, K]`` int32: for each source's token slot, ``e * C + row`` where its
            expert is local expert e, ROUTE_OVERFLOW past the capacity, else
            ROUTE_ELSEWHERE (rows t >= T_s too).
        tokens: ``[N]`` T of each source.
        overflow: whether some expert received more than C tokens (an error).
        scales: an FP8 dispatch's ``[L, C, H / FP8_GROUP]`` float32 scales (0 past
            counts), else None.
    """

    recv_x: np.ndarray
    counts: np.ndarray
    src: np.ndarray
    weights: np.ndarray
    route: np.ndarray
    tokens: np.ndarray
    overflow: bool
    scales: np.ndarray | None = None


def dispatch(shape: Shape, xs: Sequence[np.ndarray], idxs: Sequence[np.ndarray],
             weights: Sequence[np.ndarray]) -> list[Dispatched]:
    """Every rank's dispatch, from every rank's ``x [T_s, H]``, ``idx [T_s, K]`` and
    ``weights [T_s, K]`` (float32)."""
    n, lo, c, m, k = shape.nranks, shape.local_experts, shape.capacity, shape.max_tokens, shape.top_k
    valid = [valid_slots(i, shape.num_experts) for i in idxs]
    scales = None
    if shape.fp8:
        xs, scales = zip(*(fp8_rows(x, shape.hidden) for x in xs))
    out = []
    for g in range(n):
        recv_x = np.zeros((lo, c, shape.hidden), xs[0].dtype)
        recv_scales = np.zeros((lo, c, shape.hidden // FP8_GROUP), _F32) if shape.fp8 else None
        counts = np.zeros(lo, np.int64)
        src = np.full((lo, c), -1, np.int32)
        w_out = np.zeros((lo, c), _F32)
        route = np.full((n, m, k), ROUTE_ELSEWHERE, np.int32)
        overflow = False
        for s in range(n):
            idx, w = np.asarray(idxs[s]), clear_negative_zero32(weights[s])
            for t in range(idx.shape[0]):
                for slot in range(k):
                    e = int(idx[t, slot]) - g * lo
                    if not valid[s][t, slot] or not 0 <= e < lo:
                        continue
                    row = counts[e]
                    counts[e] += 1
                    if row >= c:
                        overflow = True
                        route[s, t, slot] = ROUTE_OVERFLOW
                        continue
                    recv_x[e, row] = xs[s][t]
                    if recv_scales is not None:
                        recv_scales[e, row] = scales[s][t]
                    src[e, row] = s * m + t
                    w_out[e, row] = w[t, slot]
                    route[s, t, slot] = e * c + row
        tokens = np.array([len(i) for i in idxs], np.int64)
        out.append(Dispatched(recv_x, np.minimum(counts, c).astype(np.int32), src, w_out, route, tokens, overflow,
                              recv_scales))
    return out


def fp8_rows(x: np.ndarray, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x [T, H]`` (bfloat16) as an FP8 dispatch sends them: ``(codes [T, H]
    float8_e4m3fn, scales [T, H / FP8_GROUP] float32)``."""
    groups = np.asarray(x).astype(_F32).reshape(-1, FP8_GROUP)
    codes, scales = _quant.quantize(groups, "fp8")
    t = len(x)
    return codes.astype(ml_dtypes.float8_e4m3fn).reshape(t, hidden), scales.reshape(t, hidden // FP8_GROUP)


def destinations(shape: Shape, idx: np.ndarray) -> np.ndarray:
    """``[T, N]`` bool: which GPUs hold a valid slot of each token (its combine's terms)."""
    lo, valid = shape.local_experts, valid_slots(idx, shape.num_experts)
    gpu = np.where(valid, np.asarray(idx) // lo, -1)
    return np.stack([(gpu == g).any(axis=1) for g in range(shape.nranks)], axis=1).reshape(len(idx), shape.nranks)


def partial(shape: Shape, d: Dispatched, y: np.ndarray, s: int, t: int, w: np.ndarray | None = None) -> np.ndarray:
    """GPU's fp32 partial of token (s, t) from its experts' outputs ``y [L, C, H]`` and its
    dispatch ``d``: the kept slots in top-k order, each ``acc + w * y`` rounded step by step,
    ``w`` the row's weight in ``d.weights``, or in ``w [L, C]`` where given."""
    acc = np.zeros(shape.hidden, _F32)
    flat_y, flat_w = y.reshape(-1, shape.hidden), (d.weights if w is None else np.asarray(w, _F32)).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0, inf - inf: NaN, as IEEE says
        for slot in range(shape.top_k):
            r = int(d.route[s, t, slot])
            if r >= 0:
                acc = (acc + (flat_w[r] * flat_y[r].astype(_F32)).astype(_F32)).astype(_F32)
    return acc


def combine(shape: Shape, dispatched: Sequence[Dispatched], ys: Sequence[np.ndarray],
            idxs: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None = None,
            partials: str = "float32") -> list[np.ndarray]:
    """Every rank's combine: ``out [T_s, H]`` of the dtype of ``ys`` (every GPU's ``[L, C,
    H]``), from every GPU's dispatch and every rank's ``idx``; with ``weights`` (every GPU's
    ``[L, C]``), those in place of the dispatch's; ``partials`` ``"bfloat16"``: each GPU's
    partial rounded to bfloat16 before the sum.

    Raises:
        ValueError: bf16 partials of a payload other than bfloat16, or an unknown ``partials``.
    """
    if partials not in PARTIALS or (partials == "bfloat16" and shape.dtype != "bfloat16"):
        raise ValueError(f"combine: partials {partials!r} (bfloat16 partials take a bfloat16 payload)")
    wire = None if partials == "float32" else np.dtype(ml_dtypes.bfloat16)
    out = []
    for s, idx in enumerate(idxs):
        dest = destinations(shape, idx)
        res = np.zeros((len(idx), shape.hidden), ys[0].dtype)
        for t in range(len(idx)):
            acc = np.zeros(shape.hidden, _F32)
            for g in np.flatnonzero(dest[t]):
                with np.errstate(invalid="ignore", over="ignore"):
                    w = None if weights is None else weights[g]
                    part = partial(shape, dispatched[g], ys[g], s, t, w)
                    if wire is not None:
                        part = part.astype(wire).astype(_F32)
                    acc = (acc + part).astype(_F32)
            res[t] = acc.astype(ys[0].dtype)
        out.append(res)
    return out
