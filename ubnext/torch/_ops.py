"""ubnext's collectives as ``torch.library`` custom ops (namespace ``ubnext``).

One table, ``OPS``, holds every op: its schema (the communicator is the last argument,
an int handle from ``_registry.handle``), the arguments it mutates, what it runs on the
communicator, its fake (meta) implementation for tracing (torch.compile, FakeTensor) and,
for the differentiable ones, its backward. ``register()`` turns each entry into
``torch.ops.ubnext.<name>``. A new collective is one entry: e.g. the all-gather's::

    "all_gather": Op("(Tensor x, int group) -> Tensor", (),
                     lambda comm, x: comm.all_gather(x), _all_gather_fake,
                     _all_gather_backward, _all_gather_context),

Out-of-place ops return new tensors; a name ending in ``_`` writes into its first
argument (``Tensor(a!)``), as ``torch.distributed`` does, and has no gradient.

The all-reduce and reduce-scatter ops take the call's ``precision`` (``Communicator.all_reduce``'s):
their callers in ``ubnext.torch`` pass ``"exact"`` unless their own caller gave another, so a
communicator's opt-in to the quantized collectives (``UBNEXT_QUANTIZED``) never reaches a
layer, an op's backward or a call that did not ask; every backward here runs exact.

The backwards carry the tensor-parallel meanings: the all-reduce of a row-parallel
output passes its gradient through (each rank's partial sum contributed once to the
replicated result; avg scales it by 1/size), and the fused all-reduce + add + RMSNorm
passes the gradient of its pre-norm sum to x and the residual. The sequence-parallel
ones are each other's transposes: a reduce-scatter's gradient is the all-gather of its
gradient (avg: divided by size), an all-gather's the reduce-scatter (sum) of its
gradient, and the fused reduce-scatter + add + RMSNorm all-gathers the gradient of its
pre-norm sum into x's and gives it to the residual shard; its weight and bias gradients
are this rank's rows' only, partial sums that the caller sums over the ranks (as
Megatron-LM all-reduces its sequence-parallel norm weights' gradients; the layers of
``tp`` do, by ``functional.sum_gradients``). The overlapped
matmul + reduce-scatter + add + RMSNorm gives the gradient of its pre-norm sum to the
residual and through matmul_reduce_scatter's backward to a and b, with the same partial
weight and bias gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx.node
from torch.autograd.graph import increment_version

from ubnext._engine.epilogue import check_eps
from ubnext._protocol.algorithms import FLOAT_DTYPES, SLOT_NORM_DTYPES
from ubnext._protocol.errors import UbnextError
from ubnext._protocol.quant import EXACT

from . import _overlap, _rmsnorm
from ._registry import lookup, size_of

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
    ctx.op, ctx.group = inputs[1], inputs[3]


def _all_reduce_backward(ctx, grad):
    if ctx.op == "sum":
        return grad, None, None, None
    if ctx.op == "avg":
        return grad / size_of(ctx.group), None, None, None
    raise RuntimeError(f"ubnext::all_reduce: op {ctx.op!r} has no gradient (sum and avg have)")


# ---- reduce_scatter / all_gather ---------------------------------------------------------
def _reduce_scatter_fake(x, op, precision, group):
    """Communicator.reduce_scatter's default out: (x.shape[0] / size, *x.shape[1:]) where
    size divides x.shape[0], else flat (k,)."""
    size = size_of(group)
    if x.dim() and x.shape[0] % size == 0:
        return x.new_empty((x.shape[0] // size, *x.shape[1:]))
    return x.new_empty((x.numel() // size,))


def _all_gather_fake(x, group):
    """Communicator.all_gather's default out: (size * x.shape[0], *x.shape[1:]), (size,) for 0-d."""
    size = size_of(group)
    return x.new_empty((size * x.shape[0], *x.shape[1:]) if x.dim() else (size,))


def _reduce_scatter_context(ctx, inputs, output):
    x, ctx.op, _, ctx.group = inputs
    ctx.shape = x.shape


def _all_gather_context(ctx, inputs, output):
    x, ctx.group = inputs
    ctx.shape = x.shape


def _reduce_scatter_backward(ctx, grad):
    if ctx.op not in ("sum", "avg"):
        raise RuntimeError(f"ubnext::reduce_scatter: op {ctx.op!r} has no gradient (sum and avg have)")
    d = torch.ops.ubnext.all_gather(grad.contiguous(), ctx.group).reshape(ctx.shape)
    return (d if ctx.op == "sum" else d / size_of(ctx.group)), None, None, None


