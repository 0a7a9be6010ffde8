"""Kernel sources compile for sm_90a through NVRTC, without a GPU (CI's compile gate),
and the algorithm table and compile options agree with each other.

The gate (test_every_kernel_variant_compiles_for_sm90a, gate_cases) compiles every kernel
algorithm -- a kernel source and its transport -- for every dtype and every op it takes,
once each. The world size turns with the dtype and the op, so every algorithm, and every
(algorithm, dtype) with its four ops, compiles at 1, 2, 4 and 8 ranks, but not every
(dtype, op) at every world size. The cases are separate tests, so ``pytest -n auto``
compiles them on every core, and they compile in NVRTC's fast-compile mode
(``compile_cubin(fast=True)``: front end, code generation and ptxas's checks of every
instruction, without device optimization, about 4x faster); every algorithm also compiles
once fully optimized, as ubnext compiles what it launches
(test_every_kernel_algorithm_compiles_with_full_optimization). `.ci/run` runs the gate a second time with the CUDA 12
packages (with tests/test_quant_kernels.py's gate and the separate norm kernel).

The full rank matrix compiles in the GPU suites: a communicator compiles, through
``cupy.RawModule``, each instantiation it launches at its own node's rank count
(``ubnext._engine.engine``: ``compile_defines(dtype, op, self.nranks, ...)``), and
tests/test_gpu_allreduce.py's ``test_ops`` launches every unicast kernel algorithm with
every dtype and op; `.ci/gpu_suite.py` runs it at 1, 2, 4 and 8 ranks (configurations
r1, r2, r4, r8x2; tests/gpu_suite/summary.md records which ran). The multicast algorithms
(nvls, nvls_lamport) do not compile there -- the GPU suites run with NVLink multicast
off -- so their world sizes are compiled here only, as the rotation above gives them."""

from __future__ import annotations

import pytest

from ubnext._engine import kernels as _kernels
from ubnext._memory import heap as _heap
from ubnext._protocol import constants as _protocol
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import (
    ALGORITHMS,
    DTYPES,
    KERNEL_DTYPES,
    NORM_ENTRY,
    NORM_SOURCE,
    OPS,
    ROW_KEEP,
    SLOT_NORM_DTYPES,
    SLOT_NORM_ENTRY,
    SLOT_NORM_ROW_KEEP,
    SLOT_SUM_DTYPES,
    SLOT_SUM_ENTRY,
    SLOT_SUM_SOURCE,
    TWOSHOT_ONLY_DTYPES,
    compile_defines,
    norm_defines,
    slot_sum_defines,
)
from ubnext._protocol.constants import MAX_RANKS, NORM_THREADS, SLOT_SUM_THREADS

KERNEL_ALGOS = [name for name, a in ALGORITHMS.items() if a.is_kernel]


def _compile(algorithm, dtype, op, nranks, arch="sm_90a", deterministic=False, fast=False):
    alg = ALGORITHMS[algorithm]
    defines = compile_defines(dtype, op, nranks, alg.transport, deterministic=deterministic)
    return _kernels.compile_cubin(alg.source, defines, arch=arch, fast=fast)


#: the world sizes the gate compiles: each (algorithm, dtype) of KERNEL_DTYPES meets them
#: all over its four ops, and so every algorithm meets them all
RANKS = (1, 2, 4, 8)


def gate_cases():
    """The compile gate: every kernel algorithm (a kernel source and its transport) x every
    dtype x every op it takes, once each, at a world size that turns with the dtype and
    the op (RANKS[(dtype index + op index) % 4]); see the module docstring."""
    for algorithm in KERNEL_ALGOS:
        for i, dtype in enumerate(DTYPES):
            for j, op in enumerate(OPS):
                if ALGORITHMS[algorithm].supports(dtype, op):
                    nranks = RANKS[(i + j) % len(RANKS)]
                    yield pytest.param(algorithm, dtype, op, nranks, id=f"{algorithm}-{dtype}-{op}-{nranks}")


GATE = [tuple(case.values) for case in gate_cases()]


def test_the_gate_covers_every_source_dtype_op_transport_and_world_size():
    """Every (source, transport, dtype, op) an algorithm takes compiles once; every algorithm
    at every world size; every (algorithm, dtype) with its four ops at every world size."""
    taken = {(ALGORITHMS[a].source, ALGORITHMS[a].transport, d, o)
             for a in KERNEL_ALGOS for d in DTYPES for o in OPS if ALGORITHMS[a].supports(d, o)}
    compiled = [(ALGORITHMS[a].source, ALGORITHMS[a].transport, d, o) for a, d, o, _ in GATE]
    assert sorted(compiled) == sorted(taken) and len(set(compiled)) == len(compiled)
    for algorithm in KERNEL_ALGOS:
        assert {n for a, _, _, n in GATE if a == algorithm} == set(RANKS), algorithm
        for dtype in DTYPES:
            if all(ALGORITHMS[algorithm].supports(dtype, op) for op in OPS):
                assert {n for a, d, _, n in GATE if (a, d) == (algorithm, dtype)} == set(RANKS)
    assert {a for a, *_ in GATE} == set(KERNEL_ALGOS) and {d for _, d, _, _ in GATE} == set(DTYPES)


@pytest.mark.parametrize("algorithm,dtype,op,nranks", list(gate_cases()))
def test_every_kernel_variant_compiles_for_sm90a(algorithm, dtype, op, nranks):
    """One CUBIN per gate case, with every entry point of the algorithm (float64 and the
    integers: the barrier two-shot's plain one, the fused one takes 16/32-bit floats)."""
    alg = ALGORITHMS[algorithm]
    cubin = _compile(algorithm, dtype, op, nranks, fast=True)
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return a CUBIN"
    if dtype in TWOSHOT_ONLY_DTYPES:
        assert alg.entry.encode() in cubin and alg.norm_entry.encode() not in cubin
        return
    for entry in (alg.entry, alg.norm_entry, alg.rs_entry, alg.ag_entry):
        if entry is not None:
            assert entry.encode() in cubin, f"entry point {entry} missing from the CUBIN"


