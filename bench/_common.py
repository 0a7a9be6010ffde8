"""Shared pieces of the ubnext benchmarks, in the language of nccl-tests.

What ``common.cu`` is to nccl-tests: size lists (``-b/-e/-i/-f``), the
collective record, exactly checkable input data, the result table, the timing
harness, the combination of times over ranks (``-a``) and the JSON report
(``-J``). ``all_reduce_perf.py`` and ``compare.py`` are built from these.

The dependent-kernel mode (a GEMM produces each all-reduce's input) is here too:
its exactly known GEMM operands (:class:`GemmData`) and the GEMM's launch
(:func:`gemm_launcher`), shared by ``compare.py``, ``fused_perf.py`` and ``tp_block.py``;
its default shape, ``--gemm`` parsing, the subtraction of its samples
(:func:`dependent_samples`) and the GEMM launch on cupy arrays live in ``ubnext._tools.dependent``
(``python -m ubnext.tune --mode dependent`` uses them too) and are used from here.

The pure helpers need only numpy and ml_dtypes; everything that touches a
GPU (``device_bits``, ``upload``, ``poison``, ``download``, ``capture_graph``,
``elapsed_per_op``, ``device_line``, ``gemm_launcher``) imports cupy or torch when
called, so the helpers can be tested on a machine without a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ubnext._selection.table import human_bytes as human_bytes  # re-exported for bench scripts
from ubnext._tools import cli as _cli
from ubnext._tools import dependent as _dependent
from ubnext._tools import timing as _timing

# --------------------------------------------------------------------------- dtypes and ops


@dataclass(frozen=True)
class DType:
    """A floating-point type under its nccl-tests name.

    Attributes:
        name: nccl-tests name (``-d`` value and ``type`` column).
        ubnext: ubnext / NCCL-engine name.
        itemsize: bytes per element.
        bits: numpy unsigned type of the same width (bitwise checks).
        nan: a quiet NaN bit pattern (poisons outputs before a check).
        digits: significand bits, implicit bit included.
    """

    name: str
    ubnext: str
    itemsize: int
    bits: str
    nan: int
    digits: int

    @property
    def numpy(self) -> np.dtype:
        """numpy dtype (``ml_dtypes.bfloat16`` for bfloat16, as cupy uses)."""
        if self.ubnext == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.ubnext)


#: nccl-tests type names, in nccl-tests order ("-d all"), that ubnext implements.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("half", "float16", 2, "uint16", 0x7E00, 11),
        DType("float", "float32", 4, "uint32", 0x7FC00000, 24),
        DType("bfloat16", "bfloat16", 2, "uint16", 0x7FC0, 8),
    )
}
_DTYPE_ALIASES = {"float16": "half", "fp16": "half", "float32": "float", "fp32": "float", "bf16": "bfloat16"}

#: nccl-tests op names, in nccl-tests order ("-o all"), that ubnext implements.
OPS = ("sum", "max", "min", "avg")
_NCCL_TESTS_ONLY_OPS = ("prod", "mulsum")


def parse_dtypes(text: str) -> list[DType]:
    """``-d`` value -> dtypes: a nccl-tests name (or alias such as ``bf16``) or ``all``.

    Raises:
        ValueError: unknown name.
    """
    if text == "all":
        return list(DTYPES.values())
    name = _DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise ValueError(f"datatype {text!r} is not supported; use one of {', '.join(DTYPES)} or all")
    return [DTYPES[name]]


def parse_ops(text: str) -> list[str]:
    """``-o`` value -> op names: ``sum``, ``max``, ``min``, ``avg`` or ``all``.

    Raises:
        ValueError: unknown op, or a nccl-tests op ubnext does not implement.
    """
    if text == "all":
        return list(OPS)
    if text in _NCCL_TESTS_ONLY_OPS:
        raise ValueError(f"op {text!r} is not implemented by ubnext; use one of {', '.join(OPS)} or all")
    if text not in OPS:
        raise ValueError(f"op {text!r} is not supported; use one of {', '.join(OPS)} or all")
    return [text]


# --------------------------------------------------------------------------- sizes and timing
# They live in ubnext (python -m ubnext.tune uses them too); the benchmarks use them from here.

parse_size, size_arg, size_list = _cli.parse_size, _cli.size_arg, _cli.size_list
capture_graph, elapsed_per_op, timer = _timing.capture_graph, _timing.elapsed_per_op, _timing.timer
run_or_abort = _cli.run_or_abort


# --------------------------------------------------------------------------- the collective record


def all_reduce_data(nranks: int, rank: int, count: int, seed: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s all-reduce input of ``count`` elements and the exact result
    (:func:`make_input`, :func:`expected_output`)."""
    return make_input(rank, nranks, count, seed), expected_output(nranks, count, seed, op)


