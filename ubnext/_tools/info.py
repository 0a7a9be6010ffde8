"""``python -m ubnext info``: versions, GPUs, configuration, selector tables and,
with a communicator, ``comm.describe()``.

Everything that can be missing (cupy, a driver, a GPU, MPI) is reported as a
line of text, never as a traceback, so the command is the first thing to run
on a machine that does not work yet.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections.abc import Mapping
from importlib import metadata

from ubnext._environment.config import Config, _env_text
from ubnext._environment.devices import device_name
from ubnext._environment.install import check_driver, version_text
from ubnext._protocol.algorithms import ALGORITHMS
from ubnext._protocol.errors import UbnextError
from ubnext._selection.table import FORMAT, Machine
from ubnext._selection.table_format import default_table, load_table

#: Distributions whose versions matter (metadata only: nothing is imported): the
#: CUDA packages of either extra (``cu13``, ``cu12``), then the others.
_PACKAGES = ("cupy-cuda13x", "cupy-cuda12x", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12",
             "nvidia-nccl-cu13", "nvidia-nccl-cu12", "numpy", "mpi4py", "ml_dtypes", "torch")


def _cuda_version(code: int) -> str:
    """13020 -> ``"13.2"``."""
    return f"{code // 1000}.{code % 1000 // 10}" if code else "none"


def _nccl_version(code: int) -> str:
    """22809 -> ``"2.28.9"``."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def versions() -> list[str]:
    """``name: version`` lines: ubnext, Python, the packages, CUDA driver and runtime, NCCL."""
    from ubnext._version import __version__

    lines = [f"ubnext: {__version__}", f"python: {platform.python_version()} ({sys.executable})"]
    missing = []
    for name in _PACKAGES:
        try:
            lines.append(f"{name}: {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        lines.append(f"not installed: {', '.join(missing)}")
    try:
        import cupy

        runtime = cupy.cuda.runtime
        lines.append(f"CUDA runtime: {_cuda_version(runtime.runtimeGetVersion())}")
        lines.append(f"CUDA driver: {_cuda_version(runtime.driverGetVersion())}")
        from cupy.cuda import nccl

        lines.append(f"NCCL: {_nccl_version(nccl.get_version()) if nccl.available else 'not loadable by cupy'}")
    except Exception as exc:  # no cupy, no driver library
        lines.append(f"CUDA: unavailable ({type(exc).__name__}: {exc})")
    lines.append(driver_check())
    return lines


def driver_check() -> str:
    """``check_driver``'s verdict as one line: the driver and every CUDA runtime ubnext loads, or the error."""
    try:
        checked = check_driver("driver check")
    except Exception as exc:  # UbnextError with the fix; anything else: the CUDA packages do not load
        return str(exc) if isinstance(exc, UbnextError) else f"driver check: failed ({type(exc).__name__}: {exc})"
    runtimes = ", ".join(f"{what} (CUDA {version_text(code)})" for what, code in checked.runtimes)
    return f"driver check: ok, CUDA driver {version_text(checked.driver)} runs {runtimes}"


def gpu_count() -> tuple[int, str]:
    """``(visible CUDA devices, "")``, or ``(0, why there are none)``."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no cupy, no driver, no device
        return 0, f"{type(exc).__name__}: {exc}"
    return count, "" if count else "the driver reports none"


def gpus(count: int) -> list[str]:
    """One line per visible GPU (name, compute capability, SMs, memory) and the P2P matrix."""
    import cupy

    runtime = cupy.cuda.runtime
    lines = []
    for d in range(count):
        p = runtime.getDeviceProperties(d)
        lines.append(f"GPU {d}: {device_name(d)}, sm_{p['major']}{p['minor']}, {p['multiProcessorCount']} SMs, "
                     f"{p['totalGlobalMem'] / (1 << 30):.1f} GiB")
    if count > 1:
        lines.append("P2P access (row: from, column: to): " + " ".join(f"{j:>3}" for j in range(count)))
        for i in range(count):
            cells = ("  -" if i == j else (" ok" if runtime.deviceCanAccessPeer(i, j) else " NO") for j in range(count))
            lines.append(f"{'GPU ' + str(i):>36} " + " ".join(cells))
    return lines


def config_lines(environ: Mapping[str, str]) -> list[str]:
    """Each ``UBNEXT_*`` setting with its value and where it comes from (environment or default)."""
    try:
        config = Config.from_env(environ)
    except ValueError as exc:
        return [f"invalid configuration: {exc}"]
    lines = []
    for f in dataclasses.fields(config):
        env = f.metadata["env"]
        source = "environment" if env in environ else "default"
        lines.append(f"{env:<22} {_env_text(getattr(config, f.name)) or '(empty)':<10} {source}")
    return lines


def table_lines(environ: Mapping[str, str], gpu: str | None = None) -> list[str]:
    """The shipped table and the tune file (checked: it loads, or why not): each one's
    entries, and the entry a communicator on GPU ``gpu`` (GPU 0's name; None: no GPU
    here) chooses for the mode of ``UBNEXT_TABLE_MODE``, and why."""
    try:
        mode = Config(table_mode=environ.get("UBNEXT_TABLE_MODE", Config.table_mode)).table_mode
    except ValueError:  # the configuration section says so; a communicator would refuse it
        mode = Config.table_mode
    machine = Machine(gpu=gpu, mode=mode)
    wanted = machine.label() if gpu else "a GPU not known here"

    def summary(tables) -> list[str]:
        lines = []
        for t in tables.entries:
            worlds = ", ".join(f"{w} ({'/'.join(t.rows[w])})" for w in t.rows)
            lines.append(f"  entry {t.label}: world sizes {worlds}")
        chosen = tables.choose(machine)
        lines.append(f"  for {wanted}: entry {chosen.label} ({chosen.why})")
        return lines

    default = default_table()
    lines = [f"{default.source}:", *summary(default)]
    path = environ.get("UBNEXT_TUNE_FILE", "").strip()
    if not path:
        lines.append("UBNEXT_TUNE_FILE: not set (the default table serves every world size)")
    else:
        try:
            table = load_table(path)
            old = f" (format {table.format}: one entry for any machine)" if table.format != FORMAT else ""
            lines += [f"{table.source} (UBNEXT_TUNE_FILE){old}: consulted first", *summary(table)]
        except UbnextError as exc:
            lines.append(f"UBNEXT_TUNE_FILE is not usable: {exc}")
    return lines


def _gpu_name(count: int) -> str | None:
    """GPU 0's name, or None without a GPU (or where it cannot be read)."""
    try:
        return device_name(0) if count else None
    except Exception:  # a driver that lists a device it cannot describe: info still prints
        return None


def report(environ: Mapping[str, str], mpi: str) -> list[str]:
    """Everything ``info`` prints before any communicator exists; ``mpi`` describes the MPI job."""
    count, why = gpu_count()
    sections = [
        ("versions", [*versions(), f"MPI: {mpi}"]),
        ("GPUs", gpus(count) if count else [f"no CUDA device ({why})"]),
        ("configuration (UBNEXT_*)", config_lines(environ)),
        ("selector tables", table_lines(environ, _gpu_name(count))),
        ("algorithms", [f"{a.name}: {a.summary}" for a in ALGORITHMS.values()]),
    ]
    lines = []
    for title, body in sections:
        lines += [f"# {title}", *(f"  {line}" for line in body)]
    return lines
