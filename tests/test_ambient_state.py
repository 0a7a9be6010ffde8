"""No read of the caller's ambient CUDA state in ``ubnext/`` outside the device guard.

A call must run on the communicator's device whatever the caller made current (DESIGN:
the device and context invariant; ``ubnext/_interop/context.py``). The bug class this guards
against: a call that asks CuPy or the runtime for "the current device" or "the current
stream" without naming a device, or that passes the raw null stream 0, takes whatever
GPU the caller (torch, JAX, a new thread) left current. Only the guard module may ask
what is current.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ubnext"
#: the one module that may read (and change) what is current: the guard
GUARD = PACKAGE / "_interop" / "context.py"


def ambient_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every read of ambient CUDA state in ``source``: ``Device()`` and
    ``get_current_stream()`` / ``current_stream()`` without a device, ``getDevice()``,
    ``Stream.null``, and a literal ``stream=0``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            bare = not node.args and not node.keywords
            if name in ("Device", "get_current_stream", "current_stream") and bare:
                found.append((node.lineno, f"{name}() without a device"))
            elif name == "getDevice":
                found.append((node.lineno, "getDevice()"))
            for kw in node.keywords:
                if kw.arg == "stream" and isinstance(kw.value, ast.Constant) and kw.value.value == 0:
                    found.append((node.lineno, "stream=0"))
        elif isinstance(node, ast.Attribute) and node.attr == "null" and getattr(node.value, "attr", "") == "Stream":
            found.append((node.lineno, "Stream.null"))
    return sorted(found)


def test_the_detector_finds_each_kind_of_ambient_read():
    source = "\n".join([
        "import cupy",
        "cupy.cuda.Device().synchronize()",
        "cupy.cuda.runtime.getDevice()",
        "cupy.cuda.get_current_stream().ptr",
        "torch.cuda.current_stream()",
        "launch(x, stream=0)",
        "s = cupy.cuda.Stream.null",
        "cupy.cuda.Device(3).synchronize()",           # named: fine
        "cupy.cuda.get_current_stream(device).ptr",    # named: fine
        "launch(x, stream=handle)",                    # fine
    ])
    assert [line for line, _ in ambient_reads(source)] == [2, 3, 4, 5, 6, 7]


def test_no_module_of_ubnext_reads_ambient_cuda_state_outside_the_guard():
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p != GUARD)
    assert len(modules) > 40
    reads = [f"{p.relative_to(PACKAGE.parent)}:{line}: {what}"
             for p in modules for line, what in ambient_reads(p.read_text())]
    assert reads == [], "ambient CUDA state read outside ubnext/_interop/context.py:\n" + "\n".join(reads)
