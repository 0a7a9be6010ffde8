"""``python -m ubnext selftest`` without a GPU: its cases, inputs and checks (pure), the
whole command on a fake communicator over the numpy stand-in for CuPy (bench_fakes),
at 1 rank and at 2 and 4 ranks as threads: a wrong element, an unwritten output, a
changed input or a raising call on any rank makes every rank exit 1, and rank 0's
table names the case and the rank; ``--nvls`` where a variable forbids multicast
refuses with the gate's line and makes no driver call at all.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import bench_fakes
import numpy as np
import nvls_guard
import pytest
from fake_driver import MulticastFakeDriver
from selftest_fakes import ALL, KERNELS, FakeComm
from thread_ranks import raise_first, run_ranks

from ubnext._environment import cuda as _cuda
from ubnext._environment import devices as _devices
from ubnext._environment import nvls_gate as _gate
from ubnext._environment.config import Config
from ubnext._protocol.algorithms import DTYPES as ALL_DTYPES
from ubnext._protocol.algorithms import KERNEL_DTYPES as DTYPES
from ubnext._protocol.algorithms import TWOSHOT_ONLY_DTYPES
from ubnext._protocol.errors import UbnextError
from ubnext._selection.select import buffer_limits
from ubnext._tools import reference as _reference
from ubnext._tools import selfcheck as _selfcheck
from ubnext._tools import selftest as _selftest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
SMALL = (1, 7, 1001)  # counts of the fast tests


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = bench_fakes.install(monkeypatch)
    monkeypatch.setattr(_selfcheck, "COUNTS", SMALL)
    return cupy


def selftest(bootstrap, nvls=False, **kwargs):
    """``_selftest.main`` on a FakeComm over ``bootstrap``: (status, stdout, stderr, comm)."""
    out, err, made = io.StringIO(), io.StringIO(), []

    def communicator(**overrides):
        made.append(FakeComm(bootstrap, **kwargs, **overrides))
        return made[0]

    status = _selftest.main(nvls=nvls, communicator=communicator, environ={}, out=out, err=err)
    return status, out.getvalue(), err.getvalue(), made[0] if made else None


def table(text):
    """Rows of the printed table: (algorithm, dtype, elements, result words)."""
    rows = []
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ALL + ["nvls", "nvls_lamport"]:
            rows.append(words)
    return rows


# --------------------------------------------------------------------------- the pure core


def test_plan_covers_every_algorithm_dtype_and_size_and_names_what_cannot_run():
    limits = buffer_limits(Config())
    cases = _selfcheck.plan(ALL, limits, {"nccl": "why"})
    assert {(c.algorithm, c.dtype, c.count) for c in cases} == {
        (a, d, n) for a in KERNELS for d in DTYPES for n in _selfcheck.COUNTS} | {
        ("twoshot", d, n) for d in TWOSHOT_ONLY_DTYPES for n in _selfcheck.COUNTS}  # the Lamport kernels: 3 dtypes
    big = _selfcheck.COUNTS[-1]
    for case in cases:
        assert case.symmetric == (case.nbytes >= _selfcheck.SYMMETRIC_BYTES)
        assert bool(case.skip) == (case.algorithm == "lamport" and case.nbytes > 1 << 20)
    assert next(c.skip for c in cases if c.skip) == "larger than UBNEXT_LAMPORT_MAX_KB=1024"
    assert all(1 << 20 < c.nbytes < 9 << 20 for c in cases if c.count == big)  # a few MiB
    assert _selfcheck.COUNTS[1] % 2 == 1
    # the first case of each kernel is its smallest (its first call compiles it)
    firsts = {}
    for case in cases:
        firsts.setdefault((case.algorithm, case.dtype), case.count)
    assert set(firsts.values()) == {1}
    # NCCL runs in plain arrays at every size; exact inputs where the order is not the reference's
    nccl = _selfcheck.plan(["nccl", "nvls"], limits, {})
    assert {c.dtype for c in nccl if c.algorithm == "nccl"} == set(ALL_DTYPES)
    assert {c.dtype for c in nccl if c.algorithm == "nvls"} == set(DTYPES)
    assert not any(c.symmetric for c in nccl if c.algorithm == "nccl")
    assert all(c.exact == (not _selfcheck.integer(c.dtype)) for c in nccl)  # integer sums: any order
    assert not any(c.exact for c in cases)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nranks", [1, 2, 4, 8])
def test_inputs_are_reproducible_and_exact_where_the_order_is_unknown(dtype, nranks):
    count = 5000
    inputs = _selfcheck.make_inputs(dtype, count, nranks, exact=False)
    again = _selfcheck.make_inputs(dtype, count, nranks, exact=False)
    assert all(np.array_equal(_reference.bits(a), _reference.bits(b)) for a, b in zip(inputs, again))
    assert all(x.dtype == _reference.DTYPES[dtype] and x.shape == (count,) for x in inputs)
    x0 = inputs[0]
    assert _reference.nan_mask(x0)[5] and np.isinf(x0.astype(np.float32)[3])
    assert (_reference.bits(x0[1::97]) == _reference.bits(np.full(1, -0.0, x0.dtype))[0]).all()
    if nranks > 1:
        assert not np.array_equal(_reference.bits(inputs[0]), _reference.bits(inputs[1]))
    exact = _selfcheck.make_inputs(dtype, count, nranks, exact=True)
    want = np.sum([x.astype(np.float64) for x in exact], axis=0)
    assert np.array_equal(_reference.exact(exact).astype(np.float64), want)  # raises if not exact


@pytest.mark.parametrize("dtype", TWOSHOT_ONLY_DTYPES)
def test_inputs_of_the_other_dtypes_reach_their_extremes(dtype):
    """float64: as the other floats (NaN, inf, -0.0); integers: never zero, the largest
    value at element 6, so that sums wrap; NCCL's and the two-shot's references agree."""
    inputs = _selfcheck.make_inputs(dtype, 5000, 4, exact=False)
    x0 = inputs[0]
    assert x0.dtype == _reference.ALL_DTYPES[dtype]
    if _selfcheck.integer(dtype):
        assert (x0 != 0).all() and x0[6] == np.iinfo(x0.dtype).max
        assert np.array_equal(_selfcheck.expected("nccl", inputs), _selfcheck.expected("twoshot", inputs))
        assert _selfcheck.poison(dtype) != 0 and _selfcheck.make_inputs(dtype, 9, 2, exact=True)[0].any()
    else:
        assert np.isnan(x0[5]) and np.isinf(x0[3]) and np.signbit(x0[1]) and x0[1] == 0
        exact = _selfcheck.make_inputs(dtype, 5000, 4, exact=True)
        assert np.array_equal(_selfcheck.expected("nccl", exact), np.sum(exact, axis=0))


def test_check_passes_the_reference_and_catches_any_wrong_bit():
    case = _selfcheck.Case("twoshot", "bfloat16", 1001, False)
    inputs = _selfcheck.make_inputs("bfloat16", 1001, 4, exact=False)
    want = _selfcheck.expected("twoshot", inputs)
    assert _selfcheck.check(case, inputs, 2, want.copy(), inputs[2].copy()) == ""
    wrong = want.copy()
    _reference.bits(wrong)[500] ^= 1
    assert "the output: 1 of 1001 elements differ from the reference: [500]" in _selfcheck.check(
        case, inputs, 2, wrong, inputs[2].copy())
    poisoned = np.full(1001, np.nan, want.dtype)  # the kernel wrote nothing
    assert "elements differ" in _selfcheck.check(case, inputs, 2, poisoned, inputs[2].copy())
    changed = inputs[2].copy()
    changed[0] = 3
    assert "the input after the call: 1 of 1001" in _selfcheck.check(case, inputs, 2, want.copy(), changed)
    # another algorithm's order gives other bits at the order probes
    lamport = _selfcheck.expected("lamport", inputs)
    assert "differ from the reference" in _selfcheck.check(case, inputs, 2, lamport, inputs[2].copy())


def test_merge_fails_a_case_that_failed_on_any_rank_and_keeps_the_slowest_time():
    cases = [_selfcheck.Case("twoshot", "float32", 7, False), _selfcheck.Case("lamport", "float32", 7, False, "why")]
    ok, bad = _selfcheck.Outcome("pass", "", 5.0), _selfcheck.Outcome("FAIL", "wrong", 9.0)
    reports = [_selfcheck.RankReport(0, 0, "G", [ok, None]), _selfcheck.RankReport(1, 1, "G", [bad, None]),
               _selfcheck.RankReport(2, 2, "G", [bad, None])]
    rows = _selfcheck.merge(cases, reports)
    assert rows[0] == _selfcheck.Row(cases[0], "FAIL", "wrong", (1, 2), 9.0)
    assert rows[1] == _selfcheck.Row(cases[1], "not run", "why")
    assert _selfcheck.failed(rows) and not _selfcheck.failed(_selfcheck.merge(cases, reports[:1]))


# --------------------------------------------------------------------------- the command, 1 rank


def test_all_pass_prints_one_table_and_exits_0(fake_cupy):
    status, out, err, comm = selftest(bench_fakes.Bootstrap(), algorithms=KERNELS)
    assert status == 0, out + err
    assert err == "" and comm.closed
    rows = table(out)
    checks = (len(KERNELS) * len(DTYPES) + len(TWOSHOT_ONLY_DTYPES)) * len(SMALL)  # the two-shot: every dtype
    assert len(rows) == checks == 48
    assert {r[1] for r in rows if r[0] == "twoshot"} == set(ALL_DTYPES)
    assert all(r[5] == "pass" and float(r[6]) >= 0 for r in rows)
    lines = out.splitlines()
    assert lines[0].startswith("ubnext ") and "selftest: 48 checks on 1 rank(s)" in lines[0]
    assert lines[1] == "devices by rank: 0 (Fake GPU)"
    assert lines[2].split() == ["algorithm", "dtype", "elements", "bytes", "memory", "result", "us/call"]
    compile_line = [line for line in lines if line.startswith("kernel compile: ")]
    assert len(compile_line) == 1 and " s for 16 kernels (the first call of each" in compile_line[0]
    assert lines[-1].startswith("selftest passed: 48 checks on 1 rank(s), 0 not run; ")
    assert lines[-1].endswith(f" s (budget with a cold kernel cache: {_selfcheck.BUDGET_S} s)")
    # one checked call and CALLS timed calls per case
    assert comm.calls == 48 * (1 + _selfcheck.CALLS)


@pytest.mark.parametrize("fault, says", [
    ("element", "the output: 1 of 1001 elements differ from the reference: [1000]"),
    ("unwritten", "the output: 1000 of 1001 elements differ"),  # element 5 is NaN anyway
    ("input", "the input after the call: 1 of 1001 elements differ"),
    ("raise", "BrokenCommunicatorError: all_reduce: a fake failure"),
])
def test_a_fault_in_one_case_exits_1_naming_it(fake_cupy, fault, says):
    def faulty(rank, algorithm, dtype, count):
        return fault if (algorithm, dtype, count) == ("twoshot", "float16", 1001) else None

    status, out, _, _ = selftest(bench_fakes.Bootstrap(), algorithms=KERNELS, fault=faulty)
    assert status == 1
    failed = [r for r in table(out) if r[5] != "pass"]
    assert [r[:6] for r in failed] == [["twoshot", "float16", "1001", "2002", "plain", "FAIL"]]
    assert failed[0][6:8] == ["rank", "0"]
    lines = out.splitlines()
    assert f"FAIL twoshot float16 1001 elements, rank 0: {says}" in "\n".join(lines)
    assert lines[-1].startswith("selftest FAILED: 1 of 48 checks on 1 rank(s)")


def test_lamport_past_its_buffers_is_not_run_and_says_which_setting(fake_cupy):
    status, out, _, _ = selftest(bench_fakes.Bootstrap(), algorithms=["lamport"], lamport_max_kb=1)
    assert status == 0
    skipped = [r for r in table(out) if "run" in r]
    assert [r[:3] for r in skipped] == [["lamport", dtype, "1001"] for dtype in DTYPES]  # 2002 bytes > 1 KiB
    assert all(" ".join(r).endswith("plain not run larger than UBNEXT_LAMPORT_MAX_KB=1") for r in skipped)
    assert out.splitlines()[-1].startswith("selftest passed: 6 checks on 1 rank(s), 3 not run")


def test_nccl_is_skipped_with_the_reason_where_it_does_not_load(fake_cupy, monkeypatch):
    monkeypatch.setattr(_devices, "device_uuid", lambda ordinal: "GPU-0")
    status, out, _, _ = selftest(bench_fakes.Bootstrap())
    assert status == 0
    assert not [r for r in table(out) if r[0] == "nccl"]
    assert "not run: nccl: selftest: cupy cannot load the NCCL library; install it with" in out


def test_nccl_runs_on_exact_inputs_where_it_loads(fake_cupy, monkeypatch):
    monkeypatch.setattr(fake_cupy.cuda.nccl, "available", True)
    monkeypatch.setattr(_devices, "device_uuid", lambda ordinal: "GPU-0")
    status, out, _, _ = selftest(bench_fakes.Bootstrap())
    assert status == 0
    assert len([r for r in table(out) if r[0] == "nccl" and r[5] == "pass"]) == len(ALL_DTYPES) * len(SMALL)
    assert "NCCL setup (its first call): " in out


# --------------------------------------------------------------------------- the command, several ranks


def run_threads(nranks, uuids=None, **kwargs):
    """The selftest on ``nranks`` thread ranks: [(status, stdout, stderr)] by rank."""
    def body(boot):
        status, out, err, _ = selftest(boot, **kwargs)
        return status, out, err

    return raise_first(run_ranks(nranks, body))


@pytest.mark.parametrize("nranks", [2, 4])
def test_several_ranks_all_pass(fake_cupy, nranks):
    results = run_threads(nranks, algorithms=KERNELS)
    assert [status for status, _, _ in results] == [0] * nranks
    out = results[0][1]
    assert f"on {nranks} rank(s)" in out.splitlines()[-1]
    assert all(o == "" for _, o, _ in results[1:])  # rank 0 prints


def test_a_wrong_element_on_one_rank_fails_every_rank_and_rank_0_names_it(fake_cupy):
    def faulty(rank, algorithm, dtype, count):
        return "element" if (rank, algorithm, dtype, count) == (1, "lamport_twoshot", "bfloat16", 7) else None

    results = run_threads(2, algorithms=KERNELS, fault=faulty)
    assert [status for status, _, _ in results] == [1, 1]
    out = results[0][1]
    failed = [r for r in table(out) if r[5] != "pass"]
    assert [r[:8] for r in failed] == [["lamport_twoshot", "bfloat16", "7", "14", "plain", "FAIL", "rank", "1"]]
    assert "FAIL lamport_twoshot bfloat16 7 elements, rank 1: the output: 1 of 7 elements differ" in out


def test_a_rank_that_returns_its_own_input_fails(fake_cupy):
    """The torchrun bug of a 1-rank world per process: each rank's "sum" is its input."""
    def own_input(boot):
        comm = FakeComm(boot, algorithms=["twoshot"])
        comm.all_reduce = lambda x, out=None, **kw: out.host.__setitem__(..., x.host)
        out = io.StringIO()
        return _selftest.main(communicator=lambda **o: comm, environ={}, out=out, err=io.StringIO()), out.getvalue()

    results = raise_first(run_ranks(2, own_input))
    assert [status for status, _ in results] == [1, 1]
    assert all(r[5] == "FAIL" for r in table(results[0][1]))


