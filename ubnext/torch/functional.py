"""Functional (out-of-place, differentiable) collectives, as torch's functional collectives.

Each returns a new tensor and leaves its inputs unchanged; torch.compile(fullgraph=True)
traces them (they are ``torch.ops.ubnext`` custom ops), and their gradients carry the
tensor- and sequence-parallel meanings (see ``all_reduce``, ``copy_to_group``,
``reduce_scatter``, ``all_gather``, ``sum_gradients``).

None of them quantizes unless its call says so: ``all_reduce`` and ``reduce_scatter``
take ``precision=`` (default ``"exact"``; ``"auto"`` follows the communicator's opt-in,
``UBNEXT_QUANTIZED``, as ``Communicator.all_reduce`` does), and every backward runs in
full precision.
"""

from __future__ import annotations

import torch

from ubnext._protocol.quant import EXACT

from . import _ops  # noqa: F401 (defines torch.ops.ubnext)
from ._reduce_op import op_name
from ._registry import handle

__all__ = ["all_gather", "all_gather_matmul", "all_reduce", "all_reduce_add_rmsnorm", "copy_to_group",
           "matmul_reduce_scatter", "matmul_reduce_scatter_add_rmsnorm", "reduce_scatter", "reduce_scatter_add_rmsnorm",
           "sum_gradients"]


def all_reduce(tensor: torch.Tensor, op="sum", group=None, precision: str = EXACT) -> torch.Tensor:
    """All-reduce into a new tensor (``torch.ops.ubnext.all_reduce``); ``tensor`` is unchanged.

    The gradient is the tensor-parallel "reduce from the group" one: a row-parallel
    layer's partial outputs summed once into a replicated result, so the gradient of the
    result passes through to every rank's partial (sum; avg divides it by the ranks).

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call (as ``Communicator.all_reduce``).

    Args:
        tensor: CUDA tensor on the communicator's device.
        op: ``torch.distributed.ReduceOp`` SUM/AVG/MAX/MIN, or ``"sum"``/``"avg"``/``"max"``/``"min"``.
        group: the ``Communicator`` (or its handle from ``ubnext.torch.handle``).
        precision: ``"exact"`` (default): full precision, whatever the communicator opted
            in to; ``"auto"``: the communicator's choice (its quantized opt-in from the
            measured size, ``UBNEXT_QUANTIZED``; ``Communicator.all_reduce``'s default);
            ``"int8"``, ``"fp8"`` or ``"int4"``: that quantized format (opted-in
            communicators only). The gradient passes through unquantized.

    Returns:
        The reduced tensor.

    Raises:
        UbnextError: an op ubnext does not reduce (PRODUCT, bitwise, PREMUL_SUM), no group,
            or what ``Communicator.all_reduce`` raises (a precision it cannot take).
    """
    return torch.ops.ubnext.all_reduce(tensor, op_name(op), precision, handle(_required(group)))


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           bias: torch.Tensor | None = None, eps: float = 1e-6, group=None):
    """All-reduce, bias + residual add and RMSNorm in one kernel, into new tensors
    (``torch.ops.ubnext.all_reduce_add_rmsnorm``; as ``Communicator.all_reduce_add_rmsnorm``).

    Differentiable: the gradient of the sum ``residual_out`` (the one through the norm
    plus that of ``residual_out`` itself) goes to ``x`` (passed through, as for
    ``all_reduce``) and to ``residual``; ``weight`` and ``bias`` get theirs (the same on
    every rank, as the operands are).

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call of the same shape.

    Args:
        x: 2-D CUDA tensor (tokens x hidden), this rank's partial sum.
        residual: x's shape and dtype, or None.
        weight: 1-D, hidden elements.
        bias: 1-D, hidden elements, or None.
        eps: finite, >= 0.
        group: the ``Communicator`` (or its handle).

    Returns:
        ``(normed, residual_out)``.

    Raises:
        UbnextError: what ``Communicator.all_reduce_add_rmsnorm`` raises; no group.
    """
    return torch.ops.ubnext.all_reduce_add_rmsnorm(x, residual, weight, bias, float(eps), handle(_required(group)))


