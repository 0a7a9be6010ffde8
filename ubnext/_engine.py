"""Launching ubnext's kernels on the symmetric pool.

The engine owns the pool layout (library slots at fixed offsets, so captured CUDA
graphs stay valid), the kernel cache, and the grid sizes. It never synchronizes the
host: each call is one or a few launches (and, for misaligned arrays, copies) on the
caller's stream.
"""

from __future__ import annotations

import numpy as np

from ._algorithms import ALGORITHMS, DTYPES, MAX_BLOCKS, MAX_RANKS, compile_defines, row_threads
from ._heap import SlotPlan
from ._kernels import compile_module
from ._launch import F32, I32, U64, Launcher

#: parameters of each entry point (kernels/lamport.cu, kernels/twoshot.cu): base, stride,
#: rank, mc, then 64-bit values; the fused ones take eps (fp32) before the last three.
_PARAMS = {
    "ub_lamport": (U64, U64, I32) + (U64,) * 9,
    "ub_twoshot": (U64, U64, I32) + (U64,) * 9,
    "ub_lamport_norm": (U64, U64, I32) + (U64,) * 11 + (F32,) + (U64,) * 3,
    "ub_twoshot_norm": (U64, U64, I32) + (U64,) * 12 + (F32,) + (U64,) * 3,
}

_STATE_BYTES = 16                      # kernels/sync.cuh LaunchState
_FLAG_BYTES = 4 * 2 * MAX_BLOCKS * MAX_RANKS
_SENTINEL_WORD = {2: 0x80008000, 4: 0x80000000}  # -0.0 in every element of a 32-bit word
_ALIGN = 16                            # kernels move 16-byte vectors


def plan_layout(nranks: int, lamport_bytes: int, staging_bytes: int) -> SlotPlan:
    """The library slots of every segment, identical on every rank.

    One Lamport set (3 receive buffers x nranks slots) per element width, since the
    sentinel's bit pattern depends on it, shared by the unicast and multicast one-shot
    kernels (same protocol, same rotation). The two-shot kernels have a launch state and
    barrier flags per transport: the unicast barrier stores epochs per source rank, the
    multicast one counts arrivals.
    """
    plan = SlotPlan()
    for width in (2, 4):
        plan.add(f"lamport{width}.state", _STATE_BYTES)
    for transport in ("unicast", "multicast"):
        plan.add(f"twoshot.{transport}.state", _STATE_BYTES)
        plan.add(f"flags.{transport}", _FLAG_BYTES)
    for width in (2, 4):
        plan.add(f"lamport{width}", 3 * nranks * lamport_bytes)
    plan.add("staging", staging_bytes)
    return plan


