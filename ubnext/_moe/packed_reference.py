"""Host reference of the packed (throughput-mode) dispatch and combine, bit for bit: the
low-latency reference (``reference``) laid out packed, not a second reference.

* dispatch: the low-latency dispatch at a capacity of N x M (no expert overflows), whose
  expert e's row j becomes packed row ``offset[e] + j``, ``offset`` the exclusive prefix
  sum of the experts' counts; rows from R on are dropped (an error) and their slots route
  ROUTE_OVERFLOW; ``counts`` are bounded so that their prefix sum is the kernel's
  ``offsets`` (each at most R).
* combine: the low-latency combine unchanged: its route indexes y's rows, which the
  packed route does in ``[R, H]`` as the padded one did in ``[L, C, H]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ubnext._moe import reference as _reference
from ubnext._moe.packed_layout import PackedShape


def offsets(d: _reference.Dispatched) -> np.ndarray:
    """``[L + 1]`` int32: the kernel's offsets of a packed dispatch (its bounded counts' prefix sum)."""
    return np.concatenate([[0], np.cumsum(d.counts)]).astype(np.int32)


def pack(shape: PackedShape, d: _reference.Dispatched) -> _reference.Dispatched:
    """The packed layout of one rank's low-latency dispatch ``d`` at ``shape.padded()``:
    ``recv_x [R, H]``, ``src [R]`` and ``weights [R]`` (-1 and 0 past the rows), ``counts``
    bounded by R, ``route`` the packed rows, ``overflow`` whether the rows exceed R."""
    r, c = shape.max_rows, shape.padded().capacity
    first = np.concatenate([[0], np.cumsum(d.counts.astype(np.int64))])
    recv_x = np.zeros((r, shape.hidden), d.recv_x.dtype)
    src, weights = np.full(r, -1, np.int32), np.zeros(r, np.float32)
    for e, n in enumerate(d.counts):
        rows = first[e] + np.arange(n)
        kept = rows < r
        recv_x[rows[kept]] = d.recv_x[e, :n][kept]
        src[rows[kept]] = d.src[e, :n][kept]
        weights[rows[kept]] = d.weights[e, :n][kept]
    route = d.route.astype(np.int64)
    here = route >= 0
    packed = first[route[here] // c] + route[here] % c
    route[here] = np.where(packed < r, packed, _reference.ROUTE_OVERFLOW)
    bounded = np.diff(np.minimum(first, r)).astype(np.int32)
    return _reference.Dispatched(recv_x, bounded, src, weights, route.astype(np.int32), d.tokens,
                                 bool(first[-1] > r))


def dispatch(shape: PackedShape, xs: Sequence[np.ndarray], idxs: Sequence[np.ndarray],
             weights: Sequence[np.ndarray]) -> list[_reference.Dispatched]:
    """Every rank's packed dispatch, from every rank's ``x [T_s, H]``, ``idx [T_s, K]`` and
    ``weights [T_s, K]`` (float32)."""
    return [pack(shape, d) for d in _reference.dispatch(shape.padded(), xs, idxs, weights)]


def combine(shape: PackedShape, dispatched: Sequence[_reference.Dispatched], ys: Sequence[np.ndarray],
            idxs: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Every rank's packed combine: ``out [T_s, H]`` from every GPU's packed dispatch, its
    ``y [R, H]`` (or its first rows) and, where given, its ``weights [R]``."""
    return _reference.combine(shape.padded(), dispatched, ys, idxs, weights)
