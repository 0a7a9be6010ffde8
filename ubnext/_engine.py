"""Launching ubnext's kernels on the symmetric pool.

The engine owns the pool layout (library slots at fixed offsets, so captured CUDA
graphs stay valid), the kernel cache, and the grid sizes. It never synchronizes the
host: each call is one or a few launches (and, for misaligned arrays, copies) on the
caller's stream.
"""

from __future__ import annotations

import numpy as np

from ._algorithms import ALGORITHMS, DTYPES, compile_defines, row_threads
from ._heap import SlotPlan, round_up
from ._kernels import compile_module
from ._launch import F32, I32, U64, Launcher
from ._protocol import (FLAG_PHASES, LAUNCH_STATE, LAUNCH_STATE_BYTES, MAX_BLOCKS, MAX_RANKS, NORM_THREADS,
                        TWOSHOT_ALIGN_VECS, VEC_BYTES, field_offset, sentinel_word)

#: parameters of each entry point (kernels/lamport.cu, kernels/twoshot.cu): base, stride,
#: rank, mc, then 64-bit values; the fused ones take eps (fp32) before the signature and
#: the launch state.
_PARAMS = {
    "ub_lamport": (U64, U64, I32) + (U64,) * 8,
    "ub_lamport_twoshot": (U64, U64, I32) + (U64,) * 8,
    "ub_twoshot": (U64, U64, I32) + (U64,) * 8,
    "ub_lamport_norm": (U64, U64, I32) + (U64,) * 11 + (F32, U64, U64),
    "ub_lamport_twoshot_norm": (U64, U64, I32) + (U64,) * 11 + (F32, U64, U64),
    "ub_twoshot_norm": (U64, U64, I32) + (U64,) * 12 + (F32, U64, U64),
}
#: the LaunchState slots of the plan: one per Lamport family and element width, one per
#: barrier two-shot transport
STATES = tuple([f"{family}{width}.state" for width in (2, 4) for family in ("lamport", "lamport_twoshot")]
               + [f"twoshot.{transport}.state" for transport in ("unicast", "multicast")])

# kernels/sync.cuh: flag_offset, signature_offset
_FLAG_BYTES = (4 * FLAG_PHASES + 8) * MAX_BLOCKS * MAX_RANKS
_SCALE_ROW_VECS = 64                   # fused Lamport two-shot: a 16-byte scale per row of >= 64 vectors
_NORM_LAUNCHES_MAX = 4096              # fused launch shapes an engine remembers (cleared when full)
MAX_CLUSTER = 8                        # portable thread-block cluster size
# largest cluster of the fused Lamport two-shot, whose clusters finish this rank's share of
# the rows while the other ranks' rows arrive: 4 blocks per row beat 8 (hidden 8192 bf16,
# 32 tokens: 4xH200 9.67 -> 9.04 us, 2xH200 7.54 -> 6.12; 64 tokens 11.96 -> 11.15 on 4)
TWOSHOT_MAX_CLUSTER = 4
CLUSTER_BLOCK_VECTORS = 128            # least vectors of a row per block of a cluster
NARROW_THREADS = 128                   # see lamport_twoshot_threads


def plan_layout(nranks: int, lamport_bytes: int, lamport_twoshot_bytes: int, staging_bytes: int) -> SlotPlan:
    """The library slots of every segment, identical on every rank.

    Each Lamport family has one set of 3 receive buffers and a launch state per element
    width, since the sentinel's bit pattern depends on it; a set is shared by a family's
    unicast and multicast kernels and by its fused kernel (same protocol, same rotation).
    A one-shot buffer holds nranks slots of ``lamport_bytes`` and a signature header per
    rank; a two-shot buffer holds a reduce-scatter and an all-gather area of
    ``_area(lamport_twoshot_bytes)``. The
    barrier two-shot kernels have a launch state and barrier flags per transport: the
    unicast barrier stores epochs per source rank, the multicast one counts arrivals.
    """
    plan = SlotPlan()
    for name in STATES:
        plan.add(name, LAUNCH_STATE_BYTES)
    for transport in ("unicast", "multicast"):
        plan.add(f"flags.{transport}", _FLAG_BYTES)
    for width in (2, 4):
        plan.add(f"lamport{width}", _set_bytes("lamport", nranks, lamport_bytes))
        plan.add(f"lamport_twoshot{width}", _set_bytes("lamport_twoshot", nranks, _area(lamport_twoshot_bytes)))
    plan.add("staging", staging_bytes)
    return plan


