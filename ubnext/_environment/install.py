"""Which CUDA major ubnext is installed for, and whether this node's driver runs it.

ubnext is installed with one extra per CUDA major, ``ubnext[cu13]`` or
``ubnext[cu12]``; each brings CuPy, cuda-bindings, NVRTC and NCCL built for that
major. Three checks turn a wrong install into one line instead of a failure deep
inside CuPy:

* :func:`check_install`, run by ``import ubnext``: CuPy and cuda-bindings can be
  imported. It looks for the modules only (no metadata, no CUDA library), so
  importing ubnext stays cheap.
* :func:`check_packages`, from the package metadata: one CuPy build, of CUDA 12
  or 13, and cuda-bindings of the same major.
* :func:`check_driver` (runs :func:`check_packages` first): a CUDA driver is
  loadable and its major version is at least that of every CUDA runtime ubnext
  loads (CuPy's, cuda-bindings', NVRTC's). Needs the CUDA libraries, not a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ubnext._protocol.errors import UbnextError

#: CUDA major -> the CuPy build its extra (``ubnext[cu<major>]``) installs.
CUPY_BUILDS = {13: "cupy-cuda13x", 12: "cupy-cuda12x"}
#: Every CuPy distribution that installs the ``cupy`` package: the CUDA builds
#: above, an unsupported older one, and ``cupy`` itself (source or conda builds).
_CUPY_DISTRIBUTIONS = ("cupy", "cupy-cuda11x", *CUPY_BUILDS.values())
#: The fix named by every install error.
CHOICES = ('install ubnext with the extra of the CUDA driver: pip install "ubnext[cu13]" (CUDA 13) or '
           '"ubnext[cu12]" (CUDA 12); from a checkout ".[cu13]" or ".[cu12]"')


def _installed_version(name: str) -> str | None:
    """Version of distribution ``name``, or None when it is not installed."""
    from importlib import metadata  # imported here: it takes longer to import than the rest of this module

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it; a parent package may be)."""
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _major(version: str) -> int:
    return int(version.split(".")[0])


def check_install(importable: Callable[[str], bool] | None = None) -> None:
    """Check that CuPy and cuda-bindings can be imported; ``import ubnext`` runs this.

    Args:
        importable: module name -> whether it can be imported; None looks the
            module up on ``sys.path`` (tests pass a fake).

    Raises:
        UbnextError: one line naming the missing package and the install lines
            (a bare ``pip install ubnext`` brings neither).

    Not collective; reads no metadata and loads no CUDA library.
    """
    importable = importable or _importable
    for module, package in (("cupy", "CuPy"), ("cuda.bindings", "cuda-bindings")):
        if not importable(module):
            raise UbnextError(f"import ubnext: {package} is not installed; {CHOICES}")


def check_packages(op: str = "check_packages", version: Callable[[str], str | None] | None = None) -> int | None:
    """Check, from the package metadata, that the installed CUDA packages fit together.

    Args:
        op: operation named at the start of an error message.
        version: distribution name -> installed version or None; None reads the
            package metadata (tests pass a fake).

    Returns:
        The CUDA major the CuPy build is for, or None when it is not known (a
        source or conda build of CuPy, or CuPy on ``sys.path`` without metadata).

    Raises:
        UbnextError: several CuPy builds are installed, CuPy is built for CUDA
            11, or CuPy and cuda-bindings are built for different CUDA majors;
            the message names the install lines.

    Not collective; loads no CUDA library.
    """
    version = version or _installed_version
    cupys = {name: v for name in _CUPY_DISTRIBUTIONS if (v := version(name)) is not None}
    if len(cupys) > 1:
        builds = ", ".join(f"{name} {v}" for name, v in sorted(cupys.items()))
        raise UbnextError(f"{op}: several CuPy builds are installed ({builds}) and overwrite each "
                          f"other's files; pip uninstall all of them, then {CHOICES}")
    if not cupys:
        return None
    (name, cupy_version), = cupys.items()
    if name == "cupy-cuda11x":
        raise UbnextError(f"{op}: {name} {cupy_version} is for CUDA 11, which ubnext does not support; "
                          f"pip uninstall {name}, then {CHOICES}")
    major = next((m for m, build in CUPY_BUILDS.items() if build == name), None)
    bindings = version("cuda-bindings")
    if major is not None and bindings is not None and _major(bindings) != major:
        raise UbnextError(f"{op}: {name} {cupy_version} is for CUDA {major} but cuda-bindings {bindings} "
                          f"is for CUDA {_major(bindings)}; {CHOICES}")
    return major


@dataclass(frozen=True)
class CudaVersions:
    """CUDA versions as the CUDA APIs encode them (``13020`` is 13.2).

    Attributes:
        driver: ``cudaDriverGetVersion``; 0 when no driver library is loadable.
        runtimes: ``(what, version)`` of each CUDA runtime ubnext loads, e.g.
            ``("cupy-cuda13x 14.2.0", 13020)``.
    """

    driver: int
    runtimes: tuple[tuple[str, int], ...]


