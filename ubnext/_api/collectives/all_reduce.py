"""``all_reduce``: every rank's array reduced, on every rank. Runs on ubnext's kernels over
the pool (the algorithm the selector picks), the quantized two-shot where the call opts in,
or NCCL."""

from __future__ import annotations

from ubnext._api.plans import all_reduce_key
from ubnext._api.traced import traced_call
from ubnext._interop import arrays as _arrays
from ubnext._protocol import quant as _quant
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import OPS
from ubnext._protocol.errors import UbnextError


class AllReduce:
    """The Communicator's ``all_reduce`` (module docstring)."""

    def all_reduce(self, x, out=None, op: str = "sum", algorithm: str = "auto", stream=None,
                   precision: str = "auto"):
        """All-reduces ``x`` over the ranks; never blocks the host.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call per dtype, op and algorithm (which
        compiles the kernel; NCCL's first call sets NCCL up).

        Args:
            x: CUDA array (torch.Tensor, cupy.ndarray, ``__cuda_array_interface__`` or
                ``__dlpack__``), contiguous, of a dtype of ``ubnext.DTYPES``, on this
                communicator's device. Arrays from ``empty()`` are reduced without
                copies (in place, or into an ``out`` from ``empty()``); a buffer from
                ``empty()`` must then be used on every rank alike.
            out: where to write the result (same count and dtype; may be ``x``);
                default: a new array of x's framework.
            op: ``"sum"``, ``"avg"`` (floating-point dtypes), ``"max"`` or ``"min"``.
            algorithm: ``"auto"`` or one of ``algorithms()`` (float64 and the integer
                dtypes: ``"twoshot"`` or ``"nccl"``).
            stream: torch/CuPy/cuda.core stream or raw handle; default: the current
                stream of x's framework (CuPy's for other inputs, whose producers are
                ordered before it: ``__dlpack__(stream=...)``, or the interface's
                ``stream``). On a stream other than the current one, torch tensors are
                recorded on it for the caching allocator, and a new ``out`` is ordered for
                it (CuPy's allocated on it; torch's on the current stream, which ``stream``
                then waits for). Calls on different streams run in the order they were issued.
            precision: ``"auto"``: full precision unless the communicator opted in to the
                quantized all-reduce (``UBNEXT_QUANTIZED``), which then takes bfloat16/float16
                sums and averages from the size the selector table measured for this machine
                and world size (``python -m ubnext.tune``; none measured: never; ``describe()``
                says which); ``"exact"``: full
                precision always; ``"int8"``, ``"fp8"`` (e4m3, sm_89+) or ``"int4"``: the
                quantized two-shot in that format (opt-in communicators only; lossy within the bound
                the README states, identical bits on every rank).

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: invalid arguments (before anything is launched), closed
                communicator. BrokenCommunicatorError (CollectiveTimeoutError,
                CollectiveMismatchError, ConcurrentUseError): an earlier collective of this
                communicator failed; its outputs hold NaN where results were not computed.

        May be called from any thread, whatever device is current there: each call runs
        whole as one section with this communicator's context current, and gives the
        caller's back. Every rank must issue its collectives in the same order, so calls
        from several threads need an order of their own.
        """
        if _arrays.traced(x):
            return traced_call(self, "all_reduce", x, out=out, op=op, algorithm=algorithm, stream=stream,
                                precision=precision)
        with self._order:
            name = "all_reduce"
            self._check_open(name)
            handle, owner, side = self._launch_stream(name, stream, x)
            key = None if self._node is None else all_reduce_key(x, out, op, algorithm, precision, handle, side)
            planned, key = self._planned(key, handle, owner, side, (x, out))
            if planned:
                return out
            xb = self._input(name, x, handle)
            if op not in OPS:
                raise UbnextError(f"{name}: unsupported op {op!r}; use one of {', '.join(OPS)}")
            fmt = self._quantized_format(name, precision, algorithm, xb, op)
            algo = f"quantized:{fmt}" if fmt else self._resolve(name, algorithm, xb.nbytes, xb.dtype, op)
            if out is None:
                ob = self._new(name, xb, handle, owner, side)
            elif out is x:  # in place: nothing more to check
                ob = xb
            else:
                ob = _arrays.check_out(xb, out, name, handle)
            if not self._prepare(name, algo, xb, xb.count, op, handle, owner, side, (xb, ob)):
                return ob.obj
            sig = _signature.encode(name, xb.dtype, op, xb.count)
            if fmt:
                self._dispatch.quantized(fmt, xb, ob, op, handle, owner, _quant.signature(sig, fmt))
            else:
                self._keep(key, self._dispatch.all_reduce(algo, xb, ob, op, handle, owner, sig), (xb, ob), (1,))
            if out is not None:
                _arrays.mark_written((ob,))
            return ob.obj
