"""What ``python -m ubnext selftest`` checks and how it reports: pure functions of the
inputs and outputs, so that a CPU test drives them with a fake communicator.

Every usable algorithm × dtype × a few sizes (:data:`COUNTS`: one element, an odd size,
a few MiB) is one :class:`Case`. Every rank regenerates every rank's input
(:func:`make_inputs`), so each rank checks its own output against the host reference
(``_reference``) without any exchange: bit for bit, in the kernels' order where the
reference knows it (``_reference.ALL_REDUCE``), else (NCCL, the multicast kernels, whose
order is the switch's) on inputs whose every partial sum is exact, for which any order
gives the same bits. :func:`merge` combines every rank's outcomes; :func:`render` is the
table rank 0 prints. The device work and the command are ``_selftest``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from ubnext._protocol.algorithms import ALGORITHMS, DTYPES, FLOAT_DTYPES
from ubnext._selection.select import Limits, bound
from ubnext._tools import reference as _reference

#: elements of the checked messages: one, an odd size (not a whole 16-byte vector, under
#: the Lamport one-shot's default bound in every dtype) and a few MiB (2 MiB + 6 B in 16-bit
#: dtypes, 4 MiB + 12 B in 32-bit ones, 1 MiB + 3 B in 8-bit ones, 8 MiB + 24 B in 64-bit ones)
COUNTS = (1, 100_001, (1 << 20) + 3)
#: messages of at least this many bytes run in ``comm.empty()`` buffers (symmetric memory:
#: the kernels reduce them without a staging copy, the two-shot in one launch at any size);
#: smaller ones in plain arrays, through the staging slot
SYMMETRIC_BYTES = 1 << 20
#: calls timed per case (eager, back to back, between CUDA events)
CALLS = 10
#: seed of the inputs
SEED = 20
#: seconds the selftest takes at most with a cold kernel cache, up to 8 ranks (README:
#: "Selftest"): the first calls compile 16 kernels (NVRTC: 7-13 s for the 9 of the 16-bit
#: and fp32 dtypes in one process; the barrier two-shot of 7 more dtypes),
#: NCCL sets up, and each rank computes the references (2.8 s at 8 ranks); with NVLink
#: multicast 6 more kernels (6 s) and their checks
BUDGET_S, NVLS_BUDGET_S = 60, 90

PASS, FAIL = "pass", "FAIL"


@dataclasses.dataclass(frozen=True)
class Case:
    """One checked all-reduce: ``algorithm`` on ``count`` elements of ``dtype`` (sum, out of place).

    Attributes:
        symmetric: x and out come from ``comm.empty()`` (else plain arrays).
        skip: why the case does not run ("" where it runs).
    """

    algorithm: str
    dtype: str
    count: int
    symmetric: bool
    skip: str = ""

    @property
    def nbytes(self) -> int:
        return self.count * DTYPES[self.dtype][1]

    @property
    def exact(self) -> bool:
        """Whether the inputs must be exact: the reference does not know the algorithm's
        order, and the dtype is floating (integer sums wrap alike in any order)."""
        return self.algorithm not in _reference.ALL_REDUCE and not integer(self.dtype)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One rank's result of one case that ran.

    Attributes:
        status: ``PASS`` or ``FAIL``.
        detail: why it failed ("" where it passed).
        us: µs per call of the timed calls, or None where they did not run.
        first_s: seconds of this call where it was the first of its kernel on this rank
            (the kernel compiles; for NCCL, the first call of any dtype sets NCCL up), else None.
    """

    status: str
    detail: str = ""
    us: float | None = None
    first_s: float | None = None


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What one rank gathers to rank 0: its device and one Outcome per case (None: skipped)."""

    rank: int
    device: int
    device_name: str
    outcomes: list


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a case and its result over every rank.

    Attributes:
        status: ``PASS``, ``FAIL`` or ``"not run"``.
        detail: the skip reason, or the first failing rank's reason.
        failed: the ranks where it failed.
        us: the largest µs per call over the ranks, or None.
    """

    case: Case
    status: str
    detail: str = ""
    failed: tuple = ()
    us: float | None = None


def integer(dtype: str) -> bool:
    """Whether ``dtype`` (a name of ``DTYPES``) is an integer type."""
    return dtype not in FLOAT_DTYPES


