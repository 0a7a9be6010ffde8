"""Expert-parallel dispatch and combine as ``torch.library`` ops (``torch.ops.ubnext.moe_*``),
with fake implementations and autograd (docs/moe.md, "In PyTorch").

The ops name their ``ExpertParallel`` object by its int handle (``_registry.handle``: the
object has it from construction, as a Communicator has), registered by ``_ops.register``
from the table ``MOE_OPS``:

* ``moe_dispatch(x, topk_idx, topk_weights, ep) -> (recv_x, recv_counts, src, weights)``:
  ``ExpertParallel.dispatch``, its outputs copied out of the object's buffers into new
  tensors, rows past the counts zero (``src`` -1): a later dispatch (a backward makes
  some) never overwrites a tensor autograd or the caller holds, and the rows past the
  counts are the same bits on every call.
* ``moe_combine(y, weights, topk_idx, ep) -> out``: ``ExpertParallel.combine`` of the
  object's latest dispatch (made by ``moe_dispatch``), ``weights`` in place of the router's.
* ``moe_dispatch_backward(grad_recv_x, topk_idx, ep) -> grad_x``: x's gradient, a combine
  with unit weights. It dispatches first (zeros, with ``topk_idx``): the combine needs the
  routing of the dispatch it is the transpose of, and in a backward other dispatches of the
  object (combine's backward) come between; one op, so that no compiler puts another call
  of the object between the two.
* ``moe_gather_weights(grad_weights, src, topk_idx, ep) -> grad_topk_weights``: a value per
  received row (``[L, C]`` fp32, on the expert's GPU) back into its slot of ``[T, K]`` on
  the token's rank: every rank's rows and sources all-gathered (the communicator's
  ``all_gather``: the bits move as they are), then each rank scatters its own tokens' values.

Gradients (fp32 arithmetic, orders fixed; docs/moe.md gives the formulas): dispatch's are
``moe_dispatch_backward`` (x) and ``moe_gather_weights`` of its weights output's gradient
(topk_weights); combine's are, from a dispatch of ``grad_out`` (``g``, laid out as
recv_x), ``y``'s ``round(g * w)`` (one fp32 product per element, then the dtype) and the
weights' ``float32(sum_h float64(g) * float64(y))`` (every product exact in float64),
both zero past the counts. ``recv_counts`` and ``src`` have no gradient.
"""

from __future__ import annotations

import weakref

import torch

from ubnext._protocol.errors import UbnextError

from ._gather import all_gather_any
from ._ops import Op, register
from ._registry import lookup

#: the latest dispatch of each object made by ``moe_dispatch`` (its Handle), which
#: ``moe_combine`` pairs with (weakly keyed: the entry goes with its object)
_latest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _check(name: str, s, tensors: dict):
    """``s`` (the object's Shape), after checking ``tensors`` (what -> (tensor, dims, dtype
    name); a dim "T": the tokens, the same for every "T", at most max_tokens)."""
    tokens = None
    for what, (t, dims, dtype) in tensors.items():
        want = tuple(tokens if d == "T" else d for d in dims)
        got = tuple(t.shape)
        ok = t.dtype == _torch_dtype(dtype) and len(got) == len(want)
        ok = ok and all(w is None or g == w for g, w in zip(got, want))
        if not ok:
            shown = " x ".join("T" if w is None else str(w) for w in want)
            raise UbnextError(f"ubnext::{name}: {what} must be {dtype} of shape [{shown}], got {t.dtype} of shape "
                              f"{list(got)}")
        if "T" in dims and tokens is None:
            tokens = got[dims.index("T")]
    if tokens is not None and tokens > s.max_tokens:
        raise UbnextError(f"ubnext::{name}: {tokens} tokens; the object takes at most max_tokens={s.max_tokens}")
    return s


def _routing(s, topk_idx, topk_weights=None) -> dict:
    out = {"topk_idx": (topk_idx, ("T", s.top_k), "int32")}
    if topk_weights is not None:
        out["topk_weights"] = (topk_weights, ("T", s.top_k), "float32")
    return out


def _rows(s) -> tuple[int, int]:
    """The dims of the ``[L, C]`` arrays."""
    return (s.local_experts, s.capacity)


