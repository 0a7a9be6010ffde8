"""How ``python -m ubnext.tune`` measures: each algorithm (and quantized format) of one
collective and dtype timed in CUDA graphs at every size, back to back or each call after
a GEMM; collective over the communicator's ranks."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, DTYPES, MOVER_SERVES, MOVERS
from ubnext._protocol.errors import CollectiveTimeoutError, CudaError, UbnextError
from ubnext._selection.table import human_bytes
from ubnext._tools.tune_table import Times


class Timed(NamedTuple):
    """One call's time at one size, µs: the median of ``--repeats`` samples, each the maximum
    over ranks. ``us`` is what is ranked: per call (graph mode), or per (GEMM, call) pair less
    the GEMM alone timed right after it (dependent mode, whose ``raw_us`` and ``gemm_us`` are
    the medians of those two; None in the graph mode)."""

    us: float
    raw_us: float | None = None
    gemm_us: float | None = None


@dataclasses.dataclass(frozen=True)
class Measured:
    """The times of one dtype and collective at the measured ``sizes`` (ascending; those of
    ``-b`` to ``-e`` with at least one element per rank): ``times``, the ranked
    (:attr:`Timed.us`), and in the dependent mode ``raw`` and ``gemm`` (empty in the graph mode),
    one per size."""

    sizes: list[int]
    times: list[Times]
    raw: list[Times] = dataclasses.field(default_factory=list)
    gemm: list[Times] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, sizes: Sequence[int], rows: Sequence[dict[str, Timed | None]], dependent: bool) -> Measured:
        """From each size's :class:`Timed` per name (None: refused), measured in the dependent
        mode or not."""
        def part(i: int) -> list[Times]:
            return [{name: None if t is None else t[i] for name, t in row.items()} for row in rows]

        return cls(list(sizes), part(0), part(1), part(2)) if dependent else cls(list(sizes), part(0))

    def record(self, winners: Sequence[str]) -> dict[str, Any]:
        """The measured record of one collective: sizes, winners and µs (:func:`_us`): the
        ranked, and in the dependent mode the raw and GEMM-alone ones."""
        return {"sizes": list(self.sizes), "winners": list(winners), "us": _us(self.times),
                **({"raw_us": _us(self.raw), "gemm_us": _us(self.gemm)} if self.raw else {})}


def _us(times: Sequence[Times]) -> dict[str, list[float | None]]:
    """The measured record's µs: algorithm or format -> its time at each size."""
    names = dict.fromkeys((*ALGORITHMS, *MOVERS, *_quant.FORMATS))
    return {n: [t.get(n) for t in times] for n in names if any(n in t for t in times)}


def time_algorithm(comm, stream, name: str, send, recv, args: argparse.Namespace,
                   collective: str = "all_reduce", gemm=None) -> Timed | None:
    """The time of ``comm.all_reduce(send, out=recv, algorithm=name)`` (``precision=name``
    where ``name`` is a quantized format; the call of another ``collective``, a data mover's
    included: :func:`caller`), or None when refused. Collective.

    Eager warm-up calls come first (compiling the kernel, connecting NCCL,
    outside any capture); a refusal there (the size exceeds the algorithm's
    limit) is the same on every rank, and the ranks check that it is.

    ``gemm`` (the dependent mode: a launch of the GEMM that writes the head of the buffer
    ``send`` views, :func:`gemm_into`) precedes each call, in the warm-up and in the graph;
    a graph of the GEMMs alone is sampled right after each sample of the pairs, and the
    difference ranked (:func:`ubnext._tools.dependent.dependent_samples`).
    """
    from ubnext._tools.dependent import dependent_samples
    from ubnext._tools.timing import timer

    call = {"precision": name} if name in _quant.FORMATS else {"algorithm": name}

    run = caller(comm, collective)

    def launch() -> None:
        run(send, recv, stream, call)

    def pair() -> None:
        gemm()
        launch()

    refused = None
    try:
        for _ in range(max(1, args.warmup)):
            (launch if gemm is None else pair)()
    except UbnextError as exc:
        if isinstance(exc, (CudaError, CollectiveTimeoutError)):
            raise
        refused = str(exc)
    verdicts = comm.bootstrap.allgather_obj(refused)
    if any(verdicts):
        if not all(verdicts):
            raise UbnextError(f"tune: ranks disagree whether {name} takes {send.size} elements: {verdicts}")
        return None

    def sampler(fn):
        """µs per launch of ``fn`` in one sample of its graph, the maximum over ranks."""
        sample = timer(fn, stream, args.iters, args.launches, comm.bootstrap.barrier)
        return lambda: max(comm.bootstrap.allgather_obj(sample())) * 1e6

    if gemm is None:
        sample = sampler(launch)
        return Timed(statistics.median(sample() for _ in range(args.repeats)))
    found = dependent_samples(sampler(pair), sampler(gemm), args.repeats)
    return Timed(*(statistics.median(found[key]) for key in ("times_us", "raw_us", "gemm_us")))


