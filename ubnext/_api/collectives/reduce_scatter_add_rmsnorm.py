"""``reduce_scatter_add_rmsnorm``: the sequence-parallel step, a reduce-scatter by tokens
then the residual add and RMSNorm of this rank's tokens."""

from __future__ import annotations

from ubnext._api.traced import traced_call
from ubnext._engine.epilogue import check_eps
from ubnext._interop import arrays as _arrays
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import KERNEL_DTYPES
from ubnext._protocol.errors import UbnextError


class ReduceScatterAddRmsnorm:
    """The Communicator's ``reduce_scatter_add_rmsnorm`` (module docstring)."""

    def reduce_scatter_add_rmsnorm(self, x, residual_shard, weight, eps: float = 1e-6, bias=None,
                                   algorithm: str = "auto", stream=None):
        """The sequence-parallel step: reduce-scatter by tokens, residual add and RMSNorm of
        this rank's tokens; never blocks the host.

        For ``x`` of shape (rows, hidden), rows a multiple of the world size, rank r's
        shard is rows ``[r * rows / size, (r + 1) * rows / size)``::

            residual_out = reduce_scatter(x) + bias + residual_shard
            normed = residual_out / sqrt(mean(residual_out ** 2, axis=-1) + eps) * weight

        with the arithmetic of ``all_reduce_add_rmsnorm``'s separate add + RMSNorm kernel
        (fp32, the reduced values and ``residual_out`` rounded to x's dtype first). It runs
        as the reduce-scatter kernel, then that kernel on this rank's rows.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call of the same shape, dtype and
        algorithm (which compiles its kernels).

        Args:
            x: 2-D CUDA array (rows x hidden), bfloat16/float16/float32.
            residual_shard: (rows / size) x hidden, x's dtype, or None.
            weight: 1-D, hidden elements, x's dtype.
            eps: finite, >= 0.
            bias: 1-D, hidden elements, x's dtype, or None.
            algorithm: ``"auto"`` or one of ``algorithms()`` with a reduce-scatter (picked
                by x's bytes).
            stream: as for ``all_reduce``.

        Returns:
            ``(normed_shard, residual_shard_out)``: new (rows / size) x hidden arrays in x's
            framework.

        Raises:
            UbnextError: bad arguments, among them rows that the world size does not divide,
                raised before any launch; a closed communicator.
                BrokenCommunicatorError and its kinds, as ``reduce_scatter`` raises them.
        """
        if _arrays.traced(x):
            return traced_call(self, "reduce_scatter_add_rmsnorm", x, residual_shard, weight, eps=eps, bias=bias,
                                algorithm=algorithm, stream=stream)
        with self._order:
            name = "reduce_scatter_add_rmsnorm"
            handle, owner, side, xb = self._open_call(name, x, stream)
            if len(xb.shape) != 2:
                raise UbnextError(f"{name}: x must be 2-D (rows x hidden), got shape {tuple(xb.shape)}")
            rows, hidden = (int(d) for d in xb.shape)
            if rows % self.size:
                raise UbnextError(f"{name}: x has {rows} rows, which {self.size} ranks do not divide")
            if xb.dtype not in KERNEL_DTYPES:
                raise UbnextError(f"{name}: the add + RMSNorm takes {', '.join(KERNEL_DTYPES)}, not {xb.dtype}")
            eps = check_eps(name, eps)
            shard = (rows // self.size, hidden)
            rb = None if residual_shard is None else self._operand(name, xb, residual_shard, "residual_shard", shard,
                                                                   handle)
            wb = self._operand(name, xb, weight, "weight", (hidden,), handle)
            bb = None if bias is None else self._operand(name, xb, bias, "bias", (hidden,), handle)
            nb = self._new(name, xb, handle, owner, side, shard)
            ob = self._new(name, xb, handle, owner, side, shard)
            algo = self._resolve(name, algorithm, xb.nbytes, xb.dtype, collective="reduce_scatter")
            if not self._prepare(name, algo, xb, xb.count, "add_rmsnorm", handle, owner, side, (xb, rb, wb, bb, nb, ob)):
                return nb.obj, ob.obj
            norm = (0 if rb is None else rb.ptr, 0 if bb is None else bb.ptr, wb.ptr, nb.ptr, ob.ptr)
            self._dispatch.reduce_scatter_add_rmsnorm(algo, xb, nb, shard[0], hidden, norm, eps, handle, owner,
                                                      _signature.encode_fused(xb.dtype, rows, hidden, name))
            return nb.obj, ob.obj