class Engine:
    """Runs the all-reduce kernels of one communicator.

    Args:
        pool: the node's SymmetricPool.
        plan: its library slots (``plan_layout``).
        lamport_bytes: size of one Lamport slot (largest one-shot message).
        timeout_ptr: device address of the TimeoutRecord.
        timeout_s: bound on every device wait.
        max_blocks: blocks per launch (0 = SM count).
        on_first_use: called (collectively, same order on every rank) after a kernel
            instantiation is compiled for the first time, before its first launch.
        mc_base: device address of the pool's multicast mapping (``MulticastRange.ptr``:
            byte ``o`` of it is byte ``o`` of every segment), or 0 without NVLS.
    """

    def __init__(self, pool, plan: SlotPlan, lamport_bytes: int, timeout_ptr: int,
                 timeout_s: float, max_blocks: int, on_first_use, mc_base: int = 0):
        import cupy

        self.pool = pool
        self.plan = plan
        self.nranks = pool.local_size
        self.rank = pool.local_rank
        self.lamport_bytes = lamport_bytes
        self.staging_bytes = plan.nbytes("staging")
        self._timeout_ptr = timeout_ptr
        self._timeout_ns = int(timeout_s * 1e9)
        sms = cupy.cuda.Device(pool.device).attributes["MultiProcessorCount"]
        self._blocks = min(max_blocks or sms, sms, MAX_BLOCKS)
        self._modules: dict[tuple, object] = {}
        self._launchers: dict[tuple, Launcher] = {}
        self._on_first_use = on_first_use
        self._mc_base = mc_base
        # constant arguments and addresses, computed once
        self._fixed = (pool.base, pool.stride, self.rank, mc_base)
        self._lamport = {w: (plan.offset(f"lamport{w}"), pool.local_ptr(plan.offset(f"lamport{w}.state")))
                         for w in (2, 4)}
        self._twoshot = {t: (plan.offset(f"flags.{t}"), pool.local_ptr(plan.offset(f"twoshot.{t}.state")))
                         for t in ("unicast", "multicast")}
        self.staging_off = plan.offset("staging")

    # -- setup ----------------------------------------------------------------------
    def initialize(self) -> None:
        """Zeroes states and flags, fills the Lamport buffers with the sentinel.

        Blocks the host until done; the caller then runs a barrier so that no peer
        pushes into a buffer that is still being filled.
        """
        import cupy

        self._words(0, self.staging_off).fill(0)
        for width, word in _SENTINEL_WORD.items():
            name = f"lamport{width}"
            self._words(self.plan.offset(name), self.plan.nbytes(name)).fill(np.uint32(word))
        cupy.cuda.Device(self.pool.device).synchronize()

    def _words(self, offset: int, nbytes: int):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.pool.local_ptr(offset), nbytes, self, device_id=self.pool.device)
        return cupy.ndarray((nbytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))

    # -- launches -------------------------------------------------------------------
    def _kernel(self, algorithm: str, dtype: str, op: str, fused: bool = False) -> Launcher:
        alg = ALGORITHMS[algorithm]
        entry = alg.norm_entry if fused else alg.entry
        key = (alg.source, alg.transport, dtype, op, entry)
        launcher = self._launchers.get(key)
        if launcher is None:
            if alg.multicast and not self._mc_base:
                raise AssertionError(f"engine: {algorithm} needs the multicast mapping")
            mkey = key[:-1]
            module = self._modules.get(mkey)
            if module is None:
                defines = compile_defines(dtype, op, self.nranks, alg.transport)
                module = self._modules[mkey] = compile_module(alg.source, defines)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry])
            self._on_first_use()
        return launcher

    def lamport(self, algorithm: str, dtype: str, op: str, x: int, out: int, count: int,
                stream: int) -> None:
        """One-shot all-reduce of ``count`` elements from local ``x`` into local ``out``.

        ``algorithm``: "lamport" or "nvls_lamport". Both 16-byte aligned; ``x`` may
        equal ``out``; bytes <= lamport_bytes.
        """
        width = DTYPES[dtype][1]
        nvec = -(-count * width // _ALIGN)
        threads = ALGORITHMS[algorithm].threads
        blocks = max(1, min(self._blocks, -(-nvec // threads)))
        set_off, state = self._lamport[width]
        self._kernel(algorithm, dtype, op)(
            blocks, threads, stream, *self._fixed, set_off, self.lamport_bytes, x, out, count, state,
            self._timeout_ptr, self._timeout_ns)

    def twoshot(self, algorithm: str, dtype: str, op: str, buf_off: int, src: int, dst: int,
                count: int, stream: int) -> None:
        """Two-shot all-reduce in place on the buffer at ``buf_off`` of every segment.

        ``algorithm``: "twoshot" or "nvls". ``src``/``dst``: local 16-byte aligned
        addresses to copy in from / out to, or 0 when the buffer already holds the
        input / is the output.
        """
        width = DTYPES[dtype][1]
        nvec = -(-count * width // _ALIGN)
        alg = ALGORITHMS[algorithm]
        slice_vecs = -(-nvec // self.nranks)
        blocks = self._grid(alg, -(-slice_vecs // alg.threads))
        flags, state = self._twoshot[alg.transport]
        self._kernel(algorithm, dtype, op)(
            blocks, alg.threads, stream, *self._fixed, buf_off, flags, src, dst, count, state,
            self._timeout_ptr, self._timeout_ns)

    def _grid(self, alg, wanted: int) -> int:
        # The multicast barrier counts arrivals per block, so every launch of it must
        # have the same grid; the unicast one stores epochs and takes any grid.
        return self._blocks if alg.multicast else max(1, min(self._blocks, wanted))

    def lamport_norm(self, algorithm: str, dtype: str, x: int, rows: int, hidden: int, norm: tuple,
                     eps: float, stream: int) -> None:
        """Fused one-shot all-reduce + residual add + RMSNorm of ``rows`` x ``hidden``.

        ``norm``: local addresses (residual or 0, bias or 0, weight, normed, res_out),
        all 16-byte aligned, outputs not overlapping ``x``; hidden a multiple of 8;
        rows * hidden bytes <= lamport_bytes.
        """
        width = DTYPES[dtype][1]
        vpr = hidden * width // _ALIGN
        set_off, state = self._lamport[width]
        # enough blocks for every row, and for the push at ~256 vectors per block
        blocks = max(1, min(self._blocks, max(rows, -(-rows * vpr // ALGORITHMS[algorithm].threads))))
        self._kernel(algorithm, dtype, "sum", fused=True)(
            blocks, row_threads(vpr), stream, *self._fixed, set_off,
            self.lamport_bytes, x, rows, hidden, *norm, eps, state, self._timeout_ptr, self._timeout_ns)

    def twoshot_norm_rows(self, dtype: str, hidden: int) -> int:
        """Rows one fused two-shot launch takes (two staging halves: input/normed, residual)."""
        return max(0, (self.staging_bytes // 2 // _ALIGN * _ALIGN) // (hidden * DTYPES[dtype][1]))

    def twoshot_norm(self, algorithm: str, dtype: str, x: int, rows: int, hidden: int, norm: tuple,
                     eps: float, stream: int) -> None:
        """Fused two-shot all-reduce + residual add + RMSNorm through the staging slot.

        Same arguments as ``lamport_norm``; rows <= ``twoshot_norm_rows``.
        """
        width = DTYPES[dtype][1]
        vpr = hidden * width // _ALIGN
        alg = ALGORITHMS[algorithm]
        half = self.staging_bytes // 2 // _ALIGN * _ALIGN
        flags, state = self._twoshot[alg.transport]
        self._kernel(algorithm, dtype, "sum", fused=True)(
            self._grid(alg, -(-rows // self.nranks)), row_threads(vpr), stream, *self._fixed,
            self.staging_off, self.staging_off + half, flags, x, rows, hidden, *norm, eps, state,
            self._timeout_ptr, self._timeout_ns)
