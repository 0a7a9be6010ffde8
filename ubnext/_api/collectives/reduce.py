"""``reduce``: the reduction of every rank's array, written on the root only
(``torch.distributed.reduce``'s meaning, out of place too). Runs on NCCL (``ncclReduce``)."""

from __future__ import annotations

from ubnext._api.collectives.rung import Rung
from ubnext._interop import arrays as _arrays
from ubnext._protocol.algorithms import OPS, op_problem
from ubnext._protocol.errors import UbnextError


class Reduce(Rung):
    """The Communicator's ``reduce`` (module docstring)."""

    def reduce(self, x, root: int = 0, op: str = "sum", out=None, stream=None):
        """Reduces ``x`` over the ranks into the root's ``out``; never blocks the host.

        The arithmetic is NCCL's (its own order of reduction, as ``all_reduce(...,
        algorithm="nccl")``); an average over one rank is a copy. Nothing is written on
        the other ranks.

        Runs on NCCL (``ncclReduce``; ubnext has no reduce kernel), logged once.

        Collective: yes: every rank calls it, in the same order, with the same root, op,
        count and dtype.
        Graph-capturable: yes, after a first eager call (which sets NCCL up, collectively).

        Args:
            x: CUDA array as ``all_reduce`` takes it, the same count and dtype on every rank.
            root: the rank that receives the reduction.
            op: ``"sum"``, ``"avg"`` (floating-point dtypes), ``"max"`` or ``"min"``.
            out: on the root, where to write (x's count and dtype; ``x`` for in place);
                default: a new array of x's framework and shape. On the other ranks it is
                checked alike but not written (pass None, or the same kind of array).
            stream: as for ``all_reduce``.

        Returns:
            On the root ``out`` (x's framework type for torch/CuPy, CuPy for other inputs);
            None on the other ranks.

        Raises:
            UbnextError: bad arguments (root, op, an ``avg`` of integers, ``out``), or NCCL
                cannot run here (ranks sharing a GPU), raised before anything is launched;
                an error NCCL reports; a closed communicator. BrokenCommunicatorError and
                its kinds, as ``all_reduce`` raises them.
        """
        with self._order:
            name = "reduce"
            if op not in OPS:
                raise UbnextError(f"{name}: unsupported op {op!r}; use one of {', '.join(OPS)}")
            handle, owner, side, xb, root = self._open_rooted(name, x, stream, root)
            problem = op_problem(xb.dtype, op)
            if problem:
                raise UbnextError(f"{name}: {problem}")
            mine = self.rank == root
            if out is x:
                ob = xb
            elif out is not None:
                ob = _arrays.check_out(xb, out, name, handle)
            else:
                ob = self._new(name, xb, handle, owner, side) if mine else xb  # NCCL writes only the root's
            if self._prepare(name, "nccl", xb, xb.count, f"{op} root {root}", handle, owner, side, (xb, ob)):
                self._dispatch.nccl_for(handle, owner).reduce(xb.ptr, ob.ptr, xb.count, xb.dtype, op, root, handle)
                if mine and out is not None:
                    _arrays.mark_written((ob,))
            return ob.obj if mine else None