@pytest.mark.parametrize("algorithm", KERNEL_ALGOS)
def test_every_kernel_algorithm_compiles_with_full_optimization(algorithm):
    """The gate compiles in NVRTC's fast-compile mode; each algorithm compiles once here as
    ubnext compiles what it launches, fully optimized (every entry point, 4 ranks)."""
    alg = ALGORITHMS[algorithm]
    cubin = _compile(algorithm, "bfloat16", "sum", 4)
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return a CUBIN"
    for entry in (alg.entry, alg.norm_entry, alg.rs_entry, alg.ag_entry):
        if entry is not None:
            assert entry.encode() in cubin, f"entry point {entry} missing from the CUBIN"


def _ptx_instructions(ptx: bytes) -> set[str]:
    return {line.split()[0] for line in ptx.decode(errors="replace").splitlines() if line.strip()}


def _twoshot_ops(dtype):
    return [op for op in OPS if ALGORITHMS["twoshot"].supports(dtype, op)]


@pytest.mark.parametrize("dtype", TWOSHOT_ONLY_DTYPES)
def test_the_barrier_two_shot_compiles_every_other_dtype_for_sm80_and_deterministic(dtype):
    """float64 and the integers, whose every op compiles in the gate above (sm_90a): sum for
    sm_80, and the deterministic mode; the plain entry point only (the fused one takes
    16/32-bit floats)."""
    alg = ALGORITHMS["twoshot"]
    for op, arch, deterministic in (("sum", "sm_80", False), ("max" if dtype != "float64" else "avg", "sm_90a", True)):
        cubin = _compile("twoshot", dtype, op, 4, arch, deterministic, fast=True)
        assert cubin[:4] == b"\x7fELF", "NVRTC did not return a CUBIN"
        assert alg.entry.encode() in cubin and alg.norm_entry.encode() not in cubin, (op, arch)


@pytest.mark.parametrize("dtype", TWOSHOT_ONLY_DTYPES)
def test_the_other_dtypes_accumulate_in_their_own_type(dtype):
    """No fp32 arithmetic: float64 adds, compares and divides in f64, integers compare in
    their own signedness (sums in the unsigned type of their width: wrapping)."""
    ops = {op: _ptx_instructions(_compile("twoshot", dtype, op, 3, "compute_90a")) for op in _twoshot_ops(dtype)}
    for op, found in ops.items():
        assert not any(".f32" in i or ".f16" in i or ".bf16" in i for i in found), (op, found)
    if dtype == "float64":
        assert "add.f64" in ops["sum"] and "max.f64" in ops["max"] and "min.f64" in ops["min"]
        assert "div.rn.f64" in ops["avg"]  # one IEEE division of the sum by N (3: not a power of two)
    else:
        signed = "s" if dtype.startswith("int") else "u"
        width = max(16, 8 * DTYPES[dtype][1])  # PTX compares bytes as 16-bit values
        assert f"max.{signed}{width}" in ops["max"] and f"min.{signed}{width}" in ops["min"]
        assert not any(".f64" in i for found in ops.values() for i in found)


def test_lamport_kernels_and_integer_average_refuse_to_compile():
    from ubnext._protocol.errors import CudaError

    with pytest.raises(CudaError, match="the Lamport kernels carry 16- and 32-bit floating types only"):
        _compile("lamport_twoshot", "int32", "sum", 2)
    with pytest.raises(CudaError, match="avg takes floating-point types"):
        _kernels.compile_cubin("twoshot.cu", {**compile_defines("int64", "sum", 2), "UB_OP": "OpAvg"})


@pytest.mark.parametrize("algorithm", [name for name in KERNEL_ALGOS if ALGORITHMS[name].multicast])
@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
def test_multicast_instantiations_emit_multimem(algorithm, dtype):
    """The NVLS kernels really use the switch: multimem loads-with-reduce / stores / reds."""
    expected = {"nvls": ("multimem.ld_reduce", "multimem.st", "multimem.red"),
                "nvls_lamport": ("multimem.st",)}[algorithm]
    for op in OPS:
        if not ALGORITHMS[algorithm].supports(dtype, op):
            continue
        ptx = _compile(algorithm, dtype, op, 4, arch="compute_90a")
        found = {i for i in _ptx_instructions(ptx) if i.startswith("multimem.")}
        for prefix in expected:
            assert any(i.startswith(prefix) for i in found), f"{prefix} missing ({algorithm} {dtype} {op}): {found}"
        if algorithm == "nvls" and dtype != "float32":
            assert any(".acc::f32" in i for i in found), "16-bit sums must accumulate in fp32"
    unicast = _compile("twoshot" if algorithm == "nvls" else "lamport", dtype, "sum", 4, arch="compute_90a")
    assert not any(i.startswith("multimem.") for i in _ptx_instructions(unicast))


def _entry_ptx(ptx: bytes, entry: str) -> bytes:
    """The PTX of one entry point (from its .entry line to the next one)."""
    start = ptx.index(b".entry " + entry.encode() + b"(")
    end = ptx.find(b".entry ", start + 1)
    return ptx[start:end if end > 0 else None]