def buffers(dtype: str, args: argparse.Namespace, stream) -> tuple[Any, Any]:
    """The input and output cupy arrays of one dtype's calls, made on ``stream``: the
    largest size, and in the dependent mode at least the GEMM's output (M x N), which the
    input's head holds. The input holds values spread over [-0.5, 0.5), not zeros: the
    quantized kernels skip the arithmetic of a group of zeros, and would be timed faster
    than on a model's data."""
    import cupy
    import numpy as np

    from ubnext._interop.arrays import _cupy_dtype

    count = args.sizes[-1] // DTYPES[dtype][1]
    if args.mode == "dependent":
        count = max(count, args.gemm[0] * args.gemm[2])
    key = np.arange(count, dtype=np.uint32) * np.uint32(0x9E3779B1)  # a Weyl sequence
    values = (key >> np.uint32(16)).astype(np.float32) / np.float32(65536) - np.float32(0.5)
    if dtype == "bfloat16":  # its bits: the top half of the float32's (truncated: any values will do)
        values = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    elif dtype == "float16":
        values = values.astype(np.float16).view(np.uint16)
    with stream:  # the values ordered before the dependent mode's first GEMM on the stream
        send = cupy.empty((count,), dtype=_cupy_dtype(dtype))
        send.view(values.dtype).set(values, stream=stream)
        return send, cupy.empty_like(send)


def gemm_into(send, args: argparse.Namespace, stream):
    """The dependent mode's GEMM (``--gemm``) on ``stream``, writing the head of ``send``
    (:func:`ubnext._tools.dependent.matmul_into`; run once here), or None in the graph mode.
    Its operands give every output element 1 (A = 1/K, B = 1: exact where K is a power of
    two, bounded in every dtype, so no format quantizes infinities)."""
    if args.mode != "dependent":
        return None
    import cupy

    from ubnext._tools.dependent import matmul_into

    m, k, n = args.gemm
    with stream:
        a = cupy.full((m, k), 1 / k, dtype=send.dtype)
        b = cupy.ones((k, n), dtype=send.dtype)
    return matmul_into(a, b, send, stream)


def caller(comm, collective: str):
    """``run(send, recv, stream, kwargs)``: one call of ``collective`` on ``comm``, out of
    place: the reductions' ``comm.<collective>(send, out=recv, ...)``, the broadcast from
    root 0, the all-to-all with even splits, send/recv as a ring in one batch (this rank's
    send to the next rank, its receive from the previous one)."""
    if collective == "broadcast":
        return lambda send, recv, stream, kw: comm.broadcast(send, 0, out=recv, stream=stream, **kw)
    if collective == "send_recv":
        after, before = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        return lambda send, recv, stream, kw: comm.batch_isend_irecv(
            [("send", send, after), ("recv", recv, before)], stream=stream, **kw)
    run = getattr(comm, collective)
    return lambda send, recv, stream, kw: run(send, out=recv, stream=stream, **kw)


def candidates(comm, collective: str) -> list[str]:
    """The algorithms ``python -m ubnext.tune`` times for ``collective``: those the
    communicator can run that serve it, or a data mover's (``MOVER_SERVES``: its pool forms
    and NCCL, each refused where it cannot run)."""
    if collective in MOVER_SERVES:
        return list(MOVER_SERVES[collective])
    return [n for n in comm.algorithms() if ALGORITHMS[n].serves(collective)]


def call_counts(collective: str, count: int, world: int) -> tuple[int, int]:
    """Elements of the input and of the output of a ``collective`` call on ``world`` ranks whose
    whole message is ``count`` elements: the all-reduce's, the broadcast's and a send/recv's
    ``count`` both; with k = count // world, the reduce-scatter's world x k in and k out, the
    all-gather's k in and world x k out, the all-to-all's world x k both (0: below one element
    per rank). Pure."""
    k = count // world
    return {"all_reduce": (count, count), "reduce_scatter": (k * world, k), "all_gather": (k, k * world),
            "broadcast": (count, count), "all_to_all": (k * world, k * world),
            "send_recv": (count, count)}[collective]


def measure(comm, stream, dtype: str, collective: str, args: argparse.Namespace, progress) -> Measured:
    """Times of ``collective`` for one dtype at every size of ``args.sizes`` with at least one
    element per rank (:func:`call_counts`): every algorithm of :func:`candidates`, and every
    quantized format where the communicator opted in and the collective and dtype are ones they
    take (``_quant.COLLECTIVES``, ``_quant.DTYPES``). Collective."""
    width = DTYPES[dtype][1]
    send, recv = buffers(dtype, args, stream)
    gemm = gemm_into(send, args, stream)
    formats = (list(_quant.FORMATS) if comm.config.quantized != "off" and collective in _quant.COLLECTIVES
               and dtype in _quant.DTYPES else [])
    names = candidates(comm, collective) + formats
    of = "" if collective == "all_reduce" else f" {collective}"
    sizes, rows = [], []
    for nbytes in args.sizes:
        inputs, outputs = call_counts(collective, nbytes // width, comm.size)
        if not min(inputs, outputs):
            continue
        row: dict[str, Timed | None] = {}
        for name in names:
            progress(f"{dtype} {human_bytes(nbytes):>8}{of} {name}")
            row[name] = time_algorithm(comm, stream, name, send[:inputs], recv[:outputs], args, collective, gemm)
        sizes.append(nbytes)
        rows.append(row)
    return Measured.of(sizes, rows, gemm is not None)
