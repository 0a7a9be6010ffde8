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
* ``moe_dispatch_backward(grad_recv_x?, grad_weights?, src, topk_idx, ep) -> (grad_x,
  grad_topk_weights)``: both of the dispatch's gradients, in this order, by one op. x's
  (where ``grad_recv_x`` is given, else zeros) is a combine with unit weights; it
  dispatches first (zeros, with ``topk_idx``): the combine needs the routing of the
  dispatch it is the transpose of, and in a backward other dispatches of the object
  (combine's backward) come between. topk_weights' (where ``grad_weights`` is given, else
  zeros) brings a value per received row (``[L, C]`` fp32, on the expert's GPU) back into
  its slot of ``[T, K]`` on the token's rank: every rank's rows and sources all-gathered
  (the communicator's ``all_gather``: the bits move as they are), then each rank scatters
  its own tokens' values. One op, not two: a compiler orders two independent collectives
  of a backward as it likes (Inductor put the all-gather before the dispatch, where eager
  has it after) and a rank without tokens compiles another graph, so the ranks' orders
  need not agree (2 ranks on one H200 waited for each other in the compiled backward
  until the test's bound); and no compiler puts another call of the object between the
  dispatch and the combine.

The throughput mode's ops (``moe_packed_*``, of a ``PackedExpertParallel``) are the same
three, its ``sync=False`` form: a value per row ``[R]`` where these have ``[L, C]``,
``offsets`` ``[L + 1]`` where these have ``recv_counts``, rows from ``offsets[L]`` on zero,
and ``moe_packed_dispatch_backward(grad_recv_x?, grad_weights?, src, offsets, topk_idx, ep)``
(a packed row's expert is the one whose span holds it; the offsets travel with the pairs). Both tables come
from ``_table`` of a mode (``LowLatency``, ``Packed``): what the modes differ in is the
rows' dims, which rows were received and each row's expert; the rest is shared.

Gradients (fp32 arithmetic, orders fixed; docs/moe.md gives the formulas): dispatch's are
``moe_dispatch_backward``'s (x from recv_x's gradient, topk_weights from its weights
output's); combine's are, from a dispatch of ``grad_out`` (``g``, laid out as
recv_x), ``y``'s ``round(g * w)`` (one fp32 product per element, then the dtype) and the
weights' ``float32(sum_h float64(g) * float64(y))`` (every product exact in float64),
both zero past the rows received. ``recv_counts`` (``offsets``) and ``src`` have no
gradient.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ubnext._protocol.errors import UbnextError

from ._gather import all_gather_any
from ._ops import Op, register
from ._registry import lookup

#: the latest dispatch of each object made by ``moe_dispatch`` or ``moe_packed_dispatch`` (its
#: handle), which the combine op pairs with (weakly keyed: the entry goes with its object)
_latest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LowLatency:
    """``ExpertParallel``'s ops (``moe_*``): a value per row ``[L, C]``, ``counts`` ``[L]``."""

    prefix = "moe"
    control = "counts"  # the dispatch's second output, what says which rows were received
    located = False  # whether a row's expert needs the control (the gather op then takes it)

    @staticmethod
    def rows(s) -> tuple[int, ...]:
        """The dims of an array of a value per received row."""
        return (s.local_experts, s.capacity)

    @staticmethod
    def control_dims(s) -> tuple[int, ...]:
        return (s.local_experts,)

    @staticmethod
    def kept(counts, rows: tuple[int, ...]):
        """``rows``-shaped bool: the rows each local expert received (below its count)."""
        return torch.arange(rows[1], device=counts.device, dtype=counts.dtype) < counts[:, None]

    @staticmethod
    def experts(s, controls, device):
        """``[N, L x C]`` int32: the global expert of each row of every rank (its position
        says it; ``controls``: None)."""
        ids = torch.arange(s.nranks * s.local_experts, device=device, dtype=torch.int32)
        return ids.view(s.nranks, s.local_experts, 1).expand(-1, -1, s.capacity).reshape(s.nranks, -1)


class Packed:
    """``PackedExpertParallel``'s ops (``moe_packed_*``, its ``sync=False`` dispatch): a value
    per row ``[R]``, ``offsets`` ``[L + 1]``."""

    prefix = "moe_packed"
    control = "offsets"
    located = True

    @staticmethod
    def rows(s) -> tuple[int, ...]:
        return (s.max_rows,)

    @staticmethod
    def control_dims(s) -> tuple[int, ...]:
        return (s.local_experts + 1,)

    @staticmethod
    def kept(offsets, rows: tuple[int, ...]):
        """``[R]`` bool: the rows received (below ``offsets[L]``)."""
        return torch.arange(rows[0], device=offsets.device, dtype=offsets.dtype) < offsets[-1]

    @staticmethod
    def experts(s, controls, device):
        """``[N, R]`` int32: the global expert of each row of every rank, the one whose span
        ``offsets[e]:offsets[e + 1]`` of that rank's ``controls`` (``[N, L + 1]``) holds it
        (rows past ``offsets[L]``: the last)."""
        at = torch.arange(s.max_rows, device=device, dtype=controls.dtype).expand(s.nranks, -1).contiguous()
        local = torch.searchsorted(controls[:, 1:].contiguous(), at, right=True).clamp(max=s.local_experts - 1)
        first = torch.arange(s.nranks, device=device, dtype=local.dtype)[:, None] * s.local_experts
        return (local + first).to(torch.int32)


def _op(mode, call: str):
    return getattr(torch.ops.ubnext, f"{mode.prefix}_{call}")


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


# ---- dispatch ------------------------------------------------------------------------------
def _dispatch_check(mode, s, x, topk_idx, topk_weights):
    if getattr(s, "fp8", False):
        raise UbnextError(f"ubnext::{mode.prefix}_dispatch: the object's dispatch is fp8 ((codes, scales) in place of "
                          f"recv_x), which the ops do not take; make it with fp8=False")
    return _check(f"{mode.prefix}_dispatch", s, {"x": (x, ("T", s.hidden), s.dtype),
                                                 **_routing(s, topk_idx, topk_weights)})


def _dispatch_run(mode, ep, x, topk_idx, topk_weights):
    s = _dispatch_check(mode, ep.shape, x, topk_idx, topk_weights)
    recv_x, control, handle = ep.dispatch(x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous())
    _latest[ep] = handle
    kept = mode.kept(control, mode.rows(s))
    return (torch.where(kept[..., None], recv_x, recv_x.new_zeros(())), control.clone(),
            torch.where(kept, handle.src, handle.src.new_full((), -1)),
            torch.where(kept, handle.weights, handle.weights.new_zeros(())))


def _dispatch_fake(mode, x, topk_idx, topk_weights, ep):
    s = _dispatch_check(mode, lookup(ep).shape, x, topk_idx, topk_weights)
    rows = mode.rows(s)
    return (x.new_empty((*rows, s.hidden)), x.new_empty(mode.control_dims(s), dtype=torch.int32),
            x.new_empty(rows, dtype=torch.int32), x.new_empty(rows, dtype=torch.float32))


def _dispatch_context(ctx, inputs, output):
    _, topk_idx, _, ctx.ep = inputs
    ctx.save_for_backward(topk_idx, output[2], output[1])
    ctx.set_materialize_grads(False)  # an output without a gradient: None, no collective of zeros


def _dispatch_backward(mode, ctx, grad_recv_x, grad_control, grad_src, grad_weights):
    """x's gradient (the combine of recv_x's with unit weights) and topk_weights' (each row's
    weight gradient back into its slot), by one op (the module's docstring says why)."""
    topk_idx, src, control = ctx.saved_tensors
    grad_recv_x = grad_recv_x if ctx.needs_input_grad[0] else None
    grad_weights = grad_weights if ctx.needs_input_grad[2] else None
    if grad_recv_x is None and grad_weights is None:
        return None, None, None, None
    located = (control,) if mode.located else ()  # a packed row's expert is read from the offsets
    grad_x, grad_w = _op(mode, "dispatch_backward")(
        None if grad_recv_x is None else grad_recv_x.contiguous(),
        None if grad_weights is None else grad_weights.contiguous(), src, *located, topk_idx, ctx.ep)
    return (None if grad_recv_x is None else grad_x), None, (None if grad_weights is None else grad_w), None


# ---- combine -------------------------------------------------------------------------------
def _combine_check(mode, s, y, weights, topk_idx):
    rows = mode.rows(s)
    return _check(f"{mode.prefix}_combine", s, {"y": (y, (*rows, s.hidden), s.dtype),
                                                "weights": (weights, rows, "float32"), **_routing(s, topk_idx)})


def _combine_run(mode, ep, y, weights, topk_idx):
    _combine_check(mode, ep.shape, y, weights, topk_idx)
    handle = _latest.get(ep)
    if handle is None or handle.tokens != topk_idx.shape[0]:
        raise UbnextError(f"ubnext::{mode.prefix}_combine: no dispatch of this object by ubnext.torch.moe with "
                          f"{topk_idx.shape[0]} tokens to combine (a combine pairs with the object's latest dispatch)")
    return ep.combine(y.contiguous(), handle, weights=weights.contiguous())


def _combine_fake(mode, y, weights, topk_idx, ep):
    s = _combine_check(mode, lookup(ep).shape, y, weights, topk_idx)
    return y.new_empty((topk_idx.shape[0], s.hidden))


def _combine_context(ctx, inputs, output):
    y, weights, topk_idx, ctx.ep = inputs
    ctx.save_for_backward(y, weights, topk_idx)


def _combine_backward(mode, ctx, grad_out):
    """From ``g``, the dispatch of grad_out (zero past the received rows): y's
    ``round(g * w)``, the weights' ``float32(sum float64(g) * float64(y))`` per row, both
    zero past the received rows."""
    y, weights, topk_idx = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None
    unused = torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
    g, control, _, _ = _op(mode, "dispatch")(grad_out.contiguous(), topk_idx, unused, ctx.ep)
    kept = mode.kept(control, tuple(y.shape[:-1]))
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_y = torch.where(kept[..., None], (g.float() * weights[..., None]).to(y.dtype), y.new_zeros(()))
    if ctx.needs_input_grad[1]:
        dots = (g.double() * y.double()).sum(-1).float()
        grad_w = torch.where(kept, dots, dots.new_zeros(()))
    return grad_y, grad_w, None, None


# ---- the backward-only op -----------------------------------------------------------------
def _dispatch_backward_check(mode, s, grad_recv_x, grad_weights, src, control, topk_idx):
    rows = mode.rows(s)
    given = {} if grad_recv_x is None else {"grad_recv_x": (grad_recv_x, (*rows, s.hidden), s.dtype)}
    if grad_weights is not None:
        given["grad_weights"] = (grad_weights, rows, "float32")
    located = {} if control is None else {mode.control: (control, mode.control_dims(s), "int32")}
    return _check(f"{mode.prefix}_dispatch_backward", s,
                  {**given, "src": (src, rows, "int32"), **located, **_routing(s, topk_idx)})


def _dispatch_backward_run(mode, ep, grad_recv_x, grad_weights, src, *rest):
    *located, topk_idx = rest
    s = _dispatch_backward_check(mode, ep.shape, grad_recv_x, grad_weights, src, (located or [None])[0], topk_idx)
    tokens, k = topk_idx.shape
    grad_x = (torch.zeros((tokens, s.hidden), dtype=_torch_dtype(s.dtype), device=src.device)
              if grad_recv_x is None else _x_gradient(mode, ep, s, grad_recv_x, topk_idx))
    grad_w = (torch.zeros((tokens, k), dtype=torch.float32, device=src.device)
              if grad_weights is None else _weights_gradient(mode, ep, s, grad_weights, src, located, topk_idx))
    return grad_x, grad_w


def _x_gradient(mode, ep, s, grad_recv_x, topk_idx):
    """A dispatch of zeros with ``topk_idx`` (the routing again), then the combine of
    ``grad_recv_x`` with unit weights."""
    zeros = grad_recv_x.new_zeros((topk_idx.shape[0], s.hidden))
    _, _, handle = ep.dispatch(zeros, topk_idx.contiguous(), torch.zeros(topk_idx.shape, dtype=torch.float32,
                                                                         device=topk_idx.device))
    _latest[ep] = handle
    ones = torch.ones(mode.rows(s), dtype=torch.float32, device=grad_recv_x.device)
    return ep.combine(grad_recv_x.contiguous(), handle, weights=ones)


def _weights_gradient(mode, ep, s, grad_weights, src, located, topk_idx):
    """Every rank's (value, source) pairs gathered, with its control where a row's expert
    needs it (one all-gather); this rank's sources (``src // M == rank``) scattered into
    ``[T, K]`` at (token ``src % M``, the slot of the row's expert in the token's top-k);
    slots no row holds are zero."""
    control = located[0] if located else None
    comm, rows = ep.comm, src.numel()
    pairs = torch.stack([grad_weights.contiguous().view(torch.int32), src.contiguous()], dim=-1).reshape(-1)
    every = all_gather_any(comm, pairs if control is None else torch.cat([pairs, control])).view(s.nranks, -1)
    tokens, k = topk_idx.shape
    out = torch.zeros(tokens * k + 1, dtype=torch.float32, device=grad_weights.device)
    if tokens:
        experts = mode.experts(s, None if control is None else every[:, 2 * rows:], src.device).reshape(-1)
        every = every[:, :2 * rows].reshape(-1, 2)
        values, sources = every[:, 0].contiguous().view(torch.float32), every[:, 1]
        mine = (sources >= 0) & (sources // s.max_tokens == comm.rank)
        token = torch.where(mine, sources % s.max_tokens, 0).long()
        match = topk_idx.index_select(0, token) == experts[:, None]
        mine = mine & match.any(-1)
        at = torch.where(mine, token * k + match.int().argmax(-1), tokens * k)
        out.scatter_(0, at, values)
    return out[:tokens * k].view(tokens, k)


def _dispatch_backward_fake(mode, grad_recv_x, grad_weights, src, *rest):
    *located, topk_idx, ep = rest
    s = _dispatch_backward_check(mode, lookup(ep).shape, grad_recv_x, grad_weights, src, (located or [None])[0],
                                 topk_idx)
    tokens, k = topk_idx.shape
    return src.new_empty((tokens, s.hidden), dtype=_torch_dtype(s.dtype)), src.new_empty((tokens, k),
                                                                                        dtype=torch.float32)


def _table(mode) -> dict[str, Op]:
    """The three ops of ``mode`` (``LowLatency`` or ``Packed``), named ``<prefix>_<call>``."""
    p, bound = mode.prefix, (lambda f: functools.partial(f, mode))
    located = f"Tensor {mode.control}, " if mode.located else ""
    return {
        f"{p}_dispatch": Op("(Tensor x, Tensor topk_idx, Tensor topk_weights, int ep) -> (Tensor, Tensor, Tensor, "
                            "Tensor)", (), bound(_dispatch_run), bound(_dispatch_fake), bound(_dispatch_backward),
                            _dispatch_context),
        f"{p}_combine": Op("(Tensor y, Tensor weights, Tensor topk_idx, int ep) -> Tensor", (), bound(_combine_run),
                           bound(_combine_fake), bound(_combine_backward), _combine_context),
        f"{p}_dispatch_backward": Op(f"(Tensor? grad_recv_x, Tensor? grad_weights, Tensor src, {located}"
                                     "Tensor topk_idx, int ep) -> (Tensor, Tensor)", (),
                                     bound(_dispatch_backward_run), bound(_dispatch_backward_fake)),
    }


MOE_OPS: dict[str, Op] = {**_table(LowLatency), **_table(Packed)}

register(MOE_OPS)
