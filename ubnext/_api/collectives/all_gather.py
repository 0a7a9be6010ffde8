"""``all_gather``: every rank's array, concatenated in rank order, on every rank
(``torch.distributed.all_gather_into_tensor``'s layout). Runs on ubnext's kernels or NCCL."""

from __future__ import annotations

from ubnext._api.traced import traced_call
from ubnext._interop import arrays as _arrays
from ubnext._protocol import signature as _signature
from ubnext._protocol.errors import UbnextError


class AllGather:
    """The Communicator's ``all_gather`` (module docstring)."""

    def all_gather(self, x, out=None, algorithm: str = "auto", stream=None):
        """Gathers every rank's ``x`` into one array on every rank; never blocks the host.

        The layout of ``torch.distributed.all_gather_into_tensor``: ``out`` holds size x k
        elements, rank r's ``x`` (k elements) at ``[r * k, (r + 1) * k)``.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call per dtype and algorithm (as
        ``all_reduce``).

        Args:
            x: CUDA array as ``all_reduce`` takes it, k elements (any shape), the same k
                on every rank.
            out: where to write the size x k elements (x's dtype; apart from x, or with x
                its slice r for in place). An array from ``empty()`` is written in place by
                the barrier two-shot; it must then be used on every rank alike
                (``UBNEXT_DEBUG=1`` checks). Default: a new array of x's framework, of shape
                (size * x.shape[0], *x.shape[1:]) ((size,) for a 0-d x).
            algorithm: ``"auto"`` (picked by out's bytes) or one of ``algorithms()`` that
                has an all-gather (``lamport_twoshot``, ``twoshot``, ``nvls``, ``nccl``).
            stream: as for ``all_reduce``.

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: bad arguments, among them an ``out`` whose count the world size does
                not divide, raised before any launch; a closed communicator.
                BrokenCommunicatorError and its kinds, as ``all_reduce`` raises them.
        """
        if _arrays.traced(x):
            return traced_call(self, "all_gather", x, out=out, algorithm=algorithm, stream=stream)
        with self._order:
            name = "all_gather"
            handle, owner, side, xb = self._open_call(name, x, stream)
            k = xb.count
            if out is not None:
                total = _arrays.as_buffer(out, name, handle).count
                if total % self.size:
                    raise UbnextError(f"{name}: out has {total} elements, which {self.size} ranks do not divide "
                                      f"(out holds size x k elements)")
            algo = self._resolve(name, algorithm, xb.nbytes * self.size, xb.dtype, collective=name)
            shape = (self.size * xb.shape[0], *xb.shape[1:]) if xb.shape else (self.size,)
            ob = self._part_out(name, xb, out, k * self.size, shape, handle, owner, side)
            if self._prepare(name, algo, xb, k, "-", handle, owner, side, (xb, ob)):
                self._dispatch.all_gather(algo, xb, ob, k, handle, owner, _signature.encode(name, xb.dtype, "sum", ob.count))
                if out is not None:
                    _arrays.mark_written((ob,))
            return ob.obj
