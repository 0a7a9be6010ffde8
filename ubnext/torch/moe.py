"""Expert-parallel dispatch and combine for PyTorch: differentiable, traceable by
torch.compile, capturable in CUDA graphs (docs/moe.md, "In PyTorch").

    import ubnext, ubnext.torch as ut
    ep = ubnext.ExpertParallel(comm, num_experts=64, hidden=1024, max_tokens=128, top_k=4, framework="torch")
    recv_x, recv_counts, handle = ut.moe.dispatch(x, topk_idx, topk_weights, ep)
    y = experts(recv_x, recv_counts)            # [L, C, H], rows past recv_counts are zero
    out = ut.moe.combine(y, handle)             # [T, H]: sum of w * y over each token's experts

The throughput mode (``ubnext.PackedExpertParallel``): ``packed_dispatch`` gives
``recv_x`` ``[R, H]`` and ``offsets`` ``[L + 1]`` (the object's ``sync=False`` form: static
shapes, so it traces and captures as the low-latency calls do; rows from ``offsets[L]``
on are zero), and ``combine`` takes its handle as it takes a low-latency one.

The calls are ``torch.ops.ubnext.moe_dispatch`` and ``moe_combine`` (``_moe_ops``; the
throughput mode's ``moe_packed_dispatch`` and ``moe_packed_combine``), which
name the object by its int handle, so a compiled function reads a constant. Their outputs
are new tensors (copies of the object's buffers, rows past the counts zero), which a
later dispatch does not overwrite. Gradients: x's and topk_weights' (through the
handle's weights, which combine multiplies by) from dispatch, y's and the weights' from
combine; a combine pairs with the object's latest dispatch of this module, as
``ExpertParallel.combine`` pairs with its latest handle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _moe_ops  # noqa: F401 (defines torch.ops.ubnext.moe_*)
from ._registry import handle as _handle

__all__ = ["DispatchHandle", "combine", "dispatch", "packed_dispatch"]


class DispatchHandle(NamedTuple):
    """What ``combine`` needs of a ``dispatch``.

    Attributes:
        src: ``[L, C]`` (packed: ``[R]``) int32, ``source_rank * max_tokens + token`` of
            each row (-1 past the rows received).
        weights: ``[L, C]`` (packed: ``[R]``) float32, each row's router weight (zero past
            the rows received); the topk_weights' gradient flows through it.
        topk_idx: the dispatch's ``[T, K]`` routing (combine's output has T rows, and its
            backward dispatches its gradient with it).
        ep: the object's int handle.
        packed: whether ``packed_dispatch`` made it (combine then calls the throughput
            mode's op).

    Collective: no (made by ``dispatch``).
    Graph-capturable: yes (plain tensors and an int).

    Raises:
        Nothing: a tuple.
    """

    src: torch.Tensor
    weights: torch.Tensor
    topk_idx: torch.Tensor
    ep: int
    packed: bool = False


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, ep):
    """Each token to the GPUs of its experts, laid out per local expert
    (``ExpertParallel.dispatch`` as ``torch.ops.ubnext.moe_dispatch``).

    Differentiable in ``x`` (its gradient: each row's gradient summed back into its token,
    a combine with unit weights, in fp32 rounded once) and in ``topk_weights`` (through
    ``handle.weights``: each row's weight gradient back into its slot). The backward
    dispatches once more (the combine needs the forward's routing).

    Collective: yes: every rank calls it, in the same order among the object's calls.
    Graph-capturable: yes (static shapes); torch.compile(fullgraph=True) traces it.

    Args:
        x: ``[T, H]`` of the object's dtype, T <= max_tokens, on its device.
        topk_idx: ``[T, K]`` int32: each token's experts, -1 for a dropped slot.
        topk_weights: ``[T, K]`` float32: the router's weight of each slot.
        ep: the ``ubnext.ExpertParallel``, made with ``framework="torch"`` and without
            ``fp8`` (or its handle, ``ubnext.torch.handle(ep)``).

    Returns:
        ``(recv_x, recv_counts, handle)``: ``recv_x`` ``[L, C, H]`` (row j of local expert
        e: the j-th token routed to it, by source rank then token index; zero from
        ``recv_counts[e]`` on), ``recv_counts`` ``[L]`` int32, ``handle`` (DispatchHandle).

    Raises:
        UbnextError: shapes or dtypes, an fp8 object (before any launch), and what
            ``ExpertParallel.dispatch`` raises.
    """
    h = _handle(ep)
    recv_x, counts, src, weights = torch.ops.ubnext.moe_dispatch(x, topk_idx, topk_weights, h)
    return recv_x, counts, DispatchHandle(src, weights, topk_idx, h)


def packed_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, ep):
    """Each token to the GPUs of its experts, laid out packed, expert after expert
    (``PackedExpertParallel.dispatch(..., sync=False)`` as ``torch.ops.ubnext.moe_packed_dispatch``).

    Differentiable as ``dispatch``: in ``x`` (a combine with unit weights of recv_x's
    gradient, in fp32 rounded once) and in ``topk_weights`` (through ``handle.weights``).
    The backward dispatches once more (the combine needs the forward's routing).

    Collective: yes: every rank calls it, in the same order among the object's calls.
    Graph-capturable: yes (static shapes: R rows, never a host read of the row count);
    torch.compile(fullgraph=True) traces it.

    Args:
        x: ``[T, H]`` of the object's dtype, T <= max_tokens, on its device.
        topk_idx: ``[T, K]`` int32: each token's experts, -1 for a dropped slot.
        topk_weights: ``[T, K]`` float32: the router's weight of each slot.
        ep: the ``ubnext.PackedExpertParallel``, made with ``framework="torch"`` (or its
            handle, ``ubnext.torch.handle(ep)``, which torch.compile needs made before it
            traces).

    Returns:
        ``(recv_x, offsets, handle)``: ``recv_x`` ``[R, H]`` (local expert e's rows
        ``offsets[e]:offsets[e + 1]``, each expert's by source rank then token index; zero
        from ``offsets[L]`` on), ``offsets`` ``[L + 1]`` int32, ``handle`` (DispatchHandle,
        ``packed`` True).

    Raises:
        UbnextError: shapes or dtypes (before any launch), and what
            ``PackedExpertParallel.dispatch`` raises.
    """
    h = _handle(ep)
    recv_x, offsets, src, weights = torch.ops.ubnext.moe_packed_dispatch(x, topk_idx, topk_weights, h)
    return recv_x, offsets, DispatchHandle(src, weights, topk_idx, h, True)


def combine(y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' outputs summed back into each token with its weights, in the tokens'
    order (``ExpertParallel.combine`` as ``torch.ops.ubnext.moe_combine``): ``out[t] =
    round(sum over GPUs in rank order of (sum over the token's slots there, in top-k
    order, of w * y))`` in fp32, rounded once.

    Differentiable in ``y`` (``round(w * g)``, g the dispatched gradient of out) and in the
    weights (``float32(sum float64(g) * float64(y))`` per row); zero past the counts.

    Collective: yes, as ``dispatch``.
    Graph-capturable: yes; torch.compile(fullgraph=True) traces it.

    Args:
        y: ``[L, C, H]`` (packed: ``[R, H]``) of the object's dtype: the experts' outputs,
            row for row as recv_x.
        handle: the DispatchHandle of the object's latest ``dispatch`` or ``packed_dispatch``.
        weights: ``[L, C]`` (packed: ``[R]``) float32 in place of ``handle.weights``
            (ones: the plain sum of each token's rows), or None.

    Returns:
        ``[T, H]`` of the dtype.

    Raises:
        UbnextError: shapes or dtypes, no dispatch of this module with T tokens before it,
            and what ``ExpertParallel.combine`` raises (a dispatch of the object other than
            this module's came between).
    """
    w = handle.weights if weights is None else weights
    op = torch.ops.ubnext.moe_packed_combine if handle.packed else torch.ops.ubnext.moe_combine
    return op(y, w, handle.topk_idx, handle.ep)