def test_ranks_sharing_a_gpu_skip_nccl_and_say_so(fake_cupy, monkeypatch):
    monkeypatch.setattr(fake_cupy.cuda.nccl, "available", True)
    monkeypatch.setattr(_devices, "device_uuid", lambda ordinal: "GPU-aaaa")
    results = run_threads(2)
    assert [status for status, _, _ in results] == [0, 0]
    out = results[0][1]
    assert "not run: nccl: NCCL cannot serve several ranks on one GPU (ranks 0, 1 share GPU-aaaa)" in out
    assert not [r for r in table(out) if r[0] == "nccl"]


# --------------------------------------------------------------------------- --nvls


@pytest.fixture
def recording_driver(monkeypatch):
    fake = MulticastFakeDriver()
    monkeypatch.setattr(_cuda, "default_driver", lambda: fake)
    monkeypatch.setattr(_gate, "default_driver", lambda: fake)
    return fake


@pytest.mark.parametrize("real", [False, True], ids=["stand-in", "Communicator"])
@pytest.mark.parametrize("var, value", _gate.ENV_BLOCKERS)
def test_nvls_where_a_variable_forbids_multicast_refuses_with_the_gates_line_and_calls_no_driver(
        recording_driver, var, value, real):
    made, err = [], io.StringIO()
    attempts = len(nvls_guard.attempts)
    status = _selftest.main(nvls=True, communicator=None if real else lambda **o: made.append(o),
                            environ={var: value}, out=io.StringIO(), err=err)
    assert status == 2 and made == []
    assert err.getvalue() == (f"Communicator: UBNEXT_NVLS=1 requires NVLink multicast, but {var}={value} set in the "
                              "environment (multicast is switched off on this machine); use UBNEXT_NVLS=auto (or 0) "
                              "to run without it\n")
    with pytest.raises(UbnextError) as gate:  # the gate's own words
        _gate.decide("1", {var: value}, bench_fakes.Bootstrap(), 0, driver=recording_driver)
    assert err.getvalue() == f"{gate.value}\n"
    assert recording_driver.calls == [] and len(nvls_guard.attempts) == attempts