def reduce_scatter(tensor: torch.Tensor, op="sum", group=None, precision: str = EXACT) -> torch.Tensor:
    """Reduce-scatter into a new tensor (``torch.ops.ubnext.reduce_scatter``; as
    ``Communicator.reduce_scatter``): rank r gets slice r of the reduction of every
    rank's ``tensor`` (size x k elements); ``tensor`` is unchanged.

    The gradient is the sequence-parallel one: the all-gather of the result's gradient
    (avg: divided by the ranks), each rank's slice coming from the rank that holds it;
    max and min raise in backward.

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call (as ``Communicator.reduce_scatter``).

    Args:
        tensor: CUDA tensor of size x k elements, on the communicator's device.
        op: ``torch.distributed.ReduceOp`` SUM/AVG/MAX/MIN, or ``"sum"``/``"avg"``/``"max"``/``"min"``.
        group: the ``Communicator`` (or its handle from ``ubnext.torch.handle``).
        precision: as for ``all_reduce`` (default ``"exact"``; ``"auto"``: the
            communicator's choice, with the reduce-scatter's thresholds); the gradient's
            all-gather moves the gradient unquantized.

    Returns:
        This rank's slice: shape (tensor.shape[0] / size, *tensor.shape[1:]) where size
        divides tensor.shape[0], else (k,).

    Raises:
        UbnextError: an op ubnext does not reduce, no group, or what
            ``Communicator.reduce_scatter`` raises (a count the ranks do not divide, a
            precision it cannot take).
    """
    return torch.ops.ubnext.reduce_scatter(tensor, op_name(op), precision, handle(_required(group)))


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather into a new tensor (``torch.ops.ubnext.all_gather``; as
    ``Communicator.all_gather``): every rank's ``tensor`` in rank order.

    The gradient is the sequence-parallel one: the reduce-scatter (sum) of the result's
    gradient, every rank's gradient of slice r summed into rank r's input (in full precision).

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call (as ``Communicator.all_gather``).

    Args:
        tensor: CUDA tensor, the same shape on every rank, on the communicator's device.
        group: the ``Communicator`` (or its handle).

    Returns:
        Shape (size * tensor.shape[0], *tensor.shape[1:]) ((size,) for a 0-d tensor).

    Raises:
        UbnextError: no group, or what ``Communicator.all_gather`` raises.
    """
    return torch.ops.ubnext.all_gather(tensor, handle(_required(group)))


def reduce_scatter_add_rmsnorm(x: torch.Tensor, residual_shard: torch.Tensor | None, weight: torch.Tensor,
                               bias: torch.Tensor | None = None, eps: float = 1e-6, group=None):
    """The sequence-parallel step, into new tensors
    (``torch.ops.ubnext.reduce_scatter_add_rmsnorm``; as
    ``Communicator.reduce_scatter_add_rmsnorm``): reduce-scatter of ``x`` by rows, bias +
    residual-shard add and RMSNorm of this rank's rows.

    Differentiable: the gradient of this rank's pre-norm sum ``residual_shard_out`` (the
    one through the norm plus that of ``residual_shard_out`` itself) goes to
    ``residual_shard``, and, all-gathered, to ``x`` (every rank's rows; collective in
    backward). ``weight`` and ``bias`` get the gradient of this rank's rows only: partial
    sums, different on every rank; pass them through ``sum_gradients`` first
    (``weight, bias = sum_gradients(weight, bias, group=comm)``: each backward's gradients
    summed over the ranks as they arrive, one all-reduce), or sum them some other way
    before the optimizer step, as Megatron-LM all-reduces its sequence-parallel norm
    weights' gradients. (The layers of ``ubnext.torch.tp`` do the former.)

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call of the same shape.

    Args:
        x: 2-D CUDA tensor (rows x hidden), rows a multiple of the ranks, this rank's partial sum.
        residual_shard: (rows / size) x hidden, x's dtype, this rank's rows of the residual; or None.
        weight: 1-D, hidden elements (the same on every rank).
        bias: 1-D, hidden elements (the same on every rank), or None.
        eps: finite, >= 0.
        group: the ``Communicator`` (or its handle).

    Returns:
        ``(normed_shard, residual_shard_out)``, (rows / size) x hidden each.

    Raises:
        UbnextError: what ``Communicator.reduce_scatter_add_rmsnorm`` raises; no group.
    """
    return torch.ops.ubnext.reduce_scatter_add_rmsnorm(x, residual_shard, weight, bias, float(eps),
                                                       handle(_required(group)))


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int = 0, group=None):
    """Every rank's ``a_shard`` gathered by rows and multiplied by ``b``, the transfers under
    the GEMMs (``torch.ops.ubnext.all_gather_matmul``): as
    ``torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, group_name)``, with one
    ``b`` and its product returned as a tensor instead of a list.

    Each rank multiplies its own rows first, then each peer's rows as they arrive in its
    result (pulled by copy engines from the peer's symmetric pool, in rounds of at most
    half of a bounded area: ``ubnext.torch._overlap``). Every block of rows is one GEMM of
    ``b``, so the product equals, bit for bit, ``torch.matmul`` of the same row blocks.
    Without a pool (NCCL only) it runs the all-gather, then the GEMM.

    Differentiable: ``a_shard``'s gradient is ``matmul_reduce_scatter(grad, b.T)`` (plus
    the reduce-scatter of the gathered output's own gradient), ``b``'s ``gathered.T @ grad``.

    Collective: yes: every rank of ``group`` calls it, in the same order (its backward too),
    with ``a_shard`` of the same shape and dtype on every rank (``b``'s n may differ). The
    ranks' shapes are not compared: where they differ, the ranks' transfers and barriers
    differ, the results are undefined and a rank may wait until ``UBNEXT_TIMEOUT_S``
    (CollectiveTimeoutError).
    Graph-capturable: yes, after a first eager call on the communicator (which allocates
    the overlap area of the pool, collectively, and compiles the barrier's kernel; a first
    call under capture raises); torch.compile(fullgraph=True) traces it.

    Args:
        a_shard: (rows, ..., k) CUDA tensor of float16, bfloat16, float32 or float64 on the
            communicator's device, this rank's rows (the same shape on every rank).
        b: (k, n), a_shard's dtype and device (any strides, e.g. a weight's ``.t()``); n
            this rank's own.
        gather_dim: 0 (rows; the only one taken).
        group: the ``Communicator`` (or its handle).

    Returns:
        ``(gathered, out)``: (size * rows, ..., k) and (size * rows, ..., n).

    Raises:
        UbnextError: another gather_dim, shapes that do not multiply, dtypes or devices that
            differ, another dtype, a device other than the communicator's, no group, a
            communicator's first overlapped call under CUDA graph capture (all before any
            work is queued); what ``Communicator.all_reduce`` (the barrier) raises.
    """
    _dim_zero("all_gather_matmul", "gather_dim", gather_dim)
    return torch.ops.ubnext.all_gather_matmul(a_shard, b, handle(_required(group)))


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, reduce_op: str = "sum", scatter_dim: int = 0,
                          group=None) -> torch.Tensor:
    """``a @ b`` summed over the ranks and scattered by rows, the transfers under the GEMMs
    (``torch.ops.ubnext.matmul_reduce_scatter``): as
    ``torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)``.

    Each rank multiplies every other rank's rows first (its own last), pushing each product
    into that rank's symmetric pool by copy engine while the next GEMM runs; each rank then
    sums its received blocks in rank order 0, 1, ... in fp32 (float64 in float64), rounded
    once. The result equals, bit for bit, the same row blocks' ``torch.matmul`` products
    reduced in that order. Without a pool (NCCL only) it runs the GEMM, then the reduce-scatter.

    Differentiable: ``a``'s gradient is ``all_gather_matmul(grad, b.T)``'s product, ``b``'s
    ``a.T @ all_gather(grad)`` (the gathered gradient of the same call).

    Collective: yes: every rank of ``group`` calls it, in the same order (its backward too),
    with the same dtype, ``a``'s rows and ``b``'s n on every rank (k may differ). The ranks'
    shapes are not compared: where they differ, the ranks' transfers and barriers differ,
    the results are undefined and a rank may wait until ``UBNEXT_TIMEOUT_S``
    (CollectiveTimeoutError).
    Graph-capturable: yes, after a first eager call on the communicator (as
    ``all_gather_matmul``; a first call under capture raises); torch.compile(fullgraph=True)
    traces it.

    Args:
        a: (size * rows, ..., k) CUDA tensor of float16, bfloat16, float32 or float64 on the
            communicator's device, this rank's partial operand (size * rows, ... the same on
            every rank; k this rank's own).
        b: (k, n), a's dtype and device (any strides); n the same on every rank.
        reduce_op: ``"sum"`` (the only one taken).
        scatter_dim: 0 (rows; the only one taken).
        group: the ``Communicator`` (or its handle).

    Returns:
        (rows, ..., n): this rank's rows of the sum.

    Raises:
        UbnextError: another reduce_op or scatter_dim, rows the ranks do not divide, shapes
            that do not multiply, dtypes or devices that differ, another dtype, a device
            other than the communicator's, no group, a communicator's first overlapped call
            under CUDA graph capture (all before any work is queued); what
            ``Communicator.all_reduce`` (the barrier) raises.
    """
    _dim_zero("matmul_reduce_scatter", "scatter_dim", scatter_dim)
    if op_name(reduce_op) != "sum":
        from ubnext._protocol.errors import UbnextError

        raise UbnextError(f"ubnext.torch.matmul_reduce_scatter: reduce_op must be 'sum', got {reduce_op!r}")
    return torch.ops.ubnext.matmul_reduce_scatter(a, b, handle(_required(group)))


def matmul_reduce_scatter_add_rmsnorm(a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None,
                                      weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-6,
                                      group=None):
    """The sequence-parallel row-parallel epilogue in one op
    (``torch.ops.ubnext.matmul_reduce_scatter_add_rmsnorm``): this rank's rows of ``a @ b``
    summed over the ranks, as ``matmul_reduce_scatter`` computes them (the transfers under
    the GEMMs), plus ``bias`` and ``residual``, RMS-normalized with ``weight``::

        residual_out = round(matmul_reduce_scatter(a, b) + bias + residual)
        normed = round(residual_out / sqrt(mean(residual_out ** 2, -1) + eps) * weight)

    Each round's sum covers whole rows, so its reduction kernel finishes them in the same
    pass (the slots summed in rank order in fp32 and rounded once to a's dtype, then the
    add + RMSNorm in fp32 with the arithmetic of ``Communicator.reduce_scatter_add_rmsnorm``'s
    separate kernel) instead of a norm pass of its own afterwards. ``residual_out`` equals
    ``matmul_reduce_scatter`` followed by the add in torch (``(y.float() + bias.float()) +
    residual.float()``, rounded once) bit for bit, but for one sign: a missing bias or
    residual is added as +0.0 (as in every fused kernel), so where torch's sum without it
    is -0.0 this one is +0.0. ``normed`` equals that kernel's arithmetic on it (IEEE
    division, square root and reciprocal, a fixed tree over the row, with the row group
    of this launch: the threads per row follow each round's rows, so the bits may differ
    from the separate kernel's launch over all of the rank's rows) bit for bit, and an
    RMSNorm in torch (``rsqrt``, torch's reduction order) to within about one rounding of
    a's dtype.
    Without a pool (NCCL only) or at one rank it runs the GEMM, then
    ``Communicator.reduce_scatter_add_rmsnorm``.

    Differentiable: the gradient of the pre-norm sum ``residual_out`` (the one through the
    norm plus that of ``residual_out`` itself) goes to ``residual`` and, through
    ``matmul_reduce_scatter``'s backward (``all_gather_matmul``), to ``a`` and ``b``.
    ``weight`` and ``bias`` get the gradient of this rank's rows only: partial sums, to be
    summed over the ranks (as for ``reduce_scatter_add_rmsnorm``: ``sum_gradients``).

    Collective: yes: every rank of ``group`` calls it, in the same order (its backward too),
    with the same dtype, ``a``'s rows and ``b``'s n on every rank (as ``matmul_reduce_scatter``).
    Graph-capturable: yes, after a first eager overlapped call on the communicator (as
    ``matmul_reduce_scatter``: a first call under capture raises; the first call compiles
    both of the reduction's kernels); torch.compile(fullgraph=True) traces it.

    Args:
        a: (size * rows, ..., k) CUDA tensor of bfloat16, float16 or float32 on the
            communicator's device, this rank's partial operand (as for ``matmul_reduce_scatter``).
        b: (k, n), a's dtype and device (any strides: a row-parallel weight's ``.t()``).
        residual: (rows, ..., n), a's dtype and device, this rank's rows; or None.
        weight: n elements, a's dtype and device (the same on every rank).
        bias: n elements, a's dtype and device (the same on every rank), or None.
        eps: finite, >= 0.
        group: the ``Communicator`` (or its handle).

    Returns:
        ``(normed, residual_out)``: (rows, ..., n) each, this rank's rows.

    Raises:
        UbnextError: what ``matmul_reduce_scatter`` raises; float64 (the add + RMSNorm
            takes bfloat16, float16 and float32); a residual, weight or bias of another
            shape, dtype or device; an eps that is not finite and >= 0 (all before any
            work is queued); no group.
    """
    return torch.ops.ubnext.matmul_reduce_scatter_add_rmsnorm(a, b, residual, weight, bias, float(eps),
                                                              handle(_required(group)))


def _dim_zero(name: str, what: str, dim: int) -> None:
    if dim != 0:
        from ubnext._protocol.errors import UbnextError

        raise UbnextError(f"ubnext.torch.{name}: {what} must be 0 (rows), got {dim}")


class _SumGradients(torch.autograd.Function):
    """Views of the tensors forward; their gradients summed over the ranks backward, in one
    all-reduce of them all (flattened end to end, in full precision)."""

    @staticmethod
    def forward(ctx, group: int, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        given = [g for g in grads if g is not None]
        if not given:
            return (None, *grads)
        flat = torch.cat([g.reshape(-1) for g in given]) if len(given) > 1 else given[0].reshape(-1).contiguous()
        summed = iter(torch.ops.ubnext.all_reduce(flat, "sum", EXACT, ctx.group).split([g.numel() for g in given]))
        return (None, *(None if g is None else next(summed).view(g.shape).to(g.dtype) for g in grads))


def sum_gradients(*tensors: torch.Tensor, group=None) -> tuple:
    """The tensors themselves forward (views), their gradients summed over the ranks
    backward: each backward's incoming gradients, before autograd adds them to ``.grad``
    (so accumulating micro-batches counts each once), all in one all-reduce (the
    gradients flattened end to end; one dtype: torch.cat's promotion otherwise), in full
    precision, the same bits on every rank. For parameters that every rank holds alike
    but whose gradient each rank computes from its own rows only: the sequence-parallel
    ops' norm weight and bias (``reduce_scatter_add_rmsnorm``,
    ``matmul_reduce_scatter_add_rmsnorm``), a bias added to this rank's rows.
    ``copy_to_group`` is the same for one tensor.

    Collective: yes in backward (one all-reduce per call, where a gradient arrives; every
    rank's backward must reach it); the forward moves nothing.
    Graph-capturable: yes.

    Args:
        *tensors: the tensors (None passes through as None).
        group: the ``Communicator`` (or its handle).

    Returns:
        A tuple of views of the tensors (None for None).

    Raises:
        UbnextError: no group; in backward, what ``Communicator.all_reduce`` raises.
    """
    h = handle(_required(group))
    real = [t for t in tensors if t is not None]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in real)):
        return tuple(tensors)
    views = iter(_SumGradients.apply(h, *real))
    return tuple(None if t is None else next(views) for t in tensors)


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """The input of a column-parallel layer: ``x`` itself forward (a view), its gradient
    all-reduced backward (each rank's shard contributes a partial gradient of the
    replicated input), in full precision.

    Collective: yes in backward (an all-reduce per call); the forward moves nothing.
    Graph-capturable: yes.

    Args:
        x: the replicated input.
        group: the ``Communicator`` (or its handle).

    Returns:
        A view of ``x``.

    Raises:
        UbnextError: no group.
    """
    return _SumGradients.apply(handle(_required(group)), x)[0]


def _required(group):
    if group is None:
        from ubnext._protocol.errors import UbnextError

        raise UbnextError("ubnext.torch: pass group=<ubnext.Communicator>; ubnext has no default group")
    return group
