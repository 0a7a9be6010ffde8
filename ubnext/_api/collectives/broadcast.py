"""``broadcast``: the root's array on every rank (``torch.distributed.broadcast``'s
meaning, out of place too). Runs on NCCL (``ncclBroadcast``)."""

from __future__ import annotations

from ubnext._api.collectives.rung import Rung
from ubnext._interop import arrays as _arrays


class Broadcast(Rung):
    """The Communicator's ``broadcast`` (module docstring)."""

    def broadcast(self, x, root: int = 0, out=None, stream=None):
        """Gives every rank the root's ``x``; never blocks the host.

        On the root ``out`` receives a copy of ``x``; on every other rank ``x`` gives only
        the shape and dtype (its values are not read), and ``out`` receives the root's
        values, bit for bit. ``out=x`` is in place, as ``torch.distributed.broadcast``.

        Runs on NCCL (``ncclBroadcast``; ubnext has no broadcast kernel yet), logged once.

        Collective: yes: every rank calls it, in the same order, with the same root, count
        and dtype.
        Graph-capturable: yes, after a first eager call (which sets NCCL up, collectively).

        Args:
            x: CUDA array as ``all_reduce`` takes it (any dtype of ``ubnext.DTYPES``), the
                same count and dtype on every rank.
            root: the rank whose ``x`` is sent.
            out: where to write (x's count and dtype; ``x`` for in place; apart from x
                otherwise); default: a new array of x's framework and shape.
            stream: as for ``all_reduce``.

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: bad arguments (a root that is not a rank, an ``out`` of another
                count or dtype, or partly overlapping x), or NCCL cannot run here (ranks
                sharing a GPU), raised before anything is launched; an error NCCL reports;
                a closed communicator. BrokenCommunicatorError and its kinds, as
                ``all_reduce`` raises them.
        """
        with self._order:
            name = "broadcast"
            handle, owner, side, xb = self._open_call(name, x, stream)
            root = self._rank_arg(name, root, "root")
            self._rung(name)
            if out is None:
                ob = self._new(name, xb, handle, owner, side)
            elif out is x:
                ob = xb
            else:
                ob = _arrays.check_out(xb, out, name, handle)
            if self._prepare(name, "nccl", xb, xb.count, f"root {root}", handle, owner, side, (xb, ob)):
                self._dispatch.nccl_for(handle, owner).broadcast(xb.ptr, ob.ptr, xb.count, xb.dtype, root, handle)
                if out is not None:
                    _arrays.mark_written((ob,))
            return ob.obj
