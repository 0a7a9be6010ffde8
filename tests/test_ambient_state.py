"""No read or change of the caller's ambient CUDA state in ``ubnext/`` outside the device guard.

A call must run on the communicator's device whatever the caller made current (DESIGN:
the device and context invariant, "one guard, nothing undoes it";
``ubnext/_interop/context.py``). The bug classes this guards against:

* a call that asks CuPy or the runtime for "the current device" or "the current stream"
  without naming a device, or that passes the raw null stream 0, takes whatever GPU the
  caller (torch, JAX, a new thread) left current;
* a call that sets the device or the context itself (CuPy's ``Device`` as a guard or
  ``use()``, the runtime's ``setDevice``, the driver's ``cuCtxSetCurrent``), or enters
  torch's stream or device guards (``torch.cuda.stream``, ``torch.cuda.device``,
  ``ExternalStream``, ``torch.cuda.Stream(device)``, ``set_stream``, ``set_device``):
  torch's guards keep a lazy per-thread device and on exit set *their* idea of it, which
  on a fresh thread is ``cudaSetDevice(0)``: a context on another rank's GPU. Such code
  runs through the guard's ``keep_current`` (passed to it, not called), or not at all;
* a CuPy allocation or stream made outside a section (``with <context>.current():``, a
  call's section, or a function listed in ``IN_THE_GUARD`` with why it runs there):
  CuPy allocates on the current device.

Names are resolved through the module's imports, so an alias (``from cupy.cuda.runtime
import setDevice as s``; ``import torch.cuda as tc``) or a name passed as a string
(``drv("cuCtxSetCurrent", ...)``, ``getattr(runtime, "setDevice")``) is seen too. Only the
guard module may ask what is current or change it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ubnext"
#: the one module that may read (and change) what is current: the guard
GUARD = PACKAGE / "_interop" / "context.py"

#: calls that set the device or the context, by their last name (any module)
SETTERS = {"setDevice", "cudaSetDevice", "ctxSetCurrent", "cuCtxSetCurrent", "ctxPushCurrent", "cuCtxPushCurrent",
           "ctxPopCurrent", "cuCtxPopCurrent", "_cuda_setStream", "_cuda_setDevice", "_exchange_device",
           "_maybe_exchange_device", "_accelerator_setStream", "_accelerator_setDeviceIndex", "ExternalStream"}
#: torch's guards and setters, by their full name
TORCH_GUARDS = {"torch.cuda.stream", "torch.cuda.device", "torch.cuda.device_of", "torch.cuda.set_device",
                "torch.cuda.set_stream", "torch.accelerator.set_stream", "torch.accelerator.set_device_index",
                "torch.cuda.StreamContext"}
#: CuPy calls that allocate on (or make a stream of) the current device
CUPY_ALLOCATIONS = {f"cupy.{f}" for f in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like",
                                         "full_like", "arange", "array", "asarray")} | {"cupy.cuda.Stream"}

#: (module, function) -> why its CuPy allocations and streams run in a section
IN_THE_GUARD = {
    ("_interop/arrays.py", "empty_like"): "a call's new output: made in the call's section",
    ("_engine/node.py", "__init__"): "the node's side stream: made while the Communicator's construction has its "
                                     "device current",
    ("_tools/tune_measure.py", "buffers"): "the tool's arrays: made under run()'s `with comm._context.current()`",
    ("_tools/tune_measure.py", "gemm_into"): "the tool's GEMM operands: made under run()'s `with comm._context.current()`",
    ("_tools/selftest.py", "_array"): "the selftest's arrays: made under run()'s `with comm._context.current()`",
    ("_api/collectives/barrier.py", "barrier"): "the barrier's flag: made inside `with self._order:` (the section)",
    ("_api/collectives/pool_copy.py", "_copy_flag"): "the copy form's flag: made by its caller's section",
    ("_moe/base.py", "_allocate"): "the expert-parallel objects' outputs: made inside the constructor's "
                                   "`with comm._order:` (the section: MoeObject._create)",
}
#: (module, function) -> why it may set the device or enter torch's guards
SETS_ON_PURPOSE = {
    ("_api/communicator.py", "__init__"): "the Communicator makes its device the caller's current one at "
                                          "construction, as torch.cuda.set_device (the caller's convenience)",
    ("_tools/dependent.py", "matmul_into"): "a benchmark tool's GEMM on the tool's CuPy stream, captured into a "
                                            "graph on the tool's own thread (no call of the library)",
}


def aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> full dotted name, from the module's imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def dotted(node: ast.AST, names: dict[str, str]) -> str:
    """The full dotted name of a call's function (``""`` where it is no name chain)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(names.get(node.id, node.id))
    return ".".join(reversed(parts))


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Every node -> the name of the outermost function around it (a module's function or a
    class's method; "" at module level)."""
    owner = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if not name and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[child] = inner
            visit(child, inner)

    visit(tree, "")
    return owner


def ambient_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every read of ambient CUDA state in ``source``: ``Device()`` and
    ``get_current_stream()`` / ``current_stream()`` without a device, ``getDevice()``
    (by any alias), ``Stream.null``, and a literal ``stream=0``."""
    tree = ast.parse(source)
    names = aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func, names).rpartition(".")[2]
            bare = not node.args and not node.keywords
            if name in ("Device", "get_current_stream", "current_stream") and bare:
                found.append((node.lineno, f"{name}() without a device"))
            elif name == "getDevice" or _named(node, {"getDevice", "cudaGetDevice"}):
                found.append((node.lineno, "getDevice()"))
            for kw in node.keywords:
                if kw.arg == "stream" and isinstance(kw.value, ast.Constant) and kw.value.value == 0:
                    found.append((node.lineno, "stream=0"))
        elif isinstance(node, ast.Attribute) and node.attr == "null" and getattr(node.value, "attr", "") == "Stream":
            found.append((node.lineno, "Stream.null"))
    return sorted(found)


def _named(call: ast.Call, names: set[str]) -> bool:
    """Whether a string argument of ``call`` names one of ``names`` (``drv("cuCtxSetCurrent", ...)``,
    ``getattr(runtime, "setDevice")``)."""
    return any(isinstance(a, ast.Constant) and a.value in names for a in call.args)


def context_switches(source: str) -> list[tuple[int, str, str]]:
    """(line, function, what) of every call that sets the device or the context, or enters
    torch's stream or device guards, in ``source`` (a callable passed to ``keep_current``
    is no call)."""
    tree = ast.parse(source)
    names, owner = aliases(tree), _functions(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Call):
            full = dotted(node.func, names)
            last = full.rpartition(".")[2]
            if last in SETTERS or _named(node, SETTERS):
                what = full or last
            elif full in TORCH_GUARDS:
                what = full
            elif full == "torch.cuda.Stream" and not {"stream_id", "device_index"} <= {k.arg for k in node.keywords} \
                    and (node.args or node.keywords):
                what = "torch.cuda.Stream(device): its constructor enters torch's device guard"
            elif _device_use(node, names):
                what = "Device(...).use()"
        elif isinstance(node, ast.withitem) and isinstance(node.context_expr, ast.Call) \
                and dotted(node.context_expr.func, names).rpartition(".")[2] == "Device":
            what = "with Device(...)"
        if what:
            line = node.context_expr.lineno if isinstance(node, ast.withitem) else node.lineno
            found.append((line, owner.get(node, ""), what))
    return sorted(found)


def _device_use(call: ast.Call, names: dict[str, str]) -> bool:
    """Whether ``call`` is ``<...>Device(...).use()``."""
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr == "use" and isinstance(func.value, ast.Call) \
        and dotted(func.value.func, names).endswith("Device")


def unguarded_allocations(source: str) -> list[tuple[int, str, str]]:
    """(line, function, call) of every CuPy allocation or stream made in ``source`` outside
    a ``with ....current():`` block."""
    tree = ast.parse(source)
    names, owner = aliases(tree), _functions(tree)
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(isinstance(i.context_expr, ast.Call)
                                              and dotted(i.context_expr.func, names).endswith(".current")
                                              for i in node.items):
            guarded.update(ast.walk(node))
    return sorted((node.lineno, owner.get(node, ""), dotted(node.func, names)) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and dotted(node.func, names) in CUPY_ALLOCATIONS
                  and node not in guarded)


def test_the_detector_finds_each_kind_of_ambient_read():
    source = "\n".join([
        "import cupy",
        "cupy.cuda.Device().synchronize()",
        "cupy.cuda.runtime.getDevice()",
        "cupy.cuda.get_current_stream().ptr",
        "torch.cuda.current_stream()",
        "launch(x, stream=0)",
        "s = cupy.cuda.Stream.null",
        "from cupy.cuda.runtime import getDevice as where",
        "where()",                                     # aliased: found
        "drv('cudaGetDevice')",                        # by name: found
        "cupy.cuda.Device(3).synchronize()",           # named: fine
        "cupy.cuda.get_current_stream(device).ptr",    # named: fine
        "launch(x, stream=handle)",                    # fine
    ])
    assert [line for line, _ in ambient_reads(source)] == [2, 3, 4, 5, 6, 7, 9, 10]


def test_the_detector_finds_each_kind_of_context_switch():
    source = "\n".join([
        "import torch",
        "import torch.cuda as tc",
        "from cupy.cuda import runtime as rt",
        "from cupy.cuda.runtime import setDevice as put",
        "def f(device, h):",
        "    with torch.cuda.stream(s):",                  # 6: torch's stream guard
        "        pass",
        "    with tc.device(device):",                     # 8: torch's device guard, aliased
        "        pass",
        "    torch.cuda.ExternalStream(h, device=device)",  # 10: enters the device guard
        "    torch.cuda.Stream(device)",                   # 11: so does this constructor
        "    rt.setDevice(device)",                        # 12: aliased module
        "    put(device)",                                 # 13: aliased function
        "    drv('cuCtxSetCurrent', ctx)",                 # 14: by name
        "    getattr(rt, 'setDevice')(device)",            # 15: by name
        "    cupy.cuda.Device(device).use()",              # 16
        "    with cupy.cuda.Device(device):",              # 17
        "        pass",
        "    torch.cuda.set_stream(s)",                    # 19
        "    keep_current(torch.cuda.Stream, device)",     # through the guard's helper: fine
        "    torch.cuda.Stream(stream_id=h, device_index=device, device_type=1)",  # no guard: fine
        "    torch.cuda.current_stream(device)",           # fine
    ])
    found = context_switches(source)
    assert [line for line, _, _ in found] == [6, 8, 10, 11, 12, 13, 14, 15, 16, 17, 19], found
    assert {fn for _, fn, _ in found} == {"f"}


def test_the_detector_finds_cupy_allocations_outside_the_guard():
    source = "\n".join([
        "import cupy",
        "from cupy import zeros as z",
        "def f(comm):",
        "    cupy.empty(4)",                          # 4
        "    z(4)",                                   # 5: aliased
        "    s = cupy.cuda.Stream(non_blocking=True)",  # 6
        "    with comm._context.current():",
        "        cupy.empty(4)",                      # inside the guard: fine
        "        cupy.cuda.Stream()",                 # fine
        "    cupy.asnumpy(x)",                        # no allocation on the device: fine
    ])
    assert [(line, fn) for line, fn, _ in unguarded_allocations(source)] == [(4, "f"), (5, "f"), (6, "f")]


def _modules() -> list[Path]:
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p != GUARD)
    assert len(modules) > 40
    return modules


def test_no_module_of_ubnext_reads_ambient_cuda_state_outside_the_guard():
    reads = [f"{p.relative_to(PACKAGE.parent)}:{line}: {what}"
             for p in _modules() for line, what in ambient_reads(p.read_text())]
    assert reads == [], "ambient CUDA state read outside ubnext/_interop/context.py:\n" + "\n".join(reads)


def test_no_module_of_ubnext_sets_the_device_or_enters_torchs_guards_outside_the_guard():
    found = [f"{p.relative_to(PACKAGE)}:{line} ({fn}): {what}" for p in _modules()
             for line, fn, what in context_switches(p.read_text())
             if (p.relative_to(PACKAGE).as_posix(), fn) not in SETS_ON_PURPOSE]
    assert found == [], ("device or context set, or torch's guards entered, outside ubnext/_interop/context.py "
                         "(call it through keep_current, or not at all):\n" + "\n".join(found))


def test_no_cupy_allocation_or_stream_is_made_outside_the_guard():
    found = [f"{p.relative_to(PACKAGE)}:{line} ({fn}): {call}" for p in _modules()
             for line, fn, call in unguarded_allocations(p.read_text())
             if (p.relative_to(PACKAGE).as_posix(), fn) not in IN_THE_GUARD]
    assert found == [], "CuPy allocations or streams outside a section or context.current():\n" + "\n".join(found)


def test_the_exceptions_name_places_that_exist():
    """Every entry of the lists above is still a function that does what it is excused for."""
    for table, detect in ((IN_THE_GUARD, unguarded_allocations), (SETS_ON_PURPOSE, context_switches)):
        for module, fn in table:
            assert fn in {f for _, f, _ in detect((PACKAGE / module).read_text())}, (module, fn)
