"""``scatter``: the root's array cut into one part per rank (``torch.distributed.scatter``'s
meaning, from one array). Runs on NCCL: grouped sends and receives (CuPy's binding has
no ``ncclScatter``), or the pool's copy form (``pool_copy``)."""

from __future__ import annotations

from ubnext._api.collectives.pool_copy import AREA_BYTES, PoolCopy, scatter_plan
from ubnext._interop import arrays as _arrays
from ubnext._protocol import signature as _signature
from ubnext._protocol.errors import UbnextError


class Scatter(PoolCopy):
    """The Communicator's ``scatter`` (module docstring)."""

    def scatter(self, x, root: int = 0, out=None, stream=None, algorithm: str = "auto"):
        """Gives each rank its part of the root's ``x``; never blocks the host.

        The root's ``x`` holds size x k elements; rank r receives elements
        ``[r * k, (r + 1) * k)``, bit for bit. As in ``torch.distributed.scatter``, the
        parts come from the root only, and every other rank names where its part lands:
        ``out`` is required there (its count and dtype say k and the dtype), and ``x`` is
        ignored there (None is fine).

        Runs on NCCL: the root sends every part, each rank receives its own, in one group
        (``ncclSend``/``ncclRecv``), logged once; or the pool's copy form (the root copies
        each part into its rank's area, each rank copies its own out, barriers between),
        which ``auto`` takes where NCCL cannot run.

        Collective: yes: every rank calls it, in the same order, with the same root, and
        the same k and dtype.
        Graph-capturable: yes, after a first eager call (which sets NCCL up, collectively).

        Args:
            x: on the root, a CUDA array as ``all_reduce`` takes it (any dtype of
                ``ubnext.DTYPES``) of size x k elements (of shape (size, *part) for
                torch's layout); ignored on the other ranks.
            root: the rank that sends.
            out: where this rank's k elements land: required on the other ranks; on the
                root x's dtype, apart from x or x's slice ``root`` for in place, default a
                new array of x's framework of shape x.shape[1:] when x.shape[0] is the
                world size, else (k,).
            stream: as for ``all_reduce`` (of ``out`` where x is not given).
            algorithm: ``"auto"``, ``"copy"`` (the pool's copy form) or ``"nccl"``.

        Returns:
            ``out`` (its framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: bad arguments (root; on the root an x whose count the world size
                does not divide or an ``out`` of another count or dtype; elsewhere no
                ``out``; an unknown algorithm), or NCCL cannot run here (ranks sharing a
                GPU) where it is named, raised before anything is launched; an error NCCL
                reports; a closed communicator.
                BrokenCommunicatorError and its kinds, as ``all_reduce`` raises them.
        """
        name = "scatter"
        algo = self._mover(name, algorithm)
        with self._order:
            self._check_open(name)
            root = self._rank_arg(name, root, "root")
            mine = self.rank == root
            if mine:
                if x is None:
                    raise UbnextError(f"{name}: the root (rank {root}) must pass x, the size x k elements to scatter")
                handle, owner, side, xb = self._open_call(name, x, stream)
                if xb.count % self.size:
                    raise UbnextError(f"{name}: x has {xb.count} elements, which {self.size} ranks do not divide "
                                      f"(x holds size x k elements)")
                k = xb.count // self.size
                shape = tuple(xb.shape[1:]) if xb.shape and xb.shape[0] == self.size else (k,)
                ob = self._part_out(name, xb, out, k, shape, handle, owner, side)
            else:
                if out is None:
                    raise UbnextError(f"{name}: out is required on the ranks other than the root ({root}): it says "
                                      f"how many elements of which dtype this rank receives")
                handle, owner, side, ob = self._open_call(name, out, stream)
                xb = None
            if not self._prepare(name, algo, ob, ob.count, f"root {root}", handle, owner, side,
                                 (ob, ob if xb is None else xb)):
                return ob.obj
            part = ob.nbytes
            if algo == "copy":
                plan = scatter_plan(self.rank, root, self._copy_area(), 0 if xb is None else xb.ptr, ob.ptr, part,
                                    AREA_BYTES // 2)
                self._run_copies(name, plan, _signature.encode_rooted(name, ob.dtype, ob.count, root), handle, owner)
            else:
                sends = [(xb.ptr + r * part, part, r) for r in range(self.size)] if mine else []
                recvs = [(ob.ptr, part, root)]
                if mine and xb.ptr + root * part == ob.ptr:  # in place: the root's part is there
                    sends, recvs = [v for v in sends if v[2] != root], []
                self._dispatch.nccl_for(handle, owner).exchange(sends, recvs, handle, name)
            if out is not None:
                _arrays.mark_written((ob,))
            return ob.obj