@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
def test_multicast_reduce_scatter_and_all_gather_use_the_switch(dtype):
    """NVLS reduce-scatter: multimem.ld_reduce (16-bit sums accumulating in fp32) and no
    multimem.st; all-gather: multimem.st and no ld_reduce; both the counting multimem.red
    barrier. Their unicast forms (the same templates) use no multimem instruction."""
    alg = ALGORITHMS["nvls"]
    ptx = _compile("nvls", dtype, "sum", 4, arch="compute_90a")
    rs = {i for i in _ptx_instructions(_entry_ptx(ptx, alg.rs_entry)) if i.startswith("multimem.")}
    ag = {i for i in _ptx_instructions(_entry_ptx(ptx, alg.ag_entry)) if i.startswith("multimem.")}
    assert any(i.startswith("multimem.ld_reduce") for i in rs), rs
    assert not any(i.startswith("multimem.st") for i in rs), rs
    assert any(i.startswith("multimem.st") for i in ag) and not any(i.startswith("multimem.ld_reduce") for i in ag), ag
    assert any(i.startswith("multimem.red") for i in rs) and any(i.startswith("multimem.red") for i in ag)
    if dtype != "float32":
        assert any(".acc::f32" in i for i in rs), "16-bit sums must accumulate in fp32"
    unicast = _compile("twoshot", dtype, "sum", 4, arch="compute_90a")
    for entry in (alg.rs_entry, alg.ag_entry):
        assert not any(i.startswith("multimem.") for i in _ptx_instructions(_entry_ptx(unicast, entry)))


def test_multicast_kernels_compile_for_sm100a_when_nvrtc_knows_it():
    from cuda.bindings import nvrtc

    from ubnext._environment.cuda import check

    archs = check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    if 100 not in archs:
        pytest.skip(f"this NVRTC does not target sm_100 (supports {archs})")
    for algorithm in ("nvls", "nvls_lamport"):
        assert _compile(algorithm, "bfloat16", "sum", 8, arch="sm_100a")[:4] == b"\x7fELF"


@pytest.mark.parametrize("dtype", list(KERNEL_DTYPES))
def test_separate_norm_kernel_compiles(dtype):
    cubin = _kernels.compile_cubin(NORM_SOURCE, norm_defines(dtype))
    assert NORM_ENTRY.encode() in cubin


@pytest.mark.parametrize("dtype", SLOT_SUM_DTYPES)
@pytest.mark.parametrize("slots", RANKS)
def test_slot_sum_kernel_compiles(dtype, slots):
    """The overlapped reduce-scatter's reduction, for every dtype and world size it sums,
    and its add + RMSNorm form in the same module for the dtypes that one takes (fp32
    statistics: not float64)."""
    cubin = _kernels.compile_cubin(SLOT_SUM_SOURCE, slot_sum_defines(dtype, slots))
    assert SLOT_SUM_ENTRY.encode() + b"\0" in cubin
    assert (SLOT_NORM_ENTRY.encode() + b"\0" in cubin) == (dtype in SLOT_NORM_DTYPES)
    assert set(SLOT_NORM_DTYPES) == set(KERNEL_DTYPES) < set(SLOT_SUM_DTYPES)


@pytest.mark.parametrize("dtype", ["int32", "int8", "uint64"])
def test_slot_sum_takes_floating_dtypes_only(dtype):
    with pytest.raises(ValueError, match="the slot sum takes"):
        slot_sum_defines(dtype, 2)


def test_compile_error_carries_the_log(monkeypatch):
    from ubnext._protocol.errors import CudaError

    monkeypatch.setattr(_kernels, "source", lambda name: "this is not CUDA")
    with pytest.raises(CudaError, match="nvrtcCompileProgram"):
        _compile("lamport", "float32", "sum", 2)


def test_sources_are_self_contained_with_the_generated_protocol_header():
    header = _protocol.header()
    for name in (*(a.source for a in ALGORITHMS.values() if a.is_kernel), NORM_SOURCE, SLOT_SUM_SOURCE):
        text = _kernels.source(name)
        assert "#include" not in text
        assert header.split("#pragma once\n")[1] in text, f"{name} lacks the generated protocol header"
    assert f"#define UB_MAX_RANKS {MAX_RANKS}\n" in header and f"#define UB_NORM_THREADS {NORM_THREADS}\n" in header
    assert f"#define UB_SLOT_SUM_THREADS {SLOT_SUM_THREADS}\n" in header
    for source, threads in _protocol.THREADS.items():
        assert f"#define UB_{source[:-3].upper()}_THREADS {threads}\n" in header
    # the separate kernel's vectors per thread (ubnext._engine.epilogue) are the ones it keeps
    norm = _kernels.source(NORM_SOURCE)
    assert "#ifndef UB_ROW_KEEP" in norm and norm_defines("bfloat16")["UB_ROW_KEEP"] == str(ROW_KEEP)
    # and so are the slot sum + add + RMSNorm's (ubnext._engine.slot_sum)
    assert "#ifndef UB_ROW_KEEP" in _kernels.source(SLOT_SUM_SOURCE)
    assert slot_sum_defines("bfloat16", 4)["UB_ROW_KEEP"] == str(SLOT_NORM_ROW_KEEP)


def test_no_protocol_constant_is_written_in_a_kernel_file():
    """The kernel files take every protocol constant from the generated header: none defines
    one of its macros or structs or spells the sentinel's bits."""
    import re

    header = _protocol.header()
    macros = re.findall(r"^#define (\w+)", header, re.M)
    names = macros + ["WaitSite", "LaunchState", "ErrorRecord"] + [n for n, _ in _protocol.WAIT_SITES.values()]
    for path in _kernels.kernel_dir().iterdir():
        code = re.sub(r"//[^\n]*", "", path.read_text())  # comments may name them
        for name in macros:
            assert not re.search(rf"#\s*(define|ifndef)\s+{name}\b", code), f"{path.name} defines {name}"
        for name in names[len(macros):]:
            assert not re.search(rf"\b(struct|enum)\s+{name}\b", code), f"{path.name} declares {name}"
        for value in _protocol.SENTINEL_BITS.values():
            assert not re.search(rf"\b{value:#x}u?\b", code, re.I), f"{path.name} spells the sentinel {value:#x}"
        for code_value, (name, _) in _protocol.WAIT_SITES.items():
            assert not re.search(rf"{name}\s*=", code), f"{path.name} gives {name} a value"


