"""``python -m ubnext selftest [--nvls]``: every usable algorithm × dtype at a few sizes,
on this machine, checked bit for bit against the host reference.

Under any launcher (one process, ``mpirun``, ``srun``, ``torchrun``): every rank creates
the communicator, runs the cases of ``_selfcheck.plan`` (outputs poisoned with NaN,
each call then timed with CUDA events over ``CALLS`` more), checks its own output, and
sends its outcomes to rank 0, which prints one table. Every rank exits with the same
status: 0 when every check passed on every rank, 1 when one failed anywhere, 2 when the
selftest could not start (one line on stderr: no GPU, multicast forbidden, ...).

``--nvls`` opts in to NVLink multicast (``UBNEXT_NVLS=1``), so that the multicast kernels
are checked too. Where this rank's environment forbids multicast (``_gate.ENV_BLOCKERS``)
it refuses with the gate's error before anything is set up: no device is queried and
no multicast object is created.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ubnext._api.communicator import Communicator
from ubnext._environment import devices as _devices
from ubnext._environment import nvls_gate as _gate
from ubnext._environment.devices import device_name
from ubnext._environment.install import load_nccl
from ubnext._interop.arrays import _cupy_dtype
from ubnext._interop.context import keep_current
from ubnext._protocol.errors import UbnextError
from ubnext._selection.select import buffer_limits
from ubnext._tools import cli as _cli
from ubnext._tools import reference as _reference
from ubnext._tools import selfcheck as _selfcheck
from ubnext._tools import timing as _timing
from ubnext._version import __version__

#: exit status: every check passed; one failed on some rank; the selftest could not start
OK, FAILED, NOT_STARTED = 0, 1, 2


def refuse_forbidden_multicast(environ: Mapping[str, str]) -> None:
    """Raises the gate's error where ``environ`` forbids multicast (``_gate.ENV_BLOCKERS``).
    Pure: queries no device.

    Raises:
        UbnextError: ``Communicator: UBNEXT_NVLS=1 requires NVLink multicast, but ...``.
    """
    blockers = _gate.env_blockers(environ)
    if blockers:
        _gate.verdict("1", [(blockers, None)])  # raises in mode 1


def unavailable(comm) -> dict[str, str]:
    """Algorithms of ``comm.algorithms()`` that cannot run here -> why: NCCL where it does
    not load or where ranks share a GPU (NCCL refuses them). Collective (one allgather
    over ``comm.bootstrap``), so that every rank skips alike."""
    if "nccl" not in comm.algorithms():
        return {}
    try:
        load_nccl("selftest")
        problem = ""
    except UbnextError as e:
        problem = str(e)
    views = comm.bootstrap.allgather_obj((_devices.device_uuid(comm.device), problem))
    problems = [p for _, p in views if p]
    if problems:
        return {"nccl": problems[0]}
    for uuid, ranks in _devices.shared([u for u, _ in views]).items():
        return {"nccl": f"NCCL cannot serve several ranks on one GPU (ranks {', '.join(map(str, ranks))} "
                        f"share {uuid})"}
    return {}


def run(comm, cases, calls: int = _selfcheck.CALLS) -> _selfcheck.RankReport:
    """This rank's outcome of every case (None where the case is skipped). Every rank runs
    the same calls in the same order; a call that raises fails its case on this rank
    (a broken communicator then fails the cases after it). Blocks the host."""
    with comm._context.current():  # its arrays and streams on the communicator's device
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        outcomes, first, key, inputs = [], set(), None, None
        for case in cases:
            if case.skip:
                outcomes.append(None)
                continue
            if key != (case.dtype, case.count, case.exact):  # the cases of one size share their inputs
                key = (case.dtype, case.count, case.exact)
                inputs = _selfcheck.make_inputs(case.dtype, case.count, comm.size, case.exact)
            kernel = "nccl" if case.algorithm == "nccl" else (case.algorithm, case.dtype)  # NCCL: set up once
            outcomes.append(_run_case(comm, case, inputs, stream, calls, kernel not in first))
            first.add(kernel)
        del stream, inputs  # destroyed here, in the communicator's context
        return _selfcheck.RankReport(comm.rank, comm.device, device_name(comm.device), outcomes)


def _run_case(comm, case, inputs, stream, calls: int, first: bool) -> _selfcheck.Outcome:
    try:
        x, out = _array(comm, case), _array(comm, case)
        _bits(x).set(_reference.bits(inputs[comm.rank]), stream=stream)
        with stream:
            _bits(out).fill(_selfcheck.poison(case.dtype))
        stream.synchronize()

        def call():
            comm.all_reduce(x, out=out, algorithm=case.algorithm, stream=stream)

        start = time.perf_counter()
        call()
        comm.synchronize(stream)
        first_s = time.perf_counter() - start if first else None
        got, x_after = _host(out, case.dtype, stream), _host(x, case.dtype, stream)

        def body():
            for _ in range(calls):
                call()

        seconds = _timing.elapsed_per_op(body, stream, calls, lambda: None)
        comm.synchronize(stream)
    except Exception as e:  # reported in the table; the next cases still run
        return _selfcheck.Outcome(_selfcheck.FAIL, f"{type(e).__name__}: {e}")
    why = _selfcheck.check(case, inputs, comm.rank, got, x_after)
    return _selfcheck.Outcome(_selfcheck.FAIL if why else _selfcheck.PASS, why, seconds * 1e6, first_s)


def _array(comm, case):
    """A CuPy array of the case's count and dtype: from ``comm.empty()`` or plain."""
    if case.symmetric:
        return comm.empty((case.count,), case.dtype)
    import cupy

    return cupy.empty((case.count,), dtype=_bits_dtype(case.dtype)).view(_cupy_dtype(case.dtype))


