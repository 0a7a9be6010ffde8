"""The Communicator: ubnext's public, collective API."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import pickle
import threading
import weakref

from . import _agreement, _arrays, _gate, _nccl, _preflight, _quant, _signature
from ._algorithms import ALGORITHMS, COLLECTIVES, DTYPES, KERNEL_DTYPES, OPS, UNICAST_OF, op_problem
from ._config import Config
from ._context import Context, caller_device
from ._report import Description, report
from ._devices import map_devices
from ._dispatch import Dispatcher
from ._epilogue import check_eps
from ._errors import ClosedError, UbnextError
from ._log import get_logger, log_once
from ._launch import Packed
from ._node import Node
from ._plans import Plan, Plans, add_rmsnorm_key, all_reduce_key
from ._protocol import MAX_RANKS
from ._select import Selector, buffer_limits
from ._streams import LaunchOrder
from ._table import agreed_table
from ._watchdog import Watchdog

_RESOLVED_MAX = 4096  # calls whose algorithm a communicator remembers (cleared when full)
_WATCHDOG_S = 0.5  # seconds between the watchdog's reads of the failure records
#: communicators not closed yet (weakly): the ones left open at exit are named in a warning
_OPEN: weakref.WeakSet = weakref.WeakSet()


class Communicator:
    """A group of ranks that all-reduce, reduce-scatter and all-gather together.

    Creating one is collective over ``bootstrap``: every rank of it must construct
    its Communicator at the same time. On one node whose GPUs reach each other
    (P2P), ubnext's kernels run on a symmetric memory pool; otherwise, and for what
    the kernels do not cover, the work goes to NCCL (logged once with the reason).

    Collective: yes, over ``bootstrap``. Blocks the host.
    Graph-capturable: no (it allocates and maps memory and exchanges with the other ranks).

    Args:
        bootstrap: a ``ubnext.bootstrap.Bootstrap``; default: ``ubnext.bootstrap.default()``,
            every rank the launcher started (mpirun, srun, torchrun, an initialized
            torch.distributed group), closed again by ``close()``.
        device: CUDA device ordinal; default: the current device if the caller set
            one (non-zero), else the first GPU (by UUID) no other rank of the node
            has taken (several ranks on one GPU work, with a warning).
        config: a ``Config``; default ``Config.from_env(**overrides)``.
        **overrides: Config fields that win over the ``UBNEXT_*`` environment.

    Raises:
        UbnextError: invalid configuration; no usable GPU, CuPy, MPI or NCCL (one line
            with the fix, raised before any collective setup); a launcher whose ranks
            the bootstrap does not see; or a setup step failed on this rank.
    """

    def __init__(self, bootstrap=None, device=None, config: Config | None = None, **overrides):
        if config is None:
            config = Config.from_env(**overrides)
        elif overrides:
            raise TypeError("Communicator: pass either config= or keyword overrides, not both")
        self.config = config
        _preflight.check("Communicator", config)  # no GPU, no NCCL...: one line, before anything collective
        import cupy

        self._owns_bootstrap = bootstrap is None  # default()'s is closed by close(), a caller's is not
        if bootstrap is None:
            from .bootstrap import default

            bootstrap = default()
        self.bootstrap = bootstrap
        self.rank, self.size = bootstrap.rank, bootstrap.size
        self._log = get_logger(config, self.rank)
        self._closed = False
        self._resolved: dict[tuple, str] = {}
        self._plans = Plans()  # eager calls validated and launched before (_plans)
        self._local = self._node = self._context = None
        try:
            _agreement.check(config, bootstrap)  # before anything that the configuration shapes
            table = agreed_table(config.tune_file, bootstrap) if config.tune_file else None
            self._local = bootstrap.split_local()
            self.device = map_devices(self._local, device, caller_device())
            cupy.cuda.Device(self.device).use()  # the caller's convenience, as torch.cuda.set_device
            self._context = Context(self.device)
            self._nvls = _gate.decide(config.nvls, os.environ, self._local, self.device)
            self._node = self._setup_node()
            # where NCCL cannot run (ranks sharing a GPU, no NCCL library), the barrier
            # two-shot takes what auto would give NCCL (an exchange: inside the undo)
            nccl_problem = None if self._node is None else _nccl.cannot_run(self._local, self.device)
        except BaseException:
            self._closed = True
            try:
                if self._node is not None:
                    self._node.close(local=True)
            finally:
                try:
                    _close_bootstraps(self._local, self.bootstrap if self._owns_bootstrap else None)
                finally:
                    if self._context is not None:
                        self._context.release()
            raise
        log_once(f"nvls:{self._nvls}", f"Communicator: NVLink multicast {self._nvls}", logging.INFO)
        node = self._node
        # NCCL always; kernels need the pool; multicast kernels reduce in the switch's order,
        # which deterministic mode does not take
        usable = [name for name, alg in ALGORITHMS.items()
                  if not alg.is_kernel or (node is not None and (not alg.multicast or
                                                                 (node.multicast and not config.deterministic)))]
        if nccl_problem:
            log_once(f"nccl-problem:{nccl_problem}", f"Communicator: NCCL cannot run here ({nccl_problem}); "
                     f"auto gives ubnext's barrier two-shot what it would give NCCL", logging.INFO)
        self._selector = Selector(self._local.size, buffer_limits(config), usable, table, self._nccl_reason,
                                  config.deterministic, nccl_problem)
        # every call runs in the launch section: this communicator's context, one thread, issue order
        self._order = LaunchOrder(self._context)
        self._dispatch = Dispatcher(node, self._selector.limits, self._order, bootstrap, self.device)
        for name, limit, setting in self._selector.capped():
            log_once(f"select:{name}:{setting}:{limit}",
                     f"Communicator: the selector table gives {name} messages up to {limit} bytes, but "
                     f"{setting} sizes its buffers for fewer; larger ones go to the next algorithm")
        watchdog = None
        if node is not None:
            # the thread holds neither the communicator nor its node (a dropped one is released)
            log, context, node_ref = self._log, self._context, weakref.ref(node)

            def poll():
                n = node_ref()
                return None if n is None else n.failure("watchdog", config.timeout_s)

            watchdog = Watchdog(poll, lambda e: log.error("%s", e), _WATCHDOG_S, f"ubnext-watchdog-{self.rank}",
                                start=context.enter)  # its announce and anything it frees: this device
        # what close() releases, and a finalizer if the communicator is dropped without it
        self._owned = _Owned(self._order, node, self._dispatch, watchdog, self._local,
                             bootstrap if self._owns_bootstrap else None, self._local.rank)
        self._finalizer = weakref.finalize(self, self._owned.drop)
        self._finalizer.atexit = False  # at exit: only the warning of _warn_open
        _OPEN.add(self)

    def _setup_node(self) -> Node | None:
        """The node's kernel resources, or None when every rank must use NCCL."""
        reason = None
        if self._local.size != self.size:
            reason = f"ranks span several nodes ({self._local.size} of {self.size} on this one)"
        elif self.size > MAX_RANKS:
            reason = f"{self.size} ranks on one node; the kernels serve at most {MAX_RANKS}"
        elif self.config.algorithm == "nccl":
            reason = "UBNEXT_ALGO=nccl"
        node, error = None, None
        if reason is None:
            try:
                node = Node(self._local, self._context, self.config, self._nvls)
            except UbnextError as e:
                error = str(e)
        # Every rank must take the same path: agree on the outcome.
        errors = [e for e in self._local.allgather_obj(error) if e]
        if reason is None and errors:
            reason = f"symmetric memory setup failed: {errors[0]}"
        if reason is not None:
            if node is not None:
                node.close()
                node = None
            log_once(f"node:{reason}", f"Communicator: using NCCL for every call: {reason}")
            if self._nvls.enabled:
                self._nvls = _gate.fallback(self.config.nvls, f"there is no symmetric memory pool ({reason})")
        self._nccl_reason = reason
        return node

    # -- public API -------------------------------------------------------------------
    @property
    def nvls(self) -> _gate.NvlsDecision:
        """Whether this communicator uses NVLink multicast, and why (``enabled``, ``reason``)."""
        return self._nvls

    @property
    def local_rank(self) -> int:
        """This rank's place among the ranks of its node."""
        return self._local.rank

    @property
    def local_size(self) -> int:
        """Ranks of this node in the communicator."""
        return self._local.size

    @property
    def path(self) -> str:
        """Where calls run: ``"kernels on the symmetric pool"``, or ``"NCCL only: <why>"``."""
        return "kernels on the symmetric pool" if self._nccl_reason is None else f"NCCL only: {self._nccl_reason}"

    @property
    def selector(self) -> Selector:
        """The selector ``algorithm="auto"`` consults: its ``tables``, ``explain(nbytes, dtype)``
        (algorithm and reason) and ``fits(algorithm, nbytes)``."""
        return self._selector

    @property
    def pool(self) -> dict | None:
        """The symmetric pool: ``{"bytes", "user_heap_bytes", "user_heap_free_bytes"}`` per
        rank, or None where everything runs on NCCL."""
        node = self._node
        if node is None:
            return None
        return {"bytes": node.pool.size, "user_heap_bytes": node.heap.capacity,
                "user_heap_free_bytes": node.heap.free_bytes}

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
                recorded on it for the caching allocator and a new ``out`` is allocated
                on it. Calls on different streams run in the order they were issued.
            precision: ``"auto"``: full precision unless the communicator opted in to the
                quantized all-reduce (``UBNEXT_QUANTIZED``), which then takes bfloat16/float16
                sums and averages of 16 MiB or more at 2 ranks or more; ``"exact"``: full
                precision always; ``"int8"`` or ``"fp8"`` (e4m3, sm_89+): the quantized
                two-shot in that format (opt-in communicators only; lossy within the bound
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
            return _traced_call(self, "all_reduce", x, out=out, op=op, algorithm=algorithm, stream=stream,
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
            fmt = _quant.choose(name, precision, algorithm, xb.dtype, op, xb.nbytes, self.size, self.config.quantized,
                                self._node is not None, lambda: self._arch)
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
            return _traced_call(self, "all_reduce_add_rmsnorm", x, residual, weight, eps=eps, bias=bias, out=out,
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

    def reduce_scatter(self, x, out=None, op: str = "sum", algorithm: str = "auto", stream=None):
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

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: invalid arguments, among them a count that the world size does not
                divide (before anything is launched); closed communicator.
                BrokenCommunicatorError (CollectiveTimeoutError, CollectiveMismatchError,
                ConcurrentUseError): an earlier collective of this communicator failed; its
                outputs hold NaN where results were not computed.
        """
        if _arrays.traced(x):
            return _traced_call(self, "reduce_scatter", x, out=out, op=op, algorithm=algorithm, stream=stream)
        with self._order:
            name = "reduce_scatter"
            handle, owner, side, xb = self._open_call(name, x, stream)
            if op not in OPS:
                raise UbnextError(f"{name}: unsupported op {op!r}; use one of {', '.join(OPS)}")
            if xb.count % self.size:
                raise UbnextError(f"{name}: x has {xb.count} elements, which {self.size} ranks do not divide "
                                  f"(x holds size x k elements)")
            k = xb.count // self.size
            algo = self._resolve(name, algorithm, xb.nbytes, xb.dtype, op, collective=name)
            shape = ((xb.shape[0] // self.size, *xb.shape[1:]) if xb.shape and xb.shape[0] % self.size == 0
                     else (k,))
            ob = self._part_out(name, xb, out, k, shape, handle, owner, side)
            if self._prepare(name, algo, xb, k, op, handle, owner, side, (xb, ob)):
                self._dispatch.reduce_scatter(algo, xb, ob, k, op, handle, owner,
                                              _signature.encode(name, xb.dtype, op, xb.count))
                if out is not None:
                    _arrays.mark_written((ob,))
            return ob.obj

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
            return _traced_call(self, "all_gather", x, out=out, algorithm=algorithm, stream=stream)
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
            return _traced_call(self, "reduce_scatter_add_rmsnorm", x, residual_shard, weight, eps=eps, bias=bias,
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
        allocated on the launch stream) as a Buffer, checked to be on this communicator's
        device like every array a call takes."""
        return self._on_device(name, _arrays.as_buffer(_arrays.empty_like(xb, handle, owner, side, shape), name,
                                                       handle), "a new output")

    def _on_device(self, name: str, b, what: str):
        """``b`` (a Buffer) where it is on this communicator's device; else raises."""
        if b.device != self.device:
            raise UbnextError(f"{name}: {what} is on device {b.device}, communicator on device {self.device}")
        return b

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
        """An operand of a fused call: ``shape``, x's dtype and device."""
        b = _arrays.as_buffer(arr, name, handle)
        if b.shape != shape or b.dtype != xb.dtype or b.device != xb.device:  # torch.Size is a tuple
            raise UbnextError(f"{name}: {what} must be {xb.dtype} of shape {shape} on device {xb.device}, "
                              f"got {b.dtype} of shape {tuple(b.shape)} on device {b.device}")
        return b

    def empty(self, shape, dtype: str = "float32", framework: str = "cupy"):
        """A new array in symmetric memory.

        All-reduce on it (in place, or with it as ``out``) moves no extra copies.
        The memory returns to the pool when the array and all its views are gone.
        Not available when the communicator runs on NCCL only.

        Collective: yes: every rank calls it, with the same shapes, in the same order.
        Graph-capturable: no (it allocates).

        Args:
            shape: int or tuple of ints.
            dtype: a key of ``ubnext.DTYPES``.
            framework: ``"cupy"`` or ``"torch"``.

        Returns:
            A CuPy array (``framework="cupy"``) or torch tensor of ``shape`` and ``dtype`` on
            this communicator's device, contents undefined.

        Raises:
            UbnextError: pool exhausted (on every rank alike), no symmetric pool,
                bad dtype/framework.
        """
        with self._order:
            name = "empty"
            self._check_open(name)
            if dtype not in DTYPES:
                raise UbnextError(f"{name}: unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
            if framework not in ("cupy", "torch"):
                raise UbnextError(f"{name}: framework must be 'cupy' or 'torch', got {framework!r}")
            if self._node is None:
                raise UbnextError(f"{name}: this communicator has no symmetric memory pool (it uses NCCL)")
            shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
            count = 1
            for d in shape:
                count *= d
            block = self._node.alloc(count * DTYPES[dtype][1])
            return _arrays.wrap(block.ptr, shape, dtype, self.device, framework, block)

    def algorithms(self) -> list[str]:
        """Names of the algorithms this communicator can run (``algorithm=`` values besides ``"auto"``).

        Collective: no.
        Graph-capturable: yes (host only).

        Returns:
            The names, in the order of ``ubnext.ALGORITHMS``.

        Raises:
            Nothing; a closed communicator answers too.
        """
        return [name for name in ALGORITHMS if self._selector.fits(name, 0)]

    def select(self, nbytes: int, dtype: str, fused: bool = False, collective: str = "all_reduce") -> str:
        """The algorithm ``"auto"`` picks for a message of ``nbytes`` bytes: of
        ``all_reduce``, or with ``fused`` of ``all_reduce_add_rmsnorm``, or of
        ``collective`` (``"reduce_scatter"``, ``"all_gather"``: ``nbytes`` of the whole
        message, size x k elements, as their calls pass it).

        Collective: no.
        Graph-capturable: yes (host only).

        Args:
            nbytes: the message's bytes.
            dtype: a key of ``ubnext.DTYPES``.
            fused: the choice of ``all_reduce_add_rmsnorm`` instead of ``all_reduce``.
            collective: ``"all_reduce"``, ``"reduce_scatter"`` or ``"all_gather"``
                (``reduce_scatter_add_rmsnorm`` runs the reduce-scatter's choice).

        Returns:
            One of ``algorithms()``.

        Raises:
            UbnextError: ``UBNEXT_ALGO`` names an algorithm that cannot take ``nbytes``;
                ``fused`` with a dtype the fused kernels do not take.
            KeyError: ``dtype`` is not a key of ``ubnext.DTYPES``, or an unknown ``collective``.
        """
        if dtype not in DTYPES:
            raise KeyError(f"select: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if collective not in COLLECTIVES:
            raise KeyError(f"select: unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}")
        return self._resolve("select", "auto", nbytes, dtype, fused=fused, collective=collective)

    def describe(self) -> Description:
        """What this communicator runs and why: ranks, device, kernels or NCCL only (and why),
        pool, NVLink multicast, configuration, selector tables, and the algorithm ``"auto"``
        takes for 1 KiB to 1 GiB per dtype with the reason.

        Collective: no.
        Graph-capturable: no (it reads device properties; call it outside a capture).

        Returns:
            A dict (JSON-ready); ``print(comm.describe())`` shows it as a report.

        Raises:
            ClosedError: the communicator is closed.
            BrokenCommunicatorError: a collective of this communicator failed.
        """
        with self._order:
            self._check_open("describe")
            return report(self)

    def synchronize(self, stream=None) -> None:
        """Waits for the device (or ``stream``, as ``all_reduce`` takes it); raises what a
        kernel recorded meanwhile.

        Collective: no. Blocks the host.
        Graph-capturable: no (it waits for the device).

        Args:
            stream: a stream as ``all_reduce`` takes it; default: every stream of the device.

        Raises:
            ClosedError: the communicator is closed.
            CollectiveTimeoutError, CollectiveMismatchError, ConcurrentUseError or
            BrokenCommunicatorError: a collective of this communicator failed (then every
            later call raises too).
        """
        with self._order:
            import cupy

            self._check_open("synchronize")
            if stream is None:
                cupy.cuda.runtime.deviceSynchronize()  # the communicator's device: the section's context
            else:
                cupy.cuda.runtime.streamSynchronize(self._stream_arg("synchronize", stream))
            self._check_failures("synchronize")

    def close(self) -> None:
        """Releases the pool, the NCCL communicator and the bootstrap the communicator
        created (not one passed in). Idempotent.

        Collective: yes: it waits for this device's work, then for every rank. On a broken
        communicator (a collective failed, see BrokenCommunicatorError) it is local and
        bounded: it waits for no other rank, since a failed peer may never come. Arrays
        from ``empty()`` must not be used afterwards.
        Graph-capturable: no.

        Raises:
            UbnextError: a release failed: a driver call of the pool (CudaError) or the
                bootstrap's exchange (e.g. a lost TCPStore); what follows it is released
                all the same.
        """
        self._release(local=False)

    def abort(self) -> None:
        """Gives the communicator up at once, like ``ncclCommAbort``; idempotent; safe in
        error handlers and elastic restarts.

        Marks the communicator broken on every rank of the node (their waiting kernels
        give up, and their next call raises BrokenCommunicatorError), waits for this
        device (its kernels give up their waits too), then releases everything without
        waiting for any other rank. The process can create a new communicator.

        Collective: no (local: it waits for no other rank).
        Graph-capturable: no.

        Raises:
            UbnextError: a release failed (as for ``close``); what follows it is released
                all the same.
        """
        node = self._node
        if not self._closed and node is not None:
            # before the section: a call of another thread waiting in it (synchronize) gives up
            node.announce_abort(self._local.rank)
        if self._closed:
            return  # a close() in progress on another thread releases everything
        self._release(local=True)

    def _release(self, local: bool) -> None:
        """close (``local``: abort): after any call of another thread, in the section."""
        with self._order:
            if self._closed:
                return
            self._closed = True
            self._plans.clear()
            self._node = None
            self._finalizer.detach()
            _OPEN.discard(self)
            self._owned.release(local)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals --------------------------------------------------------------------
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
        calls = [pickle.loads(b) for b in self.bootstrap.allgather(pickle.dumps(call))]
        if any(c != calls[0] for c in calls):
            rows = "; ".join(f"rank {r}: count={c[0]} dtype={c[1]} op={c[2]} algorithm={c[3]} "
                             f"symmetric offsets={c[4]}" for r, c in enumerate(calls))
            raise UbnextError(f"{name}: ranks disagree on the call ({rows})")


def _traced_call(comm, name: str, *args, **kwargs):
    """``comm.<name>(...)`` as a ``torch.ops.ubnext`` op, for dynamo (``_arrays.traced``):
    ``ubnext.torch._traced.call``, imported here, not at the top (ubnext does not import torch)."""
    from .torch import _traced

    return _traced.call(comm, name, *args, **kwargs)


def _close_bootstraps(local_boot, owned, local: bool = False) -> None:
    """Closes the node's view ``local_boot``, then ``owned`` (the bootstrap ``default()``
    made, or None); ``local``: without waiting for any rank (Bootstrap.abort)."""
    try:
        if local_boot is not None:
            local_boot.abort() if local else local_boot.close()
    finally:
        if owned is not None:
            owned.abort() if local else owned.close()


class _Owned:
    """What a communicator releases: its node, NCCL communicator, launch order, watchdog,
    bootstraps and the retain of its CUDA context. It holds no reference to the
    communicator (nor does anything it holds), so that a communicator dropped without
    ``close()`` becomes garbage and its finalizer (:meth:`drop`) gives everything back.

    Args:
        order: the communicator's LaunchOrder (its section, and its context).
        node, dispatch, watchdog: the communicator's (node and watchdog may be None).
        local_boot: the bootstrap of the node's ranks.
        owned_boot: the bootstrap ``default()`` made for the communicator, or None.
        local_rank: this rank's place on the node.
    """

    def __init__(self, order, node, dispatch, watchdog, local_boot, owned_boot, local_rank: int):
        self.order, self.node, self.dispatch, self.watchdog = order, node, dispatch, watchdog
        self.local_boot, self.owned_boot, self.local_rank = local_boot, owned_boot, local_rank
        self.released = False

    def release(self, local: bool) -> None:
        """Stops the watchdog, closes the node (``local``: waiting for no rank; a broken
        communicator closes locally too), the NCCL communicator and the bootstraps, then
        releases the context's retain; each step runs even where one before it failed.
        In the launch section. Idempotent.

        Raises:
            The first error of a release step.
        """
        if self.released:
            return
        self.released = True
        node, self.node = self.node, None
        try:
            if self.watchdog is not None:
                self.watchdog.stop()
            if node is not None:
                local = node.close(local=local)
        except BaseException:
            local = True  # what follows waits for no rank after a failed step
            raise
        finally:
            try:
                self.dispatch.close(local)
            finally:
                try:
                    _close_bootstraps(self.local_boot, self.owned_boot, local)
                finally:
                    self.order.context.release()

    def drop(self) -> None:
        """The finalizer of a communicator that became garbage without ``close()``: released
        as ``abort()`` releases (its peers cannot be met from here: no collective, no rank
        waited for), with the communicator's context current whatever thread collects it,
        and a warning (once per process)."""
        log_once("dropped", "ubnext.Communicator was dropped without close(): released locally, as abort() "
                            "does (peers are not waited for); call close() on every rank, or use `with`")
        if self.watchdog is not None and self.watchdog.on_its_thread():
            # collected on its own watchdog's thread, which may be inside the node's announce
            # and which cannot wait for itself: released on a thread of its own
            threading.Thread(target=self._drop, name="ubnext-dropped", daemon=True).start()
        else:
            self._drop()

    def _drop(self) -> None:
        if self.node is not None:
            self.node.announce_abort(self.local_rank)
        with self.order:
            self.release(local=True)


@atexit.register
def _warn_open() -> None:
    """At exit, communicators still open are only named in a warning: releasing them then
    would make driver calls while CUDA and the interpreter shut down."""
    count = len(_OPEN)
    if count:
        log_once("open-at-exit", f"{count} ubnext.Communicator(s) were not closed before exit; call close() "
                                 f"on every rank (or use `with`)")
