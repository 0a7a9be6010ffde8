"""A collective called while torch.compile traces: it becomes the ``torch.ops.ubnext`` op
that runs the same call (``ubnext.torch._traced``)."""

from __future__ import annotations


def traced_call(comm, name: str, *args, **kwargs):
    """``comm.<name>(...)`` as a ``torch.ops.ubnext`` op, for dynamo (``_arrays.traced``):
    ``ubnext.torch._traced.call``, imported here, not at the top (ubnext does not import torch)."""
    from ubnext.torch import _traced

    return _traced.call(comm, name, *args, **kwargs)
