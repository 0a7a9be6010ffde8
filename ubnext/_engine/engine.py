"""Launching ubnext's kernels on the symmetric pool.

The engine owns the kernel cache (a module per instantiation, a launcher per entry
point with its constant arguments packed once) and issues launches; the pool layout is
``heap.plan_layout``'s. It never synchronizes the host: each launch goes on the caller's
stream. The launch shapes (grid, block and cluster sizes: pure functions of a launch's
size and the machine) end this module; the rules and the measurements behind them are in
bench/NOTES.md ("Launch-shape rules").
"""

from __future__ import annotations

import numpy as np

from ubnext._engine.kernels import compile_module
from ubnext._engine.launch import F32, I32, U64, Launcher, programmatic
from ubnext._memory.heap import STATES, SlotPlan, ll_slot_bytes, round_up, set_unit, twoshot_norm_rows
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import (ALGORITHMS, DTYPES, LL_SOURCE, P2P_SOURCE, compile_defines, ll_defines,
                                        row_threads)
from ubnext._protocol.constants import (
    LAUNCH_STATE,
    LAUNCH_STATE_BYTES,
    MAX_BLOCKS,
    NORM_THREADS,
    P2P_BULK_BLOCKS,
    P2P_BULK_MIN_BYTES,
    P2P_MAX_ENTRIES,
    THREADS,
    TWOSHOT_ALIGN_VECS,
    VEC_BYTES,
    field_offset,
    sentinel_word,
)

#: parameters of each entry point (kernels/lamport.cu, kernels/twoshot.cu, ...): base, stride,
#: rank, mc, then 64-bit values; the fused ones take eps (fp32) before the signature and
#: the launch state.
_PARAMS = {
    "ub_lamport": (U64, U64, I32) + (U64,) * 8,
    "ub_lamport_twoshot": (U64, U64, I32) + (U64,) * 8,
    "ub_twoshot": (U64, U64, I32) + (U64,) * 8,
    "ub_lamport_twoshot_rs": (U64, U64, I32) + (U64,) * 8,
    "ub_lamport_twoshot_ag": (U64, U64, I32) + (U64,) * 8,
    "ub_twoshot_rs": (U64, U64, I32) + (U64,) * 8,
    "ub_twoshot_ag": (U64, U64, I32) + (U64,) * 8,
    "ub_lamport_norm": (U64, U64, I32) + (U64,) * 11 + (F32, U64, U64),
    "ub_lamport_twoshot_norm": (U64, U64, I32) + (U64,) * 11 + (F32, U64, U64),
    "ub_twoshot_norm": (U64, U64, I32) + (U64,) * 12 + (F32, U64, U64),
    "ub_quant_twoshot": (U64, U64, I32) + (U64,) * 9,
    "ub_quant_twoshot_rs": (U64, U64, I32) + (U64,) * 9,
    "ub_ll_alltoall": (U64, U64, I32) + (U64,) * 8,
    "ub_ll_broadcast": (U64, U64, I32) + (U64,) * 9,
    "ub_p2p": (U64, U64, I32) + (U64,) * (6 + 2 * P2P_MAX_ENTRIES),  # the work's words last (p2p)
    "ub_p2p_alltoallv": (U64, U64, I32) + (U64,) * 14,
}
_NORM_LAUNCHES_MAX = 4096              # fused launch shapes an engine remembers (cleared when full)