def test_protocol_structs_have_the_host_layout():
    import ctypes

    from ubnext._engine import failures as _failures

    assert _protocol.LAUNCH_STATE_BYTES == 56 and _protocol.struct_bytes(_protocol.ERROR_RECORD) == 40
    assert [f for f, _ in _failures._Record._fields_] == [f for _, f, _ in _protocol.ERROR_RECORD]
    for _, field, _ in _protocol.ERROR_RECORD:  # ctypes lays the record out as the compiler does
        assert getattr(_failures._Record, field).offset == _protocol.field_offset(_protocol.ERROR_RECORD, field)
    assert ctypes.sizeof(_failures._Record) == 40
    assert _protocol.field_offset(_protocol.LAUNCH_STATE, "record") == 24
    assert _protocol.field_offset(_protocol.LAUNCH_STATE, "entered_ns") == 48
    header = _protocol.header()  # the kernels compile it with these sizes asserted
    assert 'static_assert(sizeof(LaunchState) == 56, "LaunchState layout");' in header
    assert 'static_assert(sizeof(ErrorRecord) == 40, "ErrorRecord layout");' in header
    assert _protocol.sentinel_word(2) == 0x80008000 and _protocol.sentinel_word(4) == 0x80000000


@pytest.mark.parametrize("max_kb", [1, 7, 64, 16384])
def test_lamport_twoshot_area_holds_every_rounded_slice(max_kb):
    # kernels/lamport_twoshot.cu: N slots of round_up(ceil(nvec / N), UB_TWOSHOT_ALIGN_VECS)
    # vectors, then N signature headers at the end of the reduce-scatter area
    unit = _protocol.TWOSHOT_ALIGN_VECS
    area = _heap.area(max_kb * 1024)
    for nranks in range(1, MAX_RANKS + 1):
        for nbytes in {b for b in (1, 16, 17, 4096, max_kb * 1024 - 2, max_kb * 1024) if b <= max_kb * 1024}:
            nvec = -(-nbytes // 16)
            slice_vecs = -(-(-(-nvec // nranks)) // unit) * unit
            assert nranks * slice_vecs * 16 + nranks * _protocol.HEADER_BYTES <= area, (nranks, nbytes)
    assert area % _protocol.HEADER_BYTES == 0  # the headers at its end start lines of their own


@pytest.mark.parametrize("max_kb", [64, 2048, 16384])
@pytest.mark.parametrize("row_bytes", [1024, 8192, 16384, 65536])
def test_fused_lamport_twoshot_takes_its_largest_message_in_one_launch(max_kb, row_bytes):
    # rows of >= 1 KiB: the all-gather area has room for their scales at the full message
    rows = max_kb * 1024 // row_bytes
    area = _heap.area(max_kb * 1024)
    for nranks in range(1, MAX_RANKS + 1):
        whole = rows // nranks * nranks
        took = _heap.twoshot_norm_rows(area, row_bytes, nranks)
        assert took >= whole and took % nranks == 0, (nranks, took, whole)
        # the kernel's bound: nranks slots of took / nranks rows, each with a 16-byte scale
        # (all-gather area), and nranks signature headers after the slots (reduce-scatter area)
        assert took * (row_bytes + 16) <= area
        assert took * row_bytes + nranks * _protocol.HEADER_BYTES <= area


def test_compile_defines_cover_the_table():
    for dtype in DTYPES:
        for op in OPS:
            d = compile_defines(dtype, op, 4)
            assert d["UB_NRANKS"] == "4" and d["UB_OP"].startswith("Op") and d["UB_TRANSPORT"] == "Unicast"
            assert d["UB_T"] == DTYPES[dtype][0]
    assert {DTYPES[d][0] for d in TWOSHOT_ONLY_DTYPES} == {"double", "i8", "u8", "i32", "u32", "i64", "u64"}
    assert compile_defines("float32", "sum", 4, "multicast")["UB_TRANSPORT"] == "Multicast"
    assert _kernels.options({"B": "2", "A": "1"})[-2:] == ("-DA=1", "-DB=2")


def test_separate_norm_kernel_compiles_without_clusters_for_sm80():
    """The row groups' cluster code is guarded by the architecture: the separate norm
    kernel (every NVLink GPU's unfused path) still compiles for sm_80."""
    cubin = _kernels.compile_cubin(NORM_SOURCE, norm_defines("bfloat16"), arch="sm_80")
    assert NORM_ENTRY.encode() in cubin


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 33, 66, 67, 1000])
@pytest.mark.parametrize("vectors", [16, 64, 100, 1024, 2048, 8192])
@pytest.mark.parametrize("largest", [8, 4])
def test_row_cluster_spreads_few_rows_over_clusters(rows, vectors, largest):
    """A fused Lamport launch of a few rows too long for one block's threads splits each
    row over a cluster of blocks: never more blocks than the launch may use, never more
    than ``largest`` per cluster (8: one-shot, 4: two-shot), never less than 4 warps of
    vectors per block, never more than 32 warps per cluster (kernels/rmsnorm.cuh: row_sum)."""
    from ubnext._engine.engine import CLUSTER_BLOCK_VECTORS, row_cluster
    from ubnext._protocol.algorithms import row_threads

    blocks = 132
    cluster = row_cluster(rows, vectors, blocks, largest)
    assert cluster in (1, 2, 4, 8) and cluster <= largest
    if cluster > 1:
        assert rows * cluster <= blocks and vectors >= max(cluster * CLUSTER_BLOCK_VECTORS, NORM_THREADS)
    if cluster < largest:  # a block covers the row with a vector per thread, or no larger cluster fits
        assert (vectors < NORM_THREADS or rows * cluster * 2 > blocks
                or vectors < cluster * 2 * CLUSTER_BLOCK_VECTORS)
    threads = row_threads(vectors, cluster)
    assert threads % 32 == 0 and cluster * threads <= NORM_THREADS
    assert cluster * threads >= min(vectors, NORM_THREADS) or threads == 32


def test_row_cluster_examples():
    from ubnext._engine.engine import TWOSHOT_MAX_CLUSTER, row_cluster

    assert row_cluster(1, 1024, 132) == 8  # one token of hidden 8192 bf16: 8 SMs
    assert row_cluster(16, 1024, 132) == 8
    assert row_cluster(17, 1024, 132) == 4
    assert row_cluster(1, 512, 132) == 1  # hidden 4096 bf16: a block's threads cover it
    assert row_cluster(1, 2048, 132) == 8  # hidden 16384 bf16
    assert row_cluster(1, 16, 132) == 1  # hidden 128 bf16: one block is plenty
    assert row_cluster(100, 1024, 132) == 1
    assert row_cluster(8, 1024, 132, TWOSHOT_MAX_CLUSTER) == 4  # 32 tokens over 4 ranks
    assert row_cluster(34, 1024, 132, TWOSHOT_MAX_CLUSTER) == 2


def test_row_launch_of_the_separate_kernel_and_the_slot_sum_norm():
    """One row per block: a thread per vector of a row while a full block on every SM
    covers the array, else the kernel's kept vectors per thread (ROW_KEEP for the separate
    kernel, SLOT_NORM_ROW_KEEP for the slot sum + add + RMSNorm), at most the blocks the
    SMs hold at once."""
    from ubnext._engine.epilogue import row_launch

    assert row_launch(1, 1024, 132, ROW_KEEP) == (1, 1024)  # hidden 8192 bf16, one token
    assert row_launch(132, 1024, 132, ROW_KEEP) == (132, 1024)
    assert row_launch(133, 1024, 132, 4) == (133, 256)
    assert row_launch(1000, 1024, 132, 2) == (528, 512)  # 4 blocks of 512 threads per SM
    assert row_launch(5000, 1024, 132, 4) == (1056, 256)
    assert row_launch(3, 2, 132, 4) == (3, 32)  # a warp at least
    assert row_launch(1, 4096, 132, 4) == (1, NORM_THREADS)  # hidden 32768 bf16: 4 vectors a thread


def test_lamport_twoshot_narrow_blocks_where_threads_get_two_or_three_vectors():
    """Plain Lamport two-shot launches run on NARROW_THREADS threads per block exactly where
    a block's part of a slice (32-vector units, as kernels/lamport_twoshot.cu's
    block_part) gives each of them 2 or 3 vectors."""
    from ubnext._engine.engine import NARROW_THREADS, lamport_twoshot_threads

    mib = (1 << 20) // 16  # vectors per MiB
    assert lamport_twoshot_threads(2 * mib, 4, 132, 512) == NARROW_THREADS  # 2 MiB, 4 ranks: parts of 256
    assert lamport_twoshot_threads(3 * mib, 4, 132, 512) == NARROW_THREADS  # parts of 384
    assert lamport_twoshot_threads(1 * mib, 4, 132, 512) == 512  # parts of 128: a vector per thread
    assert lamport_twoshot_threads(4 * mib, 4, 132, 512) == 512  # parts of 512
    assert lamport_twoshot_threads(1 * mib, 2, 132, 512) == NARROW_THREADS  # 2 ranks, 1 MiB: 256
    assert lamport_twoshot_threads(2 * mib, 2, 132, 512) == 512
    def up(value, to):
        return -(-value // to) * to

    for nvec in range(1, 8 * mib, 997):
        for nranks, blocks in ((2, 132), (4, 132), (8, 100)):
            part = up(-(-up(-(-nvec // nranks), 32) // blocks), 32)  # one block's part of a slice
            fewest, most = part // NARROW_THREADS, -(-part // NARROW_THREADS)  # vectors of a thread
            narrow = lamport_twoshot_threads(nvec, nranks, blocks, 512) == NARROW_THREADS
            assert narrow == (fewest >= 2 and most <= 3)


@pytest.mark.parametrize("algorithm", [name for name in KERNEL_ALGOS if ALGORITHMS[name].pushed])
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_fused_lamport_entry_carries_its_cluster_shape(algorithm, cluster):
    """The engine launches a fused Lamport kernel in clusters by a plain cuLaunchKernel, so
    the entry point compiled for ``cluster`` must require that cluster shape; its launch
    bound is a cluster's share of NORM_THREADS, which row_threads never exceeds (checked
    with row_cluster below)."""
    import re

    alg = ALGORITHMS[algorithm]
    ptx = _kernels.compile_cubin(alg.source, compile_defines("bfloat16", "sum", 4, alg.transport, cluster),
                                 arch="compute_90a").decode(errors="replace")
    head = re.search(r"\.entry " + alg.norm_entry + r"\(.*?\)(.*?)\{", ptx, re.S).group(1)
    assert re.search(r"\.maxntid (\d+)", head).group(1) == str(NORM_THREADS // cluster)
    required = re.search(r"\.reqnctapercluster (\d+), 1, 1", head)
    assert (required and int(required.group(1))) == (cluster if cluster > 1 else None)
    plain = re.search(r"\.entry " + alg.entry + r"\(.*?\)(.*?)\{", ptx, re.S).group(1)
    assert ".reqnctapercluster" not in plain


def test_cluster_instantiation_refuses_pre_hopper_targets():
    from ubnext._protocol.errors import CudaError

    with pytest.raises(CudaError, match="sm_90 or newer"):
        _kernels.compile_cubin("lamport.cu", compile_defines("bfloat16", "sum", 4, cluster=8), arch="sm_80")


def test_launcher_packs_every_parameter_where_its_pointer_says(monkeypatch):
    """Each kernel parameter lives in its own slot, addressed by the pointer array the
    driver reads: constants written once, the varying ones on every call; a failed
    launch raises CudaError naming the call."""
    import ctypes
    import types

    from ubnext._engine import launch as _launch
    from ubnext._engine.launch import F32, I32, U64, Launcher
    from ubnext._protocol.errors import CudaError

    class DriverError(Exception):
        def __init__(self, status):
            self.status = status

    launches = []

    def launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        pointers = (ctypes.c_void_p * 7).from_address(params)
        kinds = (U64, I32, U64, I32, F32, U64, U64)
        launches.append(((func, gx, bx, stream), tuple(k.from_address(p).value for k, p in zip(kinds, pointers))))
        if stream == 666:
            raise DriverError(400)

    monkeypatch.setattr(_launch, "_cupy_driver", types.SimpleNamespace(launchKernel=launch_kernel,
                                                                       CUDADriverError=DriverError))
    kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00))
    launcher = Launcher(kernel, (U64, I32, U64, I32, F32, U64, U64), prefix=(1 << 40, -3), suffix=(9, 2**64 - 1))
    launcher(5, 256, 77, 0xABC0, 12, 0.5)
    launcher(6, 128, 78, 0xDEF0, 7, -2.25)
    assert launches == [((0xF00, 5, 256, 77), (1 << 40, -3, 0xABC0, 12, 0.5, 9, 2**64 - 1)),
                        ((0xF00, 6, 128, 78), (1 << 40, -3, 0xDEF0, 7, -2.25, 9, 2**64 - 1))]
    with pytest.raises(CudaError, match="cuLaunchKernel") as info:
        launcher(1, 32, 666, 0, 0, 0.0)
    assert info.value.code == 400 and "UBNEXT_PDL" not in str(info.value)  # no dependent launch to turn off


def test_a_dependent_launcher_asks_for_programmatic_serialization_and_packs_alike(monkeypatch):
    """A dependent launcher (Config.pdl) launches through cuLaunchKernelEx with the
    programmatic stream-serialization attribute, its grid, block and stream, and the same
    argument pack as a plain one; a call plan's Packed launch too; a failed launch raises
    CudaError naming cuLaunchKernelEx."""
    import types

    from stream_fakes import PROGRAMMATIC, read_launch_config, read_pack

    from ubnext._engine import launch as _launch
    from ubnext._engine.launch import U64, Launcher, Packed
    from ubnext._protocol.errors import CudaError

    launches = []

    def launch_ex(config_ptr, func, pack_ptr, extra):
        blocks, threads, stream, attributes = read_launch_config(config_ptr)
        launches.append((func, blocks, threads, stream, attributes, extra, tuple(read_pack(pack_ptr, 4))))
        return 700 if stream == 666 else 0

    monkeypatch.setattr(_launch, "_launch_ex", launch_ex)
    monkeypatch.setattr(_launch, "_cupy_driver", None)  # a plain launch would fail
    kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00))
    launcher = Launcher(kernel, (U64,) * 4, prefix=(1,), suffix=(4,), dependent=True)
    launcher(5, 256, 77, 2, 3)
    planned = Packed(launcher, 7, 128, (20, 30))
    launcher(6, 64, 78, 12, 13)  # the plan keeps its own pack and config
    planned(79)
    planned(80)
    assert launches == [(0xF00, 5, 256, 77, PROGRAMMATIC, None, (1, 2, 3, 4)),
                        (0xF00, 6, 64, 78, PROGRAMMATIC, None, (1, 12, 13, 4)),
                        (0xF00, 7, 128, 79, PROGRAMMATIC, None, (1, 20, 30, 4)),
                        (0xF00, 7, 128, 80, PROGRAMMATIC, None, (1, 20, 30, 4))]
    for failing in (lambda: launcher(1, 32, 666, 0, 0), lambda: Packed(launcher, 1, 32, (0, 0))(666)):
        with pytest.raises(CudaError, match="cuLaunchKernelEx: .*programmatic dependent launch.*UBNEXT_PDL=0") as info:
            failing()
        assert info.value.code == 700


def test_the_launch_config_has_cuda_h_layout(tmp_path):
    """LaunchConfig and LaunchAttribute (ubnext._engine.launch) have the sizes and offsets
    of cuda.h's CUlaunchConfig and CUlaunchAttribute, and the attribute id is cuda.h's."""
    import shutil
    import subprocess

    from ubnext._engine.launch import PROGRAMMATIC_STREAM_SERIALIZATION, SHAPE_AND_STREAM, LaunchAttribute, LaunchConfig

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc on PATH (cuda.h and its host compiler)")
    fields = ("gridDimX", "blockDimX", "sharedMemBytes", "hStream", "attrs", "numAttrs")
    program = tmp_path / "layout.c"
    program.write_text("#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\nint main(void) {\n"
                       + "".join(f'  printf("%zu\\n", offsetof(CUlaunchConfig, {f}));\n' for f in fields)
                       + '  printf("%zu\\n%zu\\n%zu\\n%d\\n", sizeof(CUlaunchConfig), sizeof(CUlaunchAttribute), '
                         "offsetof(CUlaunchAttribute, value), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
                         "  return 0;\n}\n")
    built = subprocess.run([nvcc, str(program), "-o", str(tmp_path / "layout")],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    printed = [int(v) for v in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                                              check=True).stdout.split()]
    ours = [getattr(LaunchConfig, f).offset for f in fields] + [
        ctypes_sizeof(LaunchConfig), ctypes_sizeof(LaunchAttribute), LaunchAttribute.value.offset,
        PROGRAMMATIC_STREAM_SERIALIZATION]
    assert ours == printed
    assert SHAPE_AND_STREAM.size == LaunchConfig.attrs.offset  # grid .. stream, as one pack


def test_compile_module_compiles_without_flush_to_zero_caches_and_loads_the_cubin(monkeypatch, tmp_path):
    """Kernels compile with CI's options for the device's real architecture (CuPy's own
    compile would add -ftz=true: subnormals flushed), are cached on disk under CuPy's cache
    directory, compiled once per text and options, and loaded from the cubin."""
    import types

    import cupy

    from ubnext._environment import cuda as _cuda

    compiled, loaded = [], []
    real = _cuda.nvrtc_compile

    def counting(text, name, opts):
        compiled.append(opts)
        return real(text, name, opts)

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cuda, "nvrtc_compile", counting)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(compute_capability="90"))
    monkeypatch.setattr(cupy, "RawModule", lambda path: loaded.append(path) or types.SimpleNamespace(module=path))
    for _ in range(2):
        _kernels.compile_module(NORM_SOURCE, norm_defines("bfloat16"), 0)
    assert len(compiled) == 1 and "--gpu-architecture=sm_90" in compiled[0]
    assert not any("ftz" in o or "fast-math" in o for o in compiled[0])
    assert loaded[0] == loaded[1] and loaded[0].startswith(str(tmp_path / "ubnext"))
    assert open(loaded[0], "rb").read()[:4] == b"\x7fELF"  # a cubin
    _kernels.compile_module(NORM_SOURCE, norm_defines("float16"), 0)  # other options: another file
    assert len(compiled) == 2 and len(set(loaded)) == 2


class _LoadError(Exception):
    """Stands for cupy.cuda.driver.CUDADriverError (which needs libcuda to be made)."""

    def __init__(self, status):
        super().__init__(f"CUDA_ERROR_INVALID_IMAGE ({status})")
        self.status = status


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """compile_module with its cache in tmp_path, a device of compute capability
    ``cache.arch``, its compilations counted (``cache.compiled``: their options) and a
    RawModule whose load fails (_LoadError 200) unless its file starts as a cubin or PTX
    does (``cache.loads``: the files loaded, in order)."""
    import types

    import cupy

    from ubnext._environment import cuda as _cuda

    state = types.SimpleNamespace(arch="90", compiled=[], loads=[], root=tmp_path / "ubnext")
    real = _cuda.nvrtc_compile

    def counting(text, name, opts):
        state.compiled.append(opts)
        return real(text, name, opts)

    class RawModule:
        def __init__(self, path):
            self.path = path

        @property
        def module(self):
            state.loads.append(self.path)
            if not open(self.path, "rb").read().startswith((b"\x7fELF", b"//")):
                raise _LoadError(200)
            return self.path

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cuda, "nvrtc_compile", counting)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(compute_capability=state.arch))
    monkeypatch.setattr(cupy, "RawModule", RawModule)
    monkeypatch.setattr(cupy.cuda.driver, "CUDADriverError", _LoadError)
    return state


