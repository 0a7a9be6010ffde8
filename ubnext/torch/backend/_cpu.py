"""CPU tensors of a ubnext group: served by a Gloo backend of the same ranks, created at
the group's first CPU op over the group's store (or at once where torch needs a C++
backend to hold the group's name, see ``_group``).

The route is explicit: the group sends CPU tensors here and nowhere else, under the
method names of the torch it runs on; a CPU op Gloo does not have raises.

Lifetime: torch's ``ProcessGroupGloo.shutdown()`` and ``abort()`` do nothing; its
destructor drains its queue and joins its worker threads and its transport's loop thread.
So ``close()`` (the group's shutdown, from ``destroy_process_group``) drops every reference
to the backend, which destroys it there and then, while the group itself may live on
(FSDP2, device meshes and torch's default arguments keep groups until exit): no Gloo
thread is left to interpreter exit. ``abort()`` keeps the backend (``_ABORTED``): its
destructor would wait for ops in flight, a dead peer's up to the group's timeout.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["GlooOps"]

# aborted Gloo backends, never destroyed (module docstring)
_ABORTED: list = []

# the group's op names -> the Gloo backend's (which kept torch 2.11's names)
_NAMES = {
    "allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "reduce": "reduce",
    "broadcast": "broadcast", "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "_allgather_base", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base", "all_to_all_single": "alltoall_base",
    "alltoall": "alltoall", "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv",
    "recv_anysource": "recv_anysource", "monitored_barrier": "monitored_barrier",
}


class _Done(dist._Work):
    """The work of CPU ops that already completed (the coalesced forms)."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self):
        return self._result


class GlooOps:
    """The group's op set for CPU tensors, on a ``ProcessGroupGloo`` of the same ranks.

    Collective: creating the Gloo backend is (every rank's first CPU op, in the same order).
    Graph-capturable: no (CPU).

    Args:
        store: the group's store (a prefix of its own is added).
        rank, size: this rank and the group's size.
        timeout: the group's timeout (a ``timedelta``).
    """

    def __init__(self, store, rank: int, size: int, timeout):
        self._args = (store, rank, size, timeout)
        self._opened = 0  # backends created so far: each rendezvous under a prefix of its own
        self.backend = None

    def open(self):
        """The Gloo backend (created on the first call, and on the first after a close);
        binds the op names to it."""
        if self.backend is None:
            store, rank, size, timeout = self._args
            prefix = f"gloo/{self._opened}/"
            self._opened += 1
            self.backend = gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)
            for ours, theirs in _NAMES.items():
                setattr(self, ours, getattr(gloo, theirs))
        return self.backend

    def __getattr__(self, name):  # reached only before the first CPU op bound the names
        if name in _NAMES and self.__dict__.get("backend") is None:
            self.open()
            return getattr(self, name)
        raise AttributeError(name)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts).wait()
        return _Done(outputs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts).wait()
        return _Done(outputs)

    def barrier(self, opts, device=None):
        return self.open().barrier(opts)

    def close(self) -> None:
        """Destroys the Gloo backend (its threads joined), once its ops in flight finished.
        Collective, as the group's shutdown."""
        gloo = self._unbind()
        if gloo is not None:
            gloo.shutdown()
        # the last reference goes here: the destructor (the GIL released) joins the threads

    def abort(self) -> None:
        """Gives the Gloo backend up at once: unused from now on, never destroyed. Local."""
        gloo = self._unbind()
        if gloo is not None:
            gloo.abort()
            _ABORTED.append(gloo)

    def _unbind(self):
        """The backend, no longer referenced here (nor by the op names bound to it)."""
        gloo, self.backend = self.backend, None
        for ours in _NAMES:
            self.__dict__.pop(ours, None)
        return gloo
