"""Communicators as op arguments: the int handle that a ``torch.ops.ubnext`` op takes.

Every ``Communicator`` has its handle from construction (``ubnext._api.handles``, which
holds the registry, weakly, without torch); ``handle(group)`` reads it, so torch.compile
reads a plain int attribute, on a communicator's first use too, on every supported torch.
A group that is not a ``Communicator`` (an object with the collectives' methods and
``size``) gets its handle on its first eager use; under torch.compile it must have one
already.
"""

from __future__ import annotations

import torch

from ubnext._api.handles import ATTR, assign, lookup, size_of
from ubnext._protocol.errors import UbnextError

__all__ = ["handle", "lookup", "size_of"]


def handle(group) -> int:
    """The int handle of ``group`` that the ``torch.ops.ubnext`` ops take (the same for the
    communicator's lifetime; the registry holds it weakly).

    Collective: no.
    Graph-capturable: yes (host only; torch.compile reads it as a constant).

    Args:
        group: a ``ubnext.Communicator``, or a handle already.

    Returns:
        The int handle.

    Raises:
        UbnextError: a communicator of 65536 ranks or more; a group other than a
            Communicator first met under torch.compile. (An unknown handle raises
            UbnextError when an op looks it up.)
    """
    if isinstance(group, int):
        return group
    if not hasattr(group, ATTR):  # not a Communicator: its handle on its first eager use
        if torch.compiler.is_dynamo_compiling():
            raise UbnextError(f"ubnext.torch: group= is a {type(group).__name__} without a handle under "
                              f"torch.compile: pass a ubnext.Communicator (it has one from construction), "
                              f"or call ubnext.torch.handle(group) before compiling")
        assign(group)
    h = getattr(group, ATTR)
    if h is None:
        raise UbnextError(f"ubnext.torch: a communicator of {group.size} ranks has no handle (at most 65535 ranks)")
    return h
