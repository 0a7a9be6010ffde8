"""``broadcast``: the root's array on every rank (``torch.distributed.broadcast``'s
meaning, out of place too). Runs on NCCL (``ncclBroadcast``), the pool's copy form or its
scatter + all-gather (``pool_copy``), or the low-latency kernel."""

from __future__ import annotations

from ubnext._api.collectives.pool_copy import AREA_BYTES, PoolCopy, broadcast_plan, scatter_allgather_plan
from ubnext._interop import arrays as _arrays
from ubnext._protocol import signature as _signature

#: the plans of broadcast's forms on the copy form's area
PLANS = {"copy": broadcast_plan, "scatter_allgather": scatter_allgather_plan}


class Broadcast(PoolCopy):
    """The Communicator's ``broadcast`` (module docstring)."""

    def broadcast(self, x, root: int = 0, out=None, stream=None, algorithm: str = "auto"):
        """Gives every rank the root's ``x``; never blocks the host.

        On the root ``out`` receives a copy of ``x``; on every other rank ``x`` gives only
        the shape and dtype (its values are not read), and ``out`` receives the root's
        values, bit for bit. ``out=x`` is in place, as ``torch.distributed.broadcast``.

        Runs on NCCL (``ncclBroadcast``), logged once; on the pool's copy form (the root
        stages the message in its area, every other rank copies it out, barriers between:
        ``ubnext._api.collectives.pool_copy``); on its bandwidth form for large messages
        (``"scatter_allgather"``: the root pushes one part of the message into each rank's
        area, then every rank pulls every part, so the root's links carry about twice the
        message instead of once per peer); or on the low-latency kernel (``"ll"``: the root
        pushes 8 bytes and a flag per 16-byte line into every rank, which polls; messages of
        at most ``LL_MAX_BYTES``, 64 KiB). ``auto`` takes, at each size, the algorithm of
        the selector table's broadcast rows (``python -m ubnext.tune --movers`` measures
        them, NCCL included); without rows for the machine, NCCL where it runs and the copy
        form where it cannot (ranks sharing a GPU).

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
            algorithm: ``"auto"``, ``"ll"`` (the low-latency kernel), ``"copy"`` (the pool's
                copy form), ``"scatter_allgather"`` (its bandwidth form) or ``"nccl"``.

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: bad arguments (a root that is not a rank, an ``out`` of another
                count or dtype, or partly overlapping x, an unknown algorithm, a pool form
                without a pool, ``"ll"`` past its size), or NCCL cannot run here
                (ranks sharing a GPU) where it is named, raised before anything is launched;
                an error NCCL reports; a closed communicator. BrokenCommunicatorError and its kinds, as
                ``all_reduce`` raises them.
        """
        name = "broadcast"
        algo = self._mover(name, algorithm)
        with self._order:
            handle, owner, side, xb, root = self._open_rooted(name, x, stream, root, rung=False)
            algo = self._sized(name, algo, xb.nbytes, xb.dtype)
            if out is None:
                ob = self._new(name, xb, handle, owner, side)
            elif out is x:
                ob = xb
            else:
                ob = _arrays.check_out(xb, out, name, handle)
            if self._prepare(name, algo, xb, xb.count, f"root {root}", handle, owner, side, (xb, ob)):
                sig = _signature.encode_rooted(name, xb.dtype, xb.count, root)
                if algo == "nccl":
                    self._dispatch.nccl_for(handle, owner).broadcast(xb.ptr, ob.ptr, xb.count, xb.dtype, root, handle)
                elif algo == "ll":
                    self._run_ll(name, xb.ptr, ob.ptr, xb.nbytes, sig, handle, owner, root)
                else:
                    plan = PLANS[algo](self.rank, root, self._copy_area(), xb.ptr, ob.ptr, xb.nbytes, AREA_BYTES // 2)
                    self._run_copies(name, plan, sig, handle, owner)
                if out is not None:
                    _arrays.mark_written((ob,))
            return ob.obj
