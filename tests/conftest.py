"""Shared test machinery: the ``gpu`` skip, the ``run_mpi`` fixture, the multicast guard.

* Tests marked ``@pytest.mark.gpu`` are skipped, with the reason, when no CUDA
  device is usable (checked once, lazily, without creating a CUDA context).
* ``run_mpi(script, n, args=(), timeout=...)`` runs ``mpiexec -n N python
  script`` and fails the test with the output when the job fails or hangs.
  Tests that use it carry ``@pytest.mark.mpi``.
* No test process can call a real ``cuMulticast*`` function (``nvls_guard``).
* The summary counts the kernel variants compiled through NVRTC
  (``ubnext._engine.kernels.compile_cubin``): distinct (source, defines, architecture),
  summed over the xdist workers, with the NVRTC version and the compile time.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import nvls_guard
import pytest

nvls_guard.install()

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set by the launchers when this pytest itself runs as an MPI rank.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


#: this process's compiles: variant (source, architecture, defines) -> compiles of it; seconds
_COMPILED: dict[str, int] = {}
_COMPILE_SECONDS = [0.0]


def _count_compiles() -> None:
    """Wraps ``compile_cubin`` to count the variants compiled (every kernel test calls it)."""
    from ubnext._engine import kernels

    compile_cubin = kernels.compile_cubin

    @functools.wraps(compile_cubin)
    def counted(name: str, defines: dict[str, str], arch: str = "sm_90a", fast: bool = False) -> bytes:
        start = time.perf_counter()
        image = compile_cubin(name, defines, arch, fast)
        _COMPILE_SECONDS[0] += time.perf_counter() - start
        variant = " ".join([name, arch, *(f"{k}={v}" for k, v in sorted(defines.items()))])
        _COMPILED[variant] = _COMPILED.get(variant, 0) + 1
        return image

    kernels.compile_cubin = counted


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception as exc:  # reported, not fatal: the count still prints
        return f"unknown ({exc})"


def pytest_configure(config: pytest.Config) -> None:
    _count_compiles()
    config._ubnext_compiled = {"variants": _COMPILED, "seconds": _COMPILE_SECONDS, "nvrtc": set()}


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and _COMPILED:  # an xdist worker: hand the counts to the controller
        workeroutput["ubnext_compiled"] = dict(_COMPILED)
        workeroutput["ubnext_compile_seconds"] = _COMPILE_SECONDS[0]
        workeroutput["ubnext_nvrtc"] = _nvrtc_version()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist's hook, called on the controller
    output = getattr(node, "workeroutput", {})
    counts = node.config._ubnext_compiled
    for variant, n in output.get("ubnext_compiled", {}).items():
        counts["variants"][variant] = counts["variants"].get(variant, 0) + n
    counts["seconds"][0] += output.get("ubnext_compile_seconds", 0.0)
    if "ubnext_nvrtc" in output:
        counts["nvrtc"].add(output["ubnext_nvrtc"])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    counts = getattr(config, "_ubnext_compiled", None)
    if counts is None or getattr(config, "workeroutput", None) is not None or not counts["variants"]:
        return
    nvrtc = ", ".join(sorted(counts["nvrtc"])) or _nvrtc_version()
    variants = counts["variants"]
    terminalreporter.write_line(
        f"kernel variants compiled: {len(variants)} (NVRTC {nvrtc}; {sum(variants.values())} compiles, "
        f"{counts['seconds'][0]:.0f} s of compile time over the workers)"
    )


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    # pyproject.toml sets a default per-test `timeout` for pytest-timeout (a
    # test extra). Declare the option when the plugin is absent so a bare
    # pytest does not warn about an unknown setting.
    if not pluginmanager.hasplugin("timeout"):
        parser.addini("timeout", "per-test timeout in seconds (needs pytest-timeout)")


@functools.lru_cache(maxsize=None)
def _gpu_unavailable_reason() -> str | None:
    """Why no CUDA device is usable ("no GPU: ..." where there is none), or None if one is."""
    from ubnext._environment.preflight import gpu_problem

    return gpu_problem()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        reason = _gpu_unavailable_reason()
        if reason is not None:
            pytest.skip(reason)


def _find_mpiexec() -> str | None:
    """``mpiexec`` next to the Python executable (a venv with the mpich wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


@functools.lru_cache(maxsize=None)
def _launcher_flags(mpiexec: str) -> tuple[str, ...]:
    """Extra flags Open MPI needs to run 4 ranks on 2 cores, as root; none for MPICH."""
    try:
        version = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    if "Open MPI" not in version and "OpenRTE" not in version:
        return ()
    flags = ["--oversubscribe"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return tuple(flags)


def _report(title: str, out: str, err: str) -> str:
    return f"{title}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


@pytest.fixture
def run_mpi() -> Callable[..., subprocess.CompletedProcess]:
    """Return ``run(script, n, args=(), timeout=300.0, check=True) -> CompletedProcess``.

    The job runs in its own process group with the repository on
    ``PYTHONPATH``; on timeout the whole group is killed. A timeout, and with
    ``check`` a non-zero exit, fails the test, showing stdout and stderr. Skips when no
    ``mpiexec`` is found, or when pytest itself runs under an MPI launcher.
    """
    mpiexec = _find_mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found next to the Python executable or on PATH")
    if any(var in os.environ for var in _MPI_RANK_VARS):
        pytest.skip("pytest already runs under an MPI launcher; not nesting mpiexec")

    def run(
        script: str | os.PathLike, n: int, args: Sequence[str] = (), timeout: float = 300.0, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [mpiexec, *_launcher_flags(mpiexec), "-n", str(n), sys.executable, os.fspath(script), *args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a rank escaped the group and holds the pipes
                out, err = "", ""
            pytest.fail(_report(f"{' '.join(cmd)} timed out after {timeout} s", out, err))
        if check and proc.returncode != 0:
            pytest.fail(_report(f"{' '.join(cmd)} exited with {proc.returncode}", out, err))
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    return run


@pytest.fixture
def logged(caplog):
    """``logged()``: the ``ubnext`` log records of the test so far (the logger does not
    propagate, so caplog's handler is added to it); log_once starts afresh."""
    from ubnext._environment import log as _log

    logger = _log.get_logger()  # set up now: a first setup inside the test would reset the level
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    with _log._once_lock:
        saved = set(_log._once_keys)
        _log._once_keys.clear()
    yield lambda: list(caplog.records)
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    with _log._once_lock:
        _log._once_keys.update(saved)
