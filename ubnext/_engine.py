"""Launching ubnext's kernels on the symmetric pool.

The engine owns the kernel cache (a module per instantiation, a launcher per entry
point with its constant arguments packed once) and issues launches; the pool layout is
``_layout``'s, the launch shapes are ``_shapes``'. It never synchronizes the host: each
launch goes on the caller's stream.
"""

from __future__ import annotations

import numpy as np

from ._algorithms import ALGORITHMS, DTYPES, compile_defines
from ._heap import SlotPlan
from ._kernels import compile_module
from . import _quant
from ._launch import F32, I32, U64, Launcher, issue
from ._layout import STATES, set_unit, twoshot_norm_rows
from ._protocol import (LAUNCH_STATE, LAUNCH_STATE_BYTES, MAX_BLOCKS, THREADS, VEC_BYTES, field_offset,
                        sentinel_word)
from ._shapes import lamport_shape, norm_shape, twoshot_blocks

#: parameters of each entry point (kernels/lamport.cu, kernels/twoshot.cu): base, stride,
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
    """

    def __init__(self, pool, plan: SlotPlan, records: dict[str, int], tripped: int, timeout_s: float,
                 max_blocks: int, mc_base: int = 0, deterministic: bool = False):
        import cupy

        self.pool = pool
        self.plan = plan
        self.nranks = pool.local_size
        self.rank = pool.local_rank
        self.staging_bytes = plan.nbytes("staging")
        self._records, self._tripped = records, tripped
        self._deterministic = deterministic
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
        # the quantized two-shot: flags, launch state, receive areas and their bytes (0: not opted in)
        self._quant = (plan.offset("flags.quant"), pool.local_ptr(plan.offset("quant.state")),
                       plan.offset("quant"), plan.nbytes("quant"))

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
                module = self._modules[mkey] = compile_module(alg.source, defines)
            prefix, state = self._constants(alg, DTYPES[dtype][1], fused)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry], prefix, (state,))
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
                stream: int, collective: str = "all_reduce") -> None:
        """All-reduce of ``count`` elements from local ``x`` into local ``out`` by a Lamport
        family kernel (``lamport``, ``lamport_twoshot``, ``nvls_lamport``); ``sig``: the
        call's signature (``_signature``), which every rank's launch must carry alike.

        Both 16-byte aligned; ``x`` may equal ``out``; bytes within the algorithm's limit.
        A reduce-scatter or all-gather (``collective``; the Lamport two-shot only) takes
        ``count`` elements per rank, its rank-sliced side as whole vectors per slice
        (kernels/lamport_twoshot.cu).
        """
        issue(self.lamport_launch(algorithm, dtype, op, x, out, count, sig, collective), stream)

    def lamport_launch(self, algorithm: str, dtype: str, op: str, x: int, out: int, count: int, sig: int,
                       collective: str = "all_reduce") -> tuple:
        """The launch that ``lamport`` issues with these arguments but for its stream:
        ``(launcher, blocks, threads, values)``, as ``launcher(blocks, threads, stream,
        *values)`` launches it (``_launch.Packed`` takes the same)."""
        nvec = self._vectors(dtype, count, collective)
        blocks, threads = lamport_shape(ALGORITHMS[algorithm], nvec, self.nranks, self._blocks)
        return self._kernel(algorithm, dtype, op, collective=collective), blocks, threads, (x, out, count, sig)

    def _vectors(self, dtype: str, count: int, collective: str) -> int:
        """Vectors of a message: of ``count`` elements, or of nranks slices of ``count``
        elements each in whole vectors (the reduce-scatter and all-gather)."""
        nvec = -(-count * DTYPES[dtype][1] // VEC_BYTES)
        return nvec if collective == "all_reduce" else self.nranks * nvec

    def twoshot(self, algorithm: str, dtype: str, op: str, buf_off: int, src: int, dst: int,
                count: int, sig: int, stream: int, collective: str = "all_reduce") -> None:
        """Two-shot all-reduce in place on the buffer at ``buf_off`` of every segment.

        ``algorithm``: "twoshot" or "nvls". ``src``/``dst``: local 16-byte aligned
        addresses to copy in from / out to, or 0 when the buffer already holds the
        input / is the output. ``sig``: the call's signature. A reduce-scatter or all-gather
        (``collective``) takes ``count`` elements per rank (kernels/twoshot.cu).
        """
        issue(self.twoshot_launch(algorithm, dtype, op, buf_off, src, dst, count, sig, collective), stream)

    def twoshot_launch(self, algorithm: str, dtype: str, op: str, buf_off: int, src: int, dst: int, count: int,
                       sig: int, collective: str = "all_reduce") -> tuple:
        """The launch that ``twoshot`` issues with these arguments but for its stream, as
        ``lamport_launch`` gives it."""
        alg = ALGORITHMS[algorithm]
        blocks = twoshot_blocks(alg, self._vectors(dtype, count, collective), self.nranks, self._blocks)
        return (self._kernel(algorithm, dtype, op, collective=collective), blocks, alg.threads,
                (buf_off, src, dst, count, sig))

    def quantized(self, fmt: str, dtype: str, op: str, src: int, dst: int, count: int, sig: int,
                  stream: int) -> None:
        """Quantized two-shot all-reduce (kernels/quant_twoshot.cu) of ``count`` elements
        from local ``src`` into local ``dst`` (2-byte aligned; may be equal) in ``fmt``;
        at most ``_quant.LAUNCH_BYTES`` of input. ``sig``: the call's signature."""
        flags, state, area, nbytes = self._quant
        if not nbytes:
            raise AssertionError("engine: the quantized two-shot needs Config.quantized")
        key = (f"quantized:{fmt}", dtype, op, False, 1, "all_reduce")  # shaped as _kernel's keys
        launcher = self._launchers.get(key)
        if launcher is None:
            module = compile_module(_quant.SOURCE, _quant.compile_defines(fmt, dtype, op, self.nranks))
            launcher = self._launchers[key] = Launcher(module.get_function(_quant.ENTRY), _PARAMS["ub_twoshot"],
                                                       self._fixed + (flags, area), (state,))
        slice_groups = -(-_quant.groups(count) // self.nranks)
        blocks = max(1, min(self._blocks, -(-slice_groups // _quant.BLOCK_GROUPS)))
        launcher(blocks, THREADS[_quant.SOURCE], stream, src, dst, count, sig)

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

    def add_rmsnorm_launch(self, algorithm: str, dtype: str, x: int, rows: int, hidden: int, norm: tuple,
                           eps: float, sig: int) -> tuple:
        """The launch of a fused all-reduce + residual add + RMSNorm of ``rows`` x ``hidden``
        elements but for its stream, as ``lamport_launch`` gives it.

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
