"""Inputs of the expert-parallel tests (tests/test_moe_reference.py on the CPU,
tests/test_gpu_moe.py on GPUs): every rank's tokens, routing and weights, made on the host
from a seed, so that every rank makes every rank's inputs alike and computes the reference
of all of them."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ubnext._moe import layout

NP = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def routing(kind: str, tokens: int, shape: layout.Shape, rng) -> np.ndarray:
    """``[tokens, K]`` int32 expert ids of one rank, for a routing ``kind``: ``random``
    (distinct experts uniformly), ``skewed`` (every token to expert 1 alone), ``not_last_gpu``
    (no expert on the last GPU), ``dropped`` (random, 40 % of the slots -1 and every 5th
    token with no expert at all)."""
    e, k, lo = shape.num_experts, shape.top_k, shape.local_experts
    if tokens == 0:
        return np.zeros((0, k), np.int32)
    if kind == "skewed":  # every token to expert 1 (on GPU 0), its other slots dropped
        idx = np.full((tokens, k), -1, np.int32)
        idx[:, 0] = 1
        return idx
    rows = np.stack([rng.permutation(e)[:k] for _ in range(tokens)]).astype(np.int32).reshape(tokens, k)
    if kind == "not_last_gpu":  # no token has an expert on the last GPU
        rows = np.full((tokens, k), -1, np.int32)
        for row in rows:
            kept = rng.permutation(e - lo)[:k]
            row[:len(kept)] = kept
    if kind == "dropped":
        rows[rng.random(rows.shape) < 0.4] = -1
        rows[::5] = -1  # tokens with no expert at all
    return rows


def inputs(shape: layout.Shape, kind: str, tokens: list[int], seed: int):
    """Every rank's ``x [T_r, H]`` (normal values, with -0.0 at every 13th element, +inf at
    element 3 and NaN at 7), ``idx [T_r, K]`` (``routing``) and ``weights [T_r, K]`` (in
    [0, 1), -0.0 at every 11th), T_r = ``tokens[r]``."""
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for t in tokens:
        x = rng.standard_normal((t, shape.hidden)).astype(NP[shape.dtype])
        if t:
            x.flat[1::13] = -0.0
            x.flat[3] = np.inf
            x.flat[7] = np.nan
        w = rng.random((t, shape.top_k)).astype(np.float32)
        w.flat[2::11] = -0.0
        xs.append(x)
        idxs.append(routing(kind, t, shape, rng))
        ws.append(w)
    return xs, idxs, ws


def tokens_of(shape: layout.Shape) -> list[int]:
    """Tokens per rank: full, partial, and T = 0 on rank 1 where there are 2 ranks or more."""
    return [shape.max_tokens if r % 2 == 0 else 0 if r == 1 else shape.max_tokens - 2 for r in range(shape.nranks)]


def row_dims(shape) -> tuple[int, ...]:
    """The dims of a value per received row: ``(L, C)``, or a packed shape's ``(R,)``."""
    from ubnext._moe import packed_layout

    if isinstance(shape, packed_layout.PackedShape):
        return (shape.max_rows,)
    return (shape.local_experts, shape.capacity)


def expert_outputs(shape: layout.Shape, seed: int) -> list[np.ndarray]:
    """Every GPU's experts' outputs ``[L, C, H]`` (a packed shape's ``[R, H]``): normal
    values, -0.0 at every 17th, +inf at element 9 and NaN at 29 of every GPU's."""
    rng = np.random.default_rng(seed)
    ys = []
    for _ in range(shape.nranks):
        y = rng.standard_normal((*row_dims(shape), shape.hidden)).astype(NP[shape.dtype])
        y.flat[5::17] = -0.0
        y.flat[9] = np.inf
        y.flat[29] = np.nan
        ys.append(y)
    return ys


# ---- the backwards of ubnext.torch.moe (tests/test_moe_torch.py, tests/test_gpu_moe_torch.py) ----
def _kept(d) -> np.ndarray:
    """``[L, C]`` bool: the rows of a dispatch below their expert's count (a packed one's
    ``[R]``: the rows below the counts' sum)."""
    if d.src.ndim == 1:
        return np.arange(d.src.shape[0]) < d.counts.sum()
    return np.arange(d.src.shape[1])[None, :] < d.counts[:, None]


def _rows(d):
    """``(local expert, index of its row in src)`` of every row a dispatch received, in
    order (a packed dispatch's rows expert after expert)."""
    first = np.concatenate([[0], np.cumsum(d.counts)])
    for e, n in enumerate(d.counts):
        for r in range(n):
            yield e, (first[e] + r,) if d.src.ndim == 1 else (e, r)


def combine_backward(shape: layout.Shape, grads_dispatched, ys, weights) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every GPU's ``(y's gradient [L, C, H], the weights' [L, C] float32)`` of a combine,
    from the dispatch of every rank's ``grad_out`` (``grads_dispatched``: the reference's
    Dispatched of it, its rows g), every GPU's ``y`` and the combine's ``weights`` w
    ``[L, C]``: ``dtype(float32(g * w))`` and ``float32(sum float64(g) * float64(y))`` per row,
    zero past the counts."""
    out = []
    for d, y, w in zip(grads_dispatched, ys, weights):
        kept = _kept(d)
        g = d.recv_x
        with np.errstate(invalid="ignore", over="ignore"):
            gy = (g.astype(np.float32) * np.asarray(w, np.float32)[..., None]).astype(np.float32).astype(y.dtype)
            # from +0.0, as torch's sum: a sum of -0.0 products is +0.0
            dots = (0.0 + (g.astype(np.float64) * y.astype(np.float64)).sum(-1)).astype(np.float32)
        out.append((np.where(kept[..., None], gy, np.zeros((), y.dtype)), np.where(kept, dots, np.float32(0))))
    return out


def dispatch_backward(shape: layout.Shape, dispatched, grads_recv, grads_weights, idxs):
    """Every rank's ``(x's gradient [T, H], topk_weights' [T, K] float32)`` of a dispatch,
    from every GPU's gradients of recv_x and of the weights ``[L, C]`` (a packed shape's
    ``[R]``): x's is the combine of recv_x's with unit weights (``reference.combine``, or
    ``packed_reference.combine``); each slot of topk_weights gets the weight gradient of
    the row its token landed in (zero for a slot no row holds)."""
    from ubnext._moe import packed_layout
    from ubnext._moe import packed_reference as pref
    from ubnext._moe import reference as ref

    packed = isinstance(shape, packed_layout.PackedShape)
    ones = [np.ones(row_dims(shape), np.float32)] * shape.nranks
    grads_x = (pref if packed else ref).combine(shape, dispatched, grads_recv, idxs, ones)
    grads_w = [np.zeros(np.shape(i), np.float32) for i in idxs]
    lo, m = shape.local_experts, shape.max_tokens
    for g, (d, gw) in enumerate(zip(dispatched, grads_weights)):
        for e, at in _rows(d):
            s, t = divmod(int(d.src[at]), m)
            k = int(np.flatnonzero(np.asarray(idxs[s][t]) == g * lo + e)[0])
            grads_w[s][t, k] = gw[at]
    return list(zip(grads_x, grads_w))


def moe_block_module():
    """examples/moe_block.py, imported (its block, reference and check)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        return importlib.import_module("moe_block")
    finally:
        sys.path.pop(0)
