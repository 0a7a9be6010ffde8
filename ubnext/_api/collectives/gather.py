"""``gather``: every rank's array, stacked on the root (``torch.distributed.gather``'s
meaning, as one array). Runs on NCCL: grouped sends and receives (CuPy's binding has no
``ncclGather``), or the pool's copy form (``pool_copy``)."""

from __future__ import annotations

from ubnext._api.collectives.pool_copy import AREA_BYTES, PoolCopy, gather_plan
from ubnext._interop import arrays as _arrays
from ubnext._protocol import signature as _signature


class Gather(PoolCopy):
    """The Communicator's ``gather`` (module docstring)."""

    def gather(self, x, root: int = 0, out=None, stream=None, algorithm: str = "auto"):
        """Gathers every rank's ``x`` on the root; never blocks the host.

        The root's ``out`` holds size x k elements, rank r's ``x`` (k elements) at
        ``[r * k, (r + 1) * k)``, bit for bit; by default of shape (size, *x.shape).
        Nothing is written on the other ranks.

        Runs on NCCL: each rank sends its ``x`` to the root, which receives them all, in
        one group (``ncclSend``/``ncclRecv``), logged once; or the pool's copy form (each
        rank copies x into its slot of the root's area, the root copies the slots out,
        barriers between), which ``auto`` takes where NCCL cannot run.

        Collective: yes: every rank calls it, in the same order, with the same root, count
        and dtype.
        Graph-capturable: yes, after a first eager call (which sets NCCL up, collectively).

        Args:
            x: CUDA array as ``all_reduce`` takes it (any dtype of ``ubnext.DTYPES``), k
                elements, the same k and dtype on every rank.
            root: the rank that receives.
            out: on the root, where to write the size x k elements (x's dtype; apart from
                x, or with x its slice ``root`` for in place); default: a new array of x's
                framework of shape (size, *x.shape). Ignored on the other ranks.
            stream: as for ``all_reduce``.
            algorithm: ``"auto"``, ``"copy"`` (the pool's copy form) or ``"nccl"``.

        Returns:
            On the root ``out`` (x's framework type for torch/CuPy, CuPy for other
            inputs); None on the other ranks.

        Raises:
            UbnextError: bad arguments (root, ``out``, algorithm), or NCCL cannot run here
                (ranks sharing a GPU) where it is named, raised before anything is launched;
                an error NCCL reports; a closed communicator. BrokenCommunicatorError and its kinds, as
                ``all_reduce`` raises them.
        """
        name = "gather"
        algo = self._mover(name, algorithm)
        with self._order:
            handle, owner, side, xb, root = self._open_rooted(name, x, stream, root, rung=False)
            mine = self.rank == root
            ob = None
            if mine:
                ob = self._part_out(name, xb, out, xb.count * self.size, (self.size, *xb.shape), handle, owner, side)
            if not self._prepare(name, algo, xb, xb.count, f"root {root}", handle, owner, side,
                                 (xb, xb if ob is None else ob)):
                return ob.obj if mine else None
            if algo == "copy":
                plan = gather_plan(self.rank, root, self._copy_area(), xb.ptr, 0 if ob is None else ob.ptr, xb.nbytes,
                                   AREA_BYTES // 2)
                self._run_copies(name, plan, _signature.encode_rooted(name, xb.dtype, xb.count, root), handle, owner)
            else:
                sends = [(xb.ptr, xb.nbytes, root)]
                recvs = [(ob.ptr + r * xb.nbytes, xb.nbytes, r) for r in range(self.size)] if mine else []
                if mine and ob.ptr + root * xb.nbytes == xb.ptr:  # in place: the root's slice is there
                    sends, recvs = [], [v for v in recvs if v[2] != root]
                self._dispatch.nccl_for(handle, owner).exchange(sends, recvs, handle, name)
            if mine and out is not None:
                _arrays.mark_written((ob,))
            return ob.obj if mine else None
