"""Kernel sources and their compilation.

Sources live in ``kernels/`` (shipped in the wheel as ``ubnext/kernels``). Local
``#include "x.cuh"`` lines are expanded here, so the compiled text is one string:
CuPy's on-disk cache key then covers the headers too, and NVRTC needs no include
path. At run time kernels compile through ``cupy.RawModule`` for the current
device; in CI the same text compiles for sm_90a through NVRTC without a GPU.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.M)
#: Options shared by every compiler path.
BASE_OPTIONS = ("--std=c++17",)


def kernel_dir() -> Path:
    """Directory of the CUDA sources: the installed copy, else the source tree's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"ubnext: CUDA sources not found next to {here}")


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """Text of ``kernels/<name>`` with its local includes expanded once each."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = _PRAGMA_ONCE.sub("", (kernel_dir() / fname).read_text())
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def options(defines: dict[str, str]) -> tuple[str, ...]:
    """Compiler options for one instantiation (``_algorithms.compile_defines``)."""
    return BASE_OPTIONS + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def compile_cubin(name: str, defines: dict[str, str], arch: str = "sm_90a") -> bytes:
    """Compiles ``kernels/<name>`` with NVRTC, no GPU needed (CI's compile gate).

    Raises:
        CudaError: with the compiler log, if compilation fails.
    """
    from ._cuda import nvrtc_compile

    return nvrtc_compile(source(name), name, list(options(defines)) + [f"--gpu-architecture={arch}"])


def compile_module(name: str, defines: dict[str, str]):
    """Compiles ``kernels/<name>`` for the current device through ``cupy.RawModule``.

    Local (no collective); CuPy caches the result on disk. Returns the module; its
    entry points are ``module.get_function(entry)``.
    """
    import cupy

    module = cupy.RawModule(code=source(name), options=options(defines))
    module.compile()
    return module
