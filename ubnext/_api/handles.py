"""Communicator handles: an int per communicator, from its construction on.

A ``torch.library`` op takes tensors and plain values, not Python objects, so the ops of
``ubnext.torch`` name their communicator by an int handle. ``Communicator.__init__``
assigns it (``assign``) as soon as the size is known, and the communicator keeps it as a
plain int attribute (``ATTR``): torch.compile reads it as a constant, on a communicator
that no call has used yet too. (A handle handed out on first use ran registry code inside
the trace, which dynamo before torch 2.12.1 cannot do with an object argument: every
compiled first call failed there.) The same communicator always has the same handle, so
compiled graphs and captured CUDA graphs stay valid.

The registry holds the communicators weakly: a collected communicator's entry is dropped
(its weak reference's callback), and its handle is never handed out again.

A handle carries its communicator's size in its low ``SIZE_BITS`` bits (``size_of``): the
shapes of a reduce-scatter or all-gather depend on it, and the fake implementations read
it from the handle, so a graph compiled for one world size is never taken from
torch.compile's caches (keyed by the graph and its constants) for another.

No torch: ``ubnext.torch._registry`` looks handles up here.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from ubnext._protocol.errors import UbnextError

#: the attribute that holds a communicator's handle (None: the ops cannot name it)
ATTR = "_handle"
SIZE_BITS = 16
_lock = threading.Lock()
_next = itertools.count(1)
#: handle -> weak reference to its communicator; an entry goes when its communicator does
_by_handle: dict[int, weakref.ref] = {}


def assign(comm) -> int | None:
    """Gives ``comm`` its handle (kept in ``comm._handle``) unless it has one.

    Collective: no. Graph-capturable: yes (host only); not traceable by torch.compile
    (call it before: ``Communicator.__init__`` does).

    Args:
        comm: a ``Communicator`` (or an object with ``size``, as the tests' communicators):
            the registry holds it weakly.

    Returns:
        Its handle; None for a communicator of ``2 ** SIZE_BITS`` ranks or more, whose
        size no handle carries (the torch ops refuse it; its own calls are unaffected).
    """
    with _lock:
        h = getattr(comm, ATTR, None)
        if h is None and 0 < comm.size < 1 << SIZE_BITS:
            h = next(_next) << SIZE_BITS | comm.size
            _by_handle[h] = weakref.ref(comm, _forget(h))
        setattr(comm, ATTR, h)
        return h


def _forget(h: int):
    """The callback of handle ``h``'s weak reference: drops the entry when the communicator
    is collected. Without the lock: the collection may run on a thread that holds it
    (inside ``assign``), and a dict's pop is atomic; the handle is never reused, so the
    entry it removes is its own. It closes over the dict, not the module's global, which
    interpreter shutdown may have cleared."""
    entries = _by_handle

    def drop(ref) -> None:
        entries.pop(h, None)

    return drop


def size_of(h: int) -> int:
    """The size of the communicator of handle ``h``, read from the handle itself."""
    return int(h) & ((1 << SIZE_BITS) - 1)


def lookup(h: int):
    """The communicator of handle ``h``.

    Raises:
        UbnextError: no live communicator has that handle.
    """
    ref = _by_handle.get(int(h))
    comm = None if ref is None else ref()
    if comm is None:
        raise UbnextError(f"ubnext.torch: no open communicator has handle {h}; pass group=comm "
                          f"(or ubnext.torch.handle(comm)) of a live communicator")
    return comm
