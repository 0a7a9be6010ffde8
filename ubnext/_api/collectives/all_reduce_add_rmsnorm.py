"""``all_reduce_add_rmsnorm``: the all-reduce, residual add and RMSNorm in one kernel, or
the all-reduce then ubnext's separate add + RMSNorm kernel where the fused ones cannot
take the call."""

from __future__ import annotations

from ubnext._api.plans import add_rmsnorm_key
from ubnext._api.traced import traced_call
from ubnext._engine.epilogue import check_eps
from ubnext._environment.log import log_once
from ubnext._interop import arrays as _arrays
from ubnext._protocol import signature as _signature
from ubnext._protocol.errors import UbnextError


class AllReduceAddRmsnorm:
    """The Communicator's ``all_reduce_add_rmsnorm`` (module docstring)."""

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps: float = 1e-6, bias=None, out=None,
                               residual_out=None, algorithm: str = "auto", stream=None):
        """All-reduce, residual add and RMSNorm in one kernel; never blocks the host.

        For ``x`` of shape (tokens, hidden)::

            residual_out = all_reduce(x) + bias + residual
            normed = residual_out / sqrt(mean(residual_out ** 2, axis=-1) + eps) * weight

        in fp32 arithmetic, with the all-reduced values and ``residual_out`` rounded to
        x's dtype first (as the unfused sequence would). ``residual``, ``weight`` and
        ``bias`` must hold the same values on every rank (as in tensor parallelism); every
        rank then gets the same bits. Hidden sizes that are a multiple of 8 with 16-byte
        aligned arrays take the fused kernels; anything else runs the all-reduce, then
        ubnext's separate add + RMSNorm kernel (logged once).

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call of the same shape, dtype and
        algorithm (which compiles its kernels).

        Args:
            x: 2-D CUDA array (tokens x hidden), bfloat16/float16/float32.
            residual: same shape and dtype as x, or None (plain all-reduce + RMSNorm).
            weight: 1-D, hidden elements, x's dtype.
            eps: finite, >= 0.
            bias: 1-D, hidden elements, x's dtype, or None.
            out: where to write ``normed`` (x's shape and dtype, not overlapping x);
                default: new.
            residual_out: where to write the residual sum (may be ``residual`` for in
                place, must not be ``out``); default: new.
            algorithm: ``"auto"`` or one of ``algorithms()`` (picked by x's bytes).
            stream: as for ``all_reduce``.

        Returns:
            ``(normed, residual_out)``, in x's framework.

        Raises:
            UbnextError: invalid arguments (before anything is launched), closed
                communicator. BrokenCommunicatorError (CollectiveTimeoutError,
                CollectiveMismatchError, ConcurrentUseError): an earlier collective of this
                communicator failed; its outputs hold NaN where results were not computed.
        """
        if _arrays.traced(x):
            return traced_call(self, "all_reduce_add_rmsnorm", x, residual, weight, eps=eps, bias=bias, out=out,
                                residual_out=residual_out, algorithm=algorithm, stream=stream)
        with self._order:
            name = "all_reduce_add_rmsnorm"
            self._check_open(name)
            handle, owner, side = self._launch_stream(name, stream, x)
            key = None if self._node is None else add_rmsnorm_key(x, residual, weight, bias, out, residual_out, eps,
                                                                  algorithm, handle, side)
            planned, key = self._planned(key, handle, owner, side, (x, residual, weight, bias, out, residual_out))
            if planned:
                return out, residual_out
            xb = _arrays.as_buffer(x, name, handle)
            if len(xb.shape) != 2:
                raise UbnextError(f"{name}: x must be 2-D (tokens x hidden), got shape {tuple(xb.shape)}")
            self._on_device(name, xb, "x")
            rows, hidden = (int(d) for d in xb.shape)
            eps = check_eps(name, eps)

            def operand(arr, what, shape):
                return self._operand(name, xb, arr, what, shape, handle)

            shape = (rows, hidden)
            rb = None if residual is None else operand(residual, "residual", shape)
            wb = operand(weight, "weight", (hidden,))
            bb = None if bias is None else operand(bias, "bias", (hidden,))
            nb = self._new(name, xb, handle, owner, side) if out is None else operand(out, "out", shape)
            ob = (self._new(name, xb, handle, owner, side) if residual_out is None else
                  operand(residual_out, "residual_out", shape))
            if _arrays.overlap(nb, ob):
                raise UbnextError(f"{name}: out and residual_out overlap; they must be separate arrays")
            for b, what in ((nb, "out"), (ob, "residual_out")):
                if _arrays.overlap(b, xb):
                    raise UbnextError(f"{name}: {what} overlaps x; the outputs must be separate arrays")
            if rb is not None and _arrays.overlap(ob, rb) and ob.ptr != rb.ptr:
                raise UbnextError(f"{name}: residual_out partially overlaps residual; pass residual_out=residual "
                                  f"for in place, or a separate array")
            algo = self._resolve(name, algorithm, xb.nbytes, xb.dtype, fused=True)
            if not self._prepare(name, algo, xb, xb.count, "add_rmsnorm", handle, owner, side, (xb, rb, wb, bb, nb, ob)):
                return nb.obj, ob.obj
            norm = (0 if rb is None else rb.ptr, 0 if bb is None else bb.ptr, wb.ptr, nb.ptr, ob.ptr)
            aligned = (xb.ptr | norm[0] | norm[1] | norm[2] | norm[3] | norm[4]) % 16 == 0
            chunk = self._dispatch.fused_rows(algo, xb.dtype, hidden, rows, aligned)  # rows per fused launch
            if chunk:
                self._keep(key, self._dispatch.add_rmsnorm(algo, xb, rows, chunk, hidden, norm, eps, handle, owner,
                                                           _signature.encode_fused(xb.dtype, rows, hidden)),
                           (xb, rb, wb, bb, nb, ob), (4, 5))
            else:
                why = ("the NCCL engine" if algo == "nccl" else
                       f"hidden={hidden} is not a multiple of 8" if hidden % 8 else
                       "arrays not 16-byte aligned" if not aligned else
                       f"one launch of {algo} cannot take a row of {hidden} {xb.dtype} elements")
                plain = self._resolve(name, algorithm, xb.nbytes, xb.dtype)  # the all-reduce alone must fit
                log_once(f"unfused:{why}", f"{name}: all-reduce then a separate add + RMSNorm kernel ({why})")
                self._dispatch.unfused(plain, xb, nb, rows, hidden, norm, eps, handle, owner,
                                       _signature.encode("all_reduce", xb.dtype, "sum", xb.count))
            _arrays.mark_written((None if out is None else nb, None if residual_out is None else ob))
            return nb.obj, ob.obj
