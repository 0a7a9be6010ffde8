"""What an install brings and what the project declares: the CUDA packages of one
major (CuPy, cuda-bindings, NVRTC, NCCL) that load without a GPU, the extras that
install them, the license, the version in one place, and benchmark scripts that
run on the installed ubnext rather than the checkout beside them.

CI runs this file in the ``cu13`` environment (README, "Run the tests") and in the
``cu12`` one (.ci/run's CUDA 12 gate), so both extras are checked for what they bring.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import ubnext
from ubnext._environment import install as _install

REPO_ROOT = Path(__file__).resolve().parents[1]
CUDA_MAJORS = sorted(_install.CUPY_BUILDS)


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def installed_major() -> int:
    """The CUDA major of the installed CuPy build (the environment under test)."""
    major = _install.check_packages()
    assert major in CUDA_MAJORS, f"the tests need a CuPy build of a known CUDA major, got {major}"
    return major


# --------------------------------------------------------------------------- the installed environment


def test_the_cuda_packages_are_of_one_major():
    """CuPy's build, cuda-bindings, NVRTC (through CuPy and through cuda-bindings) agree."""
    import cupy
    from cuda.bindings import nvrtc

    major = installed_major()
    assert metadata.version("cuda-bindings").split(".")[0] == str(major)
    assert cupy.cuda.runtime.runtimeGetVersion() // 1000 == major
    assert cupy.cuda.nvrtc.getVersion()[0] == major
    err, nvrtc_major, _ = nvrtc.nvrtcVersion()
    assert int(err) == 0 and nvrtc_major == major


def test_nccl_loads_without_a_gpu():
    """libnccl comes with the install and CuPy loads it: the NCCL engine's import path."""
    from ubnext._environment.install import load_nccl

    major = installed_major()
    assert metadata.version(f"nvidia-nccl-cu{major}"), "the NCCL wheel of the CUDA major is installed"
    nccl = load_nccl("test")
    assert nccl.available
    version = nccl.get_version()
    assert version >= 21801, f"NCCL {version} loaded"
    from cupy_backends.cuda.libs import nccl as backend

    assert backend.get_version() == version


def test_nvrtc_comes_from_the_cuda_extra():
    """NVRTC is a run-time dependency (the kernels compile when first used), not a test tool."""
    extras = pyproject()["project"]["optional-dependencies"]
    nvrtc = {13: "nvidia-cuda-nvrtc", 12: "nvidia-cuda-nvrtc-cu12"}
    for major in CUDA_MAJORS:
        assert nvrtc[major] in {Requirement(r).name for r in extras[f"cu{major}"]}
    assert not any("nvrtc" in Requirement(r).name for r in extras["test"])


# --------------------------------------------------------------------------- what the project declares


def test_each_cuda_extra_brings_cupy_bindings_nvrtc_and_nccl_of_its_major():
    project = pyproject()["project"]
    bare = {Requirement(r).name for r in project["dependencies"]}
    assert not any(name.startswith(("cupy", "cuda-", "nvidia-")) for name in bare), bare
    for major in CUDA_MAJORS:
        reqs = {Requirement(r).name: Requirement(r) for r in project["optional-dependencies"][f"cu{major}"]}
        nvrtc = "nvidia-cuda-nvrtc" if major >= 13 else f"nvidia-cuda-nvrtc-cu{major}"
        assert set(reqs) == {_install.CUPY_BUILDS[major], "cuda-bindings", nvrtc, f"nvidia-nccl-cu{major}"}
        for name in ("cuda-bindings", nvrtc):
            spec = reqs[name].specifier
            assert f"{major}.9" in spec and f"{major + 1}.0" not in spec and f"{major - 1}.9" not in spec, (name, spec)


def test_the_two_cuda_extras_cannot_be_installed_together():
    """Their cuda-bindings ranges share no version, so pip refuses ``ubnext[cu12,cu13]``."""
    extras = pyproject()["project"]["optional-dependencies"]
    specs = [next(Requirement(r).specifier for r in extras[f"cu{m}"] if r.startswith("cuda-bindings"))
             for m in CUDA_MAJORS]
    candidates = [f"{m}.{minor}.{patch}" for m in range(11, 16) for minor in range(12) for patch in range(12)]
    assert not [v for v in candidates if all(v in spec for spec in specs)]


def test_readme_install_lines_name_existing_extras():
    readme = (REPO_ROOT / "README.md").read_text()
    extras = set(pyproject()["project"]["optional-dependencies"])
    named = set(re.findall(r'(?:ubnext|\.)\[([a-z0-9,]+)\]', readme))
    assert {"cu13", "cu12"} <= {e for group in named for e in group.split(",")}
    for group in named:
        assert set(group.split(",")) <= extras, f"README names extra(s) {group} that pyproject.toml lacks"


def test_license_file_and_metadata():
    project = pyproject()["project"]
    text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_the_version_is_written_in_one_place():
    from ubnext import _version

    toml = pyproject()
    assert "version" not in toml["project"] and "version" in toml["project"]["dynamic"]
    assert toml["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ubnext._version.__version__"}
    assert ubnext.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", ubnext.__version__)
    init = (REPO_ROOT / "ubnext" / "__init__.py").read_text()
    assert "__version__ =" not in init
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in changelog


# --------------------------------------------------------------------------- benchmarks run on the installed ubnext

BENCH_SCRIPTS = sorted(p.name for p in (REPO_ROOT / "bench").glob("*.py")
                       if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_benchmark_scripts_import_the_installed_ubnext(script, tmp_path):
    """``python bench/<script> --help`` imports ubnext from the environment, not from the checkout.

    A copy of the package stands for the installed one (on ``PYTHONPATH``) and
    announces itself when imported; the checkout's own ``ubnext`` must stay unused.
    """
    site = tmp_path / "site"
    shutil.copytree(REPO_ROOT / "ubnext", site / "ubnext", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "ubnext" / "kernels").symlink_to(REPO_ROOT / "kernels")
    init = site / "ubnext" / "__init__.py"
    init.write_text(init.read_text() + "\nimport sys as _sys\nprint('ubnext from', __file__, file=_sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"ubnext from {site / 'ubnext' / '__init__.py'}" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- the wheel's data files


def test_the_wheel_ships_the_default_selector_table(tmp_path):
    """The wheel built from pyproject.toml holds ``ubnext/tables/default.json`` (package-data of
    ``ubnext.tables``, which has no ``__init__.py``), and an installed copy finds and loads it
    through ``importlib.resources`` (``_selection.table_format.default_table``)."""
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    needed = int(re.search(r"setuptools>=(\d+)", (REPO_ROOT / "pyproject.toml").read_text()).group(1))
    if int(setuptools.__version__.split(".")[0]) < needed:
        pytest.skip(f"building the wheel needs setuptools>={needed}, this environment has {setuptools.__version__}")
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside pyproject.toml
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in ("ubnext", "kernels"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("ubnext-*.whl")
    with zipfile.ZipFile(wheel) as z:
        tables = sorted(n for n in z.namelist() if n.startswith("ubnext/tables/"))
        assert tables == ["ubnext/tables/default.json"], tables
        z.extractall(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    code = ("import ubnext; from ubnext._selection.table_format import default_table; t = default_table(); "
            "print(ubnext.__file__); print(t.entries[0].label)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(tmp_path / "site" / "ubnext" / "__init__.py"),
                                        "NVIDIA H200 nvlink plain graph"], proc.stdout
