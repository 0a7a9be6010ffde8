"""The steps every call of a Communicator is made of, below its public methods: the
launch stream, the arrays checked (one device check: ``arrays.on_device``), the call's
plan, the algorithm resolved for it, the ranks' calls compared in debug mode.

:class:`CallSteps` is the Communicator's base: its methods read the state the
Communicator's constructor sets (device, rank, config, selector, node, dispatcher, plans,
launch order) and run inside a call's launch section.
"""

from __future__ import annotations

import functools
import pickle

from ubnext._api.plans import Plan
from ubnext._engine.launch import Packed
from ubnext._interop import arrays as _arrays
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, DTYPES, KERNEL_DTYPES, UNICAST_OF, op_problem
from ubnext._protocol.errors import ClosedError, UbnextError

_RESOLVED_MAX = 4096  # calls whose algorithm a communicator remembers (cleared when full)


class CallSteps:
    """The private steps of the Communicator's calls (see the module docstring)."""

    def _prepare(self, name: str, algo: str, xb, k: int, op: str, handle: int, owner, side: bool,
                 buffers: tuple) -> bool:
        """Whether a call of ``k`` elements (per rank) has work: then the ranks' calls are
        compared in debug mode, and its ``buffers`` recorded on a side stream."""
        if k == 0:
            return False
        if self.config.debug:
            self._compare_across_ranks(name, (xb.count, xb.dtype, op, algo, self._symmetric(buffers)))
        if side:
            _arrays.record_stream(handle, owner, buffers)
        return True

    def _planned(self, key, handle: int, owner, side: bool, arrays: tuple) -> tuple:
        """Launches the plan of ``key`` (``_plans``; None: the call is never planned), if the
        communicator has one: the call validated and launched before, the same launch, in the
        launch section, with ``arrays`` (the call's, in the order of ``Plan.buffers``)
        recorded on a side stream. The caller has checked that the communicator is open.

        Returns:
            ``(launched, key)``: ``key`` for ``_keep`` after the full path, None where it is
            unhashable (the full path names the argument).
        """
        try:
            plan = self._plans.get(key)
        except TypeError:
            return False, None
        if plan is None:
            return False, key
        if side:
            _arrays.record_stream(handle, owner, [None if t is None else _arrays.Buffer(a, *t)
                                                  for a, t in zip(arrays, plan.buffers)])
        self._dispatch.launch(plan.launch, handle, owner)
        if plan.written:
            _arrays.increment_versions([arrays[i] for i in plan.written])
        return True, key

    def _keep(self, key, launch, buffers: tuple, outputs: tuple) -> None:
        """Keeps the one kernel launch of a call's full path (``launch``: the Dispatcher's,
        None where the call was not one) as the plan of ``key`` (None: not planned), with
        ``buffers`` (the call's Buffers, None for an array not given, as ``_planned``
        records them) and ``outputs`` (the places in ``buffers`` of the outputs; the torch
        tensors among them have their versions incremented by a planned call). Debug mode
        plans nothing: it compares the ranks' calls every time. (No close can come between
        the launch and this: close waits for the call's section.)"""
        if launch is not None and key is not None and not self.config.debug:
            written = tuple(i for i in outputs if buffers[i] is not None and buffers[i].framework == "torch")
            self._plans.put(key, Plan(Packed(*launch), tuple(None if b is None else b[1:] for b in buffers),
                                      written))

    def _open_call(self, name: str, x, stream) -> tuple:
        """The start of a call: the communicator open, its launch stream (``handle, owner,
        side``: ``_arrays.launch_stream``) and x as a Buffer on this communicator's device."""
        self._check_open(name)
        handle, owner, side = self._launch_stream(name, stream, x)
        return handle, owner, side, self._input(name, x, handle)

    def _launch_stream(self, name: str, stream, x) -> tuple:
        """The stream a call on ``x`` launches on (``_arrays.launch_stream``: ``handle, owner,
        side``), in the section; a ``stream`` of another device than this communicator's
        raises before anything is launched."""
        handle, owner, side = _arrays.launch_stream(stream, x, self.device)
        if stream is not None:
            self._check_stream(name, handle)
        if self._node is not None:
            self._node.hold(handle)  # a CUDA graph being captured holds the pool (holders.Graphs)
        return handle, owner, side

    def _stream_arg(self, name: str, stream) -> int:
        """The raw handle of a ``stream=`` given alone (``synchronize``), checked as
        ``_launch_stream`` checks it."""
        handle = _arrays.stream_handle(stream)
        self._check_stream(name, handle)
        return handle

    def _check_stream(self, name: str, handle: int) -> None:
        """Raises where stream ``handle`` belongs to another context than this communicator's."""
        if not self._order.context.owns(handle):
            raise UbnextError(f"{name}: stream {handle:#x} belongs to another device (or context) than the "
                              f"communicator's, device {self.device}; pass a stream of device {self.device}")

    def _input(self, name: str, x, handle: int):
        """x as a Buffer on this communicator's device (``handle``: the launch stream)."""
        return self._on_device(name, _arrays.as_buffer(x, name, handle), "input")

    def _new(self, name: str, xb, handle: int, owner, side: bool, shape: tuple | None = None):
        """A new output of x's framework (``_arrays.empty_like``: x's shape or ``shape``,
        ordered for the launch stream) as a Buffer, checked to be on this communicator's
        device like every array a call takes."""
        return self._on_device(name, _arrays.as_buffer(_arrays.empty_like(xb, handle, owner, side, shape), name,
                                                       handle), "a new output")

    def _on_device(self, name: str, b, what: str):
        """``b`` (a Buffer) where it is on this communicator's device; else raises."""
        return _arrays.on_device(b, self.device, name, what)

    def _part_out(self, name: str, xb, out, count: int, shape: tuple, handle: int, owner, side: bool):
        """The output of a reduce-scatter (``count`` < x's) or all-gather: ``out`` checked
        (``_arrays.check_part``), or a new array of ``shape``."""
        if out is None:
            return self._new(name, xb, handle, owner, side, shape)
        slice_bytes = min(count, xb.count) * DTYPES[xb.dtype][1]
        # rank r's slice: r is the global rank, NCCL's (the local rank on one node, the kernels')
        return _arrays.check_part(xb, out, count, self.rank * slice_bytes, name, handle)

    @staticmethod
    def _operand(name: str, xb, arr, what: str, shape: tuple, handle: int):
        """An operand of a fused call: ``shape``, x's dtype and device (the communicator's)."""
        b = _arrays.on_device(_arrays.as_buffer(arr, name, handle), xb.device, name, what)
        if b.shape != shape or b.dtype != xb.dtype:  # torch.Size is a tuple
            raise UbnextError(f"{name}: {what} must be {xb.dtype} of shape {shape}, "
                              f"got {b.dtype} of shape {tuple(b.shape)}")
        return b

    def _quantized_format(self, name: str, precision: str, algorithm: str, xb, op: str) -> str | None:
        """The format a call of ``name`` (a collective of ``_quant.COLLECTIVES``) on ``xb`` runs
        in, or None for full precision (``_quant.choose``, with this communicator's opt-in and
        the selector table's threshold for the collective)."""
        setting = self.config.quantized
        threshold = self._selector.quantized(setting, xb.dtype, name)[0]
        return _quant.choose(name, precision, algorithm, xb.dtype, op, xb.nbytes, threshold, setting,
                             self._node is not None, lambda: self._arch)

    @functools.cached_property
    def _arch(self) -> int:
        """The device's compute capability, e.g. 90 (read once, when a call first needs it)."""
        import cupy

        return int(cupy.cuda.Device(self.device).compute_capability)

    def _check_open(self, name: str) -> None:
        if self._closed:
            raise ClosedError(f"{name}: the communicator is closed")
        self._check_failures(name)

    def _check_failures(self, name: str) -> None:
        error = None if self._node is None else self._node.failure(name, self.config.timeout_s)
        if error is not None:
            self._plans.clear()
            raise error

    def _resolve(self, name: str, algorithm: str, nbytes: int, dtype: str, op: str = "sum",
                 fused: bool = False, collective: str = "all_reduce") -> str:
        """The algorithm that runs a call of ``collective`` (a pure function of its
        arguments: cached). ``fused``: a fused add + RMSNorm call, which the kernels take
        in launches of whole rows, so that any size fits them."""
        key = (algorithm, nbytes, dtype, op, fused, collective)
        algo = self._resolved.get(key)
        if algo is None:
            if len(self._resolved) >= _RESOLVED_MAX:
                self._resolved.clear()
            algo = self._resolved[key] = self._resolve_uncached(name, algorithm, nbytes, dtype, op, fused,
                                                                collective)
        return algo

    def _resolve_uncached(self, name: str, algorithm: str, nbytes: int, dtype: str, op: str,
                          fused: bool, collective: str) -> str:
        problem = op_problem(dtype, op)
        if problem:
            raise UbnextError(f"{name}: {problem}")
        if fused and dtype not in KERNEL_DTYPES:
            raise UbnextError(f"{name}: the fused add + RMSNorm takes {', '.join(KERNEL_DTYPES)}, not {dtype}")
        if algorithm == "auto" and self.config.algorithm != "auto" and ALGORITHMS[self.config.algorithm].supports(
                dtype, op, collective):  # UBNEXT_ALGO names a kernel: what it does not run stays with auto
            algorithm = self.config.algorithm
        if algorithm == "auto":
            algo = (self._selector.select_fused(nbytes, dtype) if fused else
                    self._selector.select(nbytes, dtype, collective))
            if not ALGORITHMS[algo].supports(dtype, op, collective):  # NVLS reduces no fp32 max/min
                algo = UNICAST_OF[algo]
            if self.config.deterministic and algo == "nccl" and dtype == "float64" and collective != "all_gather":
                where = (f"this communicator has no ubnext kernels ({self._nccl_reason or 'NCCL only'})"
                         if collective == "all_reduce" else f"ubnext's kernels run no {collective} of float64")
                raise UbnextError(f"{name}: deterministic mode (UBNEXT_DETERMINISTIC=1) cannot reduce float64 "
                                  f"here: {where}, and NCCL reduces in an order of its own")
            return self._runnable(name, algo, dtype, collective)
        if algorithm not in ALGORITHMS:
            raise UbnextError(f"{name}: unknown algorithm {algorithm!r}; use auto or one of {', '.join(ALGORITHMS)}")
        if not self._selector.fits(algorithm, 0 if fused else nbytes):  # 0: usable at all
            bounds = "; ".join(f"{n} up to {setting}" for n, (_, setting) in self._selector.limits.items()
                               if n in self.algorithms())
            raise UbnextError(f"{name}: algorithm {algorithm!r} cannot take {nbytes} bytes on this communicator "
                              f"(usable: {', '.join(self.algorithms())}; {bounds})")
        if not ALGORITHMS[algorithm].serves(collective):
            served = [n for n in self.algorithms() if ALGORITHMS[n].serves(collective)]
            raise UbnextError(f"{name}: algorithm {algorithm!r} has no {collective} kernel; use auto or one of "
                              f"{', '.join(served)}")
        if not ALGORITHMS[algorithm].supports(dtype, op, collective):
            raise UbnextError(f"{name}: algorithm {algorithm!r} does not reduce {dtype} with op {op!r}")
        return self._runnable(name, algorithm, dtype, collective)

    def _runnable(self, name: str, algo: str, dtype: str, collective: str) -> str:
        """``algo``, unless it is NCCL where NCCL cannot run (ranks sharing a GPU, a rank
        without the library: known alike on every rank since construction), which raises
        here, before any launch or exchange, instead of in NCCL's setup."""
        problem = self._selector.nccl_problem
        if algo == "nccl" and problem:
            raise UbnextError(f"{name}: this {collective} of {dtype} needs NCCL, which cannot run here "
                              f"({problem}); ubnext's kernels take {collective} of {', '.join(KERNEL_DTYPES)}"
                              + (", and the barrier two-shot every dtype" if collective == "all_reduce" else ""))
        return algo

    def _symmetric(self, buffers: tuple) -> tuple:
        """Where each buffer lies in this rank's pool segment (an offset, or None outside
        it): the kernels address the same offsets on every rank, so ranks must agree."""
        pool = None if self._node is None else self._node.pool
        return tuple(None if pool is None else pool.contains(b.ptr, b.nbytes) for b in buffers)

    def _compare_across_ranks(self, name: str, call: tuple) -> None:
        """Debug mode: every rank's (count, dtype, op, algorithm, pool offsets of its
        buffers) must be the same; raises on every rank naming each rank's call."""
        calls = [pickle.loads(b) for b in self._exchanges.run(name, self.bootstrap.allgather, pickle.dumps(call))]
        if any(c != calls[0] for c in calls):
            rows = "; ".join(f"rank {r}: count={c[0]} dtype={c[1]} op={c[2]} algorithm={c[3]} "
                             f"symmetric offsets={c[4]}" for r, c in enumerate(calls))
            raise UbnextError(f"{name}: ranks disagree on the call ({rows})")
