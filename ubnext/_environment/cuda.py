"""The one error gate for CUDA calls, and the NVRTC compiler helper.

Every ``cuda.bindings`` call in ubnext goes through :func:`check` (or :func:`drv`,
its driver shorthand): a call returns ``(err, *values)``; the gate returns the
values or raises :class:`~ubnext._protocol.errors.CudaError` naming the call and the error.
Modelled on cuda-python's ``handle_return``.

``cuda.bindings`` is imported lazily, so importing ubnext never loads a CUDA
library, and the driver module can be replaced by a fake in tests (pass
``driver=`` to :func:`drv`).
"""

from __future__ import annotations

from typing import Any

from ubnext._protocol.errors import CudaError


def check(result: tuple, call: str) -> Any:
    """Turn a ``cuda.bindings`` return tuple into its value(s) or raise.

    Works for driver (``CUresult``), runtime (``cudaError_t``) and NVRTC
    (``nvrtcResult``) calls; the error text comes from the matching
    ``*GetErrorName`` / ``*GetErrorString`` function.

    Args:
        result: what the call returned: ``(err,)`` or ``(err, value, ...)``.
        call: name of the API call, used as the start of the error message.

    Returns:
        None when the call has no output, the output itself when it has one,
        a tuple of the outputs otherwise.

    Raises:
        CudaError: ``err`` is not success; ``code`` is ``int(err)`` and the
            message reads ``"<call>: <ERROR_NAME>: <error string>"``.

    Not collective; does not block the host.
    """
    err, *values = result
    if int(err) != 0:
        raise CudaError(call, int(err), error_text(err))
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return tuple(values)


def drv(name: str, *args: Any, driver: Any = None) -> Any:
    """Call ``driver.<name>(*args)`` through :func:`check`.

    Args:
        name: driver API function name, e.g. ``"cuMemCreate"``.
        *args: its arguments, as ``cuda.bindings.driver`` takes them.
        driver: the driver module; ``None`` means ``cuda.bindings.driver``.
            Tests pass a recording fake here.

    Returns:
        What :func:`check` returns.

    Raises:
        CudaError: the call failed.
    """
    module = default_driver() if driver is None else driver
    return check(getattr(module, name)(*args), name)


def default_driver() -> Any:
    """Return the ``cuda.bindings.driver`` module (imported on first use)."""
    from cuda.bindings import driver

    return driver


def error_text(err: Any) -> str:
    """Return ``"<ERROR_NAME>: <error string>"`` for a CUDA error enum value.

    Never raises: where the describing function is unavailable (no driver
    library on a CPU-only machine), the enum's own name is used.
    """
    from cuda.bindings import driver, nvrtc, runtime

    if isinstance(err, driver.CUresult):
        try:
            name_err, name = driver.cuGetErrorName(err)
            text_err, text = driver.cuGetErrorString(err)
        except Exception:  # libcuda is not loadable (CPU-only machine)
            return f"{err.name}: (no description: CUDA driver library unavailable)"
        if int(name_err) != 0 or int(text_err) != 0:
            return f"{err.name}: (no description from the CUDA driver)"
        return f"{name.decode()}: {text.decode()}"
    if isinstance(err, runtime.cudaError_t):
        _, name = runtime.cudaGetErrorName(err)
        _, text = runtime.cudaGetErrorString(err)
        return f"{name.decode()}: {text.decode()}"
    if isinstance(err, nvrtc.nvrtcResult):
        _, name = nvrtc.nvrtcGetErrorString(err)
        return name.decode()
    return f"unknown CUDA error {err!r}"


def nvrtc_compile(
    source: str,
    name: str,
    options: list[str],
    headers: dict[str, str] | None = None,
) -> bytes:
    """Compile CUDA C++ source with NVRTC; needs no GPU and no driver.

    Args:
        source: the translation unit.
        name: program name shown in compiler messages (e.g. ``"lamport.cu"``).
        options: NVRTC options, e.g. ``["--gpu-architecture=sm_90a", "-std=c++17"]``.
            A real architecture (``sm_XX``, via ``--gpu-architecture=`` or
            ``-arch=``) yields CUBIN; a virtual one (``compute_XX``) or none
            yields PTX.
        headers: include name -> header source, for ``#include "<name>"``.

    Returns:
        The CUBIN image, or the PTX text (NUL-terminated, as NVRTC emits it).

    Raises:
        CudaError: ``call == "nvrtcCompileProgram"`` with the full compiler
            log in the message when compilation fails; another NVRTC call
            name when NVRTC itself fails.

    Not collective; blocks the host for the duration of the compilation.
    The NVRTC program is always destroyed.
    """
    from cuda.bindings import nvrtc

    headers = headers or {}
    prog = check(
        nvrtc.nvrtcCreateProgram(
            source.encode(),
            name.encode(),
            len(headers),
            [text.encode() for text in headers.values()],
            [include.encode() for include in headers],
        ),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [option.encode() for option in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        if int(err) != 0:
            raise CudaError(
                "nvrtcCompileProgram",
                int(err),
                f"{error_text(err)} compiling {name} with {' '.join(options)}:\n"
                f"{_program_log(nvrtc, prog)}",
            )
        if _is_real_arch(options):
            image = _read_output(nvrtc, prog, "CUBIN")
        else:
            image = _read_output(nvrtc, prog, "PTX")
    except BaseException:
        nvrtc.nvrtcDestroyProgram(prog)  # best effort: the original error matters
        raise
    check(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")
    return image


def _program_log(nvrtc: Any, prog: Any) -> str:
    size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    log = b" " * size
    check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
    return log.rstrip(b"\0").decode(errors="replace")


def _read_output(nvrtc: Any, prog: Any, kind: str) -> bytes:
    """Read the program's CUBIN or PTX (``kind``) into a new bytes object."""
    size = check(getattr(nvrtc, f"nvrtcGet{kind}Size")(prog), f"nvrtcGet{kind}Size")
    image = b" " * size
    check(getattr(nvrtc, f"nvrtcGet{kind}")(prog, image), f"nvrtcGet{kind}")
    return image


def _is_real_arch(options: list[str]) -> bool:
    """True when the last architecture option names a real GPU (``sm_XX``)."""
    arch = ""
    for option in options:
        for prefix in ("--gpu-architecture=", "-arch="):
            if option.startswith(prefix):
                arch = option[len(prefix):]
    return arch.startswith("sm_")
