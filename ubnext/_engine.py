"""Launching ubnext's kernels on the symmetric pool.

The engine owns the pool layout (library slots at fixed offsets, so captured CUDA
graphs stay valid), the kernel cache, and the grid sizes. It never synchronizes the
host: each call is one or a few launches (and, for misaligned arrays, copies) on the
caller's stream.
"""

from __future__ import annotations

import numpy as np

from ._algorithms import ALGORITHMS, DTYPES, MAX_BLOCKS, MAX_RANKS
from ._heap import SlotPlan
from ._kernels import compile_kernel
from ._launch import I32, U64, Launcher

#: parameters of ub_lamport and ub_twoshot: base, stride, rank, then eight 64-bit values
_PARAMS = (U64, U64, I32) + (U64,) * 8

_STATE_BYTES = 16                      # kernels/sync.cuh LaunchState
_FLAG_BYTES = 4 * 2 * MAX_BLOCKS * MAX_RANKS
_SENTINEL_WORD = {2: 0x80008000, 4: 0x80000000}  # -0.0 in every element of a 32-bit word
_ALIGN = 16                            # kernels move 16-byte vectors


def plan_layout(nranks: int, lamport_bytes: int, staging_bytes: int) -> SlotPlan:
    """The library slots of every segment, identical on every rank.

    One Lamport set (3 receive buffers x nranks slots) per element width, since the
    sentinel's bit pattern depends on it; one launch state per kernel family.
    """
    plan = SlotPlan()
    for width in (2, 4):
        plan.add(f"lamport{width}.state", _STATE_BYTES)
    plan.add("twoshot.state", _STATE_BYTES)
    plan.add("flags", _FLAG_BYTES)
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
        self._mc_base = mc_base
        self.plan = plan
        self.nranks = pool.local_size
        self.rank = pool.local_rank
        self.lamport_bytes = lamport_bytes
        self.staging_bytes = plan.nbytes("staging")
        self._timeout_ptr = timeout_ptr
        self._timeout_ns = int(timeout_s * 1e9)
        sms = cupy.cuda.Device(pool.device).attributes["MultiProcessorCount"]
        self._blocks = min(max_blocks or sms, sms, MAX_BLOCKS)
        self._launchers: dict[tuple, Launcher] = {}
        self._on_first_use = on_first_use
        base, stride = pool.base, pool.stride
        # constant arguments and addresses, computed once
        self._fixed = (base, stride, self.rank)
        self._flags = plan.offset("flags")
        self._lamport = {w: (plan.offset(f"lamport{w}"), pool.local_ptr(plan.offset(f"lamport{w}.state")))
                         for w in (2, 4)}
        self._twoshot_state = pool.local_ptr(plan.offset("twoshot.state"))

    # -- setup ----------------------------------------------------------------------
    def initialize(self) -> None:
        """Zeroes states and flags, fills the Lamport buffers with the sentinel.

        Blocks the host until done; the caller then runs a barrier so that no peer
        pushes into a buffer that is still being filled.
        """
        import cupy

        self._words(0, self.plan.offset("staging")).fill(0)
        for width, word in _SENTINEL_WORD.items():
            name = f"lamport{width}"
            self._words(self.plan.offset(name), self.plan.nbytes(name)).fill(np.uint32(word))
        cupy.cuda.Device(self.pool.device).synchronize()

    def _words(self, offset: int, nbytes: int):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.pool.local_ptr(offset), nbytes, self, device_id=self.pool.device)
        return cupy.ndarray((nbytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))

    # -- launches -------------------------------------------------------------------
    def _kernel(self, algorithm: str, dtype: str, op: str) -> Launcher:
        key = (algorithm, dtype, op)
        launcher = self._launchers.get(key)
        if launcher is None:
            fn = compile_kernel(algorithm, dtype, op, self.nranks)
            launcher = self._launchers[key] = Launcher(fn, _PARAMS)
            self._on_first_use()
        return launcher

    def lamport(self, dtype: str, op: str, x: int, out: int, count: int, stream: int) -> None:
        """One-shot all-reduce of ``count`` elements from local ``x`` into local ``out``.

        Both 16-byte aligned; ``x`` may equal ``out``; bytes <= lamport_bytes.
        """
        width = DTYPES[dtype][1]
        nvec = -(-count * width // _ALIGN)
        threads = ALGORITHMS["lamport"].threads
        blocks = max(1, min(self._blocks, -(-nvec // threads)))
        set_off, state = self._lamport[width]
        self._kernel("lamport", dtype, op)(
            blocks, threads, stream, *self._fixed, set_off, self.lamport_bytes, x, out, count, state,
            self._timeout_ptr, self._timeout_ns)

    def twoshot(self, dtype: str, op: str, buf_off: int, src: int, dst: int, count: int,
                stream: int) -> None:
        """Two-shot all-reduce in place on the buffer at ``buf_off`` of every segment.

        ``src``/``dst``: local 16-byte aligned addresses to copy in from / out to, or 0
        when the buffer already holds the input / is the output.
        """
        width = DTYPES[dtype][1]
        nvec = -(-count * width // _ALIGN)
        threads = ALGORITHMS["twoshot"].threads
        slice_vecs = -(-nvec // self.nranks)
        blocks = max(1, min(self._blocks, -(-slice_vecs // threads)))
        self._kernel("twoshot", dtype, op)(
            blocks, threads, stream, *self._fixed, buf_off, self._flags, src, dst, count,
            self._twoshot_state, self._timeout_ptr, self._timeout_ns)
