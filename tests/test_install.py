"""The install checks of ``ubnext._environment.install``: ``import ubnext`` names the install lines
when CuPy or cuda-bindings is missing, ``check_packages`` refuses mixed CUDA packages,
and ``check_driver`` gives one line when the driver is older than a CUDA runtime
ubnext loads. Fakes stand in for module lookup, package metadata and the CUDA version
queries, so every case runs without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ubnext import UbnextError
from ubnext._environment import install as _install
from ubnext._environment.install import CHOICES, CudaVersions, check_driver, check_install, check_packages

REPO_ROOT = Path(__file__).resolve().parents[1]


def installed(**versions):
    """A fake ``version`` lookup for an environment with these distributions (``_`` for ``-``)."""
    return {name.replace("_", "-"): v for name, v in versions.items()}.get


# --------------------------------------------------------------------------- check_install (import ubnext)


def test_importable_cupy_and_bindings_pass():
    assert check_install(importable=lambda module: True) is None


def test_a_bare_install_names_the_choices():
    with pytest.raises(UbnextError) as info:
        check_install(importable=lambda module: module not in ("cupy", "cuda.bindings"))
    message = str(info.value)
    assert message == f"import ubnext: CuPy is not installed; {CHOICES}"
    assert '"ubnext[cu13]"' in message and '"ubnext[cu12]"' in message and "\n" not in message


def test_missing_cuda_bindings_names_the_choices():
    with pytest.raises(UbnextError, match=r"^import ubnext: cuda-bindings is not installed; install ubnext with"):
        check_install(importable=lambda module: module != "cuda.bindings")


# --------------------------------------------------------------------------- check_packages (metadata)


@pytest.mark.parametrize("cupy, bindings, major", [("cupy-cuda13x", "13.5.0", 13), ("cupy-cuda12x", "12.9.10", 12)])
def test_one_cupy_build_and_matching_bindings_pass(cupy, bindings, major):
    assert check_packages(version=installed(**{cupy: "14.2.0", "cuda_bindings": bindings})) == major


def test_a_source_build_of_cupy_has_no_known_major():
    assert check_packages(version=installed(cupy="14.0.0", cuda_bindings="13.5.0")) is None


def test_packages_on_the_path_without_metadata_pass():
    assert check_packages(version=installed()) is None


def test_two_cupy_builds_are_refused():
    with pytest.raises(UbnextError) as info:
        check_packages("Communicator", installed(cupy_cuda12x="14.2.0", cupy_cuda13x="14.2.0", cuda_bindings="13.5.0"))
    assert str(info.value).startswith("Communicator: several CuPy builds are installed (cupy-cuda12x 14.2.0, "
                                      "cupy-cuda13x 14.2.0) and overwrite each other's files; pip uninstall all")


def test_cupy_and_bindings_of_different_majors_are_refused():
    with pytest.raises(UbnextError) as info:
        check_packages(version=installed(cupy_cuda12x="14.2.0", cuda_bindings="13.5.0"))
    assert str(info.value) == ("check_packages: cupy-cuda12x 14.2.0 is for CUDA 12 but cuda-bindings 13.5.0 is for "
                               f"CUDA 13; {CHOICES}")


def test_cupy_for_cuda11_is_refused():
    with pytest.raises(UbnextError, match=r"cupy-cuda11x 13.6.0 is for CUDA 11, which ubnext does not support"):
        check_packages(version=installed(cupy_cuda11x="13.6.0", cuda_bindings="12.9.0"))


def test_import_ubnext_without_cupy_fails_with_one_line(tmp_path):
    """A real import in an interpreter where ``cupy`` is not importable and has no metadata."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import importlib.abc, importlib.metadata, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cupy' or name.startswith('cupy.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "_version = importlib.metadata.version\n"
        "def version(name):\n"
        "    if name.startswith('cupy'):\n"
        "        raise importlib.metadata.PackageNotFoundError(name)\n"
        "    return _version(name)\n"
        "importlib.metadata.version = version\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", "import ubnext"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"ubnext._protocol.errors.UbnextError: import ubnext: CuPy is not installed; {CHOICES}"


# --------------------------------------------------------------------------- check_driver


def versions(driver, cupy=13020, bindings=13050, nvrtc=13050):
    return CudaVersions(driver, (("cupy-cuda13x 14.2.0", cupy), ("cuda-bindings 13.5.0", bindings), ("NVRTC", nvrtc)))