def _set_bytes(family: str, nranks: int, unit: int) -> int:
    """Bytes of a Lamport family's set of 3 receive buffers whose kernels take ``unit``:
    one-shot, nranks slots of ``unit`` bytes and a signature header vector per rank
    (kernels/lamport.cu); two-shot, a reduce-scatter and an all-gather area of ``unit``
    bytes (kernels/lamport_twoshot.cu)."""
    return 3 * (nranks * (unit + VEC_BYTES) if family == "lamport" else 2 * unit)


def _set_unit(family: str, nranks: int, set_bytes: int) -> int:
    """The ``unit`` of a set of ``set_bytes`` (the inverse of _set_bytes)."""
    return set_bytes // (3 * nranks) - VEC_BYTES if family == "lamport" else set_bytes // 6


def row_cluster(rows: int, vectors: int, blocks: int, largest: int = MAX_CLUSTER) -> int:
    """Blocks per cluster that finish one row of ``vectors`` 16-byte vectors when a launch
    of ``rows`` rows may use ``blocks`` blocks: a power of two up to ``largest``, with a
    cluster for every row and at least CLUSTER_BLOCK_VECTORS vectors per block. Rows that
    one block covers with a vector per thread stay on one block. Measured on 4×H200:
    hidden 8192 bf16 (1024 vectors) over 8 blocks is 7 % faster at 1 token and 16 % at
    32; hidden 4096 (512 vectors) over 2 to 8 blocks was 4-10 % slower."""
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
    gathered while the later ones still cross NVLink. Measured, bf16, against 512
    threads (same grid): 4xH200 2 MiB (parts of 256 vectors) 15.87 -> 14.73 µs,
    2.5 MiB (320) 17.86 -> 17.02, 3 MiB (384) 19.72 -> 19.31; 2xH200 1 MiB (256) 7.20 ->
    6.37, 1.5 MiB (384) 8.78 -> 8.25. With 1 vector per thread it lost (2xH200 512 KiB
    +0.12, 256 KiB +0.17), with 4 it was even (2xH200 2 MiB -0.09); 128 of 512
    threads working on 4xH200 lost 1.1 µs at 4 MiB (4 vectors each) and 4.9 at 8 MiB
    (8 each): fewer pushes in flight."""
    slice_vecs = round_up(-(-nvec // nranks), TWOSHOT_ALIGN_VECS)
    part = round_up(-(-slice_vecs // blocks), TWOSHOT_ALIGN_VECS)
    return NARROW_THREADS if 2 * NARROW_THREADS <= part <= 3 * NARROW_THREADS else threads


def _area(max_bytes: int) -> int:
    """Bytes of a Lamport two-shot area for messages up to ``max_bytes``: the slots of the
    reduce-scatter area are whole slices of whole TWOSHOT_ALIGN_VECS-vector units, up to
    that many vectors per rank more than the message, followed by a signature header
    vector per rank; the all-gather area of the fused kernel also holds a 16-byte scale
    per row: room for them at the full message when rows have at least _SCALE_ROW_VECS
    vectors (1 KiB)."""
    vecs = -(-max_bytes // VEC_BYTES)
    return VEC_BYTES * (vecs + vecs // _SCALE_ROW_VECS + (TWOSHOT_ALIGN_VECS + 1) * MAX_RANKS)


def twoshot_norm_rows(area: int, row_bytes: int, nranks: int) -> int:
    """Rows of ``row_bytes`` one fused Lamport two-shot launch takes with areas of ``area``
    bytes (kernels/lamport_twoshot.cu): every rank's slot holds ceil(rows / nranks) rows,
    the all-gather area also a 16-byte scale per row."""
    return (area // (row_bytes + VEC_BYTES)) // nranks * nranks


class Engine:
    """Runs the all-reduce kernels of one communicator.

    Args:
        pool: the node's SymmetricPool.
        plan: its library slots (``plan_layout``).
        records: ``{state name: device address of its ErrorRecord}`` (``FailureRecords``).
        timeout_s: bound on every device wait.
        max_blocks: blocks per launch (0 = SM count).
        on_first_use: called (collectively, same order on every rank) after a kernel
            instantiation is compiled for the first time, before its first launch.
        mc_base: device address of the pool's multicast mapping (``MulticastRange.ptr``:
            byte ``o`` of it is byte ``o`` of every segment), or 0 without NVLS.
    """

    def __init__(self, pool, plan: SlotPlan, records: dict[str, int], timeout_s: float, max_blocks: int,
                 on_first_use, mc_base: int = 0):
        import cupy

        self.pool = pool
        self.plan = plan
        self.nranks = pool.local_size
        self.rank = pool.local_rank
        self.staging_bytes = plan.nbytes("staging")
        self._records = records
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
        self._on_first_use = on_first_use
        self._mc_base = mc_base
        # constant arguments and addresses, computed once
        self._fixed = (pool.base, pool.stride, self.rank, mc_base)
        # (family, width) -> (set offset, launch state, the kernels' buffer size argument:
        # one-shot slot bytes, two-shot area bytes)
        self._sets = {(f, w): (plan.offset(f"{f}{w}"), pool.local_ptr(plan.offset(f"{f}{w}.state")),
                               _set_unit(f, self.nranks, plan.nbytes(f"{f}{w}")))
                      for f in ("lamport", "lamport_twoshot") for w in (2, 4)}
        self._twoshot = {t: (plan.offset(f"flags.{t}"), pool.local_ptr(plan.offset(f"twoshot.{t}.state")))
                         for t in ("unicast", "multicast")}
        self.staging_off = plan.offset("staging")
        self.staging_ptr = pool.local_ptr(self.staging_off)

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
            fields[field_offset(LAUNCH_STATE, "timeout_ns") // 8] = self._timeout_ns
            self._words(self.plan.offset(name), LAUNCH_STATE_BYTES).set(fields.view(np.uint32))
        for family, width in self._sets:
            name = f"{family}{width}"
            self._words(self.plan.offset(name), self.plan.nbytes(name)).fill(np.uint32(sentinel_word(width)))
        cupy.cuda.Device(self.pool.device).synchronize()

    def _words(self, offset: int, nbytes: int):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.pool.local_ptr(offset), nbytes, self, device_id=self.pool.device)
        return cupy.ndarray((nbytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))

    # -- launches -------------------------------------------------------------------
    def _kernel(self, algorithm: str, dtype: str, op: str, fused: bool = False, cluster: int = 1) -> Launcher:
        """The launcher of ``algorithm``'s entry point (``fused``: the add + RMSNorm one,
        compiled for thread-block clusters of ``cluster`` blocks)."""
        key = (algorithm, dtype, op, fused, cluster)
        launcher = self._launchers.get(key)
        if launcher is None:
            alg = ALGORITHMS[algorithm]
            entry = alg.norm_entry if fused else alg.entry
            if alg.multicast and not self._mc_base:
                raise AssertionError(f"engine: {algorithm} needs the multicast mapping")
            mkey = (alg.source, alg.transport, dtype, op, cluster)
            module = self._modules.get(mkey)
            if module is None:
                defines = compile_defines(dtype, op, self.nranks, alg.transport, cluster)
                module = self._modules[mkey] = compile_module(alg.source, defines)
            prefix, state = self._constants(alg, DTYPES[dtype][1], fused)
            launcher = self._launchers[key] = Launcher(module.get_function(entry), _PARAMS[entry], prefix, (state,))
            self._on_first_use()
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
                stream: int) -> None:
        """All-reduce of ``count`` elements from local ``x`` into local ``out`` by a Lamport
        family kernel (``lamport``, ``lamport_twoshot``, ``nvls_lamport``); ``sig``: the
        call's signature (``_signature``), which every rank's launch must carry alike.

        Both 16-byte aligned; ``x`` may equal ``out``; bytes within the algorithm's limit.
        """
        nvec = -(-count * DTYPES[dtype][1] // VEC_BYTES)
        blocks, threads = lamport_shape(ALGORITHMS[algorithm], nvec, self.nranks, self._blocks)
        self._kernel(algorithm, dtype, op)(blocks, threads, stream, x, out, count, sig)

    def twoshot(self, algorithm: str, dtype: str, op: str, buf_off: int, src: int, dst: int,
                count: int, sig: int, stream: int) -> None:
        """Two-shot all-reduce in place on the buffer at ``buf_off`` of every segment.

        ``algorithm``: "twoshot" or "nvls". ``src``/``dst``: local 16-byte aligned
        addresses to copy in from / out to, or 0 when the buffer already holds the
        input / is the output. ``sig``: the call's signature.
        """
        alg = ALGORITHMS[algorithm]
        nvec = -(-count * DTYPES[dtype][1] // VEC_BYTES)
        slice_vecs = -(-nvec // self.nranks)
        blocks = self._grid(alg, -(-slice_vecs // alg.threads))
        self._kernel(algorithm, dtype, op)(blocks, alg.threads, stream, buf_off, src, dst, count, sig)

    def _grid(self, alg, wanted: int) -> int:
        # The multicast barrier counts arrivals per block, so every launch of it must
        # have the same grid; the unicast one stores epochs and takes any grid.
        return self._blocks if alg.multicast else max(1, min(self._blocks, wanted))

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
                    eps: float, sig: int, stream: int) -> None:
        """Fused all-reduce + residual add + RMSNorm of ``rows`` x ``hidden`` elements.

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
        launcher(blocks, threads, stream, x, rows, hidden, *norm, eps, sig)

    def _norm_launch(self, algorithm: str, dtype: str, rows: int, hidden: int) -> tuple:
        """The kernel and grid of a fused launch of ``rows`` x ``hidden``: (launcher,
        blocks, threads per block, blocks per cluster). The launcher's entry point is
        compiled for its cluster size, so a plain launch forms the clusters."""
        alg = ALGORITHMS[algorithm]
        vpr = hidden * DTYPES[dtype][1] // VEC_BYTES
        # rows that each rank normalizes: all (one-shot) or its own (two-shot kernels)
        owned = rows if alg.family == "lamport" else -(-rows // self.nranks)
        # few of them: a cluster per row, so a row's polls and passes run on several SMs
        largest = MAX_CLUSTER if alg.family == "lamport" else TWOSHOT_MAX_CLUSTER
        cluster = row_cluster(owned, vpr, self._blocks, largest) if alg.pushed and self._cluster_rows else 1
        if alg.family == "twoshot":  # a block per owned row
            blocks = self._grid(alg, owned)
        elif alg.family == "lamport" and cluster > 1:
            blocks = cluster * rows
        else:  # enough blocks for every row, and for the pushes at ~`threads` vectors per block
            wanted = max(rows, -(-rows * vpr // alg.threads))
            blocks = max(cluster, min(self._blocks, wanted) // cluster * cluster)
        launcher = self._kernel(algorithm, dtype, "sum", fused=True, cluster=cluster)
        return launcher, blocks, row_threads(vpr, cluster), cluster
