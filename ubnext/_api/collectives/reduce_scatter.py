"""``reduce_scatter``: the reduction of every rank's array, each rank given its slice
(``torch.distributed.reduce_scatter_tensor``'s layout). Runs on ubnext's kernels, the
quantized reduce-scatter where the call opts in, or NCCL."""

from __future__ import annotations

from ubnext._api.traced import traced_call
from ubnext._interop import arrays as _arrays
from ubnext._protocol import quant as _quant
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import OPS
from ubnext._protocol.errors import UbnextError


class ReduceScatter:
    """The Communicator's ``reduce_scatter`` (module docstring)."""

    def reduce_scatter(self, x, out=None, op: str = "sum", algorithm: str = "auto", stream=None,
                       precision: str = "auto"):
        """Reduces ``x`` over the ranks and gives each rank its slice; never blocks the host.

        The layout of ``torch.distributed.reduce_scatter_tensor``: ``x`` holds size x k
        elements, and rank r gets the reduction of elements ``[r * k, (r + 1) * k)``.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call per dtype, op and algorithm (as
        ``all_reduce``).

        Args:
            x: CUDA array as ``all_reduce`` takes it, of size x k elements (any shape). An
                array from ``empty()`` is read in place by the barrier two-shot; it must then
                be used on every rank alike (``UBNEXT_DEBUG=1`` checks).
            out: where to write this rank's k elements (x's dtype; apart from x, or x's
                slice r for in place); default: a new array of x's framework, of shape
                (x.shape[0] / size, *x.shape[1:]) where size divides x.shape[0], else (k,).
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
            algorithm: ``"auto"`` (picked by x's bytes) or one of ``algorithms()`` that has a
                reduce-scatter (``lamport_twoshot``, ``twoshot``, ``nvls``, ``nccl``).
            stream: as for ``all_reduce``.
            precision: as for ``all_reduce``, with the reduce-scatter's own thresholds:
                ``"auto"``: full precision unless the communicator opted in
                (``UBNEXT_QUANTIZED``), which then takes bfloat16/float16 sums and averages
                from the size (of x) the selector table measured for reduce-scatters on this
                machine and world size (none measured, as in the shipped table: never;
                ``describe()`` says which); ``"exact"``: full precision always; ``"int8"``,
                ``"fp8"`` or ``"int4"``: the quantized reduce-scatter in that format
                (opt-in communicators only): every rank's slices cross the links quantized,
                and each rank adds them in rank order in fp32 and rounds its slice once,
                within the bound docs/quantized.md states (one quantization: below the
                all-reduce's).

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: invalid arguments, among them a count that the world size does not
                divide (before anything is launched), a ``precision`` the call cannot take
                (as for ``all_reduce``); closed communicator.
                BrokenCommunicatorError (CollectiveTimeoutError, CollectiveMismatchError,
                ConcurrentUseError): an earlier collective of this communicator failed; its
                outputs hold NaN where results were not computed.
        """
        if _arrays.traced(x):
            return traced_call(self, "reduce_scatter", x, out=out, op=op, algorithm=algorithm, stream=stream,
                                precision=precision)
        with self._order:
            name = "reduce_scatter"
            handle, owner, side, xb = self._open_call(name, x, stream)
            if op not in OPS:
                raise UbnextError(f"{name}: unsupported op {op!r}; use one of {', '.join(OPS)}")
            if xb.count % self.size:
                raise UbnextError(f"{name}: x has {xb.count} elements, which {self.size} ranks do not divide "
                                  f"(x holds size x k elements)")
            k = xb.count // self.size
            fmt = self._quantized_format(name, precision, algorithm, xb, op)
            algo = f"quantized:{fmt}" if fmt else self._resolve(name, algorithm, xb.nbytes, xb.dtype, op,
                                                                 collective=name)
            shape = ((xb.shape[0] // self.size, *xb.shape[1:]) if xb.shape and xb.shape[0] % self.size == 0
                     else (k,))
            ob = self._part_out(name, xb, out, k, shape, handle, owner, side)
            if self._prepare(name, algo, xb, k, op, handle, owner, side, (xb, ob)):
                sig = _signature.encode(name, xb.dtype, op, xb.count)
                if fmt:
                    self._dispatch.quantized_reduce_scatter(fmt, xb, ob, k, op, handle, owner,
                                                            _quant.signature(sig, fmt))
                else:
                    self._dispatch.reduce_scatter(algo, xb, ob, k, op, handle, owner, sig)
                if out is not None:
                    _arrays.mark_written((ob,))
            return ob.obj