class Engine:
    """Runs the all-reduce kernels of one communicator.

    Args:
        pool: the node's SymmetricPool.
        plan: its library slots (``plan_layout``).
        records: ``{state name: device address of its ErrorRecord}`` (``FailureRecords``).
        tripped: device address of the word any completed record sets (``FailureRecords``).
        timeout_s: bound on every device wait.
        max_blocks: blocks per launch (0 = SM count).
        mc_base: device address of the pool's multicast mapping (``MulticastRange.ptr``:
            byte ``o`` of it is byte ``o`` of every segment), or 0 without NVLS.
        deterministic: compile every kernel in deterministic mode (``Config.deterministic``).
        pdl: launch with programmatic dependent launch where the device has it (``Config.pdl``).
    """

    def __init__(self, pool, plan: SlotPlan, records: dict[str, int], tripped: int, timeout_s: float,
                 max_blocks: int, mc_base: int = 0, deterministic: bool = False, pdl: bool = True):
        import cupy

        self.pool = pool
        self.plan = plan
        self.nranks = pool.local_size
        self.rank = pool.local_rank
        self.staging_bytes = plan.nbytes("staging")
        self._records, self._tripped = records, tripped
        self._deterministic = deterministic
        self.dependent = programmatic(pdl, pool.device)
        self._timeout_ns = int(timeout_s * 1e9)
        device = cupy.cuda.Device(pool.device)
        sms = device.attributes["MultiProcessorCount"]
        self._blocks = min(max_blocks or sms, sms, MAX_BLOCKS)
        # thread-block clusters (sm_90+) for the Lamport kernels' fused launches of few rows
        self._cluster_rows = int(device.compute_capability) >= 90
        self._modules: dict[tuple, object] = {}
        self._launchers: dict[tuple, Launcher] = {}
        #: (algorithm, dtype, rows, hidden) -> a fused launch's (launcher, blocks, threads, cluster)
        self._norm_launches: dict[tuple, tuple] = {}
        self._mc_base = mc_base
        # constant arguments and addresses, computed once
        self._fixed = (pool.base, pool.stride, self.rank, mc_base)
        # (family, width) -> (set offset, launch state, the kernels' buffer size argument:
        # one-shot slot bytes, two-shot area bytes)
        self._sets = {(f, w): (plan.offset(f"{f}{w}"), pool.local_ptr(plan.offset(f"{f}{w}.state")),
                               set_unit(f, self.nranks, plan.nbytes(f"{f}{w}")))
                      for f in ("lamport", "lamport_twoshot") for w in (2, 4)}
        self._twoshot = {t: (plan.offset(f"flags.{t}"), pool.local_ptr(plan.offset(f"twoshot.{t}.state")))
                         for t in ("unicast", "multicast")}
        self.staging_off = plan.offset("staging")
        self.staging_ptr = pool.local_ptr(self.staging_off)
        # the quantized two-shot: flags, launch state, the receive areas (reduce-scatter slots,
        # then the all-gather area: _quant.slots_bytes) and their bytes (0: not opted in)
        slots = plan.offset("quant")
        self._quant = (plan.offset("flags.quant"), pool.local_ptr(plan.offset("quant.state")), slots,
                       slots + _quant.slots_bytes(self.nranks), plan.nbytes("quant"))
        # the low-latency movers: their set, launch state and slot bytes
        self._ll = (plan.offset("ll"), pool.local_ptr(plan.offset("ll.state")), ll_slot_bytes())
        # point-to-point: its area, slot bytes and launch state
        self._p2p = (plan.offset("p2p"), ll_slot_bytes(), pool.local_ptr(plan.offset("p2p.state")))

    # -- setup ----------------------------------------------------------------------
    def initialize(self) -> None:
        """Zeroes states and flags, gives every state its ErrorRecord and timeout, fills
        every Lamport family's buffers with the sentinel.

        Blocks the host until done; the caller then runs a barrier so that no peer
        pushes into a buffer that is still being filled.
        """
        import cupy

        self._words(0, self.staging_off).fill(0)
        for name in STATES:
            fields = np.zeros(LAUNCH_STATE_BYTES // 8, np.uint64)
            fields[field_offset(LAUNCH_STATE, "record") // 8] = self._records[name]
            fields[field_offset(LAUNCH_STATE, "tripped") // 8] = self._tripped
            fields[field_offset(LAUNCH_STATE, "timeout_ns") // 8] = self._timeout_ns
            self._words(self.plan.offset(name), LAUNCH_STATE_BYTES).set(fields.view(np.uint32))
        for family, width in self._sets:
            name = f"{family}{width}"
            self._words(self.plan.offset(name), self.plan.nbytes(name)).fill(np.uint32(sentinel_word(width)))
        cupy.cuda.Device(self.pool.device).synchronize()

    def close(self) -> None:
        """Drops the launchers and the engine's references to its kernel modules, on the
        closing thread. The modules stay loaded: CuPy memoizes each compiled module per
        device for the process (a communicator made again reuses it, as every communicator
        with the same kernels does), and frees them at exit. Idempotent; the engine
        launches nothing afterwards."""
        self._norm_launches.clear()
        self._launchers.clear()
        self._modules.clear()

    def entries(self) -> dict[str, int]:
        """The global timer (ns) when block 0 of the latest launch of each kernel family
        entered, before its grid-dependency wait (LaunchState.entered_ns; 0 before the
        first launch), by state name: earlier than the end of the kernel before it on the
        stream where programmatic dependent launch is in effect. Synchronizes the device."""
        import cupy

        word = field_offset(LAUNCH_STATE, "entered_ns") // 4
        cupy.cuda.Device(self.pool.device).synchronize()
        return {name: int(self._words(self.plan.offset(name), LAUNCH_STATE_BYTES).get()[word:word + 2]
                          .view(np.uint64)[0]) for name in STATES}

    def _words(self, offset: int, nbytes: int):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.pool.local_ptr(offset), nbytes, self, device_id=self.pool.device)
        return cupy.ndarray((nbytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))

    # -- launches -------------------------------------------------------------------
    def _kernel(self, algorithm: str, dtype: str, op: str, fused: bool = False, cluster: int = 1,
                collective: str = "all_reduce") -> Launcher:
        """The launcher of ``algorithm``'s entry point of ``collective`` (``fused``: the
        add + RMSNorm one, compiled for thread-block clusters of ``cluster`` blocks)."""
        key = (algorithm, dtype, op, fused, cluster, collective)
        launcher = self._launchers.get(key)
        if launcher is None:
            alg = ALGORITHMS[algorithm]
            entry = alg.norm_entry if fused else alg.entry_of(collective)
            if alg.multicast and not self._mc_base:
                raise AssertionError(f"engine: {algorithm} needs the multicast mapping")
            mkey = (alg.source, alg.transport, dtype, op, cluster)
            module = self._modules.get(mkey)
            if module is None:
                defines = compile_defines(dtype, op, self.nranks, alg.transport, cluster, self._deterministic)
                module = self._modules[mkey] = compile_module(alg.source, defines, self.pool.device)
            prefix, state = self._constants(alg, DTYPES[dtype][1], fused)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry], prefix, (state,),
                                                        self.dependent)
        return launcher

    def _constants(self, alg, width: int, fused: bool) -> tuple[tuple, int]:
        """The leading parameters of ``alg``'s entry points that never change, and its launch state."""
        if alg.family == "twoshot":
            flags, state = self._twoshot[alg.transport]
            slots = (self.staging_off, self.staging_off + self._staging_half(), flags) if fused else (flags,)
            return self._fixed + slots, state
        set_off, state, unit = self._sets[alg.family, width]
        return self._fixed + (set_off, unit), state

    def lamport(self, algorithm: str, dtype: str, op: str, x: int, out: int, count: int, sig: int,
                collective: str = "all_reduce") -> tuple:
        """The launch of an all-reduce of ``count`` elements from local ``x`` into local
        ``out`` by a Lamport family kernel (``lamport``, ``lamport_twoshot``,
        ``nvls_lamport``); ``sig``: the call's signature (``signature``), which every rank's
        launch must carry alike.

        Both 16-byte aligned; ``x`` may equal ``out``; bytes within the algorithm's limit.
        A reduce-scatter or all-gather (``collective``; the Lamport two-shot only) takes
        ``count`` elements per rank, its rank-sliced side as whole vectors per slice
        (kernels/lamport_twoshot.cu).

        Returns:
            ``(launcher, blocks, threads, values)``: ``launch.issue(launch, stream)`` issues
            it, ``launch.Packed`` keeps it for a call plan. Every launch method of the
            engine returns this, and none issues.
        """
        nvec = self._vectors(dtype, count, collective)
        blocks, threads = lamport_shape(ALGORITHMS[algorithm], nvec, self.nranks, self._blocks)
        return self._kernel(algorithm, dtype, op, collective=collective), blocks, threads, (x, out, count, sig)

    def _vectors(self, dtype: str, count: int, collective: str) -> int:
        """Vectors of a message: of ``count`` elements, or of nranks slices of ``count``
        elements each in whole vectors (the reduce-scatter and all-gather)."""
        nvec = -(-count * DTYPES[dtype][1] // VEC_BYTES)
        return nvec if collective == "all_reduce" else self.nranks * nvec

    def twoshot(self, algorithm: str, dtype: str, op: str, buf_off: int, src: int, dst: int, count: int,
                sig: int, collective: str = "all_reduce") -> tuple:
        """The launch of a two-shot all-reduce in place on the buffer at ``buf_off`` of
        every segment, as ``lamport`` gives it.

        ``algorithm``: "twoshot" or "nvls". ``src``/``dst``: local 16-byte aligned
        addresses to copy in from / out to, or 0 when the buffer already holds the
        input / is the output. ``sig``: the call's signature. A reduce-scatter or all-gather
        (``collective``) takes ``count`` elements per rank (kernels/twoshot.cu).
        """
        alg = ALGORITHMS[algorithm]
        blocks = twoshot_blocks(alg, self._vectors(dtype, count, collective), self.nranks, self._blocks)
        return (self._kernel(algorithm, dtype, op, collective=collective), blocks, alg.threads,
                (buf_off, src, dst, count, sig))

    def quantized(self, fmt: str, dtype: str, op: str, src: int, dst: int, count: int, sig: int) -> tuple:
        """The launch of a quantized two-shot all-reduce (kernels/quant_twoshot.cu) of
        ``count`` elements from local ``src`` into local ``dst`` (2-byte aligned; may be
        equal) in ``fmt``, as ``lamport`` gives it; at most ``quant.LAUNCH_BYTES`` of input.
        ``sig``: the call's signature."""
        slice_units = -(-_quant.units(count) // self.nranks)
        return (self._quant_launcher(fmt, dtype, op, "all_reduce"), self._quant_blocks(slice_units),
                THREADS[_quant.SOURCE], (src, dst, count, sig))

    def quantized_rs(self, fmt: str, dtype: str, op: str, src: int, dst: int, k: int, pitch: int,
                     sig: int) -> tuple:
        """The launch of a quantized reduce-scatter (kernels/quant_twoshot.cu) of nranks
        slices of ``k`` elements, slice r at local ``src + r * pitch`` bytes, this rank's
        sums into local ``dst`` (k elements; 2-byte aligned; may be this rank's slice of the
        input), in ``fmt``, as ``lamport`` gives it; k at most ``quant.slice_launch_elems``.
        ``sig``: the call's signature."""
        return (self._quant_launcher(fmt, dtype, op, "reduce_scatter"), self._quant_blocks(-(-k // _quant.UNIT)),
                THREADS[_quant.SOURCE], (src, dst, k, pitch, sig))

    def _quant_launcher(self, fmt: str, dtype: str, op: str, collective: str) -> Launcher:
        """The launcher of the quantized entry point of ``collective`` (``_quant.ENTRIES``); both
        come from one module per format, dtype and op, and take the flags and the
        reduce-scatter slots, the all-reduce the all-gather area too."""
        flags, state, slots, gather, nbytes = self._quant
        if not nbytes:
            raise AssertionError("engine: the quantized two-shot needs Config.quantized")
        key = (f"quantized:{fmt}", dtype, op, False, 1, collective)  # shaped as _kernel's keys
        launcher = self._launchers.get(key)
        if launcher is None:
            mkey = (_quant.SOURCE, fmt, dtype, op)
            module = self._modules.get(mkey)
            if module is None:
                module = self._modules[mkey] = compile_module(
                    _quant.SOURCE, _quant.compile_defines(fmt, dtype, op, self.nranks), self.pool.device)
            entry = _quant.ENTRIES[collective]
            areas = (slots, gather) if collective == "all_reduce" else (slots,)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry],
                                                       self._fixed + (flags, *areas), (state,), self.dependent)
        return launcher

    def ll_move(self, entry: str, x: int, out: int, nbytes: int, sig: int, root: int | None = None) -> tuple:
        """The launch of a low-latency data mover (kernels/ll_move.cu), as ``lamport`` gives
        it: ``entry`` ``"ub_ll_alltoall"`` (``nbytes``: each part, at most LL_MAX_BYTES) or
        ``"ub_ll_broadcast"`` (``nbytes``: the message; ``root``); local addresses of any
        alignment. ``sig``: the call's signature."""
        key = ("ll", "-", "-", False, 1, entry)  # shaped as _kernel's keys
        launcher = self._launchers.get(key)
        if launcher is None:
            set_off, state, slot_bytes = self._ll
            module = self._modules.get(LL_SOURCE)
            if module is None:
                module = self._modules[LL_SOURCE] = compile_module(LL_SOURCE, ll_defines(self.nranks),
                                                                   self.pool.device)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry],
                                                       self._fixed + (set_off, slot_bytes), (state,), self.dependent)
        threads = THREADS[LL_SOURCE]
        lines = self.nranks * -(-nbytes // 8)
        values = (x, out, nbytes, sig) if root is None else (x, out, nbytes, root, sig)
        return launcher, max(1, min(self._blocks, -(-lines // threads))), threads, values

    def p2p(self, groups: list, head: int) -> tuple:
        """The launch of a batch of sends and receives (kernels/p2p.cu: ``ub_p2p``), as
        ``lamport`` gives it: ``groups``, a list of ``(kind, peer, [(address, bytes), ...])``
        ("send" or "recv"; local addresses of any alignment), each group's entries in issue
        order, at most P2P_MAX_ENTRIES entries in all; the same number of blocks per group
        (``p2p_blocks``). ``head``: the call's signature without its count (each header
        carries its message's bytes)."""
        words = []
        for kind, peer, entries in groups:
            for ptr, nbytes in entries:
                words += [ptr, nbytes | peer << 48 | (kind == "send") << 56]
        n = len(words) // 2
        if not groups or n > P2P_MAX_ENTRIES:
            raise AssertionError(f"engine: a point-to-point launch takes 1 to {P2P_MAX_ENTRIES} entries, not {n}")
        words += [0] * (2 * P2P_MAX_ENTRIES - len(words))
        largest = max(nbytes for _, _, entries in groups for _, nbytes in entries)
        blocks = len(groups) * p2p_blocks(largest, len(groups), self._blocks)
        return self._p2p_launcher("ub_p2p"), blocks, THREADS[P2P_SOURCE], (n, head, *words)

    def p2p_alltoallv(self, x: int, out: int, x_rows: int, out_rows: int, row_bytes: int, in_splits: int,
                      in_width: int, out_splits: int, out_width: int, head: int) -> tuple:
        """The launch of an all-to-all whose split counts (signed ints, one per rank, of
        ``in_width`` and ``out_width`` bytes: each array its own) are in device memory at
        ``in_splits`` and ``out_splits`` (kernels/p2p.cu: ``ub_p2p_alltoallv``), as
        ``lamport`` gives it: rows of ``row_bytes`` from the ``x_rows`` at local ``x`` into
        the ``out_rows`` at local ``out``; a block per send and per receive. ``head``: as
        for ``p2p``; the same number of blocks per send and per receive (``p2p_blocks`` of the
        largest part the arrays could hold)."""
        values = (x, out, x_rows, out_rows, row_bytes, in_splits, in_width, out_splits, out_width, head)
        groups = 2 * self.nranks
        blocks = groups * p2p_blocks(max(x_rows, out_rows) * row_bytes, groups, self._blocks)
        return self._p2p_launcher("ub_p2p_alltoallv"), blocks, THREADS[P2P_SOURCE], values

    def _p2p_launcher(self, entry: str) -> Launcher:
        key = ("p2p", "-", "-", False, 1, entry)  # shaped as _kernel's keys
        launcher = self._launchers.get(key)
        if launcher is None:
            module = self._modules.get(P2P_SOURCE)
            if module is None:
                module = self._modules[P2P_SOURCE] = compile_module(P2P_SOURCE, ll_defines(self.nranks),
                                                                    self.pool.device)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry],
                                                       self._fixed + self._p2p, (), self.dependent)
        return launcher

    def _quant_blocks(self, slice_units: int) -> int:
        """Blocks of a quantized launch whose slices have ``slice_units`` units: one per
        ``_quant.BLOCK_UNITS`` of a slice, at most the engine's (every block resident)."""
        return max(1, min(self._blocks, -(-slice_units // _quant.BLOCK_UNITS)))

    def norm_rows(self, algorithm: str, dtype: str, hidden: int, rows: int) -> int:
        """Rows one fused launch of ``algorithm`` takes (of ``rows``; 0: not even one)."""
        alg = ALGORITHMS[algorithm]
        width = DTYPES[dtype][1]
        row_bytes = hidden * width
        if alg.family == "lamport":  # a message of whole rows that fits a slot
            return min(rows, self._sets[alg.family, width][2] // row_bytes)
        if alg.family == "lamport_twoshot":
            return twoshot_norm_rows(self._sets[alg.family, width][2], row_bytes, self.nranks)
        return self._staging_half() // row_bytes  # two staging halves: input/normed, residual

    def _staging_half(self) -> int:
        return self.staging_bytes // 2 // VEC_BYTES * VEC_BYTES

    def add_rmsnorm(self, algorithm: str, dtype: str, x: int, rows: int, hidden: int, norm: tuple,
                    eps: float, sig: int) -> tuple:
        """The launch of a fused all-reduce + residual add + RMSNorm of ``rows`` x ``hidden``
        elements, as ``lamport`` gives it.

        ``norm``: local addresses (residual or 0, bias or 0, weight, normed, res_out),
        all 16-byte aligned, outputs not overlapping ``x``; hidden a multiple of 8;
        rows <= ``norm_rows``.
        """
        key = (algorithm, dtype, rows, hidden)
        launch = self._norm_launches.get(key)
        if launch is None:
            if len(self._norm_launches) >= _NORM_LAUNCHES_MAX:
                self._norm_launches.clear()
            launch = self._norm_launches[key] = self._norm_launch(algorithm, dtype, rows, hidden)
        launcher, blocks, threads, _ = launch
        return launcher, blocks, threads, (x, rows, hidden, *norm, eps, sig)

    def _norm_launch(self, algorithm: str, dtype: str, rows: int, hidden: int) -> tuple:
        """The kernel and grid of a fused launch of ``rows`` x ``hidden``: (launcher,
        blocks, threads per block, blocks per cluster). The launcher's entry point is
        compiled for its cluster size, so a plain launch forms the clusters."""
        vpr = hidden * DTYPES[dtype][1] // VEC_BYTES
        blocks, threads, cluster = norm_shape(ALGORITHMS[algorithm], rows, vpr, self.nranks, self._blocks,
                                              self._cluster_rows)
        return self._kernel(algorithm, dtype, "sum", fused=True, cluster=cluster), blocks, threads, cluster


# Launch shapes: the grid, block and cluster sizes of every kernel launch.

#: portable thread-block cluster size (the one-shot's fused clusters)
MAX_CLUSTER = 8
#: largest cluster of the fused Lamport two-shot, whose clusters finish this rank's share
#: of the rows while the other ranks' rows arrive: smaller clusters leave SMs for them
TWOSHOT_MAX_CLUSTER = 4
#: least vectors of a row per block of a cluster
CLUSTER_BLOCK_VECTORS = 128
#: threads per block of the Lamport two-shot's narrow launches (lamport_twoshot_threads)
NARROW_THREADS = 128


def row_cluster(rows: int, vectors: int, blocks: int, largest: int = MAX_CLUSTER) -> int:
    """Blocks per cluster that finish one row of ``vectors`` 16-byte vectors when a launch
    of ``rows`` rows may use ``blocks`` blocks: a power of two up to ``largest``, with a
    cluster for every row and at least CLUSTER_BLOCK_VECTORS vectors per block, so that a
    few long rows spread their polls and passes over several SMs. Rows that one block
    covers with a vector per thread stay on one block."""
    if vectors < NORM_THREADS:
        return 1
    cluster = 1
    while (cluster * 2 <= largest and rows * cluster * 2 <= blocks
           and vectors >= cluster * 2 * CLUSTER_BLOCK_VECTORS):
        cluster *= 2
    return cluster


def lamport_shape(alg, nvec: int, nranks: int, max_blocks: int) -> tuple[int, int]:
    """(blocks, threads per block) of a plain launch of the Lamport family ``alg`` on
    ``nvec`` vectors: a block per ``alg.threads`` vectors, at most ``max_blocks`` (the
    two-shot kernel gives each block a part of every slice), on the narrow blocks of
    ``lamport_twoshot_threads`` where they apply."""
    blocks = max(1, min(max_blocks, -(-nvec // alg.threads)))
    threads = alg.threads
    if alg.family == "lamport_twoshot":
        threads = lamport_twoshot_threads(nvec, nranks, blocks, threads)
    return blocks, threads


def lamport_twoshot_threads(nvec: int, nranks: int, blocks: int, threads: int) -> int:
    """Threads per block of a plain Lamport two-shot launch of ``nvec`` vectors on
    ``blocks`` blocks (``threads``: the kernel's own). NARROW_THREADS where a block's
    part of a slice (kernels/lamport_twoshot.cu: block_part) gives each of them 2 or 3
    vectors: a thread's pushes leave in order, so its first vectors are reduced and
    gathered while the later ones still cross NVLink. With one vector per thread there is
    nothing to overlap, and with more, fewer pushes are in flight."""
    slice_vecs = round_up(-(-nvec // nranks), TWOSHOT_ALIGN_VECS)
    part = round_up(-(-slice_vecs // blocks), TWOSHOT_ALIGN_VECS)
    return NARROW_THREADS if 2 * NARROW_THREADS <= part <= 3 * NARROW_THREADS else threads


def twoshot_blocks(alg, nvec: int, nranks: int, max_blocks: int) -> int:
    """Blocks of a barrier two-shot launch of ``nvec`` vectors: one per ``alg.threads``
    vectors of a slice, at most ``max_blocks``; the multicast barrier counts arrivals per
    block, so every launch of it has ``max_blocks`` (the unicast one takes any grid)."""
    return grid(alg, -(-(-(-nvec // nranks)) // alg.threads), max_blocks)


def grid(alg, wanted: int, max_blocks: int) -> int:
    """``wanted`` blocks, at least 1 and at most ``max_blocks``; always ``max_blocks`` for a
    multicast barrier two-shot (whose counting barrier needs the same grid every launch)."""
    return max_blocks if alg.multicast else max(1, min(max_blocks, wanted))


def norm_shape(alg, rows: int, vpr: int, nranks: int, max_blocks: int, clusters: bool) -> tuple[int, int, int]:
    """(blocks, threads per block, blocks per cluster) of a fused launch of ``rows`` rows of
    ``vpr`` vectors by ``alg``; ``clusters``: whether the device runs thread-block clusters."""
    # rows that each rank normalizes: all (one-shot) or its own (two-shot kernels)
    owned = rows if alg.family == "lamport" else -(-rows // nranks)
    # few of them: a cluster per row, so a row's polls and passes run on several SMs
    largest = MAX_CLUSTER if alg.family == "lamport" else TWOSHOT_MAX_CLUSTER
    cluster = row_cluster(owned, vpr, max_blocks, largest) if alg.pushed and clusters else 1
    if alg.family == "twoshot":  # a block per owned row
        blocks = grid(alg, owned, max_blocks)
    elif alg.family == "lamport" and cluster > 1:
        blocks = cluster * rows
    else:  # enough blocks for every row, and for the pushes at ~`threads` vectors per block
        wanted = max(rows, -(-rows * vpr // alg.threads))
        blocks = max(cluster, min(max_blocks, wanted) // cluster * cluster)
    return blocks, row_threads(vpr, cluster), cluster


def p2p_blocks(largest: int, groups: int, max_blocks: int) -> int:
    """Blocks per group of a point-to-point launch (kernels/p2p.cu) whose largest message
    may be ``largest`` bytes: P2P_BULK_BLOCKS where it may take the bulk form (its chunks
    shared among them), else 1; at most ``max_blocks`` in all, so that every block of the
    launch runs at once (a group's blocks wait for another group's)."""
    return max(1, min(P2P_BULK_BLOCKS if largest >= P2P_BULK_MIN_BYTES else 1, max_blocks // groups))