def test_a_failed_cache_write_leaves_no_temporary_file(cache, monkeypatch):
    import os

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        _kernels.compile_module(NORM_SOURCE, norm_defines("bfloat16"), 0)
    assert list(cache.root.iterdir()) == []


def test_a_cached_file_that_does_not_load_is_compiled_again_once(cache, monkeypatch):
    """A truncated cubin in the cache is compiled again and replaced, loaded at once
    (RawModule loads lazily); where the new image does not load either, CudaError names
    the load, the kernel and the architecture."""
    from ubnext._environment import cuda as _cuda
    from ubnext._protocol.errors import CudaError

    module = _kernels.compile_module(NORM_SOURCE, norm_defines("bfloat16"), 0)
    (path,) = cache.root.iterdir()
    good = path.read_bytes()
    path.write_bytes(b"\0" * 100)  # truncated: no ELF header
    again = _kernels.compile_module(NORM_SOURCE, norm_defines("bfloat16"), 0)
    assert len(cache.compiled) == 2 and path.read_bytes() == good
    assert cache.loads == [str(path)] * 3 and again.path == module.path == str(path)
    assert [p.name for p in cache.root.iterdir()] == [path.name]  # replaced, no temporary left
    path.write_bytes(b"\0" * 100)
    monkeypatch.setattr(_cuda, "nvrtc_compile", lambda text, name, opts: b"\0" * 10)
    with pytest.raises(CudaError, match=r"cuModuleLoad: .*rmsnorm.* compiled for --gpu-architecture=sm_90 .* does "
                                        r"not load") as info:
        _kernels.compile_module(NORM_SOURCE, norm_defines("bfloat16"), 0)
    assert info.value.code == 200


