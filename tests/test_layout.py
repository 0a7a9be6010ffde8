"""The package layout (docs/architecture.md): every module of ubnext belongs to one layer,
and imports only from its own layer and the layers below it, at module level or inside a
function alike. A new module lands in a package named after its concept; a new import
that points upward fails here with the line that makes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ubnext"

#: lowest first: a layer may import itself and what is listed before it
LAYERS = (
    "_version",      # the version string
    "_protocol",     # the host-kernel contract: constants, algorithm table, signatures, errors, quantized formats
    "_environment",  # this machine and process: CUDA driver gate, install, configuration, log, devices, NVLS gate
    "bootstrap",     # the ranks' host channel (public package)
    "_interop",      # the caller's arrays, streams and CUDA context
    "_memory",       # the symmetric pool and what lives in it
    "_selection",    # which algorithm a call takes
    "_engine",       # the kernels, their launch, NCCL, the node's resources
    "_moe",          # expert parallelism: dispatch and combine over the pool
    "_api",          # the Communicator
    "torch",         # torch ops and layers over the Communicator (public package)
    "_tools",        # selftest, info, what tune and the benchmarks share
    "",              # ubnext/__init__.py, __main__.py, tune.py: the public entry points
)

#: upward imports that are the design, each made inside the function that needs it
ALLOWED_UPWARD = {
    # a collective called while torch.compile traces becomes a torch.ops.ubnext op
    ("_api", "torch"): "torch.compile hands a traced call to ubnext.torch",
    # an expert-parallel object gets its handle at construction, as a Communicator does
    ("_moe", "_api"): "ExpertParallel's int handle for the ubnext.torch.moe ops (_api.handles)",
}


def layer_of(module: str) -> str:
    """``ubnext._api.communicator`` -> ``_api``; ``ubnext.tune`` and ``ubnext`` -> ``""``."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    head = parts[1]
    if head in LAYERS:
        return head
    return "" if len(parts) == 2 else head


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of ubnext in ``path``, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ubnext"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ubnext":
                continue
            for a in node.names:  # `from ubnext._api import communicator` names a module
                sub = f"{target}.{a.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").is_file()
                found.append((node.lineno, sub if is_module else target))
    return found


def in_functions(path: Path) -> set[int]:
    """The lines of the imports in ``path`` that are made inside a function (run when it is
    called, not when the module is imported)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lines.update(n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return lines


def upward(path: Path) -> list[str]:
    """The imports of ``path`` that point up the layers: any not in ALLOWED_UPWARD, and an
    allowed one made at module level (it must be made inside the function that needs it,
    so that importing the lower layer does not import the upper one)."""
    mine = layer_of(module_name(path))
    inside = in_functions(path)
    found = []
    for line, target in imports(path):
        theirs = layer_of(target)
        if LAYERS.index(theirs) <= LAYERS.index(mine):
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{line}: {target} ({mine or 'entry'} -> {theirs or 'entry'})"
        if (mine, theirs) not in ALLOWED_UPWARD:
            found.append(where)
        elif line not in inside:
            found.append(where + " at module level; allowed only inside the function that needs it")
    return found


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_belongs_to_a_layer():
    stray = [module_name(p) for p in modules() if layer_of(module_name(p)) not in LAYERS]
    assert stray == [], f"modules outside the layers of tests/test_layout.py: {stray}"


def test_top_level_holds_only_entry_points():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_version.py", "tune.py"], top


@pytest.mark.parametrize("path", modules(), ids=lambda p: module_name(p))
def test_imports_point_down(path):
    found = upward(path)
    assert found == [], "imports pointing up the layers:\n" + "\n".join(found)


def test_an_allowed_upward_import_counts_only_inside_a_function(tmp_path, monkeypatch):
    """The one allowed upward import (_api -> torch) passes inside a function and fails
    at module level; an upward import that is not allowed fails inside a function too."""
    root = tmp_path / "ubnext"
    (root / "_api").mkdir(parents=True)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", root)
    module = root / "_api" / "planted.py"
    module.write_text("def call():\n    from ubnext.torch import _traced\n")
    assert upward(module) == []
    module.write_text("from ubnext.torch import _traced\n")
    assert upward(module) == ["ubnext/_api/planted.py:1: ubnext.torch (_api -> torch) at module level; "
                              "allowed only inside the function that needs it"]
    module.write_text("def call():\n    from ubnext._tools import info\n")
    assert upward(module) == ["ubnext/_api/planted.py:2: ubnext._tools (_api -> _tools)"]


def test_the_checker_resolves_relative_and_module_imports(tmp_path):
    """The parser sees through the spellings an upward import could take."""
    assert layer_of("ubnext._api.communicator") == "_api" and layer_of("ubnext") == ""
    assert layer_of("ubnext.tune") == "" and layer_of("ubnext.torch._ops") == "torch"
    got = dict((t, n) for n, t in imports(PACKAGE / "_engine" / "node.py"))
    assert "ubnext._memory.pool" in got and "ubnext._engine.engine" in got
    assert ("_api", "torch") in ALLOWED_UPWARD and LAYERS.index("_api") < LAYERS.index("torch")


@pytest.mark.parametrize("package", [p for p in LAYERS if p.startswith("_") and (PACKAGE / p).is_dir()])
def test_each_package_says_what_it_owns(package):
    """A package's docstring names every module in it, and what it may import."""
    doc = (PACKAGE / package / "__init__.py").read_text()
    modules = sorted(p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__")
    assert [m for m in modules if f"``{m}``" not in doc] == []
    assert "Imports:" in doc
