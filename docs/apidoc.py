"""The API reference (docs/API.md), generated from ubnext's docstrings, and the rules
those docstrings keep.

    python docs/apidoc.py > docs/API.md

The public API is every name of ``ubnext.__all__``, ``ubnext.bootstrap.__all__``,
``ubnext.torch.__all__``, ``ubnext.torch.functional.__all__``, ``ubnext.torch.moe.__all__`` and ``ubnext.torch.backend.__all__`` and every public method
and property of their classes (:func:`entries`). A callable's
docstring (a class's: its constructor's) says, checked by :func:`problems`:

* ``Args:`` where it takes arguments, ``Returns:`` where it returns something (a
  ``return`` with a value in its body, or a return annotation other than None), and
  ``Raises:`` always;
* a line ``Collective: yes ...`` or ``Collective: no ...`` (must every rank call it?);
* a line ``Graph-capturable: yes ...`` or ``Graph-capturable: no ...`` (may it run
  while a CUDA graph is being captured?).

Abstract classes, exceptions, properties, constants and modules need a description only (constants: a
``#:`` comment above their assignment). A method or property that overrides a documented
one without a docstring of its own keeps the base's contract and is documented there. tests/test_apidoc.py checks both the rules and
that docs/API.md is what this script prints.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ubnext  # noqa: E402
import ubnext.bootstrap  # noqa: E402

#: the lines a callable's docstring must hold, by their first word
FLAGS = ("Collective:", "Graph-capturable:")
#: where the reference is committed
API_MD = Path(__file__).resolve().parent / "API.md"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One documented name.

    Attributes:
        name: its full name, e.g. ``ubnext.Communicator.all_reduce``.
        kind: ``"class"``, ``"abstract class"``, ``"function"``, ``"method"``,
            ``"property"``, ``"exception"``, ``"constant"`` or ``"module"``.
        signature: the call signature (callables), else "".
        doc: its docstring (a constant's ``#:`` comment), dedented; "" where there is none.
        params: whether it takes arguments (callables).
        returns: whether it returns something (callables but classes).
    """

    name: str
    kind: str
    signature: str
    doc: str
    params: bool = False
    returns: bool = False

    @property
    def callable(self) -> bool:
        return self.kind in ("class", "function", "method")


def entries() -> list[Entry]:
    """Every public name of ubnext, in the order of the reference: ``ubnext``'s classes,
    functions, constants and exceptions, then ``ubnext.bootstrap`` and its names; a
    class's methods and properties follow it, in the order they are defined."""
    out = []
    for module in modules():
        if module is not ubnext:
            out.append(Entry(module.__name__, "module", "", _doc(module)))
        names = [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]
        for name in sorted(names, key=lambda n: _KIND_ORDER.index(_kind(getattr(module, n)))):
            out += _entries_of(f"{module.__name__}.{name}", getattr(module, name), module)
    return out


_KIND_ORDER = ("class", "function", "constant", "exception")


def modules() -> list:
    """The documented modules: ``ubnext``, ``ubnext.bootstrap``, and, where torch is
    installed, ``ubnext.torch``, ``ubnext.torch.functional``, ``ubnext.torch.moe`` and ``ubnext.torch.backend``."""
    out = [ubnext, ubnext.bootstrap]
    try:
        return out + [importlib.import_module(m) for m in ("ubnext.torch", "ubnext.torch.functional", "ubnext.torch.moe",
                                                           "ubnext.torch.backend")]
    except ImportError:  # no torch: the reference lacks ubnext.torch (tests/test_apidoc.py skips the comparison)
        return out


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) else "constant"


def _entries_of(name: str, obj: Any, module: Any) -> list[Entry]:
    kind = _kind(obj)
    if kind == "constant":
        return [Entry(name, kind, "", _comment(name.rsplit(".", 1)[1], obj, module))]
    if kind == "exception":
        return [Entry(name, kind, "", _doc(obj))]
    if kind == "function":
        return [_callable(name, kind, obj, obj)]
    if inspect.isabstract(obj):  # no constructor to document: its implementations have theirs
        out = [Entry(name, "abstract class", "", _doc(obj))]
    else:
        init = obj.__init__ if "__init__" in vars(obj) or dataclasses.is_dataclass(obj) else None
        out = [_callable(name, kind, obj, init)]
    for attr, value in _members(obj):
        if attr.startswith("_") or _inherits_doc(obj, attr, value):
            continue
        if isinstance(value, property):
            out.append(Entry(f"{name}.{attr}", "property", "", _doc(value)))
        elif isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
            func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            out.append(_callable(f"{name}.{attr}", "method", getattr(obj, attr), func))
    return out