# ---- moe_dispatch ------------------------------------------------------------------------
def _dispatch_check(s, x, topk_idx, topk_weights):
    if s.fp8:
        raise UbnextError("ubnext::moe_dispatch: the object's dispatch is fp8 ((codes, scales) in place of recv_x), "
                          "which the ops do not take; make it with fp8=False")
    return _check("moe_dispatch", s, {"x": (x, ("T", s.hidden), s.dtype), **_routing(s, topk_idx, topk_weights)})


def _received(counts, capacity: int):
    """``[L, C]`` bool: the rows each local expert received (below its count)."""
    return torch.arange(capacity, device=counts.device, dtype=counts.dtype) < counts[:, None]


def _dispatch_run(ep, x, topk_idx, topk_weights):
    s = _dispatch_check(ep.shape, x, topk_idx, topk_weights)
    recv_x, counts, handle = ep.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())
    _latest[ep] = handle
    kept = _received(counts, s.capacity)
    return (torch.where(kept[..., None], recv_x, recv_x.new_zeros(())), counts.clone(),
            torch.where(kept, handle.src, handle.src.new_full((), -1)),
            torch.where(kept, handle.weights, handle.weights.new_zeros(())))


def _dispatch_fake(x, topk_idx, topk_weights, ep):
    s = _dispatch_check(lookup(ep).shape, x, topk_idx, topk_weights)
    rows = _rows(s)
    return (x.new_empty((*rows, s.hidden)), x.new_empty((s.local_experts,), dtype=torch.int32),
            x.new_empty(rows, dtype=torch.int32), x.new_empty(rows, dtype=torch.float32))


def _dispatch_context(ctx, inputs, output):
    _, topk_idx, _, ctx.ep = inputs
    ctx.save_for_backward(topk_idx, output[2])
    ctx.set_materialize_grads(False)  # an output without a gradient: None, no collective of zeros


def _dispatch_backward(ctx, grad_recv_x, grad_counts, grad_src, grad_weights):
    """x's gradient: the combine of recv_x's with unit weights; topk_weights': each row's
    weight gradient back into its slot (``moe_gather_weights``)."""
    topk_idx, src = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0] and grad_recv_x is not None:
        grad_x = torch.ops.ubnext.moe_dispatch_backward(grad_recv_x.contiguous(), topk_idx, ctx.ep)
    if ctx.needs_input_grad[2] and grad_weights is not None:
        grad_w = torch.ops.ubnext.moe_gather_weights(grad_weights.contiguous(), src, topk_idx, ctx.ep)
    return grad_x, None, grad_w, None


# ---- moe_combine ---------------------------------------------------------------------------
def _combine_check(s, y, weights, topk_idx):
    return _check("moe_combine", s, {"y": (y, (*_rows(s), s.hidden), s.dtype),
                                     "weights": (weights, _rows(s), "float32"), **_routing(s, topk_idx)})


def _combine_run(ep, y, weights, topk_idx):
    name = "moe_combine"
    _combine_check(ep.shape, y, weights, topk_idx)
    handle = _latest.get(ep)
    if handle is None or handle.tokens != topk_idx.shape[0]:
        raise UbnextError(f"ubnext::{name}: no dispatch of this object by ubnext.torch.moe.dispatch with "
                          f"{topk_idx.shape[0]} tokens to combine (a combine pairs with the object's latest dispatch)")
    return ep.combine(y.contiguous(), handle, weights=weights.contiguous())


def _combine_fake(y, weights, topk_idx, ep):
    s = _combine_check(lookup(ep).shape, y, weights, topk_idx)
    return y.new_empty((topk_idx.shape[0], s.hidden))


def _combine_context(ctx, inputs, output):
    y, weights, topk_idx, ctx.ep = inputs
    ctx.save_for_backward(y, weights, topk_idx)


def _combine_backward(ctx, grad_out):
    """From ``g``, the dispatch of grad_out (zero past the counts): y's ``round(g * w)``,
    the weights' ``float32(sum float64(g) * float64(y))`` per row, both zero past the counts."""
    y, weights, topk_idx = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None
    unused = torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
    g, counts, _, _ = torch.ops.ubnext.moe_dispatch(grad_out.contiguous(), topk_idx, unused, ctx.ep)
    kept = _received(counts, y.shape[1])
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_y = torch.where(kept[..., None], (g.float() * weights[..., None]).to(y.dtype), y.new_zeros(()))
    if ctx.needs_input_grad[1]:
        dots = (g.double() * y.double()).sum(-1).float()
        grad_w = torch.where(kept, dots, dots.new_zeros(()))
    return grad_y, grad_w, None, None