def _all_gather_backward(ctx, grad):
    return torch.ops.ubnext.reduce_scatter(grad.contiguous(), "sum", EXACT, ctx.group).reshape(ctx.shape), None


# ---- all_reduce_add_rmsnorm, reduce_scatter_add_rmsnorm ---------------------------------
def _fused_context(ctx, inputs, output):
    x, residual, weight, bias, eps, group = inputs
    ctx.eps, ctx.group = eps, group
    ctx.has = (residual is not None, bias is not None)
    ctx.save_for_backward(output[1], weight)


def _norm_grads(ctx, residual_out, weight, grad_normed, grad_residual):
    """The gradients of a fused op's add + RMSNorm (``ctx.eps``; ``ctx.has``: whether it
    had a residual and a bias): ``(d, (residual's, weight's, bias's))``, ``d`` being that
    of the pre-norm sum ``residual_out`` (its dtype and shape), which is the residual's;
    weight's and bias's from this rank's rows (rows: every dimension but the last)."""
    d_sum, d_weight = _rmsnorm.backward(_rows_of(grad_normed), _rows_of(grad_residual), _rows(residual_out), weight,
                                        ctx.eps)
    dtype = residual_out.dtype
    d = d_sum.to(dtype).view(residual_out.shape)
    has_residual, has_bias = ctx.has
    return d, (d if has_residual else None, None if d_weight is None else d_weight.to(weight.dtype),
               d_sum.sum(0).to(dtype) if has_bias else None)


def _fused_grads(ctx, grad_normed, grad_residual, x_grad: Callable):
    """The fused ops' gradients: that of the pre-norm sum (``residual_out``) to the
    residual and, through ``x_grad(d, group)``, to x; weight and bias from this rank's rows."""
    residual_out, weight = ctx.saved_tensors
    d, rest = _norm_grads(ctx, residual_out, weight, grad_normed, grad_residual)
    return (x_grad(d, ctx.group), *rest, None, None)


def _fused_backward(ctx, grad_normed, grad_residual):
    return _fused_grads(ctx, grad_normed, grad_residual, lambda d, group: d)


def _sequence_parallel_fused_backward(ctx, grad_normed, grad_residual):
    return _fused_grads(ctx, grad_normed, grad_residual, torch.ops.ubnext.all_gather)


