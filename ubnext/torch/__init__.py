"""ubnext for PyTorch, shaped like ``torch.distributed``.

    import ubnext, ubnext.torch as ut
    comm = ubnext.Communicator()
    ut.all_reduce(t, op=ut.ReduceOp.SUM, group=comm)      # in place, like dist.all_reduce
    y = ut.functional.all_reduce(t, "sum", group=comm)    # new tensor, differentiable

Which form does what:

* ``all_reduce(t, op, group)``: in place (``torch.ops.ubnext.all_reduce_``), as
  ``torch.distributed.all_reduce``; no gradient. (``Communicator.all_reduce(t)`` instead
  returns a new tensor and leaves ``t`` unchanged.)
* ``functional.all_reduce``, ``functional.all_reduce_add_rmsnorm``: out of place, as torch's
  functional collectives; differentiable with tensor-parallel meanings;
  ``functional.copy_to_group``: forward identity, backward all-reduce.
* ``torch.ops.ubnext.*``: the custom ops underneath (``_ops.OPS``), with fake
  implementations, so ``torch.compile(fullgraph=True)`` traces through every form and a
  compiled function replays in a CUDA graph.
* ``tp``: tensor-parallel layers built on them; ``BufferPlan``: planned symmetric buffers
  the row-parallel GEMMs write into.

``group`` is a ``ubnext.Communicator`` (or the int from ``handle(comm)``, which the ops take).
"""

from __future__ import annotations

from torch.distributed import ReduceOp

from . import functional
from ._planner import BufferPlan
from ._reduce_op import op_name
from ._registry import handle
from .tp import (AddRMSNormEpilogue, ColumnParallelLinear, RowParallelLinear, TensorParallelAttentionOutput,
                 TensorParallelMLP)

# ReduceOp is torch.distributed's, re-exported (documented there)
__all__ = ["AddRMSNormEpilogue", "BufferPlan", "ColumnParallelLinear", "RowParallelLinear",
           "TensorParallelAttentionOutput", "TensorParallelMLP", "all_reduce", "functional", "handle", "op_name"]


class _Done:
    """The ``async_op=True`` result: the work is already ordered on the current stream,
    as NCCL's ``Work.wait()`` orders it, so waiting adds nothing."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
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

    Returns:
        None, or the work object with ``async_op``.

    Raises:
        UbnextError: an op ubnext does not reduce (PRODUCT, bitwise, PREMUL_SUM), no group,
            or what ``Communicator.all_reduce`` raises.
    """
    import torch

    torch.ops.ubnext.all_reduce_(tensor, op_name(op), handle(functional._required(group)))
    return _Done() if async_op else None
