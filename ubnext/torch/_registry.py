"""Communicators as op arguments: an int handle per communicator.

A ``torch.library`` op takes tensors and plain values, not Python objects, so the ops
of ``ubnext.torch`` name their communicator by an int handle that ``handle(comm)``
hands out (once per communicator; the same comm always gets the same handle, so
compiled graphs and captured CUDA graphs stay valid). The handle is kept on the
communicator (``_ubnext_torch_handle``), which torch.compile reads as a constant; the
registry holds the communicators weakly, so a handle outlives nothing: a collected
communicator's entry is dropped (its weak reference's callback), and its handle is never
handed out again.

A handle carries its communicator's size in its low 16 bits (``size_of``): the shapes of
a reduce-scatter or all-gather depend on it, and the fake implementations read it from
the handle, so a graph compiled for one world size is never taken from torch.compile's
caches (keyed by the graph and its constants) for another.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from ubnext._protocol.errors import UbnextError

_ATTR = "_ubnext_torch_handle"
_SIZE_BITS = 16
_lock = threading.Lock()
_next = itertools.count(1)
#: handle -> weak reference to its communicator; an entry goes when its communicator does
_by_handle: dict[int, weakref.ref] = {}


def handle(group) -> int:
    """The int handle of ``group`` that the ``torch.ops.ubnext`` ops take, registering a
    communicator the first time it is seen (the same handle for its lifetime; the
    registry holds it weakly).

    Collective: no.
    Graph-capturable: yes (host only; torch.compile reads it as a constant).

    Args:
        group: a ``ubnext.Communicator``, or a handle already.

    Returns:
        The int handle.

    Raises:
        UbnextError: a communicator of 65536 ranks or more. (An unknown handle raises
            UbnextError when an op looks it up.)
    """
    if isinstance(group, int):
        return group
    h = getattr(group, _ATTR, None)
    return h if h is not None else _register(group)


@torch.compiler.assume_constant_result
def _register(group) -> int:
    with _lock:
        h = getattr(group, _ATTR, None)
        if h is None:
            if not 0 < group.size < 1 << _SIZE_BITS:
                raise UbnextError(f"ubnext.torch: a communicator of {group.size} ranks has no handle")
            h = next(_next) << _SIZE_BITS | group.size
            _by_handle[h] = weakref.ref(group, _forget(h))
            setattr(group, _ATTR, h)
        return h


def _forget(h: int):
    """The callback of handle ``h``'s weak reference: drops the entry when the communicator
    is collected. Without the lock: the collection may run on a thread that holds it
    (inside ``_register``), and a dict's pop is atomic; the handle is never reused, so the
    entry it removes is its own. It closes over the dict, not the module's global, which
    interpreter shutdown may have cleared."""
    entries = _by_handle

    def drop(ref) -> None:
        entries.pop(h, None)

    return drop


def size_of(h: int) -> int:
    """The size of the communicator of handle ``h``, read from the handle itself."""
    return int(h) & ((1 << _SIZE_BITS) - 1)


def lookup(h: int):
    """The communicator of handle ``h``."""
    ref = _by_handle.get(int(h))
    comm = None if ref is None else ref()
    if comm is None:
        raise UbnextError(f"ubnext.torch: no open communicator has handle {h}; pass group=comm "
                          f"(or ubnext.torch.handle(comm)) of a live communicator")
    return comm
