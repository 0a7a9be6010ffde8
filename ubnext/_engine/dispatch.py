"""Running a validated call: the launches of its algorithm, in one ordered section.

The Communicator validates a call and picks its algorithm; a ``Dispatcher`` turns it
into work on the caller's stream: one kernel launch, or launches of at most the
algorithm's buffers, through the staging slot for arrays that are not 16-byte aligned;
the fused call's launches of whole rows, or the all-reduce and then the separate
add + RMSNorm kernel; the reduce-scatter's and all-gather's launches of whole slices
(``_sliced``); or NCCL. Every call's work is issued inside the communicator's
launch section (``_streams.LaunchOrder``), so calls keep their issue order across
streams and threads.
"""

from __future__ import annotations

import functools

from ubnext._engine.copies import aligned as _aligned
from ubnext._engine.copies import copy as _copy
from ubnext._engine.holders import Graphs
from ubnext._engine.launch import issue
from ubnext._engine.sliced import Sliced
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, DTYPES


class Dispatcher:
    """Issues the work of validated calls of one communicator.

    Args:
        node: the node's kernel resources (``_node.Node``), or None (NCCL only).
        limits: ``{algorithm: (largest bytes of one launch, setting)}`` (``Selector.limits``).
        order: the communicator's ``LaunchOrder``.
        bootstrap: the communicator's bootstrap (for the NCCL communicator, made on first use).
        device: the CUDA device ordinal.
        pdl: launch with programmatic dependent launch where the device has it.
        exchange: ``exchange(op, fn, *args)`` runs NCCL's first connect (``lifetime.Exchanges.run``,
            which ``abort()`` abandons), or None (the connect runs directly).
        driver: the ``cuda.bindings.driver`` module (default) or a fake, for :attr:`graphs`.

    Attributes:
        nccl: the NCCL communicator, once a call needed it.
        graphs: the captured CUDA graphs of NCCL work (``holders.Graphs``): they hold the
            NCCL communicator, whose release ``close`` defers until the last one is gone.
    """

    def __init__(self, node, limits: dict, order, bootstrap, device: int, pdl: bool = True, exchange=None,
                 driver=None):
        self._node, self._limits, self._order = node, limits, order
        self._bootstrap, self._device, self._pdl = bootstrap, device, pdl
        self._exchange = exchange  # runs NCCL's first connect, a host exchange (lifetime.Exchanges.run)
        self.nccl = None
        self._driver, self._graphs = driver, None
        self._epilogue = None

    @property
    def graphs(self) -> Graphs:
        """The captured CUDA graphs of NCCL work (see the class docstring), made on first use."""
        if self._graphs is None:
            self._graphs = Graphs(driver=self._driver, context=self._order.context)
        return self._graphs

    # -- the calls ------------------------------------------------------------------
    def all_reduce(self, algo: str, xb, ob, op: str, stream: int, owner, sig: int):
        """All-reduce of buffer ``xb`` into ``ob`` by ``algo`` (``sig``: the call's signature).

        Returns:
            Where the call was one kernel launch, that launch but for its stream
            (``Engine.lamport``: what ``_launch.Packed`` takes, for ``launch``),
            else None (NCCL, launches in chunks, through the staging slot).
        """
        self._order.follow(stream, owner)
        return self._all_reduce(algo, xb, ob, op, stream, sig)

    def launch(self, launch, stream: int, owner) -> None:
        """``launch`` (a ``_launch.Packed`` of a launch ``all_reduce`` or ``add_rmsnorm``
        returned: a call plan's) on ``stream``, in the launch section."""
        self._order.follow(stream, owner)
        launch(stream)

    def quantized(self, fmt: str, xb, ob, op: str, stream: int, owner, sig: int) -> None:
        """Quantized all-reduce of ``xb`` into ``ob`` in ``fmt``, in launches of at most
        ``_quant.LAUNCH_BYTES`` (whole groups, so every launch's groups are the message's)."""
        eng = self._node.engine
        width = DTYPES[xb.dtype][1]
        chunk = _quant.LAUNCH_BYTES // width
        self._order.follow(stream, owner)
        for start in range(0, xb.count, chunk):
            issue(eng.quantized(fmt, xb.dtype, op, xb.ptr + start * width, ob.ptr + start * width,
                                min(chunk, xb.count - start), sig), stream)

    def quantized_reduce_scatter(self, fmt: str, xb, ob, k: int, op: str, stream: int, owner, sig: int) -> None:
        """Quantized reduce-scatter of ``xb`` (size x k elements) into ``ob`` (this rank's k)
        in ``fmt``, in launches of at most ``_quant.slice_launch_elems`` of every slice (whole
        units, so that every launch's groups are the slices')."""
        eng = self._node.engine
        width = DTYPES[xb.dtype][1]
        chunk = _quant.slice_launch_elems(eng.nranks)
        self._order.follow(stream, owner)
        for c0 in range(0, k, chunk):
            issue(eng.quantized_rs(fmt, xb.dtype, op, xb.ptr + c0 * width, ob.ptr + c0 * width, min(chunk, k - c0),
                                   k * width, sig), stream)

    def fused_rows(self, algo: str, dtype: str, hidden: int, rows: int, aligned: bool) -> int:
        """Rows one fused launch of ``algo`` takes, or 0 where the call goes unfused."""
        if not (ALGORITHMS[algo].is_kernel and hidden % 8 == 0 and aligned):
            return 0
        return self._node.engine.norm_rows(algo, dtype, hidden, rows)

    def add_rmsnorm(self, algo: str, xb, rows: int, chunk: int, hidden: int, norm: tuple, eps: float,
                    stream: int, owner, sig: int):
        """Fused launches of ``chunk`` rows of ``xb`` (the last one the rest; ``rows`` > 0);
        ``norm``: the addresses of residual (or 0), bias (or 0), weight, normed and res_out.

        Returns:
            Where the call was one launch (``rows`` <= ``chunk``), that launch but for its
            stream (``Engine.add_rmsnorm``, as ``all_reduce`` returns its own), else None.
        """
        eng = self._node.engine
        row_bytes = hidden * DTYPES[xb.dtype][1]
        residual, bias, weight, normed, res_out = norm
        self._order.follow(stream, owner)
        for r0 in range(0, rows, chunk):
            off = r0 * row_bytes
            part = (residual + off if residual else 0, bias, weight, normed + off, res_out + off)
            launch = eng.add_rmsnorm(algo, xb.dtype, xb.ptr + off, min(chunk, rows - r0), hidden, part, eps, sig)
            issue(launch, stream)
        return launch if rows <= chunk else None

    def unfused(self, algo: str, xb, nb, rows: int, hidden: int, norm: tuple, eps: float, stream: int,
                owner, sig: int) -> None:
        """The all-reduce of ``xb`` into ``nb`` by ``algo``, then the separate add + RMSNorm
        kernel on ``nb`` (in place: normed into ``nb``)."""
        self._order.follow(stream, owner)
        self._all_reduce(algo, xb, nb, "sum", stream, sig)
        self._add_rmsnorm()(xb.dtype, nb.ptr, rows, hidden, norm, eps, stream)

    def reduce_scatter(self, algo: str, xb, ob, k: int, op: str, stream: int, owner, sig: int) -> None:
        """Reduce-scatter of ``xb`` (size x k elements) into ``ob`` (this rank's k) by ``algo``."""
        self._order.follow(stream, owner)
        self._reduce_scatter(algo, xb, ob, k, op, stream, sig)

    def all_gather(self, algo: str, xb, ob, k: int, stream: int, owner, sig: int) -> None:
        """All-gather of ``xb`` (k elements) into ``ob`` (size x k) by ``algo``."""
        self._order.follow(stream, owner)
        if ALGORITHMS[algo].is_kernel:
            Sliced(self._node, self._limits, algo, xb.dtype, k, stream).all_gather(xb.ptr, ob.ptr, sig)
        else:
            self._nccl(stream).all_gather(xb.ptr, ob.ptr, k, xb.dtype, stream)

    def reduce_scatter_add_rmsnorm(self, algo: str, xb, nb, rows: int, hidden: int, norm: tuple, eps: float,
                                   stream: int, owner, sig: int) -> None:
        """The reduce-scatter of ``xb`` by rows into ``nb`` (this rank's ``rows``), then the
        separate add + RMSNorm kernel on ``nb`` (in place: normed into ``nb``)."""
        self._order.follow(stream, owner)
        self._reduce_scatter(algo, xb, nb, rows * hidden, "sum", stream, sig)
        self._add_rmsnorm()(xb.dtype, nb.ptr, rows, hidden, norm, eps, stream)

    def _reduce_scatter(self, algo, xb, ob, k, op, stream, sig):
        if ALGORITHMS[algo].is_kernel:
            Sliced(self._node, self._limits, algo, xb.dtype, k, stream).reduce_scatter(xb.ptr, ob.ptr, op, sig)
        else:
            self._nccl(stream).reduce_scatter(xb.ptr, ob.ptr, k, xb.dtype, op, stream)

    def nccl_for(self, stream: int, owner):
        """The NCCL communicator (``_engine.nccl.NcclComm``, made on first use) for a call's
        work on ``stream``, the launch order following that stream: the calls that NCCL
        serves alone (``_api.collectives``) issue their work on it."""
        self._order.follow(stream, owner)
        return self._nccl(stream)

    def close(self, local: bool) -> None:
        """Releases the NCCL communicator (``local``: aborts it, waiting for no rank), the
        launch order's stream and event and the add + RMSNorm kernels, on this thread. Where
        a captured graph of NCCL work still lives, the NCCL communicator stays for its
        replays and is aborted (local: no rank waited for) once the last such graph is
        destroyed, on the graphs' thread (``holders.Graphs``; after a capture in progress,
        on ubnext's release thread: ``captures.RELEASES``)."""
        self._epilogue = None
        self._order.close()
        nccl, self.nccl = self.nccl, None
        deferred = () if nccl is None else (functools.partial(_abort_in, self._order.context, nccl),)
        if self.graphs.close(*deferred) and nccl is not None:
            nccl.abort() if local else nccl.close()

    # -- how each family runs --------------------------------------------------------
    def _all_reduce(self, algo, xb, ob, op, stream, sig):
        """The all-reduce's work on ``stream``; returns its launch where it is one kernel
        launch (``_single``), else None."""
        alg = ALGORITHMS[algo]
        if alg.family == "nccl":
            self._nccl(stream).all_reduce(xb.ptr, ob.ptr, xb.count, xb.dtype, op, stream)
            return None
        launch = self._single(algo, xb, ob, op, sig)
        if launch is not None:
            issue(launch, stream)
        elif alg.pushed:
            self._lamport(algo, xb, ob, op, stream, sig)
        else:
            self._twoshot(algo, xb, ob, op, stream, sig)
        return launch

    def _single(self, algo, xb, ob, op, sig):
        """The one kernel launch (``Engine.lamport``) that all-reduces ``xb`` into
        ``ob`` by kernel algorithm ``algo``, or None where it takes several: a Lamport family
        kernel for a message within its buffers, the barrier two-shot for an ``out`` in the
        pool (the result lands in out's buffer); both for 16-byte aligned arrays."""
        eng = self._node.engine
        if ALGORITHMS[algo].pushed:
            if xb.nbytes <= self._limits[algo][0] and _aligned(xb.ptr, ob.ptr):
                return eng.lamport(algo, xb.dtype, op, xb.ptr, ob.ptr, xb.count, sig)
            return None
        out_off = self._node.pool.contains(ob.ptr, ob.nbytes)
        if out_off is not None and _aligned(xb.ptr, ob.ptr):
            return eng.twoshot(algo, xb.dtype, op, out_off, 0 if xb.ptr == ob.ptr else xb.ptr, 0, xb.count, sig)
        return None

    def _lamport(self, algo, xb, ob, op, stream, sig):
        """A Lamport family kernel in launches of at most its buffers' size (past them only
        an ``in_launches`` kernel is chosen), or through the staging slot (not aligned)."""
        eng = self._node.engine

        def launch(src, dst, n):  # 0: the chunk is in the staging slot
            issue(eng.lamport(algo, xb.dtype, op, src or eng.staging_ptr, dst or eng.staging_ptr, n, sig), stream)

        self._in_chunks(xb, ob, self._limits[algo][0], launch, stream)

    def _twoshot(self, algo, xb, ob, op, stream, sig):
        """The barrier two-shot through the staging slot (an ``out`` outside the pool, or
        arrays not aligned)."""
        eng = self._node.engine

        def launch(src, dst, n):  # through the staging slot; 0: it holds the input / is the output
            issue(eng.twoshot(algo, xb.dtype, op, eng.staging_off, src, dst, n, sig), stream)

        self._in_chunks(xb, ob, eng.staging_bytes, launch, stream)

    def _in_chunks(self, xb, ob, chunk_bytes, launch, stream):
        """``launch(src, dst, n)`` for each chunk of at most ``chunk_bytes`` of x into out.
        Arrays that are not 16-byte aligned are copied through the staging slot (which
        holds any chunk): ``launch(0, 0, n)`` reduces the chunk there, in place."""
        width = DTYPES[xb.dtype][1]
        chunk = chunk_bytes // width
        aligned = _aligned(xb.ptr, ob.ptr)
        staging = self._node.engine.staging_ptr
        for start in range(0, xb.count, chunk):
            n = min(chunk, xb.count - start)
            src, dst = xb.ptr + start * width, ob.ptr + start * width
            if aligned:
                launch(src, dst, n)
            else:
                _copy(staging, src, n * width, stream)
                launch(0, 0, n)
                _copy(dst, staging, n * width, stream)

    def _nccl(self, stream: int):
        """The NCCL communicator for work on ``stream``, connected (its first connect is a
        host exchange, run by ``exchange`` where given; published only once the connect
        succeeded), and held by the graph that ``stream`` is being captured into, if any."""
        if self.nccl is None:
            from ubnext._engine.nccl import NcclComm

            comm = NcclComm(self._bootstrap, self._device)
            try:
                if self._exchange is None:
                    comm.connect()
                else:
                    self._exchange("NCCL's setup", comm.connect)
            except BaseException:
                comm.abort()  # a connect that returned after abort(): its communicator is not kept
                raise
            self.nccl = comm
        self.graphs.hold(stream)
        return self.nccl

    def _add_rmsnorm(self):
        if self._epilogue is None:
            import cupy

            from ubnext._engine.epilogue import AddRmsNorm
            from ubnext._engine.launch import programmatic

            sms = cupy.cuda.Device(self._device).attributes["MultiProcessorCount"]
            self._epilogue = AddRmsNorm(self._device, sms, programmatic(self._pdl, self._device))
        return self._epilogue


def _abort_in(context, nccl) -> None:
    """``nccl.abort()`` with ``context`` current (the graphs' thread has none of its own)."""
    with context.current():
        nccl.abort()