def test_a_gpu_newer_than_nvrtc_gets_ptx_of_the_newest_architecture_it_knows(cache):
    """An architecture NVRTC does not know (a GPU newer than it) compiles to PTX for the
    newest one it knows, which the driver compiles; one older than every architecture it
    knows raises, naming both and NVRTC's version."""
    from cuda.bindings import nvrtc

    from ubnext._protocol.errors import CudaError

    known = nvrtc.nvrtcGetSupportedArchs()[1]
    assert _kernels.target(90) == "sm_90" and _kernels.target(max(known) + 1) == f"compute_{max(known)}"
    cache.arch = str(max(known) + 1)
    module = _kernels.compile_module(NORM_SOURCE, norm_defines("bfloat16"), 0)
    assert cache.compiled[-1][-1] == f"--gpu-architecture=compute_{max(known)}"
    assert module.path.endswith(".ptx") and open(module.path, "rb").read().startswith(b"//")
    with pytest.raises(CudaError, match=rf"NVRTC \d+\.\d+ compiles for sm_{min(known)} to sm_{max(known)}; "
                                        rf"this GPU is sm_{min(known) - 1}"):
        _kernels.target(min(known) - 1)


def ctypes_sizeof(struct_type) -> int:
    import ctypes

    return ctypes.sizeof(struct_type)