def _bits_dtype(dtype: str) -> np.dtype:
    return _reference.bits(np.zeros(1, _reference.ALL_DTYPES[dtype])).dtype


def _bits(array):
    return array.view(_bits_dtype(array.dtype.name))


def _host(array, dtype: str, stream) -> np.ndarray:
    bits = _bits(array).get(stream=stream)
    stream.synchronize()
    return bits.view(_reference.ALL_DTYPES[dtype])


def main(nvls: bool = False, communicator: Callable[..., Any] | None = None,
         environ: Mapping[str, str] | None = None, out=None, err=None) -> int:
    """Runs the selftest on this rank; rank 0 prints the table to ``out``. Collective over
    every rank the launcher started. The caller's current device is left as it was (the
    selftest's communicator makes its own current while it lives).

    Args:
        nvls: opt in to NVLink multicast (``UBNEXT_NVLS=1``).
        communicator: the Communicator class, or a stand-in (tests).
        environ: this rank's environment (default ``os.environ``).
        out, err: streams of the report and of a one-line error (default stdout, stderr).

    Returns:
        OK, FAILED or NOT_STARTED, the same on every rank (NOT_STARTED: the error line
        printed, the MPI job ended where other ranks would wait for this one).
    """
    return keep_current(_main, nvls, communicator, environ, out, err)


def _main(nvls, communicator, environ, out, err) -> int:
    environ = os.environ if environ is None else environ
    out, err = out or sys.stdout, err or sys.stderr
    start = time.perf_counter()
    try:
        if nvls:
            refuse_forbidden_multicast(environ)
        comm = (communicator or Communicator)(**({"nvls": "1"} if nvls else {}))
    except UbnextError as e:
        print(e, file=err)
        return _cli.abort_mpi_job(NOT_STARTED)
    say = (lambda line: print(line, file=out, flush=True)) if comm.rank == 0 else (lambda line: None)
    with comm:  # close() is collective
        skipped = unavailable(comm)
        cases = _selfcheck.plan(comm.algorithms(), buffer_limits(comm.config), skipped)
        say(f"ubnext {__version__} selftest: {sum(not c.skip for c in cases)} checks on {comm.size} rank(s); "
            f"{comm.path}; NVLink multicast {comm.nvls}")
        report = run(comm, cases)
        reports = comm.bootstrap.allgather_obj(report)
    rows = _selfcheck.merge(cases, reports)
    budget = _selfcheck.NVLS_BUDGET_S if comm.nvls.enabled else _selfcheck.BUDGET_S
    for line in _selfcheck.render(rows, reports, cases, skipped, time.perf_counter() - start, budget):
        say(line)
    return FAILED if _selfcheck.failed(rows) else OK