# ---- the backward-only ops -----------------------------------------------------------------
def _dispatch_backward_check(s, grad_recv_x, topk_idx):
    return _check("moe_dispatch_backward", s, {"grad_recv_x": (grad_recv_x, (*_rows(s), s.hidden), s.dtype),
                                                **_routing(s, topk_idx)})


def _dispatch_backward_run(ep, grad_recv_x, topk_idx):
    s = _dispatch_backward_check(ep.shape, grad_recv_x, topk_idx)
    tokens = topk_idx.shape[0]
    zeros = grad_recv_x.new_zeros((tokens, s.hidden))
    _, _, handle = ep.dispatch(zeros, topk_idx.contiguous(), torch.zeros(topk_idx.shape, dtype=torch.float32,
                                                                         device=topk_idx.device))
    _latest[ep] = handle
    ones = torch.ones(_rows(s), dtype=torch.float32, device=grad_recv_x.device)
    return ep.combine(grad_recv_x.contiguous(), handle, weights=ones)


def _dispatch_backward_fake(grad_recv_x, topk_idx, ep):
    s = _dispatch_backward_check(lookup(ep).shape, grad_recv_x, topk_idx)
    return grad_recv_x.new_empty((topk_idx.shape[0], s.hidden))


def _gather_check(s, grad_weights, src, topk_idx):
    return _check("moe_gather_weights", s, {"grad_weights": (grad_weights, _rows(s), "float32"),
                                             "src": (src, _rows(s), "int32"), **_routing(s, topk_idx)})


def _gather_run(ep, grad_weights, src, topk_idx):
    """Every rank's (value, source) pairs gathered; this rank's sources (``src // M ==
    rank``) scattered into ``[T, K]`` at (token ``src % M``, the slot of the row's expert in
    the token's top-k); slots no row holds are zero."""
    s = _gather_check(ep.shape, grad_weights, src, topk_idx)
    comm = ep.comm
    pairs = torch.stack([grad_weights.contiguous().view(torch.int32), src.contiguous()], dim=-1)
    every = all_gather_any(comm, pairs).view(s.nranks * s.local_experts, s.capacity, 2)
    tokens, k = topk_idx.shape
    out = torch.zeros(tokens * k + 1, dtype=torch.float32, device=grad_weights.device)
    if tokens:
        values, sources = every[..., 0].contiguous().view(torch.float32), every[..., 1]
        expert = torch.arange(s.nranks * s.local_experts, device=src.device, dtype=torch.int32)[:, None]
        mine = (sources >= 0) & (sources // s.max_tokens == comm.rank)
        token = torch.where(mine, sources % s.max_tokens, 0).long()
        match = topk_idx.index_select(0, token.reshape(-1)).view(*token.shape, k) == expert[..., None]
        mine = mine & match.any(-1)
        at = torch.where(mine, token * k + match.int().argmax(-1), tokens * k)
        out.scatter_(0, at.reshape(-1), values.reshape(-1))
    return out[:tokens * k].view(tokens, k)


def _gather_fake(grad_weights, src, topk_idx, ep):
    _gather_check(lookup(ep).shape, grad_weights, src, topk_idx)
    return grad_weights.new_empty(tuple(topk_idx.shape))


MOE_OPS: dict[str, Op] = {
    "moe_dispatch": Op("(Tensor x, Tensor topk_idx, Tensor topk_weights, int ep) -> (Tensor, Tensor, Tensor, Tensor)",
                       (), _dispatch_run, _dispatch_fake, _dispatch_backward, _dispatch_context),
    "moe_combine": Op("(Tensor y, Tensor weights, Tensor topk_idx, int ep) -> Tensor", (),
                      _combine_run, _combine_fake, _combine_backward, _combine_context),
    "moe_dispatch_backward": Op("(Tensor grad_recv_x, Tensor topk_idx, int ep) -> Tensor", (),
                                _dispatch_backward_run, _dispatch_backward_fake),
    "moe_gather_weights": Op("(Tensor grad_weights, Tensor src, Tensor topk_idx, int ep) -> Tensor", (),
                             _gather_run, _gather_fake),
}

register(MOE_OPS)
