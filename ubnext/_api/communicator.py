"""The Communicator: ubnext's public, collective API."""

from __future__ import annotations

import functools
import logging
import os
import weakref

from ubnext._api import agreement as _agreement
from ubnext._api import handles as _handles
from ubnext._api import lifetime
from ubnext._api.calls import CallSteps
from ubnext._api.collectives import (AllGather, AllReduce, AllReduceAddRmsnorm, AllToAll, Barrier, Broadcast, Gather,
                                     Reduce, ReduceScatter, ReduceScatterAddRmsnorm, Scatter, SendRecv)
from ubnext._api.plans import Plans
from ubnext._api.report import Description, report
from ubnext._engine import nccl as _nccl
from ubnext._engine.dispatch import Dispatcher
from ubnext._engine.node import Node
from ubnext._environment import nvls_gate as _gate
from ubnext._environment import preflight as _preflight
from ubnext._environment.config import Config
from ubnext._environment.devices import device_name, map_devices
from ubnext._environment.log import get_logger, log_once
from ubnext._interop import arrays as _arrays
from ubnext._interop.context import Context, caller_device
from ubnext._interop.streams import LaunchOrder
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, DTYPES
from ubnext._protocol.constants import MAX_RANKS
from ubnext._protocol.errors import UbnextError
from ubnext._selection.select import Selector, buffer_limits
from ubnext._selection.table import agreed_machine
from ubnext._selection.table_format import agreed_table

_WATCHDOG_S = 0.5  # seconds between the watchdog's reads of the failure records


