"""The Communicator's collectives as ``torch.ops.ubnext`` ops, where torch.compile traces them.

Dynamo cannot trace a collective's Python body (it reads raw pointers and launches
kernels), so each public collective of ``ubnext.Communicator`` starts with a hook: when
``_arrays.traced(x)`` (dynamo is tracing, x is a torch tensor) it hands its arguments to
``call``, which maps them to the op that runs the same call, the communicator named by
its handle (``_registry.handle``): no graph break, and when the compiled code runs, the
op calls the method eagerly, the same call (the same bits) as without torch.compile.

``out=`` maps to the ops that write into their first argument (``all_reduce_``,
``reduce_scatter_``, ``all_gather_``); an all-reduce into an ``out`` other than x copies x
there first, then reduces it in place. What these forms do not map raises UbnextError naming
the argument, never ignored: ``stream=``, an ``algorithm`` or ``precision`` other than
``"auto"``, and the fused all-reduce's ``out=`` and ``residual_out=``. ``"auto"`` reaches
the op as the call's precision: the Communicator's own calls keep its quantized opt-in
under torch.compile (``ubnext.torch``'s own functions pass ``"exact"`` unless asked). torch.compile
raises it from the compiled function's call (with ``fullgraph=True`` as dynamo's
``Unsupported``, whose message holds ours); the same call outside torch.compile takes
the argument. The methods are not differentiable in eager
code (they write through raw pointers, unseen by autograd): traced, they detach their
inputs, so compiled code has eager's gradients (none through the collective);
``ubnext.torch.functional`` has the differentiable forms.
"""

from __future__ import annotations

import torch

from ubnext._engine.epilogue import check_eps
from ubnext._protocol.algorithms import OPS
from ubnext._protocol.errors import UbnextError
from ubnext._protocol.quant import PRECISIONS

from . import _ops  # noqa: F401 (defines torch.ops.ubnext)
from ._registry import handle


def call(comm, name: str, *args, **kwargs):
    """``comm.<name>(*args, **kwargs)`` as the ``torch.ops.ubnext`` op that does it, for
    code that dynamo traces (the hook at the top of each Communicator collective).

    Args:
        comm: the ``ubnext.Communicator``.
        name: ``"all_reduce"``, ``"all_reduce_add_rmsnorm"``, ``"reduce_scatter"``,
            ``"all_gather"`` or ``"reduce_scatter_add_rmsnorm"``.
        *args, **kwargs: the method's arguments.

    Returns:
        What the method returns: ``out``, a new tensor, or a pair of new tensors.

    Raises:
        UbnextError: an argument that the ops cannot express (see the module), an unknown
            op or a mismatched ``out`` (as the method raises them), or a method without a
            traced form.
    """
    form = _FORMS.get(name)
    if form is None:
        raise UbnextError(f"{name}: no traced form under torch.compile (traced: {', '.join(_FORMS)})")
    return form(comm, *args, **kwargs)


def _untraceable(name: str, algorithm="auto", stream=None) -> None:
    """Raises for what the ops cannot take: they run ``algorithm="auto"`` on the current
    stream."""
    where = (f"; torch.ops.ubnext.{name} runs on the current stream, with algorithm auto: "
             f"leave it out, or call {name} outside the compiled region")
    if stream is not None:
        raise UbnextError(f"{name}: stream= cannot be traced by torch.compile{where}")
    if algorithm != "auto":
        raise UbnextError(f"{name}: algorithm={algorithm!r} cannot be traced by torch.compile{where}")


def _precision(name: str, precision) -> str:
    """The call's ``precision``, which the all-reduce and reduce-scatter ops take as it is."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise UbnextError(f"{name}: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def _op(name: str, op) -> str:
    if not isinstance(op, str) or op not in OPS:
        raise UbnextError(f"{name}: unsupported op {op!r}; use one of {', '.join(OPS)}")
    return op


def _plain(t):
    """``t`` without autograd (the methods are not differentiable); None stays None."""
    return t.detach() if t is not None and t.requires_grad else t


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _all_reduce(comm, x, out=None, op="sum", algorithm="auto", stream=None, precision="auto"):
    name = "all_reduce"
    _untraceable(name, algorithm, stream)
    op, group, precision = _op(name, op), handle(comm), _precision(name, precision)
    if out is None:
        return torch.ops.ubnext.all_reduce(_plain(x), op, precision, group)
    if out is not x:
        if out.numel() != x.numel() or out.dtype != x.dtype:
            raise UbnextError(f"{name}: out has {out.numel()} {_dtype(out)} elements, input has {x.numel()} "
                              f"{_dtype(x)}; they must match")
        _plain(out).copy_(_plain(x).reshape(out.shape))
    torch.ops.ubnext.all_reduce_(_plain(out), op, precision, group)
    return out


def _all_reduce_add_rmsnorm(comm, x, residual, weight, eps=1e-6, bias=None, out=None, residual_out=None,
                            algorithm="auto", stream=None):
    name = "all_reduce_add_rmsnorm"
    _untraceable(name, algorithm, stream)
    for given, what in ((out, "out"), (residual_out, "residual_out")):
        if given is not None:
            raise UbnextError(f"{name}: {what}= cannot be traced by torch.compile: "
                              f"torch.ops.ubnext.{name} writes new tensors (there is no form that writes into "
                              f"given ones); leave {what} out and use the returned tensors, or call {name} outside "
                              f"the compiled region")
    return torch.ops.ubnext.all_reduce_add_rmsnorm(_plain(x), _plain(residual), _plain(weight), _plain(bias),
                                                   check_eps(name, eps), handle(comm))


def _reduce_scatter(comm, x, out=None, op="sum", algorithm="auto", stream=None, precision="auto"):
    name = "reduce_scatter"
    _untraceable(name, algorithm, stream)
    op, group, precision = _op(name, op), handle(comm), _precision(name, precision)
    if out is None:
        return torch.ops.ubnext.reduce_scatter(_plain(x), op, precision, group)
    torch.ops.ubnext.reduce_scatter_(_plain(out), _plain(x), op, precision, group)
    return out


def _all_gather(comm, x, out=None, algorithm="auto", stream=None):
    name = "all_gather"
    _untraceable(name, algorithm, stream)
    group = handle(comm)
    if out is None:
        return torch.ops.ubnext.all_gather(_plain(x), group)
    torch.ops.ubnext.all_gather_(_plain(out), _plain(x), group)
    return out


def _reduce_scatter_add_rmsnorm(comm, x, residual_shard, weight, eps=1e-6, bias=None, algorithm="auto",
                                stream=None):
    name = "reduce_scatter_add_rmsnorm"
    _untraceable(name, algorithm, stream)
    return torch.ops.ubnext.reduce_scatter_add_rmsnorm(_plain(x), _plain(residual_shard), _plain(weight),
                                                       _plain(bias), check_eps(name, eps), handle(comm))


#: method name -> its traced form (the method's signature, the communicator first)
_FORMS = {"all_reduce": _all_reduce, "all_reduce_add_rmsnorm": _all_reduce_add_rmsnorm,
          "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
          "reduce_scatter_add_rmsnorm": _reduce_scatter_add_rmsnorm}