def version_text(code: int) -> str:
    """``13020`` -> ``"13.2"``."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _code_major(code: int) -> int:
    """``13020`` -> 13."""
    return code // 1000


def query_versions(op: str = "query_versions") -> CudaVersions:
    """Ask the CUDA libraries for the driver's version and that of each runtime ubnext loads.

    The runtimes: CuPy's (``cudaRuntimeGetVersion`` of its build), cuda-bindings'
    (the same call through ``cuda.bindings.runtime``) and NVRTC's
    (``nvrtcVersion``, through CuPy, which compiles the kernels).

    Args:
        op: operation named at the start of an error message.

    Raises:
        UbnextError: NVRTC is not loadable (the message names the install line).

    Not collective; needs no GPU.
    """
    import cupy
    from cuda.bindings import runtime as cudart

    from ubnext._environment.cuda import check

    cupy_name = next((name for name in _CUPY_DISTRIBUTIONS if _installed_version(name)), "cupy")
    bindings = _installed_version("cuda-bindings") or "(version unknown)"
    runtimes = [
        (f"{cupy_name} {cupy.__version__}", cupy.cuda.runtime.runtimeGetVersion()),
        (f"cuda-bindings {bindings}", check(cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")),
    ]
    try:
        nvrtc_major, nvrtc_minor = cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # libnvrtc not found: CuPy raises RuntimeError or its own error types
        raise UbnextError(f"{op}: NVRTC, which compiles ubnext's kernels, is not loadable "
                          f"({type(exc).__name__}: {exc}); {CHOICES}") from exc
    runtimes.append(("NVRTC", nvrtc_major * 1000 + nvrtc_minor * 10))
    return CudaVersions(cupy.cuda.runtime.driverGetVersion(), tuple(runtimes))


def check_driver(op: str = "check_driver", versions: CudaVersions | None = None) -> CudaVersions:
    """Check that this node's CUDA driver runs the installed CUDA packages.

    A driver runs a runtime of its own major version or an older one (a newer
    minor is fine: CUDA's minor-version compatibility, and CuPy compiles to
    CUBIN, not PTX). Call it before any collective setup, on every rank.

    Args:
        op: operation named at the start of an error message (e.g. ``"Communicator"``).
        versions: the versions to judge; None checks the installed packages
            (:func:`check_packages`) and queries their versions (:func:`query_versions`).

    Returns:
        The versions judged.

    Raises:
        UbnextError: one line: the packages do not fit together
            (:func:`check_packages`), NVRTC is not loadable, no driver is
            loadable, or the driver's major is older than a runtime's; names both
            versions and the fix (the ``ubnext[cu<major>]`` extra of the driver's
            major, or a driver update).

    Not collective; needs no GPU.
    """
    if versions is None:
        check_packages(op)
        versions = query_versions(op)
    problem = driver_problem(versions)
    if problem is not None:
        raise UbnextError(f"{op}: {problem}")
    return versions


def driver_problem(versions: CudaVersions) -> str | None:
    """Why the driver of ``versions`` cannot run their runtimes (one line naming both
    versions and the fix), or None when it can. Pure."""
    newest_major = max(_code_major(code) for _, code in versions.runtimes)
    if versions.driver == 0:
        return (f"no CUDA driver is loadable (libcuda.so.1 not found); install the NVIDIA driver for CUDA "
                f"{newest_major} or newer")
    driver_major = _code_major(versions.driver)
    for what, code in versions.runtimes:
        if _code_major(code) > driver_major:
            if driver_major in CUPY_BUILDS:
                fix = f'install "ubnext[cu{driver_major}]" or update the driver to CUDA {_code_major(code)}'
            else:
                supported = " or ".join(str(m) for m in sorted(CUPY_BUILDS))
                fix = f"update the driver to CUDA {supported}"
            return (f"CUDA driver {version_text(versions.driver)} is older than the CUDA {version_text(code)} "
                    f"runtime of {what}; {fix}")
    return None


def nccl_problem() -> str | None:
    """Why this process cannot load NCCL (through ``cupy.cuda.nccl``), or None. Local."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"cupy is not importable ({exc})"
    if not nccl.available:
        return ("cupy cannot load the NCCL library; install it with "
                "'pip install nvidia-nccl-cu13' (or the wheel matching your CUDA)")
    return None


def load_nccl(op: str) -> Any:
    """Import ``cupy.cuda.nccl``, raising a ubnext error when NCCL is missing."""
    problem = nccl_problem()
    if problem is not None:
        raise UbnextError(f"{op}: {problem}")
    from cupy.cuda import nccl

    return nccl
