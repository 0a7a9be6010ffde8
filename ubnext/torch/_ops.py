"""ubnext's collectives as ``torch.library`` custom ops (namespace ``ubnext``).

One table, ``OPS``, holds every op: its schema (the communicator is the last argument,
an int handle from ``_registry.handle``), the arguments it mutates, what it runs on the
communicator, its fake (meta) implementation for tracing (torch.compile, FakeTensor) and,
for the differentiable ones, its backward. ``register()`` turns each entry into
``torch.ops.ubnext.<name>``. A new collective is one entry: e.g. a reduce-scatter::

    "reduce_scatter": Op("(Tensor x, str op, int group) -> Tensor", (),
                         lambda comm, x, op: comm.reduce_scatter(x, op=op),
                         lambda x, op, group: x.new_empty((x.shape[0] // lookup(group).size, *x.shape[1:]))),

The backwards carry the tensor-parallel meanings: the all-reduce of a row-parallel
output passes its gradient through (each rank's partial sum contributed once to the
replicated result; avg scales it by 1/size), and the fused all-reduce + add + RMSNorm
passes the gradient of its pre-norm sum to x and the residual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import _rmsnorm
from ._registry import lookup

NAMESPACE = "ubnext"


@dataclasses.dataclass(frozen=True)
class Op:
    """One custom op.

    Attributes:
        schema: arguments and results in torch's schema syntax, without the name; the
            last argument is ``int group``, the communicator's handle.
        mutates: the arguments written in place (``Tensor(a!)`` in the schema).
        run: ``run(comm, *args)``: the op on the communicator, ``args`` without the handle.
        fake: ``fake(*args)`` (with the handle): empty results of the right shape, dtype
            and device, for tracing.
        backward: ``backward(ctx, *grads)``: a gradient per argument (None for non-tensors),
            or None where the op has no gradient.
        setup_context: ``setup_context(ctx, inputs, output)``: what backward keeps.
    """

    schema: str
    mutates: tuple[str, ...]
    run: Callable
    fake: Callable
    backward: Callable | None = None
    setup_context: Callable | None = None


# ---- all_reduce ------------------------------------------------------------------------
def _all_reduce_context(ctx, inputs, output):
    ctx.op, ctx.group = inputs[1], inputs[2]


def _all_reduce_backward(ctx, grad):
    if ctx.op == "sum":
        return grad, None, None
    if ctx.op == "avg":
        return grad / lookup(ctx.group).size, None, None
    raise RuntimeError(f"ubnext::all_reduce: op {ctx.op!r} has no gradient (sum and avg have)")


# ---- all_reduce_add_rmsnorm -------------------------------------------------------------
def _fused_context(ctx, inputs, output):
    x, residual, weight, bias, eps, _ = inputs
    ctx.eps = eps
    ctx.has = (residual is not None, bias is not None)
    ctx.save_for_backward(output[1], weight)


def _fused_backward(ctx, grad_normed, grad_residual):
    residual_out, weight = ctx.saved_tensors
    d_sum, d_weight = _rmsnorm.backward(grad_normed, grad_residual, residual_out, weight, ctx.eps)
    dtype = residual_out.dtype
    d = d_sum.to(dtype)
    has_residual, has_bias = ctx.has
    return (d, d if has_residual else None, None if d_weight is None else d_weight.to(weight.dtype),
            d_sum.sum(0).to(dtype) if has_bias else None, None, None)


def _all_reduce_in_place(comm, x, op):
    comm.all_reduce(x, out=x, op=op)


def _fused_run(comm, x, residual, weight, bias, eps):
    return comm.all_reduce_add_rmsnorm(x, residual, weight, eps=eps, bias=bias)


OPS: dict[str, Op] = {
    # out of place: a new tensor, x unchanged
    "all_reduce": Op("(Tensor x, str op, int group) -> Tensor", (),
                     lambda comm, x, op: comm.all_reduce(x, op=op),
                     lambda x, op, group: torch.empty_like(x),
                     _all_reduce_backward, _all_reduce_context),
    # in place, as torch.distributed.all_reduce (no gradient: autograd does not take mutations)
    "all_reduce_": Op("(Tensor(a!) x, str op, int group) -> ()", ("x",),
                      _all_reduce_in_place,
                      lambda x, op, group: None),
    # (normed, residual_out), both new
    "all_reduce_add_rmsnorm": Op(
        "(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, int group) -> (Tensor, Tensor)", (),
        _fused_run, lambda x, residual, weight, bias, eps, group: (torch.empty_like(x), torch.empty_like(x)),
        _fused_backward, _fused_context),
}


def _kernel(op: Op):
    def run(*args):
        comm = lookup(args[-1])
        return op.run(comm, *args[:-1])

    return run


def register() -> None:
    """Defines ``torch.ops.ubnext.<name>`` for every entry of ``OPS`` (once per process)."""
    for name, op in OPS.items():
        custom = torch.library.custom_op(f"{NAMESPACE}::{name}", _kernel(op), mutates_args=op.mutates,
                                         schema=op.schema)
        custom.register_fake(op.fake)
        if op.backward is not None:
            custom.register_autograd(op.backward, setup_context=op.setup_context)


register()