@pytest.mark.parametrize("source", sorted({a.source for a in ALGORITHMS.values() if a.is_kernel}
                                          | {NORM_SOURCE, SLOT_SUM_SOURCE, _quant.SOURCE}))
def test_every_entry_point_waits_for_the_kernel_before_it_and_nothing_flushes_subnormals(source):
    """Programmatic dependent launch lets a kernel start before the one before it on the
    stream has ended: in every entry point's PTX, the grid-dependency wait comes before
    every memory access but the parameters' loads and block 0's entry stamp (one store),
    and the trigger for dependents follows it. And no fp32 instruction flushes subnormals
    (.ftz): an all-reduce of subnormal values keeps them, as NCCL's and the host
    references do (bfloat16's kernels accumulate in fp32: one compile checks both)."""
    import re

    alg = next((a for a in ALGORITHMS.values() if a.is_kernel and a.source == source), None)
    defines = (compile_defines("bfloat16", "sum", 4, alg.transport) if alg else norm_defines("bfloat16")
               if source == NORM_SOURCE else slot_sum_defines("bfloat16", 4) if source == SLOT_SUM_SOURCE
               else _quant.compile_defines("int8", "bfloat16", "sum", 4))
    ptx = _kernels.compile_cubin(source, defines, arch="compute_90a").decode(errors="replace")
    assert not [line for line in ptx.splitlines() if ".ftz" in line]
    entries = re.findall(r"\.entry (\w+)\(", ptx)
    assert entries
    for entry in entries:
        body = _entry_ptx(ptx.encode(), entry).decode()
        body = body[body.index("{"):]
        wait = body.index("griddepcontrol.wait;")
        assert body.index("griddepcontrol.launch_dependents;") > wait
        before = [line.split()[0] for line in body[:wait].splitlines()
                  if re.match(r"\s*(ld|st|atom|red|multimem|cp|prefetch)\.", line)]
        stamps = [i for i in before if i.startswith("st.")]
        assert all(i.startswith("ld.param") for i in before if not i.startswith("st.")), (entry, before)
        stateless = entry in (NORM_ENTRY, SLOT_SUM_ENTRY, SLOT_NORM_ENTRY)  # no launch state to stamp
        assert stamps == (["st.relaxed.gpu.global.u64"] if "LaunchState" in _kernels.source(source)
                          and not stateless else []), (entry, stamps)


