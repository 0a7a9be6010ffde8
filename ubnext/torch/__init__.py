"""ubnext for PyTorch, shaped like ``torch.distributed``.

    import ubnext, ubnext.torch as ut
    comm = ubnext.Communicator()
    ut.all_reduce(t, op=ut.ReduceOp.SUM, group=comm)      # in place, like dist.all_reduce
    y = ut.functional.all_reduce(t, "sum", group=comm)    # new tensor, differentiable
    ut.reduce_scatter_tensor(shard, t, group=comm)        # into shard, like dist.reduce_scatter_tensor

Which form does what:

* ``all_reduce(t, op, group)``: in place (``torch.ops.ubnext.all_reduce_``), as
  ``torch.distributed.all_reduce``; no gradient. (``Communicator.all_reduce(t)`` instead
  returns a new tensor and leaves ``t`` unchanged.) ``precision="auto"`` (or a format)
  lets it quantize, e.g. a data-parallel gradient reduction.
* ``reduce_scatter_tensor(output, input, op, group)``, ``all_gather_into_tensor(output,
  input, group)``: into ``output`` (``torch.ops.ubnext.reduce_scatter_``,
  ``all_gather_``), as torch.distributed's; no gradient.
* ``functional.all_reduce``, ``functional.all_reduce_add_rmsnorm``: out of place, as torch's
  functional collectives; differentiable with tensor-parallel meanings;
  ``functional.copy_to_group``: forward identity, backward all-reduce (``sum_gradients``:
  of several tensors in one all-reduce);
  ``functional.reduce_scatter``, ``functional.all_gather``,
  ``functional.reduce_scatter_add_rmsnorm``: the same with sequence-parallel meanings
  (each other's transposes; the fused op's weight and bias gradients are this rank's
  rows' partial sums).
* ``torch.ops.ubnext.*``: the custom ops underneath (``_ops.OPS``), with fake
  implementations, so ``torch.compile(fullgraph=True)`` traces through every form and a
  compiled function replays in a CUDA graph. The ``Communicator``'s own collectives on
  torch tensors become these ops under torch.compile too (``_traced``).
* ``all_gather_matmul(a_shard, b, group=comm)``, ``matmul_reduce_scatter(a, b,
  group=comm)`` (``functional``'s, re-exported): the sequence-parallel GEMMs with their
  communication under them (``torch.ops.ubnext.all_gather_matmul``,
  ``matmul_reduce_scatter``; shaped like torch's async-TP ops; ``_overlap``);
  ``matmul_reduce_scatter_add_rmsnorm(a, b, residual, weight, bias, eps, group=comm)``:
  the latter with the bias + residual add and RMSNorm of its rows in its reduction's pass.
* ``moe.dispatch(x, topk_idx, topk_weights, ep)``, ``moe.combine(y, handle)``: the
  expert-parallel calls of a ``ubnext.ExpertParallel`` (``torch.ops.ubnext.moe_*``),
  differentiable (dispatch's backward a combine, combine's a dispatch), traceable and
  capturable; ``moe.packed_dispatch`` the same of a ``ubnext.PackedExpertParallel``
  (``torch.ops.ubnext.moe_packed_*``: its packed ``[R, H]`` layout and offsets).
* ``tp``: tensor-parallel layers built on them (``sequence_parallel=True``: the overlapped
  GEMMs); ``BufferPlan``: planned symmetric buffers the row-parallel GEMMs write into.

``group`` is a ``ubnext.Communicator`` (or the int from ``handle(comm)``, which the ops take).

Nothing here quantizes unless its call or layer is given ``precision=``: a communicator's
opt-in (``Communicator(quantized=...)``, ``UBNEXT_QUANTIZED``) serves the Communicator's own
calls with ``precision="auto"``, never a layer, an op's backward or a call that did not ask.
"""

from __future__ import annotations

from torch.distributed import ReduceOp

from ubnext._interop import arrays as _arrays
from ubnext._protocol.quant import EXACT

from . import functional, moe
from ._planner import BufferPlan
from ._reduce_op import op_name
from ._registry import handle
from .backend import register as _register_backend
from .functional import all_gather_matmul, matmul_reduce_scatter, matmul_reduce_scatter_add_rmsnorm
from .tp import (
    AddRMSNormEpilogue,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttentionOutput,
    TensorParallelMLP,
)

_register_backend()  # the "ubnext" torch.distributed backend (ubnext.torch.backend)
_arrays.bind_torch()  # torch is imported: before any compiled collective (_interop.arrays.bind_torch)