def test_nvls_opts_in_where_nothing_forbids_it(fake_cupy):
    made = []

    def communicator(**overrides):
        made.append(overrides)
        return FakeComm(bench_fakes.Bootstrap(), algorithms=["nvls", "nvls_lamport", "twoshot"], **overrides)

    out = io.StringIO()
    status = _selftest.main(nvls=True, communicator=communicator, environ={"NCCL_NVLS_ENABLE": "1"}, out=out,
                            err=io.StringIO())
    assert status == 0 and made == [{"nvls": "1"}]
    rows = table(out.getvalue())
    assert {r[0] for r in rows} == {"nvls", "nvls_lamport", "twoshot"} and all(r[5] == "pass" for r in rows)
    assert out.getvalue().endswith(f" s (budget with a cold kernel cache: {_selfcheck.NVLS_BUDGET_S} s)\n")


# --------------------------------------------------------------------------- the real command, no GPU


def run_cli(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("UBNEXT_", "NCCL_", "TORCH_SYMM", "NVSHMEM"))}
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "ubnext", "selftest", *args], cwd=REPO_ROOT, env=environ,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_command_without_a_gpu_is_one_line_and_exit_2():
    from ubnext._environment.preflight import gpu_problem

    problem = gpu_problem()
    if problem is None:
        pytest.skip("this machine has a CUDA device")
    proc = run_cli()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"Communicator: {problem}\n"