def _shard_fake(x, residual_shard, weight, bias, eps, group):
    shard = x.new_empty((x.shape[0] // size_of(group), *x.shape[1:]))
    return shard, torch.empty_like(shard)


def _all_reduce_in_place(comm, x, op, precision):
    comm.all_reduce(x, out=x, op=op, precision=precision)


def _fused_run(comm, x, residual, weight, bias, eps):
    return comm.all_reduce_add_rmsnorm(x, residual, weight, eps=eps, bias=bias)


def _reduce_scatter_into(comm, out, x, op, precision):
    comm.reduce_scatter(x, out=out, op=op, precision=precision)


def _all_gather_into(comm, out, x):
    comm.all_gather(x, out=out)


def _sequence_parallel_fused_run(comm, x, residual_shard, weight, bias, eps):
    return comm.reduce_scatter_add_rmsnorm(x, residual_shard, weight, eps=eps, bias=bias)


# ---- all_gather_matmul / matmul_reduce_scatter (the GEMMs with the communication under them) ----
#: the dtypes of the overlapped ops: those cuBLAS multiplies (torch.matmul on CUDA)
MATMUL_DTYPES = tuple(getattr(torch, name) for name in FLOAT_DTYPES)


def check_matmul(name: str, a, b, size: int, scattered: bool) -> None:
    """The operands of the overlapped ops: ``a`` (rows, ..., k), ``b`` (k, n) of a's dtype
    (one of MATMUL_DTYPES) and device, rows a multiple of the ranks where they are scattered."""
    if a.dim() < 2 or b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise UbnextError(f"ubnext::{name}: a (rows, ..., k) and b (k, n) needed, got shapes "
                          f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise UbnextError(f"ubnext::{name}: a and b must share dtype and device, got {a.dtype} on {a.device} "
                          f"and {b.dtype} on {b.device}")
    if a.dtype not in MATMUL_DTYPES:
        raise UbnextError(f"ubnext::{name}: dtype {a.dtype} is not taken; the GEMMs take "
                          f"{', '.join(map(str, MATMUL_DTYPES))}")
    if scattered and a.shape[0] % size:
        raise UbnextError(f"ubnext::{name}: a has {a.shape[0]} rows, which {size} ranks do not divide")


def _check_device(name: str, comm, a) -> None:
    """``a`` (and so ``b``: check_matmul) on the communicator's device: CUDA device
    ``comm.device`` (a torch.device for a communicator of CPU tensors: the tests' threads)."""
    device = comm.device if isinstance(comm.device, torch.device) else torch.device("cuda", comm.device)
    if a.device != device:
        raise UbnextError(f"ubnext::{name}: a and b are on {a.device}, the communicator on {device}")


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _rows_of(t):
    return None if t is None else _rows(t)


def _all_gather_matmul_run(comm, a, b):
    check_matmul("all_gather_matmul", a, b, comm.size, False)
    _check_device("all_gather_matmul", comm, a)
    gathered, out = _overlap.all_gather_matmul(comm, _rows(a).contiguous(), b)
    lead = (comm.size * a.shape[0], *a.shape[1:-1])
    return gathered.view(*lead, a.shape[-1]), out.view(*lead, b.shape[1])


def _matmul_reduce_scatter_run(comm, a, b):
    check_matmul("matmul_reduce_scatter", a, b, comm.size, True)
    _check_device("matmul_reduce_scatter", comm, a)
    out = _overlap.matmul_reduce_scatter(comm, _rows(a).contiguous(), b)
    return out.view(a.shape[0] // comm.size, *a.shape[1:-1], b.shape[1])


def _all_gather_matmul_fake(a, b, group):
    size = size_of(group)
    check_matmul("all_gather_matmul", a, b, size, False)
    lead = (size * a.shape[0], *a.shape[1:-1])
    return a.new_empty((*lead, a.shape[-1])), a.new_empty((*lead, b.shape[1]))


def _matmul_reduce_scatter_fake(a, b, group):
    size = size_of(group)
    check_matmul("matmul_reduce_scatter", a, b, size, True)
    return a.new_empty((a.shape[0] // size, *a.shape[1:-1], b.shape[1]))


def _matmul_context(ctx, inputs, output):
    a, b, ctx.group = inputs
    # the all-gather side keeps its gathered a (its first output), the other side a itself
    ctx.save_for_backward(output[0] if isinstance(output, tuple) else a, b)


def _all_gather_matmul_backward(ctx, grad_gathered, grad_out):
    """gathered = all_gather(a), out = gathered @ b: a's gradient is the reduce-scatter of
    grad_out @ b.T (the overlapped op) plus that of the gathered output's own gradient;
    b's is gathered.T @ grad_out."""
    gathered, b = ctx.saved_tensors
    da = db = None
    if grad_out is not None and ctx.needs_input_grad[0]:
        da = torch.ops.ubnext.matmul_reduce_scatter(grad_out, b.t(), ctx.group)
    if grad_gathered is not None and ctx.needs_input_grad[0]:
        rs = torch.ops.ubnext.reduce_scatter(grad_gathered.contiguous(), "sum", EXACT, ctx.group)
        da = rs if da is None else da + rs
    if grad_out is not None and ctx.needs_input_grad[1]:
        db = _rows(gathered).t() @ _rows(grad_out)
    return da, db, None


def _scatter_grads(ctx, a, b, grad):
    """out = reduce_scatter(a @ b): the gradient of a @ b is the all-gather of grad, so
    a's is all_gather(grad) @ b.T (the overlapped op) and b's a.T @ all_gather(grad):
    ``(a's, b's)`` (``ctx.needs_input_grad``'s first two: a and b)."""
    gathered, da = torch.ops.ubnext.all_gather_matmul(grad.contiguous(), b.t(), ctx.group)
    db = _rows(a).t() @ _rows(gathered) if ctx.needs_input_grad[1] else None
    return (da if ctx.needs_input_grad[0] else None), db


def _matmul_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return (*_scatter_grads(ctx, a, b, grad), None)


# ---- matmul_reduce_scatter_add_rmsnorm (the sum's rows finished in the reduction's pass) ----
#: the dtypes of the overlapped matmul + reduce-scatter + add + RMSNorm: those the add +
#: RMSNorm takes (fp32 statistics; not float64)
NORM_MATMUL_DTYPES = tuple(getattr(torch, name) for name in SLOT_NORM_DTYPES)
_MATMUL_NORM = "matmul_reduce_scatter_add_rmsnorm"


def check_matmul_norm(a, b, residual, weight, bias, size: int) -> tuple:
    """The operands of ``matmul_reduce_scatter_add_rmsnorm``: those of
    ``matmul_reduce_scatter`` (``check_matmul``) of a dtype of NORM_MATMUL_DTYPES,
    ``residual`` (or None) of the result's shape, ``weight`` and ``bias`` (or None) of n
    elements, all of a's dtype and device. Returns the result's shape."""
    check_matmul(_MATMUL_NORM, a, b, size, True)
    if a.dtype not in NORM_MATMUL_DTYPES:
        raise UbnextError(f"ubnext::{_MATMUL_NORM}: the add + RMSNorm takes "
                          f"{', '.join(map(str, NORM_MATMUL_DTYPES))}, not {a.dtype}")
    shape = (a.shape[0] // size, *a.shape[1:-1], b.shape[1])
    for what, t, want in (("residual", residual, shape), ("weight", weight, shape[-1:]), ("bias", bias, shape[-1:])):
        if t is not None and (tuple(t.shape) != want or t.dtype != a.dtype or t.device != a.device):
            raise UbnextError(f"ubnext::{_MATMUL_NORM}: {what} must be {want} of a's dtype and device "
                              f"({a.dtype} on {a.device}), got {tuple(t.shape)} of {t.dtype} on {t.device}")
    return shape


def _matmul_norm_run(comm, a, b, residual, weight, bias, eps):
    shape = check_matmul_norm(a, b, residual, weight, bias, comm.size)
    eps = check_eps(f"ubnext::{_MATMUL_NORM}", eps)
    _check_device(_MATMUL_NORM, comm, a)
    normed, res_out = _overlap.matmul_reduce_scatter_add_rmsnorm(
        comm, _rows(a).contiguous(), b, None if residual is None else _rows(residual).contiguous(),
        weight.contiguous(), None if bias is None else bias.contiguous(), eps)
    return normed.view(shape), res_out.view(shape)


def _matmul_norm_fake(a, b, residual, weight, bias, eps, group):
    shape = check_matmul_norm(a, b, residual, weight, bias, size_of(group))
    return a.new_empty(shape), a.new_empty(shape)


def _matmul_norm_context(ctx, inputs, output):
    a, b, residual, weight, bias, ctx.eps, ctx.group = inputs
    ctx.has = (residual is not None, bias is not None)
    ctx.save_for_backward(a, b, output[1], weight)


def _matmul_norm_backward(ctx, grad_normed, grad_residual):
    """The add + RMSNorm's gradients (``_norm_grads``: the residual's, and this rank's rows'
    of weight and bias), and those of a and b from the pre-norm sum's (``_scatter_grads``)."""
    a, b, residual_out, weight = ctx.saved_tensors
    d, rest = _norm_grads(ctx, residual_out, weight, grad_normed, grad_residual)
    return (*_scatter_grads(ctx, a, b, d), *rest, None, None)


OPS: dict[str, Op] = {
    # out of place: a new tensor, x unchanged
    "all_reduce": Op("(Tensor x, str op, str precision, int group) -> Tensor", (),
                     lambda comm, x, op, precision: comm.all_reduce(x, op=op, precision=precision),
                     lambda x, op, precision, group: torch.empty_like(x),
                     _all_reduce_backward, _all_reduce_context),
    # in place, as torch.distributed.all_reduce (no gradient: autograd does not take mutations)
    "all_reduce_": Op("(Tensor(a!) x, str op, str precision, int group) -> ()", ("x",),
                      _all_reduce_in_place,
                      lambda x, op, precision, group: None),
    # (normed, residual_out), both new
    "all_reduce_add_rmsnorm": Op(
        "(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, int group) -> (Tensor, Tensor)", (),
        _fused_run, lambda x, residual, weight, bias, eps, group: (torch.empty_like(x), torch.empty_like(x)),
        _fused_backward, _fused_context),
    # sequence parallelism: this rank's slice of the reduction; every rank's x gathered
    "reduce_scatter": Op("(Tensor x, str op, str precision, int group) -> Tensor", (),
                         lambda comm, x, op, precision: comm.reduce_scatter(x, op=op, precision=precision),
                         _reduce_scatter_fake,
                         _reduce_scatter_backward, _reduce_scatter_context),
    "all_gather": Op("(Tensor x, int group) -> Tensor", (),
                     lambda comm, x: comm.all_gather(x), _all_gather_fake,
                     _all_gather_backward, _all_gather_context),
    # into out, as torch.distributed.reduce_scatter_tensor / all_gather_into_tensor
    "reduce_scatter_": Op("(Tensor(a!) out, Tensor x, str op, str precision, int group) -> ()", ("out",),
                          _reduce_scatter_into,
                          lambda out, x, op, precision, group: None),
    "all_gather_": Op("(Tensor(a!) out, Tensor x, int group) -> ()", ("out",),
                      _all_gather_into,
                      lambda out, x, group: None),
    # (normed_shard, residual_shard_out), both new, rows / size x hidden
    "reduce_scatter_add_rmsnorm": Op(
        "(Tensor x, Tensor? residual_shard, Tensor weight, Tensor? bias, float eps, int group) -> (Tensor, Tensor)",
        (), _sequence_parallel_fused_run, _shard_fake, _sequence_parallel_fused_backward, _fused_context),
    # (gathered a, gathered a @ b) and reduce_scatter(a @ b) by rows, the communication under
    # the GEMMs (_overlap); each other's transposes in backward
    "all_gather_matmul": Op("(Tensor a, Tensor b, int group) -> (Tensor, Tensor)", (),
                            _all_gather_matmul_run, _all_gather_matmul_fake,
                            _all_gather_matmul_backward, _matmul_context),
    "matmul_reduce_scatter": Op("(Tensor a, Tensor b, int group) -> Tensor", (),
                                _matmul_reduce_scatter_run, _matmul_reduce_scatter_fake,
                                _matmul_reduce_scatter_backward, _matmul_context),
    # (normed, residual_out) of this rank's rows of reduce_scatter(a @ b) + bias + residual,
    # the norm in the reduction's pass; its backward: the norm's, then matmul_reduce_scatter's
    _MATMUL_NORM: Op(
        "(Tensor a, Tensor b, Tensor? residual, Tensor weight, Tensor? bias, float eps, int group) -> (Tensor, Tensor)",
        (), _matmul_norm_run, _matmul_norm_fake, _matmul_norm_backward, _matmul_norm_context),
}


def _kernel(op: Op):
    def run(*args):
        comm = lookup(args[-1])
        return op.run(comm, *args[:-1])

    return run


#: the library that defines the ops (kept here: a Library removes its ops when collected)
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _version_bump(overload, mutated: tuple[str, ...]):
    """The op's ADInplaceOrView kernel: bumps the version counter of every tensor it
    writes, then runs the op below that key. The kernels write through raw pointers, so
    without it autograd would not see the write and would use a tensor it saved for
    backward after the op overwrote it (a wrong gradient, no error)."""
    where = [i for i, a in enumerate(overload._schema.arguments) if a.name in mutated]
    below = torch._C._after_ADInplaceOrView_keyset

    def bump(keyset, *args, **kwargs):
        for i in where:
            increment_version(args[i])
        return overload.redispatch(keyset & below, *args, **kwargs)

    return bump


def _holding(setup_context):
    """``setup_context``, and the op's communicator (its last argument's handle) kept on the
    autograd context until backward runs: the graph of a functional call holds its
    communicator, as a layer does (the registry of handles holds none)."""
    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.comm = lookup(inputs[-1])

    return setup


def register(ops: dict[str, Op] = OPS) -> None:
    """Defines ``torch.ops.ubnext.<name>`` for every entry of ``ops`` (default ``OPS``;
    ``_moe_ops`` registers its own table), once per process.

    Through ``torch.library.Library`` rather than ``torch.library.custom_op``, which
    wraps every eager call in Python autograd and version-bump layers (several times the
    cost of the op itself, bench/NOTES.md): the kernel is registered
    for CompositeExplicitAutograd, the fake and the backward through ``torch.library``,
    and a mutating op bumps the versions of what it writes (``_version_bump``), as
    custom_op does.
    """
    for name, op in ops.items():
        qualname = f"{NAMESPACE}::{name}"
        _LIB.define(name + op.schema)
        # every op is (part of) a collective: no compiler may drop it from one rank's graph
        # and keep it in another's (Inductor drops a call whose output nothing reads, as a
        # zero-size one on a rank without tokens), so each is registered as side-effecting
        torch.fx.node.has_side_effect(getattr(getattr(torch.ops, NAMESPACE), name).default)
        _LIB.impl(name, _kernel(op), "CompositeExplicitAutograd")
        torch.library.register_fake(qualname, op.fake, lib=_LIB)
        if op.backward is not None:
            torch.library.register_autograd(qualname, op.backward, setup_context=_holding(op.setup_context), lib=_LIB)
        if op.mutates:
            overload = getattr(getattr(torch.ops, NAMESPACE), name).default
            _LIB.impl(name, _version_bump(overload, op.mutates), "ADInplaceOrView", with_keyset=True)


register()