# ReduceOp is torch.distributed's, re-exported (documented there)
__all__ = ["AddRMSNormEpilogue", "BufferPlan", "ColumnParallelLinear", "RowParallelLinear",
           "TensorParallelAttentionOutput", "TensorParallelMLP", "all_gather_into_tensor", "all_gather_matmul",
           "all_reduce", "functional", "handle", "matmul_reduce_scatter", "matmul_reduce_scatter_add_rmsnorm",
           "moe", "op_name", "reduce_scatter_tensor"]


class _Done:
    """The ``async_op=True`` result: the work is already ordered on the current stream,
    as NCCL's ``Work.wait()`` orders it, so waiting adds nothing."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, precision: str = EXACT):
    """All-reduces ``tensor`` in place, like ``torch.distributed.all_reduce``.

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call (as ``Communicator.all_reduce``);
    torch.compile(fullgraph=True) traces it.

    Args:
        tensor: CUDA tensor on the communicator's device, reduced in place.
        op: ``ReduceOp.SUM``, ``AVG``, ``MAX`` or ``MIN`` (or their names).
        group: the ``ubnext.Communicator`` (or its handle); required.
        async_op: as torch's: with True, a work object whose ``wait()`` returns at once
            (the call is ordered on the current stream, never blocking the host).
        precision: ``"exact"`` (default): full precision, whatever the communicator opted
            in to; ``"auto"``: the communicator's choice (with ``UBNEXT_QUANTIZED`` /
            ``Communicator(quantized=...)``, its format from the measured size: e.g. a
            data-parallel gradient reduction); ``"int8"``, ``"fp8"``, ``"int4"``: that
            format (opted-in communicators only); as ``Communicator.all_reduce``'s.

    Returns:
        None, or the work object with ``async_op``.

    Raises:
        UbnextError: an op ubnext does not reduce (PRODUCT, bitwise, PREMUL_SUM), no group,
            or what ``Communicator.all_reduce`` raises (a precision it cannot take).
    """
    import torch

    torch.ops.ubnext.all_reduce_(tensor, op_name(op), precision, handle(functional._required(group)))
    return _Done() if async_op else None


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False,
                          precision: str = EXACT):
    """Reduce-scatters ``input`` into ``output``, like ``torch.distributed.reduce_scatter_tensor``:
    rank r's ``output`` gets elements ``[r * k, (r + 1) * k)`` of the reduction of every
    rank's ``input`` (size x k elements).

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call (as ``Communicator.reduce_scatter``);
    torch.compile(fullgraph=True) traces it.

    Args:
        output: CUDA tensor of k elements, input's dtype, written (``input``'s slice r for in place).
        input: CUDA tensor of size x k elements on the communicator's device.
        op: ``ReduceOp.SUM``, ``AVG``, ``MAX`` or ``MIN`` (or their names).
        group: the ``ubnext.Communicator`` (or its handle); required.
        async_op: as for ``all_reduce``.
        precision: as for ``all_reduce`` (default ``"exact"``; ``"auto"``: the
            communicator's choice, with the reduce-scatter's thresholds).

    Returns:
        None, or the work object with ``async_op``.

    Raises:
        UbnextError: an op ubnext does not reduce, no group, or what
            ``Communicator.reduce_scatter`` raises (a precision it cannot take).
    """
    import torch

    torch.ops.ubnext.reduce_scatter_(output, input, op_name(op), precision, handle(functional._required(group)))
    return _Done() if async_op else None


def all_gather_into_tensor(output, input, group=None, async_op: bool = False):
    """Gathers every rank's ``input`` into ``output``, like
    ``torch.distributed.all_gather_into_tensor``: rank r's ``input`` (k elements) at
    elements ``[r * k, (r + 1) * k)`` of ``output`` on every rank.

    Collective: yes: every rank of ``group`` calls it, in the same order.
    Graph-capturable: yes, after a first eager call (as ``Communicator.all_gather``);
    torch.compile(fullgraph=True) traces it.

    Args:
        output: CUDA tensor of size x k elements, input's dtype, written.
        input: CUDA tensor of k elements (the same k on every rank), on the communicator's
            device (``output``'s slice r for in place).
        group: the ``ubnext.Communicator`` (or its handle); required.
        async_op: as for ``all_reduce``.

    Returns:
        None, or the work object with ``async_op``.

    Raises:
        UbnextError: no group, or what ``Communicator.all_gather`` raises.
    """
    import torch

    torch.ops.ubnext.all_gather_(output, input, handle(functional._required(group)))
    return _Done() if async_op else None