@dataclass(frozen=True)
class Collective:
    """What a benchmark needs to know about one collective (nccl-tests' ``testColl``).

    Attributes:
        name: display name, e.g. ``"AllReduce"``.
        count: ``(nbytes, itemsize, nranks) -> elements`` of a message of ``nbytes`` (the
            table's count: the larger buffer's).
        bus_factor: ``nranks -> busbw / algbw``.
        run: ``(engine, send, recv, dtype, op, stream) -> None`` enqueues one operation.
        buffers: ``(count, nranks) -> (send, recv)`` elements (default: the all-reduce's).
        in_place: ``(count, nranks, rank) -> (send, recv)`` offsets, in elements, in the one
            buffer of an in-place call (default: both at 0).
        data: ``(nranks, rank, count, seed, op) -> (this rank's input, its exact output)``
            (default :func:`all_reduce_data`).
        reduces: whether it takes a reduction op (nccl-tests prints ``none`` otherwise).
        quantized: ``(inputs, format, op, rank) -> rank's output`` of ubnext's quantized form
            in that format (``--precision``), from every rank's input, bit for bit; None:
            the collective has none.
        root: the root rank (the table's ``root`` column; -1: none).
        has_in_place: whether it has an in-place form (else the in-place columns read N/A).
    """

    name: str
    count: Callable[[int, int, int], int]
    bus_factor: Callable[[int], float]
    run: Callable[..., None]
    buffers: Callable[[int, int], tuple[int, int]] = lambda count, nranks: (count, count)
    in_place: Callable[[int, int, int], tuple[int, int]] = lambda count, nranks, rank: (0, 0)
    data: Callable[..., tuple[np.ndarray, np.ndarray]] = all_reduce_data
    reduces: bool = True
    quantized: Callable[..., np.ndarray] | None = None
    root: int = -1
    has_in_place: bool = True

    def bandwidths(self, nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
        """``(algbw, busbw)`` in GB/s (10^9 bytes) for ``nbytes`` moved in ``seconds``."""
        algbw = nbytes / 1e9 / seconds if seconds > 0 else 0.0
        return algbw, algbw * self.bus_factor(nranks)


def sliced(name: str, run: Callable[..., None], data: Callable[..., tuple[np.ndarray, np.ndarray]],
           gathers: bool, quantized: Callable[..., np.ndarray] | None = None) -> Collective:
    """A collective with a side of size x k elements and a side of k, as nccl-tests'
    reduce_scatter (``gathers`` False: the input is the larger side) and all_gather
    (``gathers``: the output is): counts of the larger side, rounded down to a multiple of
    the world size; in place, the smaller side is rank r's slice of the larger;
    busbw = algbw * (n-1)/n; ``quantized`` as Collective takes it."""
    def buffers(count: int, nranks: int) -> tuple[int, int]:
        return (count // nranks, count) if gathers else (count, count // nranks)

    def in_place(count: int, nranks: int, rank: int) -> tuple[int, int]:
        return (rank * (count // nranks), 0) if gathers else (0, rank * (count // nranks))

    return Collective(name=name, count=lambda nbytes, itemsize, nranks: nbytes // itemsize // nranks * nranks,
                      bus_factor=lambda nranks: (nranks - 1) / nranks, run=run, buffers=buffers,
                      in_place=in_place, data=data, reduces=not gathers, quantized=quantized)


# --------------------------------------------------------------------------- exactly checkable data


def value_range(nranks: int) -> int:
    """Largest input magnitude ``m`` such that every partial sum over ranks is exact in bfloat16.

    Inputs are integers in ``[-m, m]``; any sum of up to ``nranks`` of them is
    an integer of magnitude <= 256, which bfloat16 (8 significant bits), half
    and float all represent exactly, in any reduction order.
    """
    return max(1, min(16, 256 // max(nranks, 1)))


def make_input(rank: int, nranks: int, count: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input: ``count`` integers in ``[-m, m]`` (int8), depending on rank, index and seed.

    The high bits of a Weyl sequence ``index * golden + offset(rank, seed)``
    spread the values, so a chunk that lands at the wrong offset or comes
    from the wrong rank is wrong with high probability. No value is -0.0 once
    converted to floating point. Costs a few passes over ``count`` uint32.
    """
    m = value_range(nranks)
    offset = (rank * 0x85EBCA6B + seed * 0xC2B2AE35 + 0x27D4EB2F) & 0xFFFFFFFF
    key = np.arange(count, dtype=np.uint32)
    key *= np.uint32(0x9E3779B1)  # wraps modulo 2**32, as intended
    key += np.uint32(offset)
    key >>= np.uint32(16)
    key *= np.uint32(2 * m + 1)  # (high 16 bits) * (2m + 1) / 2**16 is uniform in [0, 2m]
    key >>= np.uint32(16)
    values = key.astype(np.int8)
    values -= np.int8(m)
    return values


def expected_output(nranks: int, count: int, seed: int, op: str) -> np.ndarray:
    """The exact all-reduce of every rank's :func:`make_input`, in float64."""
    return reduce_exact((make_input(r, nranks, count, seed) for r in range(nranks)), nranks, count, op)


def reduce_exact(inputs: Any, nranks: int, count: int, op: str) -> np.ndarray:
    """The all-reduce of ``nranks`` integer arrays of ``count`` elements (an iterable), in float64."""
    inputs = iter(inputs)
    if op in ("sum", "avg"):
        total = np.zeros(count, dtype=np.int16)
        for x in inputs:
            total += x
        result = total.astype(np.float64)
        if op == "avg":
            result /= nranks
        return result
    reduce = np.maximum if op == "max" else np.minimum
    result = np.array(next(inputs), dtype=np.int16)
    for x in inputs:
        reduce(result, x, out=result)
    return result.astype(np.float64)


def reduce_scatter_data(nranks: int, rank: int, count: int, seed: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s reduce-scatter input (``count`` elements) and its slice of the exact result."""
    k = count // nranks
    return make_input(rank, nranks, count, seed), expected_output(nranks, count, seed, op)[rank * k:(rank + 1) * k]


def all_gather_data(nranks: int, rank: int, count: int, seed: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s all-gather input (``count / nranks`` elements) and every rank's, in rank order."""
    k = count // nranks
    parts = [make_input(r, nranks, k, seed) for r in range(nranks)]
    return parts[rank], np.concatenate(parts).astype(np.float64)


def tolerance(op: str, nranks: int, dtype: DType) -> float:
    """Allowed absolute error of one output element: 0 (bitwise) unless the op rounds.

    Only ``avg`` over a world size that is not a power of two rounds: ``1/n``
    is not representable, and NCCL pre-multiplies each input by it. The bound
    is ``nranks`` roundings of the largest input.
    """
    if op != "avg" or nranks & (nranks - 1) == 0:
        return 0.0
    return nranks * value_range(nranks) * 2.0 ** (1 - dtype.digits)


def encode(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Numbers (small integers, or float64 results) -> their bit patterns in ``dtype`` (unsigned ints).

    Converts through float32, which holds the inputs and every exact result
    here exactly (``avg`` over a world size that is not a power of two rounds;
    see :func:`tolerance`).
    """
    return values.astype(np.float32).astype(dtype.numpy).view(dtype.bits)


def count_wrong(got_bits: np.ndarray, want_bits: np.ndarray, dtype: DType, tol: float = 0.0) -> int:
    """Number of elements of ``got_bits`` that differ from ``want_bits``.

    With ``tol == 0`` the comparison is bitwise (NaN, -0.0 and every last bit
    count); otherwise values may differ by at most ``tol`` and NaN is wrong.
    """
    if tol == 0.0:
        return int(np.count_nonzero(got_bits != want_bits))
    got = got_bits.view(dtype.numpy).astype(np.float64)
    want = want_bits.view(dtype.numpy).astype(np.float64)
    return int(np.count_nonzero(~(np.abs(got - want) <= tol)))


# --------------------------------------------------------------------------- the nccl-tests table


def format_float(value: float, width: int) -> str:
    """A number in ``width`` columns with as many decimals as fit (nccl-tests' ``getFloatStr``)."""
    if not np.isfinite(value):
        return f"{value:>{width}}"
    power, bound = 0, 1
    while value >= bound:
        power += 1
        bound *= 10
    if power < width - 2:
        return f"{value:{width}.2f}"
    if power < width - 1:
        return f"{value:{width}.1f}"
    if power < width + 1:
        return f"{value:{width}.0f}"
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


def table_header(time_label: str = "time") -> list[str]:
    """The lines above the table: a ``#`` spacer, the placement line, column names, units."""
    blank = f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"
    names = ("size", "count", "type", "redop", "root")
    units = ("(B)", "(elements)", "", "", "")

    def columns(first: Sequence[str], a: str, b: str, c: str, d: str) -> str:
        lead = f"# {first[0]:>10}  {first[1]:>12}  {first[2]:>8}  {first[3]:>6}  {first[4]:>6}"
        half = f"  {a:>7}  {b:>6}  {c:>6}  {d:>6}"
        return lead + half + half + " "

    return [
        "#",
        blank + "           out-of-place                       in-place          ",
        columns(names, time_label, "algbw", "busbw", "#wrong"),
        columns(units, "(us)", "(GB/s)", "(GB/s)", ""),
    ]


def row_prefix(nbytes: int, count: int, type_name: str, op: str, root: int = -1) -> str:
    """The ``size count type redop root`` columns of one row."""
    return f"{nbytes:12d}  {count:12d}  {type_name:>8}  {op:>6}  {root:6d}"


def row_result(time_us: float, algbw: float, busbw: float, wrong: int | None) -> str:
    """The ``time algbw busbw #wrong`` columns of one placement (``wrong=None``: not checked)."""
    cells = f"  {format_float(time_us, 7)}  {format_float(algbw, 6)}  {format_float(busbw, 6)}"
    return cells + ("    N/A" if wrong is None else f"  {wrong:6g}")


def row_absent() -> str:
    """The ``time algbw busbw #wrong`` columns of a placement the backend does not run (N/A)."""
    return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"


def footer(failed_tests: int, avg_busbw: float, program: str) -> list[str]:
    """The summary lines below the table."""
    return [
        f"# {'Out of bounds values':<20} : {failed_tests} {'FAILED' if failed_tests else 'OK'}",
        f"# {'Avg bus bandwidth':<20} : {avg_busbw:g} ",
        "#",
        f"# Collective test concluded: {program}",
    ]


def device_properties(device: int) -> dict[str, Any]:
    """``cudaGetDeviceProperties`` of ``device`` (through cupy), with ``name`` as str."""
    import cupy

    props = dict(cupy.cuda.runtime.getDeviceProperties(device))
    if isinstance(props["name"], bytes):
        props["name"] = props["name"].decode()
    return props


def device_line(rank: int, device: int, group: int = 0) -> str:
    """``#  Rank  0 Group  0 Pid 123 on host device  0 [0000:18:00] NVIDIA H200`` for this process."""
    import socket

    props = device_properties(device)
    pci = f"{props['pciDomainID']:04x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}"
    host = socket.gethostname()
    return (f"#  Rank {rank:2d} Group {group:2d} Pid {os.getpid():6d} on {host:>10} "
            f"device {device:2d} [{pci}] {props['name']}")


_DEVICE_LINE = re.compile(
    r"#  Rank\s+(\d+) Group\s+(\d+) Pid\s+(\d+) on\s+(\S+) device\s+(\d+) \[([^\]]*)\] (.*)"
)


def parse_device_line(line: str) -> dict[str, Any]:
    """A :func:`device_line` as the JSON ``devices`` record nccl-tests writes."""
    rank, group, pid, host, device, pci, info = _DEVICE_LINE.match(line).groups()
    return {"rank": int(rank), "group": int(group), "pid": int(pid), "hostname": host,
            "device": int(device), "device_hex": pci, "device_info": info}


# --------------------------------------------------------------------------- combining over ranks

#: ``-a`` values, as in nccl-tests.
AVERAGE_MODES = {0: "rank 0", 1: "average", 2: "minimum", 3: "maximum"}


def combine(values: Sequence[float], mode: int) -> float:
    """One number from every rank's number, per nccl-tests' ``-a``: 0 rank 0, 1 mean, 2 min, 3 max."""
    if mode == 0:
        return float(values[0])
    if mode == 1:
        return float(sum(values) / len(values))
    if mode == 2:
        return float(min(values))
    if mode == 3:
        return float(max(values))
    raise ValueError(f"average mode must be one of {sorted(AVERAGE_MODES)}, got {mode}")


def allgather_float(bootstrap: Any, value: float) -> list[float]:
    """Every rank's ``value``. Collective over ``bootstrap``; blocks the host."""
    return [struct.unpack("<d", b)[0] for b in bootstrap.allgather(struct.pack("<d", value))]


# --------------------------------------------------------------------------- device harness


def device_bits(array: Any, count: int, dtype: DType) -> Any:
    """A cupy view of the first ``count`` elements of a cupy array or torch tensor, as unsigned bits."""
    import cupy

    if isinstance(array, cupy.ndarray):
        ptr, device = array.data.ptr, array.device.id
    else:  # a torch tensor
        ptr, device = array.data_ptr(), array.device.index
    mem = cupy.cuda.UnownedMemory(ptr, max(count * dtype.itemsize, 1), array, device_id=device)
    return cupy.ndarray((count,), dtype=dtype.bits, memptr=cupy.cuda.MemoryPointer(mem, 0))


def upload(array: Any, values: np.ndarray, dtype: DType, stream: Any) -> None:
    """Write float64 ``values`` into ``array`` (converted to ``dtype``), ordered on ``stream``."""
    device_bits(array, values.size, dtype).set(encode(values, dtype), stream=stream)


def poison(array: Any, count: int, dtype: DType, stream: Any) -> None:
    """Fill the first ``count`` elements of ``array`` with NaN, ordered on ``stream``."""
    with stream:
        device_bits(array, count, dtype).fill(dtype.nan)


def download(array: Any, count: int, dtype: DType, stream: Any) -> np.ndarray:
    """The bits of the first ``count`` elements of ``array`` after ``stream``'s work. Blocks the host."""
    host = device_bits(array, count, dtype).get(stream=stream)
    stream.synchronize()
    return host


# --------------------------------------------------------------------------- dependent-kernel mode
# What a tensor-parallel model runs: a GEMM writes the all-reduce's input, on the same stream,
# right before it (ubnext._tools.dependent: python -m ubnext.tune --mode dependent uses it too;
# the benchmarks use its shape, parsing, subtraction and cupy launch from here).

GEMM_SHAPE, parse_gemm, gemm_arg = _dependent.GEMM_SHAPE, _dependent.parse_gemm, _dependent.gemm_arg
dependent_samples = _dependent.dependent_samples


@dataclass(frozen=True)
class GemmData:
    """The operands of the dependent mode's GEMM ``C = A @ B`` (M x K times K x N), chosen so
    that C is exact small integers in every dtype and known on the host.

    B holds small integers, the same on every rank (:func:`make_input` values, bounded for
    ``nranks + 1`` terms, so a sum over ranks plus a residual stays exact). A has one 1 per
    row, at a column that depends on the rank: row i of rank r's C is row ``rows(r)[i]`` of
    B, every other product term is 0. A GEMM that ran, on the right data, is thus checkable
    bit for bit after the all-reduce.
    """

    shape: tuple[int, int, int]
    nranks: int
    seed: int = 1

    @property
    def elements(self) -> int:
        """M * N: the elements the GEMM writes."""
        return self.shape[0] * self.shape[2]

    @functools.cached_property
    def b(self) -> np.ndarray:
        """B, K x N small integers (int8)."""
        _, k, n = self.shape
        return make_input(self.nranks, self.nranks + 1, k * n, self.seed).reshape(k, n)

    def rows(self, rank: int) -> np.ndarray:
        """For each of the M rows of rank ``rank``'s A, the column holding its 1."""
        m, k, _ = self.shape
        return (np.arange(m, dtype=np.int64) * 2654435761 + rank * 40503 + self.seed * 97 + 1) % k

    def a(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s A, M x K zeros and ones (uint8)."""
        m, k, _ = self.shape
        a = np.zeros((m, k), dtype=np.uint8)
        a[np.arange(m), self.rows(rank)] = 1
        return a

    def product(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s C, flattened (M * N int8): what its GEMM writes."""
        return self.b[self.rows(rank)].reshape(-1)

    def inputs(self, rank: int, count: int) -> np.ndarray:
        """Rank ``rank``'s all-reduce input of ``count`` elements as the GEMM leaves it: C's
        first ``count`` elements where the message is smaller than C, else C followed by
        zeros (filled once; zeros stay zeros under an in-place all-reduce)."""
        out = np.zeros(count, dtype=np.int16)
        c = self.product(rank)[:count]
        out[:c.size] = c
        return out

    def expected(self, count: int, op: str) -> np.ndarray:
        """The exact all-reduce of every rank's :meth:`inputs`, in float64."""
        return reduce_exact((self.inputs(r, count) for r in range(self.nranks)), self.nranks, count, op)


def gemm_launcher(data: GemmData, rank: int, dtype: DType, use_torch: bool,
                  stream: Any = None) -> Callable[[Any], Callable[[], None]]:
    """Put rank ``rank``'s A and B of ``data`` on the current device once; returns ``into``.

    ``into(out)``, for a flat cupy array or torch tensor ``out`` of at least M * N
    elements, returns a launch of ``C = A @ B`` into ``out``'s first M * N elements
    (viewed M x N): ``torch.matmul(out=)`` on torch's current stream, or, where torch is
    not the benchmark's framework, torch's GEMM on the cupy arrays and ``stream``
    (``ubnext._tools.dependent.matmul_into``: cupy cannot call cuBLAS during capture).
    ``into`` runs the GEMM once eagerly, so cuBLAS picks its kernel and workspace before
    any capture.
    """
    m, k, n = data.shape
    if use_torch:
        import torch

        tdtype = getattr(torch, dtype.ubnext)
        device = torch.device("cuda", torch.cuda.current_device())
        a = torch.from_numpy(data.a(rank).astype(np.float32)).to(device=device, dtype=tdtype)
        b = torch.from_numpy(data.b.astype(np.float32)).to(device=device, dtype=tdtype)

        def into(out: Any) -> Callable[[], None]:
            if not isinstance(out, torch.Tensor):  # a cupy array: the same memory, through its bits
                out = torch.as_tensor(device_bits(out, data.elements, dtype).view(signed_name(dtype)),
                                      device=device).view(tdtype)
            c = out.view(-1)[:data.elements].view(m, n)

            def launch() -> None:
                torch.matmul(a, b, out=c)

            launch()
            return launch
    else:
        import cupy

        with stream:
            a = cupy.asarray(data.a(rank).astype(dtype.numpy))
            b = cupy.asarray(data.b.astype(dtype.numpy))

        def into(out: Any) -> Callable[[], None]:
            return _dependent.matmul_into(a, b, out, stream)
    return into


def signed_name(dtype: DType) -> str:
    """numpy name of the signed integer type as wide as ``dtype`` (torch reads those from cupy)."""
    return {2: "int16", 4: "int32"}[dtype.itemsize]


# --------------------------------------------------------------------------- JSON and process control


def environment_subset(environ: dict[str, str] | None = None) -> list[str]:
    """``NAME=value`` for the variables that shape a run (NCCL_*, UBNEXT_*, CUDA_*, TORCH_*).

    nccl-tests writes the whole environment; a results file committed to a
    repository should not, so only these prefixes are kept.
    """
    environ = os.environ if environ is None else environ
    keep = ("NCCL_", "UBNEXT_", "CUDA_", "TORCH_")
    return sorted(f"{k}={v}" for k, v in environ.items() if k.startswith(keep))


def now_string() -> str:
    """Local time as nccl-tests writes it: ``YYYY-MM-DD HH:MM:SS``."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def write_json(path: str, document: dict[str, Any], overwrite: bool = False) -> str:
    """Write ``document`` to ``path``; returns the path written.

    Like nccl-tests, an existing file is never overwritten unless asked:
    ``path.0``, ``path.1``, ... are tried instead.
    """
    candidate, n = path, 0
    while True:
        try:
            with open(candidate, "w" if overwrite else "x", encoding="utf-8") as f:
                json.dump(document, f, indent=1)
                f.write("\n")
            return candidate
        except FileExistsError:
            candidate, n = f"{path}.{n}", n + 1