def _members(cls: type) -> list:
    """``cls``'s attributes, then those it takes from bases in ubnext's private modules (the
    Communicator's collectives are such bases: ``ubnext._api.collectives``)."""
    members: dict = {}
    for klass in cls.__mro__:
        if klass is cls or klass.__module__.startswith("ubnext._"):
            for attr, value in vars(klass).items():
                members.setdefault(attr, value)
    return list(members.items())


def _inherits_doc(cls: type, attr: str, value: Any) -> bool:
    """Whether ``attr`` overrides a documented method or property of a base class without a
    docstring of its own: it keeps the base's contract, documented there."""
    own = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    return not own.__doc__ and any(getattr(getattr(base, attr, None), "__doc__", None) for base in cls.__mro__[1:])


def _callable(name: str, kind: str, obj: Any, func: Any) -> Entry:
    """The entry of a function, method or class (``func``: the code that runs: the
    function, or the class's ``__init__``, or None where it has none of its own)."""
    if func is None:
        return Entry(name, kind, "()", _doc(obj))
    if dataclasses.is_dataclass(obj):  # its fields are the README's configuration table
        signature = "(**fields)"
    else:  # names and defaults: the types are in the docstring
        bare = [p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(obj).parameters.values()
                if p.name != "self"]
        signature = str(inspect.Signature(bare)).replace("'", '"')
    params = any(p.name not in ("self", "cls") for p in inspect.signature(func).parameters.values())
    returns = kind != "class" and _returns(func)
    return Entry(name, kind, signature, _doc(obj), params, returns)


def _returns(func: Any) -> bool:
    """Whether ``func`` returns something: a return annotation other than None, or a
    ``return`` with a value other than None in its own body (not in nested functions)."""
    annotation = inspect.signature(func).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None")
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    todo = list(ast.iter_child_nodes(tree.body[0]))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            return True
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        todo += ast.iter_child_nodes(node)
    return False


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def _comment(name: str, value: Any, module: Any) -> str:
    """The ``#:`` comment above ``name``'s assignment in the module that defines it."""
    for candidate in (module, *(sys.modules[m] for m in sorted(sys.modules) if m.startswith("ubnext."))):
        if getattr(candidate, name, None) is not value or not getattr(candidate, "__file__", None):
            continue
        lines = Path(candidate.__file__).read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"^{re.escape(name)}\s*(:[^=]*)?=", line):
                comment = []
                while i > 0 and lines[i - 1].startswith("#:"):
                    i -= 1
                    comment.insert(0, lines[i][2:].strip())
                if comment:
                    return " ".join(comment)
    return ""


def problems(entry: Entry) -> list[str]:
    """What ``entry``'s docstring lacks (empty: it keeps the rules of this module)."""
    if not entry.doc:
        return ["a docstring" if entry.kind != "constant" else "a #: comment above its assignment"]
    if not entry.callable:
        return []
    lines = [line.strip() for line in entry.doc.splitlines()]
    missing = []
    for section, needed in (("Args:", entry.params), ("Returns:", entry.returns), ("Raises:", True)):
        if needed and section not in lines:
            missing.append(section)
    for flag in FLAGS:
        if not any(re.match(rf"^{flag} (yes|no)\b", line) for line in lines):
            missing.append(f"a line '{flag} yes|no ...'")
    return missing


def render(items: list[Entry]) -> str:
    """docs/API.md."""
    out = ["# ubnext API reference", "",
           "Generated from the docstrings by `python docs/apidoc.py > docs/API.md`; `tests/test_apidoc.py` checks",
           "that this file is current and that every callable's docstring gives `Args:` (where it takes",
           "arguments), `Returns:` (where it returns something), `Raises:`, whether it is collective",
           "(`Collective: yes|no`: must every rank call it, in the same order?) and whether it can be captured",
           "in a CUDA graph (`Graph-capturable: yes|no`). Configuration fields: the README's Configuration",
           "table.", "", "## Contents", ""]
    for e in items:
        if e.kind in ("class", "abstract class", "function", "module", "constant", "exception"):
            out.append(f"- [`{e.name}`](#{_anchor(e.name)}) ({e.kind})")
    for e in items:
        depth = "###" if e.kind in ("method", "property") else "##"
        short = e.name if depth == "##" else ".".join(e.name.split(".")[-2:])
        title = f"{short}{e.signature}" if e.callable else short
        out += ["", f"{depth} {e.kind}: `{title}`" if e.kind != "module" else f"{depth} module: `{e.name}`",
                f'<a id="{_anchor(e.name)}"></a>', ""]
        if e.doc:
            out += ["```text", e.doc, "```"]
    return "\n".join(out) + "\n"


def _anchor(name: str) -> str:
    return name.lower().replace(".", "-")


if __name__ == "__main__":
    sys.stdout.write(render(entries()))