class Communicator(CallSteps, AllReduce, AllReduceAddRmsnorm, ReduceScatter, AllGather, ReduceScatterAddRmsnorm,
                   Broadcast, Reduce, AllToAll, SendRecv, Gather, Scatter, Barrier):
    """A group of ranks that run NCCL's collectives together: all-reduce, reduce-scatter,
    all-gather (ubnext's kernels), broadcast, reduce, all-to-all, send/recv, gather,
    scatter (NCCL's) and barrier, each in its module of ``ubnext._api.collectives``.

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
            the bootstrap does not see; a quantized opt-in that a GPU of the node cannot
            run (fp8 before compute capability 8.9: on every rank alike); or a setup step
            failed on this rank.
    """

    def __init__(self, bootstrap=None, device=None, config: Config | None = None, **overrides):
        if config is None:
            config = Config.from_env(**overrides)
        elif overrides:
            raise TypeError("Communicator: pass either config= or keyword overrides, not both")
        self.config = config
        _arrays.bind_torch()  # before any compiled collective (_interop.arrays.bind_torch)
        _preflight.check("Communicator", config)  # no GPU, no NCCL...: one line, before anything collective
        import cupy

        self._owns_bootstrap = bootstrap is None  # default()'s is closed by close(), a caller's is not
        if bootstrap is None:
            from ubnext.bootstrap import default

            bootstrap = default()
        self.bootstrap = bootstrap
        self.rank, self.size = bootstrap.rank, bootstrap.size
        _handles.assign(self)  # self._handle: the int torch ops and compiled code name it by
        self._log = get_logger(config, self.rank)
        self._closed = False
        self._resolved: dict[tuple, str] = {}
        self._plans = Plans()  # eager calls validated and launched before (_plans)
        self._areas: dict[str, tuple] = {}  # symmetric areas of the features above (_symmetric_area)
        self._exchanges = lifetime.Exchanges()  # its calls' host exchanges, which abort() abandons
        self._local = self._node = self._context = None
        try:
            _agreement.check(config, bootstrap)  # before anything that the configuration shapes
            table = agreed_table(config.tune_file, bootstrap) if config.tune_file else None
            self._local = bootstrap.split_local()
            self.device = map_devices(self._local, device, caller_device())
            cupy.cuda.Device(self.device).use()  # the caller's convenience, as torch.cuda.set_device
            # the selector tables' entries are chosen for local rank 0's GPU, alike on every rank
            # (the name read with this communicator's device current: no other device is touched;
            # read inside agreed_machine, so a rank that cannot read it still joins the allgather),
            # and for the mode UBNEXT_TABLE_MODE asks for
            machine, mixed = agreed_machine(self._local, lambda: device_name(self.device), config.table_mode)
            if config.quantized in _quant.FORMATS:  # a format every GPU of the node runs (fp8: sm_89), alike
                _quant.check_opt_in("Communicator", config.quantized, self._local.allgather_obj(self._arch))
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
                    lifetime.close_bootstraps(self._local, self.bootstrap if self._owns_bootstrap else None)
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
        if mixed:
            log_once(f"mixed-gpus:{mixed}", f"Communicator: {mixed}", logging.INFO)
        self._selector = Selector(self._local.size, buffer_limits(config), usable, table, self._nccl_reason,
                                  config.deterministic, nccl_problem, machine)
        # every call runs in the launch section: this communicator's context, one thread, issue order
        self._order = LaunchOrder(self._context)
        self._dispatch = Dispatcher(node, self._selector.limits, self._order, bootstrap, self.device,
                                    self.config.pdl, self._exchanges.run)
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

            watchdog = lifetime.Watchdog(poll, lambda e: log.error("%s", e), _WATCHDOG_S, f"ubnext-watchdog-{self.rank}",
                                start=context.enter)  # its announce and anything it frees: this device
        # what close() releases, and a finalizer if the communicator is dropped without it
        self._owned = lifetime.Owned(self._order, node, self._dispatch, watchdog, self._local,
                                     bootstrap if self._owns_bootstrap else None, self._local.rank, self._exchanges)
        self._finalizer = weakref.finalize(self, self._owned.drop)
        self._finalizer.atexit = False  # at exit: only the warning of _warn_open
        lifetime.OPEN.add(self)

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

    def empty(self, shape, dtype: str = "float32", framework: str = "cupy"):
        """A new array in symmetric memory.

        All-reduce on it (in place, or with it as ``out``) moves no extra copies.
        The memory returns to the pool when the array and all its views are gone. The
        array holds this rank's pool segment: it stays valid (and its address is never
        mapped to anything else) after the communicator is closed or dropped, until the
        array and its views are gone (docs/reliability.md, "What owns the pool").
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
                bad dtype/framework. ClosedError: the communicator is closed.
                BrokenCommunicatorError: ``abort()`` was called while the ranks exchanged
                their free lists.
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
            block = self._node.alloc(count * DTYPES[dtype][1], functools.partial(self._exchanges.run, name))
            return _arrays.wrap(block.ptr, shape, dtype, self.device, framework, block)

    def _symmetric_area(self, key: str, nbytes: int, framework: str = "cupy") -> tuple:
        """The area ``key`` of ``nbytes`` in the pool, for a feature built on the communicator
        (``ubnext.torch``'s overlapped GEMMs): allocated at the first call (collective: every
        rank's first call for ``key`` comes at the same place of its program, with the same
        ``nbytes``), kept until ``close``, which drops it. The array holds this rank's
        segment as ``empty()``'s arrays do; the peers' addresses stay mapped while the
        communicator is open or a captured graph that used them lives.

        Returns:
            ``(array, ptrs)``: this rank's bytes as a uint8 array of ``framework``, and the
            area's address in every local rank's segment, in local-rank order (launch into
            them only inside a call's launch section).

        Raises:
            UbnextError: no symmetric pool, pool exhausted, or a closed communicator.
        """
        with self._order:
            self._check_open(key)
            area = self._areas.get(key)
            if area is None:
                if self._node is None:
                    raise UbnextError(f"{key}: this communicator has no symmetric memory pool (it uses NCCL)")
                block = self._node.alloc(nbytes, functools.partial(self._exchanges.run, key))
                pool = self._node.pool
                offset = pool.contains(block.ptr, nbytes)
                area = self._areas[key] = (_arrays.wrap(block.ptr, (nbytes,), "uint8", self.device, framework, block),
                                           tuple(pool.ptr(r, offset) for r in range(self._local.size)))
            return area

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
            One of ``algorithms()``: the full-precision choice. On a communicator opted in
            to the quantized collectives (``UBNEXT_QUANTIZED``), bfloat16/float16 sums and
            averages of an all-reduce or a reduce-scatter from the size measured for this
            machine (each collective its own) run quantized instead; ``describe()`` says
            per size which format and why.

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
        bounded: it waits for no other rank, since a failed peer may never come.
        Graph-capturable: no.

        Every later call raises ClosedError before launching anything. What still points
        into the pool keeps what it needs (docs/reliability.md, "What owns the pool"):
        arrays from ``empty()`` (and buffer plans, layers holding them) keep this rank's
        segment, whose peers' parts are unmapped now; a captured CUDA graph that launched
        ubnext's kernels keeps the whole pool and the failure words until it is destroyed
        (a replay after close runs without host code: its kernels then wait for peers that
        may not come, and give up after ``UBNEXT_TIMEOUT_S``).

        Raises:
            UbnextError: a release failed: a driver call of the pool (CudaError) or the
                bootstrap's exchange (e.g. a lost TCPStore); what follows it is released
                all the same.
        """
        self._release(local=False)

    def abort(self) -> None:
        """Gives the communicator up at once, like ``ncclCommAbort``; idempotent; safe in
        error handlers and elastic restarts, from any thread.

        Marks the communicator broken on every rank of the node (their waiting kernels
        give up, and their next call raises BrokenCommunicatorError) and closed here (every
        later call raises ClosedError), abandons a host exchange that a call of another
        thread is waiting in (the heap's allgather of ``empty()``, the overlapped ops' area,
        the debug-mode comparison, NCCL's first connect, close's barrier: it raises
        BrokenCommunicatorError if it ever returns, before launching anything), then
        releases what is local, without waiting for any other rank, once nothing launches
        into it (called on the thread that is inside a call of this communicator, a signal
        handler's or a hook's, the release runs when that call leaves: the pool stays
        mapped until then). The process can create a new communicator.

        How long it takes: it never waits for a peer. It waits (1) for a call of another
        thread that is in the launch section but in no host exchange, to leave it: its
        launches, and on a first call a kernel compile (seconds); ``synchronize()`` waits
        for the device, as (2) does; (2) for the device: this communicator's kernels give
        up within a poll round of the mark (and at most ``UBNEXT_TIMEOUT_S`` after they
        started waiting), but the wait covers all the device's work, other communicators'
        kernels included (bounded by their own timeouts). A thread left in an MPI exchange
        stays blocked there (MPI cannot be interrupted): after such an abort the process
        must leave (``MPI_Abort`` or ``os._exit``), see docs/reliability.md.

        Collective: no (local: it waits for no other rank).
        Graph-capturable: no.

        Raises:
            UbnextError: a release failed (as for ``close``); what follows it is released
                all the same.
        """
        node = self._node
        self._closed = True  # a call that enters the section from now on raises ClosedError
        self._exchanges.abandon()  # before anything that may wait: a call in an exchange raises now
        if self._owned.released:
            return
        if node is not None:
            # before the section: a call of another thread waiting in it (synchronize) gives up
            node.announce_abort(self._local.rank)
        lifetime.abort_release(self._order, self._exchanges, self._release)

    def _release(self, local: bool, in_section: bool = True) -> None:
        """close (``local``: abort): after any call of another thread, in the section; an
        abort whose section is held by a call waiting in a host exchange releases outside
        it (``in_section=False``: that call raises before it launches anything)."""
        if self._owned.released:  # an abort released it already (its section may stay taken)
            return
        if in_section:
            with self._order:
                self._release_now(local)
        else:
            with self._context.current():
                self._release_now(local)

    def _release_now(self, local: bool) -> None:
        if self._owned.released:
            return
        self._closed = True
        self._plans.clear()
        self._areas.clear()  # their blocks go back to the heap before the pool's release
        self._node = None
        self._finalizer.detach()
        lifetime.OPEN.discard(self)
        self._owned.release(local)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        """The communicator itself: a copy of an object holding one (a layer) shares it."""
        return self

    def __reduce__(self):
        raise TypeError("Communicator cannot be pickled (it is a group of processes and their device memory); "
                        "pickle what is state (a model's state_dict()) and create a communicator in the new process")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