@pytest.mark.parametrize("driver", [13000, 13020, 13080, 14000])
def test_a_driver_of_the_runtimes_major_or_newer_passes(driver):
    v = versions(driver)
    assert check_driver(versions=v) is v


def test_a_cuda12_driver_under_cuda13_packages_names_both_versions_and_the_fix():
    with pytest.raises(UbnextError) as info:
        check_driver("Communicator", versions(12040))
    assert str(info.value) == ('Communicator: CUDA driver 12.4 is older than the CUDA 13.2 runtime of cupy-cuda13x '
                               '14.2.0; install "ubnext[cu12]" or update the driver to CUDA 13')


def test_the_first_too_new_runtime_is_named():
    with pytest.raises(UbnextError, match=r"older than the CUDA 13.5 runtime of NVRTC;"):
        check_driver(versions=versions(12090, cupy=12090, bindings=12090, nvrtc=13050))


def test_a_driver_older_than_any_extra_asks_for_an_update():
    with pytest.raises(UbnextError, match=r"^check_driver: CUDA driver 11.8 is older than the CUDA 12.9 runtime of "
                                          r"cupy-cuda12x 14.2.0; update the driver to CUDA 12 or 13$"):
        check_driver(versions=CudaVersions(11080, (("cupy-cuda12x 14.2.0", 12090),)))


def test_no_driver_says_so():
    with pytest.raises(UbnextError, match=r"^Communicator: no CUDA driver is loadable \(libcuda.so.1 not found\); "
                                          r"install the NVIDIA driver for CUDA 13 or newer$"):
        check_driver("Communicator", versions(0))


def test_check_driver_queries_the_installed_runtimes(monkeypatch):
    """The real version queries, with only the driver's faked: one major older than CuPy's build."""
    import cupy

    real = _install.query_versions()
    names = [what.split()[0] for what, _ in real.runtimes]
    assert names[1:] == ["cuda-bindings", "NVRTC"] and names[0].startswith("cupy")
    cupy_code = real.runtimes[0][1]
    major = cupy_code // 1000
    assert major in (12, 13) and all(code // 1000 == major for _, code in real.runtimes), real

    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: (major - 1) * 1000 + 40)
    fix = ('install "ubnext[cu12]" or update the driver to CUDA 13' if major == 13
           else "update the driver to CUDA 12 or 13")
    with pytest.raises(UbnextError) as info:
        check_driver()
    assert str(info.value) == (f"check_driver: CUDA driver {major - 1}.4 is older than the CUDA "
                               f"{_install.version_text(cupy_code)} runtime of {real.runtimes[0][0]}; {fix}")

    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: major * 1000)
    assert check_driver().driver == major * 1000


def test_check_driver_checks_the_packages_first(monkeypatch):
    two = installed(cupy_cuda12x="14.2.0", cupy_cuda13x="14.2.0", cuda_bindings="13.5.0")
    monkeypatch.setattr(_install, "_installed_version", two)
    monkeypatch.setattr(_install, "query_versions", lambda op: pytest.fail("versions queried before the packages"))
    with pytest.raises(UbnextError, match=r"^Communicator: several CuPy builds are installed"):
        check_driver("Communicator")


def test_nvrtc_that_does_not_load_names_the_install_line(monkeypatch):
    import cupy

    def missing():
        raise RuntimeError("CuPy failed to load libnvrtc.so.13: OSError: cannot open shared object file")

    monkeypatch.setattr(cupy.cuda.nvrtc, "getVersion", missing)
    with pytest.raises(UbnextError, match=r"^query_versions: NVRTC, which compiles ubnext's kernels, is not "
                                          r"loadable \(RuntimeError: CuPy failed to load libnvrtc.so.13: .*\); "
                                          r"install ubnext with the extra"):
        _install.query_versions()


def test_info_prints_the_driver_check(monkeypatch):
    from ubnext._tools import info as _info

    monkeypatch.setattr(_info, "check_driver", lambda op: CudaVersions(13000, (("cupy-cuda13x 14.2.0", 13020),)))
    assert _info.driver_check() == "driver check: ok, CUDA driver 13.0 runs cupy-cuda13x 14.2.0 (CUDA 13.2)"
    assert _info.driver_check() in _info.versions()

    def too_old(op):
        return check_driver(op, versions(12040))

    monkeypatch.setattr(_info, "check_driver", too_old)
    assert _info.driver_check().startswith("driver check: CUDA driver 12.4 is older than the CUDA 13.2 runtime")