@pytest.mark.parametrize("algorithm", KERNEL_ALGOS)
def test_launch_bounds_admit_the_tables_block_size(algorithm):
    """The engine launches ``threads`` per block; the entry point's __launch_bounds__ must allow it."""
    import re

    alg = ALGORITHMS[algorithm]
    text = _kernels.source(alg.source)
    bound = re.search(r"__launch_bounds__\((\w+)(?:, \d+)?\)\s*\n\s*" + alg.entry + r"\(", text).group(1)
    assert int(re.search(rf"#define {bound} (\d+)", text).group(1)) == alg.threads


def test_cmake_compile_gate_builds_every_kernel(tmp_path):
    """CMakeLists.txt builds every kernels/*.cu with nvcc, with the protocol header it
    generates from ubnext/_protocol/constants.py (the compile gate beside NVRTC)."""
    import shutil
    import subprocess

    if shutil.which("cmake") is None or shutil.which("nvcc") is None:
        pytest.skip("needs cmake and nvcc on PATH")
    root = _kernels.kernel_dir().parent
    if not (root / "CMakeLists.txt").is_file():
        pytest.skip("CMakeLists.txt is not beside the kernels (an installed package)")
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(root), "-B", str(build), "-DUBNEXT_CUDA_ARCHS=90a"],
                ["cmake", "--build", str(build), "-j", "2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    built = sorted(p.stem for p in (build / "sm_90a").glob("*.cubin"))
    assert built == sorted(p.stem for p in _kernels.kernel_dir().glob("*.cu"))
    assert (build / "include" / "protocol.h").read_text() == _protocol.header()


@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot"])
def test_deterministic_mode_compiles_into_every_kernel(algorithm):
    """Config.deterministic reaches the kernels as UB_DETERMINISTIC, plain and fused."""
    alg = ALGORITHMS[algorithm]
    defines = compile_defines("bfloat16", "sum", 4, alg.transport, deterministic=True)
    assert defines["UB_DETERMINISTIC"] == "1" and compile_defines("bfloat16", "sum", 4)["UB_DETERMINISTIC"] == "0"
    cubin = _kernels.compile_cubin(alg.source, defines)
    assert alg.entry.encode() in cubin and alg.norm_entry.encode() in cubin
