"""The API reference: every public name of ubnext, ubnext.bootstrap and (with torch)
ubnext.torch and ubnext.torch.functional, and every public
method of their classes, has a docstring with Args (where it takes arguments), Returns
(where it returns something), Raises, and the lines ``Collective: yes|no`` and
``Graph-capturable: yes|no``; docs/API.md is what ``python docs/apidoc.py`` prints."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import ubnext
import ubnext.bootstrap

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "docs"))  # docs/ is not part of the installed package

import apidoc  # noqa: E402

ENTRIES = apidoc.entries()
FLAGS = ["a line 'Collective: yes|no ...'", "a line 'Graph-capturable: yes|no ...'"]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_public_docstring_keeps_the_rules(entry):
    assert apidoc.problems(entry) == [], f"the docstring of {entry.name} lacks: {', '.join(apidoc.problems(entry))}"


def test_the_walk_covers_every_public_name_and_method():
    names = {e.name for e in ENTRIES}
    for module in apidoc.modules():
        for name in module.__all__:
            assert f"{module.__name__}.{name}" in names
    for cls, qual in ((ubnext.Communicator, "ubnext.Communicator"), (ubnext.Config, "ubnext.Config"),
                      (ubnext.bootstrap.Bootstrap, "ubnext.bootstrap.Bootstrap")):
        public = {n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(
            v, (property, classmethod)))}
        assert public and {f"{qual}.{n}" for n in public} <= names
    assert {"ubnext.bootstrap.StoreBootstrap.connect", "ubnext.bootstrap.TorchBootstrap.over_world",
            "ubnext.bootstrap.default", "ubnext.Communicator.nvls"} <= names


def test_an_override_without_a_docstring_keeps_its_bases_contract():
    names = {e.name for e in ENTRIES}
    assert "ubnext.bootstrap.SelfBootstrap.rank" not in names  # an undocumented override of Bootstrap.rank
    assert "ubnext.bootstrap.Bootstrap.rank" in names


def _complete(a, b=1):
    """Does something.

    Collective: no.
    Graph-capturable: yes (host only).

    Args:
        a: one.
        b: two.

    Returns:
        a sum.

    Raises:
        nothing.
    """
    return a + b


def _no_value(a):
    """Nothing returned.

    Collective: maybe.
    Graph-capturable: no.

    Args:
        a: one.

    Raises:
        nothing.
    """

    def inner():
        return a

    if a:
        return None
    return


def test_the_checker_names_what_a_docstring_lacks():
    def lacking(a):
        """Does something."""
        return a

    entry = apidoc._callable("lacking", "function", lacking, lacking)
    assert entry.params and entry.returns
    assert apidoc.problems(entry) == ["Args:", "Returns:", "Raises:"] + FLAGS
    assert apidoc.problems(apidoc._callable("c", "function", _complete, _complete)) == []
    no_value = apidoc._callable("n", "function", _no_value, _no_value)
    assert not no_value.returns  # the nested function's return does not count, nor `return None`
    assert apidoc.problems(no_value) == FLAGS[:1]  # "maybe" is not yes or no
    assert apidoc.problems(apidoc.Entry("x", "function", "()", "")) == ["a docstring"]
    assert apidoc.problems(apidoc.Entry("X", "constant", "", "")) == ["a #: comment above its assignment"]


def test_constants_are_described_by_their_comment():
    docs = {e.name: e.doc for e in ENTRIES if e.kind == "constant"}
    assert docs["ubnext.DTYPES"].startswith("dtype name -> ")
    assert set(docs) == {"ubnext.ALGORITHMS", "ubnext.DTYPES", "ubnext.OPS"}


def test_api_md_is_current():
    pytest.importorskip("torch", reason="docs/API.md documents ubnext.torch, which needs torch")
    assert apidoc.API_MD.read_text() == apidoc.render(ENTRIES), (
        "docs/API.md is not what the docstrings say: regenerate it with python docs/apidoc.py > docs/API.md")


def test_the_script_prints_the_reference():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "docs" / "apidoc.py")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == apidoc.render(ENTRIES)
    assert inspect.getsource(apidoc).count("def render") == 1