def test_the_command_with_nvls_forbidden_is_the_gates_line_and_exit_2():
    proc = run_cli("--nvls", env={"NCCL_NVLS_ENABLE": "0"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("Communicator: UBNEXT_NVLS=1 requires NVLink multicast, but NCCL_NVLS_ENABLE=0")
    assert proc.stderr.count("\n") == 1


# --------------------------------------------------------------------------- MPI ranks


@pytest.mark.mpi
def test_over_mpi_a_wrong_element_on_rank_1_makes_every_rank_exit_1(run_mpi):
    result = run_mpi(SCRIPTS / "selftest_fake.py", 2, ["fault"], timeout=240, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 0 status 1" in result.stderr and "rank 1 status 1" in result.stderr
    failed = [r for r in table(result.stdout) if r[5] != "pass"]
    assert [r[:8] for r in failed] == [["twoshot", "float32", "7", "28", "plain", "FAIL", "rank", "1"]]
    assert result.stdout.count("devices by rank: 0 0 (Fake GPU)") == 1  # rank 0 prints, once


@pytest.mark.mpi
def test_over_mpi_a_rank_that_cannot_start_ends_the_job_instead_of_hanging_it(run_mpi):
    result = run_mpi(SCRIPTS / "selftest_fake.py", 2, ["setup"], timeout=240, check=False)
    assert result.returncode != 0
    assert "Communicator: a fake setup failure on rank 1\n" in result.stderr
    assert "rank 0 status" not in result.stderr  # rank 0 waited for rank 1 in a collective until the abort
