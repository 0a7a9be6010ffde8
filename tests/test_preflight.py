"""One-line errors before any collective setup (ubnext._environment.preflight), from faked CuPy
failures, and what Communicator construction and close do with the bootstrap it
made itself (closed) or was given (left open)."""

from __future__ import annotations

import sys
import types

import bench_fakes as fakes
import pytest
from stream_fakes import fake_context

import ubnext
from ubnext._api import communicator as _comm
from ubnext._environment import preflight as _preflight
from ubnext._environment.config import Config
from ubnext._protocol.errors import UbnextError
from ubnext.bootstrap import SelfBootstrap


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


def fake_cupy(monkeypatch, count=None, error=None, driver=0, runtime=13020):
    """A ``cupy`` whose runtime reports ``count`` devices or raises ``error``; the driver
    check (``_install``) sees ``driver`` and CuPy's ``runtime``."""
    from ubnext._environment import install as _install

    versions = _install.CudaVersions(driver, (("cupy-cuda13x 14.2.0", runtime),))
    monkeypatch.setattr(_install, "query_versions", lambda op="": versions)
    monkeypatch.setattr(_install, "check_packages", lambda op="", version=None: None)
    def get_count():
        if error is not None:
            raise error
        return count

    rt = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError, getDeviceCount=get_count,
                               driverGetVersion=lambda: driver, runtimeGetVersion=lambda: runtime)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=rt)
    monkeypatch.setitem(sys.modules, "cupy", cupy)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(error=CUDARuntimeError(35, "cudaErrorInsufficientDriver: CUDA driver version is insufficient")),
     r"no GPU: no NVIDIA driver is loaded \(cudaErrorInsufficientDriver\); run on a node with an NVIDIA GPU"),
    (dict(error=CUDARuntimeError(35, "cudaErrorInsufficientDriver: ..."), driver=12080),
     r'CUDA driver 12.8 is older than the CUDA 13.2 runtime of cupy-cuda13x 14.2.0; install "ubnext\[cu12\]" '
     r"or update the driver to CUDA 13"),
    (dict(error=CUDARuntimeError(100, "cudaErrorNoDevice: no CUDA-capable device is detected")),
     r"no GPU: CUDA sees no device \(cudaErrorNoDevice; CUDA_VISIBLE_DEVICES is ''\); run on a GPU node"),
    (dict(count=0), r"no GPU: the CUDA driver reports no device; run on a GPU node"),
    (dict(error=CUDARuntimeError(999, "cudaErrorUnknown: unknown error")),
     r"CUDA cannot start \(cudaErrorUnknown: unknown error\); check the GPU and its driver with nvidia-smi"),
])
def test_gpu_problems_are_one_line(monkeypatch, kwargs, message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fake_cupy(monkeypatch, **kwargs)
    assert _preflight.gpu_problem() is not None
    with pytest.raises(UbnextError, match=rf"^Communicator: {message}") as info:
        _preflight.check("Communicator", Config())
    assert "\n" not in str(info.value)


def test_cupy_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert _preflight.gpu_problem().startswith("CuPy is not importable")


def test_a_usable_gpu_passes(monkeypatch):
    fake_cupy(monkeypatch, count=1, driver=13000)
    assert _preflight.gpu_problem() is None
    _preflight.check("Communicator", Config())


def test_nccl_is_required_only_where_every_call_goes_to_it(monkeypatch):
    fakes.install(monkeypatch)  # its nccl cannot be loaded
    monkeypatch.setattr(_preflight, "gpu_problem", lambda: None)
    from ubnext._environment import install as _install

    monkeypatch.setattr(_install, "check_driver", lambda op="", versions=None: None)
    _preflight.check("Communicator", Config())
    with pytest.raises(UbnextError, match=r"^Communicator: cupy cannot load the NCCL library; install it with "
                                          r"'pip install nvidia-nccl-cu13'"):
        _preflight.check("Communicator", Config(algorithm="nccl"))


def test_communicator_without_gpu_raises_before_the_bootstrap(monkeypatch):
    monkeypatch.setattr(_preflight, "gpu_problem", lambda: "no GPU: faked")
    monkeypatch.setattr(ubnext.bootstrap, "default", lambda: pytest.fail("bootstrap created before the check"))
    with pytest.raises(UbnextError, match="^Communicator: no GPU: faked$"):
        ubnext.Communicator()


# -- the bootstrap a communicator made is its own to close -----------------------------

@pytest.fixture
def cpu_comm(monkeypatch):
    """Communicator construction on fakes, NCCL only (no pool), multicast off; returns
    the list of the bootstraps ``default()`` made."""
    fakes.install(monkeypatch)
    monkeypatch.setattr(sys.modules["cupy"].cuda.runtime, "getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(_preflight, "check", lambda op, config: None)
    monkeypatch.setattr(_comm, "map_devices", lambda local, device, current: 0)
    monkeypatch.setattr(_comm, "Context", fake_context)
    made: list[SelfBootstrap] = []
    monkeypatch.setattr(ubnext.bootstrap, "default", lambda: made.append(SelfBootstrap()) or made[-1])
    return made


def test_close_releases_the_default_bootstrap(cpu_comm):
    comm = ubnext.Communicator(algorithm="nccl", nvls="0")
    assert comm.bootstrap is cpu_comm[0] and not cpu_comm[0].closed
    comm.close()
    assert cpu_comm[0].closed


def test_close_leaves_a_given_bootstrap_open(cpu_comm):
    mine = SelfBootstrap()
    ubnext.Communicator(bootstrap=mine, algorithm="nccl", nvls="0").close()
    assert not mine.closed and not cpu_comm


@pytest.mark.parametrize("given", [False, True])
def test_failed_construction_releases_only_the_default_bootstrap(cpu_comm, monkeypatch, given):
    def fail(local, device, current):
        raise UbnextError("Communicator: local rank 1: device 5 does not exist (1 visible)")

    monkeypatch.setattr(_comm, "map_devices", fail)
    mine = SelfBootstrap() if given else None
    with pytest.raises(UbnextError, match="device 5 does not exist"):
        ubnext.Communicator(bootstrap=mine, algorithm="nccl", nvls="0")
    if given:
        assert not mine.closed and not cpu_comm
    else:
        assert cpu_comm[0].closed
