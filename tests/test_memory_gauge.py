"""The GPU tests' memory gauge (tests/memory_gauge.py) without a GPU: NVML's answers and
the device's free memory stand in, one rank (a world whose collectives return this rank's
part alone)."""

from __future__ import annotations

import os

import pytest

import memory_gauge as mg

BUS = "00000000:18:00.0"
OTHER_PID = os.getpid() + 1


class World:
    """One rank's MPI world."""

    def __init__(self):
        self.barriers = 0

    def allgather(self, obj):
        return [obj]

    def Barrier(self):
        self.barriers += 1


@pytest.fixture
def device(monkeypatch):
    """``state``: what NVML lists (``processes``) and the device's memory (``free``,
    ``total``) as the gauge reads them."""
    import cupy

    state = {"processes": [], "free": 60 << 30, "total": 80 << 30}
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetPCIBusId", lambda device: BUS)
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (state["free"], state["total"]))
    monkeypatch.setattr(mg, "nvml_processes", lambda device: list(state["processes"]))
    return state


def test_where_nvml_names_this_process_its_own_usage_is_read(device):
    device["processes"] = [(OTHER_PID, 5 << 30), (os.getpid(), 1 << 30)]
    gauge = mg.MemoryGauge(World(), 0)
    assert (gauge.how, gauge.slack) == ("process", mg.SLACK_BYTES)
    assert gauge.read() == 1 << 30
    device["processes"] = [(OTHER_PID, 9 << 30), (os.getpid(), 1 << 30)]
    device["free"] -= 4 << 30  # another process allocates: not this one's
    assert gauge.read() == 1 << 30


def test_where_nvml_stops_naming_this_process_the_gauge_skips_saying_so(device):
    device["processes"] = [(os.getpid(), 1 << 30)]
    gauge = mg.MemoryGauge(World(), 0)
    assert gauge.how == "process"
    device["processes"] = [(os.getpid(), None)]
    with pytest.raises(pytest.skip.Exception, match="NVML stopped reporting this process"):
        gauge.read()
    device["processes"] = []
    with pytest.raises(pytest.skip.Exception, match="NVML stopped reporting this process"):
        gauge.read()


def test_where_nvml_hides_the_pid_the_device_is_read_while_only_this_job_is_on_it(device):
    device["processes"] = [(OTHER_PID, None)]  # this process, under another pid
    gauge = mg.MemoryGauge(World(), 0)
    assert gauge.how == "device"
    assert gauge.read() == 20 << 30
    device["processes"].append((OTHER_PID + 1, 2 << 30))  # another job came
    with pytest.raises(pytest.skip.Exception, match="lists 2 compute process"):
        gauge.read()


@pytest.mark.parametrize("processes", [[], [(OTHER_PID, None), (OTHER_PID + 1, 1 << 30)]],
                         ids=["none listed", "another job"])
def test_where_nothing_tells_this_process_apart_the_gauge_skips(device, processes):
    device["processes"] = processes
    with pytest.raises(pytest.skip.Exception, match="NVML does not name this process"):
        mg.MemoryGauge(World(), 0)


def test_assert_memory_given_back_fails_on_a_held_segment_and_passes_once_it_goes(device):
    device["processes"] = [(os.getpid(), 1 << 30)]
    held = []

    def leak():
        held.append(64 << 20)
        device["processes"] = [(os.getpid(), (1 << 30) + sum(held))]

    with pytest.raises(AssertionError, match=r"^device memory held grew by 192 MiB after 3 leaks \(measured: process"):
        mg.assert_memory_given_back(World(), 0, leak, 3, "leaks")
    mg.assert_memory_given_back(World(), 0, lambda: None, 3, "cycles")


def test_nvml_processes_reads_cuda_bindings_entries(monkeypatch):
    """The ``cuda.bindings.nvml`` path: every entry of its ProcessInfo array, NVML's
    "not available" (an unsigned -1) as None, NVML shut down after the query."""
    import cupy
    nvml = pytest.importorskip("cuda.bindings.nvml")

    infos = nvml.ProcessInfo(2)
    infos.pid = [11, 12]
    infos.used_gpu_memory = [3 << 20, (1 << 64) - 1]
    calls = []
    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetPCIBusId", lambda device: BUS)
    monkeypatch.setattr(nvml, "init_v2", lambda: calls.append("init"))
    monkeypatch.setattr(nvml, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(nvml, "device_get_handle_by_pci_bus_id_v2", lambda bus: calls.append(bus) or 7)
    monkeypatch.setattr(nvml, "device_get_compute_running_processes_v3", lambda handle: infos)
    assert mg.nvml_processes(0) == [(11, 3 << 20), (12, None)]
    assert calls == ["init", BUS, "shutdown"]