def plan(algorithms: Sequence[str], limits: Limits, unavailable: dict[str, str],
         dtypes: Sequence[str] = tuple(DTYPES), counts: Sequence[int] | None = None) -> list[Case]:
    """The cases, by dtype, then size, then algorithm (the first case of each kernel is its
    smallest); an algorithm only in the dtypes it reduces (the Lamport and multicast
    kernels: bfloat16, float16, float32). Pure.

    Args:
        algorithms: ``comm.algorithms()``.
        limits: ``_select.buffer_limits(comm.config)``: sizes an algorithm's buffers
            cannot take are skipped, naming the setting.
        unavailable: algorithm -> why it cannot run here (``unavailable``); left out.
    """
    cases = []
    for dtype in dtypes:
        for count in COUNTS if counts is None else counts:
            for name in algorithms:
                if name in unavailable or not ALGORITHMS[name].supports(dtype, "sum"):
                    continue
                nbytes = count * DTYPES[dtype][1]
                setting = bound(name, nbytes, limits)
                cases.append(Case(name, dtype, count, ALGORITHMS[name].is_kernel and nbytes >= SYMMETRIC_BYTES,
                                  f"larger than {setting}" if setting else ""))
    return cases


def make_inputs(dtype: str, count: int, nranks: int, exact: bool, seed: int = SEED) -> list[np.ndarray]:
    """Every rank's input, in rank order; the same on every rank that computes them. Pure.

    Random normal values (never zero), with -0.0 at every 97th element and at every 31st
    from a rank-dependent start, +inf on rank 0 and -inf on rank 1 at element 3 (NaN from
    two ranks on), NaN on rank 0 at element 5, the dtype's largest value at element 6
    (overflow from two ranks on), and ``_reference.order_probe`` at every 1024th from
    element 8 (the reduction order shows in every dtype there). With ``exact``: nonzero
    multiples of ``_reference.EXACT_QUANTUM``, small enough that every partial sum over
    ``nranks`` is exact in bfloat16 (``_reference.exact``). Integers: uniform over the
    whole range, never zero, the largest value at element 6 (sums wrap from two ranks on);
    ``exact`` changes nothing for them (any order gives the same bits).
    """
    npdtype = _reference.ALL_DTYPES[dtype]
    inputs = []
    for rank in range(nranks):
        rng = np.random.default_rng([seed, rank, count, int(exact)])
        if integer(dtype):
            info = np.iinfo(npdtype)
            x = rng.integers(info.min, info.max, count, dtype=npdtype, endpoint=True)
            x[x == 0] = 1
            x[6:7] = info.max
            inputs.append(x)
            continue
        if exact:
            top = max(1, min(16, 256 // nranks))  # |sum| <= nranks * top / 2 <= 128: 8 bits of 0.5
            k = rng.integers(1, top + 1, count) * (rng.integers(0, 2, count) * 2 - 1)
            inputs.append((k * _reference.EXACT_QUANTUM).astype(np.float32).astype(npdtype))
            continue
        x = rng.standard_normal(count, dtype=np.float32).astype(npdtype)
        x[x == 0] = 1
        x[1::97] = -0.0
        x[(2 + rank)::31] = -0.0
        specials = {3: {0: np.inf, 1: -np.inf}.get(rank), 5: np.nan if rank == 0 else None,
                    6: ml_dtypes.finfo(npdtype).max}
        for i, value in specials.items():
            if value is not None and i < count:
                x[i] = value
        x[8::1024] = _reference.order_probe(dtype, rank)
        inputs.append(x)
    return inputs


def expected(algorithm: str, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """What ``algorithm`` stores for every rank's ``inputs`` (sum, one launch of the
    barrier two-shot: its messages here fit the staging slot or are symmetric memory)."""
    if algorithm in _reference.ALL_REDUCE:
        return _reference.all_reduce(algorithm, inputs, "sum")
    if inputs[0].dtype.kind in "iu":
        return _reference.integer(inputs, "sum")
    return _reference.exact(inputs, "sum")


def poison(dtype: str) -> int:
    """The bits an output is filled with before a call: NaN for floating types, 0x5A in
    every byte for integers (a value the checked sums hardly ever take)."""
    npdtype = _reference.ALL_DTYPES[dtype]
    if integer(dtype):
        return int.from_bytes(b"\x5a" * npdtype.itemsize, "little")
    return int(_reference.bits(np.full(1, np.nan, npdtype))[0])


def check(case: Case, inputs: Sequence[np.ndarray], rank: int, got: np.ndarray, x_after: np.ndarray) -> str:
    """Why rank ``rank``'s call of ``case`` is wrong, or "" where it is right: its output
    ``got`` has the reference's bits (NaN as a class), its input ``x_after`` is unchanged. Pure."""
    try:
        _reference.assert_same_bits(x_after, inputs[rank], "the input after the call")
        _reference.assert_same_bits(got, expected(case.algorithm, inputs), "the output")
    except (AssertionError, ValueError) as e:
        return str(e)
    return ""


def merge(cases: Sequence[Case], reports: Sequence[RankReport]) -> list[Row]:
    """One Row per case from every rank's report: FAIL where any rank failed. Pure."""
    rows = []
    for i, case in enumerate(cases):
        if case.skip:
            rows.append(Row(case, "not run", case.skip))
            continue
        outcomes = [(r.rank, r.outcomes[i]) for r in reports]
        failed = [(rank, o.detail) for rank, o in outcomes if o.status != PASS]
        times = [o.us for _, o in outcomes if o.us is not None]
        us = max(times) if times else None
        if failed:
            rows.append(Row(case, FAIL, failed[0][1], tuple(rank for rank, _ in failed), us))
        else:
            rows.append(Row(case, PASS, "", (), us))
    return rows


def first_calls(reports: Sequence[RankReport], cases: Sequence[Case]) -> tuple[int, float, float | None]:
    """(kernels compiled, seconds of their first calls, seconds of NCCL's first call or
    None): each rank's sums, the largest over the ranks. Pure."""
    kernels, compile_s, nccl_s = 0, 0.0, None
    for report in reports:
        n, s, nccl = 0, 0.0, None
        for case, outcome in zip(cases, report.outcomes):
            if outcome is None or outcome.first_s is None:
                continue
            if case.algorithm == "nccl":
                nccl = outcome.first_s
            else:
                n, s = n + 1, s + outcome.first_s
        kernels, compile_s = max(kernels, n), max(compile_s, s)
        if nccl is not None:
            nccl_s = max(nccl_s or 0.0, nccl)
    return kernels, compile_s, nccl_s


def failed(rows: Sequence[Row]) -> bool:
    return any(row.status == FAIL for row in rows)


def render(rows: Sequence[Row], reports: Sequence[RankReport], cases: Sequence[Case],
           unavailable: dict[str, str], seconds: float, budget_s: int = BUDGET_S) -> list[str]:
    """The report rank 0 prints: devices, the table, what did not run, the failures, the
    first calls (kernel compilation) and the verdict. Pure."""
    names = sorted({r.device_name for r in reports})
    lines = [f"devices by rank: {' '.join(str(r.device) for r in reports)} ({', '.join(names)})",
             (f"{'algorithm':<16} {'dtype':<9} {'elements':>9} {'bytes':>8}  {'memory':<9}  {'result':<13} "
              f"{'us/call':>9}")]
    for row in rows:
        c = row.case
        result = row.status if row.status != FAIL else f"FAIL rank {','.join(map(str, row.failed))}"
        us = "" if row.us is None else f"{row.us:9.1f}"
        line = (f"{c.algorithm:<16} {c.dtype:<9} {c.count:>9} {c.nbytes:>8}  "
                f"{'symmetric' if c.symmetric else 'plain':<9}  {result:<13} {us:>9}")
        if row.status == "not run":
            line = f"{line.rstrip()} {row.detail}"
        lines.append(line.rstrip())
    for name, why in unavailable.items():
        lines.append(f"not run: {name}: {why}")
    for row in rows:
        if row.status == FAIL:
            c = row.case
            lines.append(f"FAIL {c.algorithm} {c.dtype} {c.count} elements, rank {row.failed[0]}: {row.detail}")
    kernels, compile_s, nccl_s = first_calls(reports, cases)
    nccl = "" if nccl_s is None else f"; NCCL setup (its first call): {nccl_s:.1f} s"
    lines.append(f"kernel compile: {compile_s:.1f} s for {kernels} kernels (the first call of each, "
                 f"largest over the ranks; cached on disk for later runs){nccl}")
    ran = [row for row in rows if row.status != "not run"]
    bad = [row for row in ran if row.status == FAIL]
    verdict = f"FAILED: {len(bad)} of {len(ran)} checks" if bad else f"passed: {len(ran)} checks"
    lines.append(f"selftest {verdict} on {len(reports)} rank(s), {len(rows) - len(ran)} not run; {seconds:.1f} s "
                 f"(budget with a cold kernel cache: {budget_s} s)")
    return lines
