"""The algorithm table: one record per algorithm (of the all-reduce, and of the
reduce-scatter and all-gather where its kernel source has them).

This table is the single place that says what exists. It drives selection
(`Selector`), compilation (`compile_defines`), validation, and the benchmarks'
list of candidates. Adding an algorithm means adding a row here and a kernel in
``kernels/``; nothing else lists algorithms by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from ubnext._protocol.constants import NORM_THREADS, THREADS

#: dtype name -> (element type in the kernels, bytes per element): every dtype an
#: all-reduce takes (kernels/common.cuh: Elem). ubnext's kernels accumulate the 16-bit
#: floats in fp32 (rounded once), float32 and float64 in their own type (as NCCL does), and
#: integers in their own type, a sum wrapping around modulo 2**bits (as NCCL does).
DTYPES = {"bfloat16": ("bf16", 2), "float16": ("f16", 2), "float32": ("float", 4),
          "float64": ("double", 8), "int8": ("i8", 1), "uint8": ("u8", 1), "int32": ("i32", 4),
          "uint32": ("u32", 4), "int64": ("i64", 8), "uint64": ("u64", 8)}
#: the dtypes every ubnext kernel reduces (the Lamport kernels' -0.0 sentinel exists in
#: them), the fused add + RMSNorm takes and the selector tables cover
KERNEL_DTYPES = ("bfloat16", "float16", "float32")
#: the other dtypes: among ubnext's kernels only the barrier two-shot ("twoshot", unicast)
#: reduces them; ``auto`` gives them to NCCL where NCCL can run (``_select.Selector``)
TWOSHOT_ONLY_DTYPES = tuple(name for name in DTYPES if name not in KERNEL_DTYPES)
#: the floating-point dtypes (the ones ``avg`` takes)
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
#: op name -> reduction functor in the kernels
OPS = {"sum": "OpSum", "avg": "OpAvg", "max": "OpMax", "min": "OpMin"}
#: the collectives an algorithm may serve (a selector table's rows are per collective)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def op_problem(dtype: str, op: str) -> str | None:
    """Why no algorithm reduces ``dtype`` with ``op``, or None where some does: ``avg``
    takes floating-point dtypes only (an integer mean would need a rounding rule).
    ``dtype`` and ``op`` are keys of DTYPES and OPS."""
    if op == "avg" and dtype not in FLOAT_DTYPES:
        return f"op 'avg' takes floating-point dtypes ({', '.join(FLOAT_DTYPES)}), not {dtype}; use sum"
    return None


@dataclass(frozen=True)
class Algorithm:
    """One all-reduce algorithm.

    Attributes:
        name: public name (``algorithm=`` argument, ``UBNEXT_ALGO``).
        source: kernel file in ``kernels/``, or None for the NCCL engine.
        entry: ``extern "C"`` all-reduce entry point in ``source``.
        norm_entry: entry point of the fused all-reduce + residual add + RMSNorm.
        transport: ``"unicast"`` (peer pointers), ``"multicast"`` (NVLS), or None.
        threads: threads per block of ``entry`` (its launch bound: ``_protocol.THREADS``).
        family: the kernel family, shared by a unicast algorithm and its multicast
            instantiation; it names their pool slots. ``"lamport"`` and
            ``"lamport_twoshot"`` push into sentinel-polled receive buffers (no
            barrier); ``"twoshot"`` works in place on the pool between cross-rank
            block barriers; ``"nccl"`` is the NCCL engine.
        limit: the ``Config`` field (KiB) that sizes the receive buffers and so
            bounds one launch's message, or None (no bound: larger messages go in chunks).
        summary: one line for ``python -m ubnext info``.
        in_launches: whether an all-reduce larger than the buffers runs as launches of
            the buffers' size (a bandwidth kernel whose cost per byte hardly grows with
            the launch count); otherwise ``limit`` bounds the message.
        rs_entry: entry point of the reduce-scatter in ``source``, or None (none there).
        ag_entry: entry point of the all-gather in ``source``, or None.
    """

    name: str
    source: str | None
    entry: str | None
    norm_entry: str | None
    transport: str | None
    threads: int
    family: str
    limit: str | None
    summary: str
    in_launches: bool = False
    rs_entry: str | None = None
    ag_entry: str | None = None

    @property
    def is_kernel(self) -> bool:
        return self.source is not None

    @property
    def pushed(self) -> bool:
        """Whether it uses the Lamport protocol (receive buffers bounded by ``limit``)."""
        return self.family in ("lamport", "lamport_twoshot")

    @property
    def multicast(self) -> bool:
        return self.transport == "multicast"

    def entry_of(self, collective: str) -> str | None:
        """The entry point of ``collective`` (a key of COLLECTIVES), or None where this
        kernel source has none."""
        return {"all_reduce": self.entry, "reduce_scatter": self.rs_entry, "all_gather": self.ag_entry}[collective]

    def serves(self, collective: str) -> bool:
        """Whether it runs ``collective``: NCCL every one, a kernel those of its source."""
        return not self.is_kernel or self.entry_of(collective) is not None

    def supports(self, dtype: str, op: str, collective: str = "all_reduce") -> bool:
        """Whether it runs ``collective`` on ``dtype`` with ``op``: NCCL every dtype; the
        kernels KERNEL_DTYPES (NVLS no fp32 max/min), the unicast barrier two-shot's
        all-reduce every dtype; ``avg`` only floating types (op_problem). The all-gather
        reduces nothing: its op is "sum"."""
        if op_problem(dtype, op) or not self.serves(collective):
            return False
        if not self.is_kernel:
            return True
        if dtype in TWOSHOT_ONLY_DTYPES:
            return self.family == "twoshot" and not self.multicast and collective == "all_reduce"
        return not (self.multicast and dtype == "float32" and op in ("max", "min"))


#: algorithm name -> its Algorithm record (kernel source, entry points, transport, family, buffer limit)
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "lamport", "lamport.cu", "ub_lamport", "ub_lamport_norm", "unicast", THREADS["lamport.cu"],
            "lamport", "lamport_max_kb",
            "one-shot push into every rank, sentinel-polled, no barrier (small messages)",
        ),
        Algorithm(
            "lamport_twoshot", "lamport_twoshot.cu", "ub_lamport_twoshot", "ub_lamport_twoshot_norm",
            "unicast", THREADS["lamport_twoshot.cu"], "lamport_twoshot", "lamport_twoshot_max_kb",
            "reduce-scatter + all-gather by pushes into sentinel-polled buffers, no barrier (mid sizes)",
            in_launches=True, rs_entry="ub_lamport_twoshot_rs", ag_entry="ub_lamport_twoshot_ag",
        ),
        Algorithm(
            "twoshot", "twoshot.cu", "ub_twoshot", "ub_twoshot_norm", "unicast", THREADS["twoshot.cu"], "twoshot",
            None,
            "reduce-scatter by loads + all-gather by stores, in place on the pool (large messages)",
            rs_entry="ub_twoshot_rs", ag_entry="ub_twoshot_ag",
        ),
        Algorithm(
            "nvls_lamport", "lamport.cu", "ub_lamport", "ub_lamport_norm", "multicast", THREADS["lamport.cu"],
            "lamport", "lamport_max_kb",
            "Lamport one-shot with one multimem.st per vector (NVLink multicast; small messages)",
        ),
        Algorithm(
            "nvls", "twoshot.cu", "ub_twoshot", "ub_twoshot_norm", "multicast", THREADS["twoshot.cu"], "twoshot",
            None,
            "NVLS simple two-shot: multimem.ld_reduce + multimem.st, multimem.red barrier",
            rs_entry="ub_twoshot_rs", ag_entry="ub_twoshot_ag",
        ),
        Algorithm(
            "nccl", None, None, None, None, 0, "nccl", None,
            "the NCCL library (fallback engine: several nodes, no P2P, other cases)",
        ),
    )
}

#: the algorithms of the data movers (``broadcast``, ``all_to_all`` with even splits,
#: ``gather``, ``scatter``: ubnext/_api/collectives), besides ``"auto"``
MOVERS = {
    "ll": "low-latency kernel: 8 bytes and a flag per pushed 16-byte line, polled, no barrier (broadcast and "
          "all_to_all; parts up to LL_MAX_BYTES)",
    "copy": "copy engines between the ranks' segments of a pool area, ubnext's one-shot all-reduce as the barrier",
    "scatter_allgather": "broadcast's bandwidth form on the copy form's area: the root's message cut in one part "
                         "per rank, each pushed into its rank's area, then every rank pulls every part",
    "nccl": "the NCCL library (ncclBroadcast; grouped ncclSend/ncclRecv for the others)",
}
#: data mover -> the algorithms of MOVERS its calls take (by name, and from selector table rows)
MOVER_SERVES = {"broadcast": ("ll", "copy", "scatter_allgather", "nccl"), "all_to_all": ("ll", "copy", "nccl"),
                "gather": ("copy", "nccl"), "scatter": ("copy", "nccl"), "send_recv": ("nccl",)}
#: the data movers that selector tables have rows for (``collectives`` of an entry; a call of
#: them resolves ``auto`` by its size: ``pool_copy.PoolCopy._sized``)
MOVER_TABLES = ("broadcast", "all_to_all", "send_recv")
#: the low-latency movers' kernel source and its entry point per collective
LL_SOURCE = "ll_move.cu"
LL_ENTRIES = {"all_to_all": "ub_ll_alltoall", "broadcast": "ub_ll_broadcast"}
#: point-to-point on the pool (send, recv, batch_isend_irecv, and all_to_all with uneven
#: splits: kernels/p2p.cu, compiled as LL_SOURCE is), its entry points, and the algorithms
#: of those calls besides "auto"
P2P_SOURCE = "p2p.cu"
P2P_ENTRIES = ("ub_p2p", "ub_p2p_alltoallv")
P2P_ALGORITHMS = {
    "ll": "point-to-point kernel: a pair's messages through the pair's own slots, polled, credits, no barrier; "
          "in LL lines (chunks of LL_MAX_BYTES), or from P2P_BULK_MIN_BYTES on in 16-byte vectors of flagged "
          "chunks, several blocks per pair",
    "nccl": "the NCCL library (grouped ncclSend/ncclRecv)",
}


def ll_defines(nranks: int) -> dict[str, str]:
    """Preprocessor definitions of the low-latency movers (LL_SOURCE) for ``nranks`` ranks:
    they move bytes, so no dtype or op; the unicast transport."""
    return {"UB_NRANKS": str(nranks), "UB_TRANSPORT": "Unicast"}

#: the unicast algorithm each multicast one falls back to
UNICAST_OF = {"nvls_lamport": "lamport", "nvls": "twoshot"}

#: the separate residual add + RMSNorm kernel (unfused path): source, entry point
NORM_SOURCE, NORM_ENTRY = "rmsnorm.cu", "ub_add_rmsnorm"
#: vectors of a row each thread of the separate add + RMSNorm kernel keeps in registers
#: (compiled in as UB_ROW_KEEP; the fused kernels keep one: kernels/rmsnorm.cuh)
ROW_KEEP = 4


#: the sum of slots in slot order (the overlapped matmul + reduce-scatter's reduction):
#: source, entry point, and the dtypes it takes (floating, summed in Elem's accumulator)
SLOT_SUM_SOURCE, SLOT_SUM_ENTRY = "slot_sum.cu", "ub_slot_sum"
SLOT_SUM_DTYPES = FLOAT_DTYPES
#: the same sum finished by the residual add + RMSNorm, row by row (the overlapped matmul +
#: reduce-scatter + add + RMSNorm): its entry point in SLOT_SUM_SOURCE, and the dtypes it
#: takes (the add + RMSNorm's: fp32 statistics)
SLOT_NORM_ENTRY = "ub_slot_sum_add_rmsnorm"
SLOT_NORM_DTYPES = KERNEL_DTYPES
#: vectors of a row each thread of SLOT_NORM_ENTRY keeps in registers (UB_ROW_KEEP): two,
#: where the separate kernel keeps ROW_KEEP; its eight slots' vectors in flight besides
#: four kept ones exceed the 64 registers of its launch bound (ptxas spills 12 to 36 bytes
#: at 8 slots), two spill at no slot count
SLOT_NORM_ROW_KEEP = 2


def row_threads(vectors: int, cluster: int = 1) -> int:
    """Threads per block of a row kernel whose rows are split over ``cluster`` blocks: one
    per 16-byte vector of the block's share, in whole warps, at most NORM_THREADS per
    cluster (kernels/rmsnorm.cuh: row_sum adds at most 32 warp totals)."""
    return max(32, min(NORM_THREADS // cluster, -(-vectors // (32 * cluster)) * 32))


def compile_defines(dtype: str, op: str, nranks: int, transport: str = "unicast",
                    cluster: int = 1, deterministic: bool = False) -> dict[str, str]:
    """Preprocessor definitions that instantiate a kernel entry point.

    Args:
        dtype: a key of ``DTYPES``.
        op: a key of ``OPS``.
        nranks: ranks of the node, 1..MAX_RANKS.
        transport: ``"unicast"`` or ``"multicast"``.
        cluster: blocks per thread-block cluster of the fused Lamport entry points
            (kernels/rmsnorm.cuh: UB_CLUSTER; 1: none, more needs sm_90).
        deterministic: every algorithm reduces in one order (kernels/common.cuh:
            UB_DETERMINISTIC; ``Config.deterministic``).

    Returns:
        ``{"UB_T": ..., "UB_OP": ..., "UB_NRANKS": ..., "UB_TRANSPORT": ..., "UB_CLUSTER": ...,
        "UB_DETERMINISTIC": ...}``.
    """
    return {"UB_T": DTYPES[dtype][0], "UB_OP": OPS[op], "UB_NRANKS": str(nranks),
            "UB_TRANSPORT": {"unicast": "Unicast", "multicast": "Multicast"}[transport],
            "UB_CLUSTER": str(cluster), "UB_DETERMINISTIC": str(int(deterministic))}


def slot_sum_defines(dtype: str, slots: int) -> dict[str, str]:
    """Preprocessor definitions of the slot sum (SLOT_SUM_SOURCE) of ``slots`` slots of
    ``dtype`` (one of SLOT_SUM_DTYPES), both its entry points (SLOT_NORM_ENTRY where
    ``dtype`` is one of SLOT_NORM_DTYPES, keeping SLOT_NORM_ROW_KEEP vectors per thread)."""
    if dtype not in SLOT_SUM_DTYPES:
        raise ValueError(f"the slot sum takes {', '.join(SLOT_SUM_DTYPES)}, not {dtype}")
    return {**compile_defines(dtype, "sum", slots), "UB_ROW_KEEP": str(SLOT_NORM_ROW_KEEP)}


def norm_defines(dtype: str) -> dict[str, str]:
    """Preprocessor definitions of the separate add + RMSNorm kernel (NORM_SOURCE) for
    ``dtype``: one rank, and ROW_KEEP vectors kept per thread."""
    return {**compile_defines(dtype, "sum", 1), "UB_ROW_KEEP": str(ROW_KEEP)}
