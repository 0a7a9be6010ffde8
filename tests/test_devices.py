"""Device mapping by UUID (ubnext._environment.devices): the assignment rule over gathered views,
the shared-GPU warning, different CUDA_VISIBLE_DEVICES lists, and the UUID query
against a fake driver; ranks are threads (thread_ranks)."""

from __future__ import annotations

import logging

import pytest
from thread_ranks import run_ranks

from ubnext._environment import devices as _devices
from ubnext._environment.devices import DeviceView, assign, map_devices, shared
from ubnext._protocol.errors import UbnextError

A, B, C, D = (f"GPU-{i}" for i in "ABCD")


@pytest.mark.parametrize(("views", "expected"), [
    ([(A, B, C, D)] * 4, [0, 1, 2, 3]),  # mpirun -n 4 on 4 GPUs
    ([(A,)] * 4, [0, 0, 0, 0]),  # 4 ranks on the one GPU of the machine
    ([(A, B)] * 4, [0, 1, 0, 1]),  # more ranks than GPUs: they spread, then share
    ([(A,), (B,), (C,), (D,)], [0, 0, 0, 0]),  # srun --gpus-per-task=1: each its own ordinal 0
    ([(A, B), (C, D)], [0, 0]),  # --gpus-per-task=2
    ([(A, B), (B, A)], [0, 0]),  # same GPUs, other order: ordinal 1 of rank 0 would be a clash
    ([(A, B, C), (A,), (A, B, C)], [1, 0, 2]),  # rank 1 can only have A; the others avoid it
])
def test_each_rank_takes_the_first_free_gpu(views, expected):
    views = [DeviceView(v) for v in views]
    ordinals = assign(views)
    assert ordinals == expected
    if len({v.visible[o] for v, o in zip(views, ordinals)}) == len(views):
        assert not shared([v.visible[o] for v, o in zip(views, ordinals)])


def test_requested_devices_are_kept_and_avoided():
    views = [DeviceView((A, B, C)), DeviceView((A, B, C), requested=0), DeviceView((A, B, C))]
    assert assign(views) == [1, 0, 2]


def test_shared_names_the_ranks_of_each_gpu():
    assert shared([A, B, A, C, A, C]) == {A: [0, 2, 4], C: [3, 5]}
    assert shared([A, B]) == {}


class UuidDriver:
    """cuInit, cuDeviceGetCount, cuDeviceGet and cuDeviceGetUuid over ``uuids`` (16 bytes each)."""

    class Uuid:
        def __init__(self, raw: bytes) -> None:
            self.bytes = raw

    def __init__(self, uuids: list[bytes]) -> None:
        self.uuids = uuids

    def cuInit(self, flags):
        return (0,)

    def cuDeviceGetCount(self):
        return 0, len(self.uuids)

    def cuDeviceGet(self, ordinal):
        return 0, ordinal

    def cuDeviceGetUuid(self, dev):
        return 0, self.Uuid(self.uuids[dev])


def raw(c: str) -> bytes:
    return bytes([ord(c)]) * 16


def test_uuid_formats_like_nvidia_smi():
    drv = UuidDriver([bytes(range(16))])
    assert _devices.device_uuid(0, drv) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert _devices.visible_uuids(UuidDriver([raw("a"), raw("b")])) == (
        "GPU-61616161-6161-6161-6161-616161616161", "GPU-62626262-6262-6262-6262-626262626262")


def test_ranks_sharing_a_gpu_are_warned_once(logged):
    drv = UuidDriver([raw("a")])  # a 1-GPU machine
    got = run_ranks(3, lambda boot: map_devices(boot, None, 0, drv))
    assert got == [0, 0, 0]
    warnings = [r.getMessage() for r in logged() if r.levelno == logging.WARNING]
    assert warnings == ["Communicator: local ranks 0, 1, 2 share one GPU (ordinal 0 here, "
                        "GPU-61616161-6161-6161-6161-616161616161); they take turns on it, so every call is "
                        "many times slower than with a GPU each: start one rank per GPU (sharing is meant "
                        "for tests)"]
    run_ranks(3, lambda boot: map_devices(boot, None, 0, drv))  # a second communicator: no new warning
    assert len([r for r in logged() if r.levelno == logging.WARNING]) == 1


def test_one_gpu_each_is_not_warned(logged):
    drv = UuidDriver([raw("a"), raw("b")])
    assert run_ranks(2, lambda boot: map_devices(boot, None, 0, drv)) == [0, 1]
    assert not logged()


def test_different_visible_lists_map_by_uuid(logged):
    """Rank 0 sees GPUs (a, b), rank 1 sees (b, a), rank 2 only (c): ordinals would clash."""
    drivers = [UuidDriver([raw("a"), raw("b")]), UuidDriver([raw("b"), raw("a")]), UuidDriver([raw("c")])]
    assert run_ranks(3, lambda boot: map_devices(boot, None, 0, drivers[boot.rank])) == [0, 0, 0]
    (record,) = logged()
    assert record.levelno == logging.INFO and "see different CUDA device lists" in record.getMessage()
    assert "2, 2, 1 devices" in record.getMessage()


def test_current_device_counts_as_requested():
    drv = UuidDriver([raw("a"), raw("b")])
    assert run_ranks(2, lambda boot: map_devices(boot, None, 1 - boot.rank, drv)) == [1, 0]


def test_a_missing_device_fails_on_every_rank():
    drv = UuidDriver([raw("a"), raw("b")])
    got = run_ranks(2, lambda boot: map_devices(boot, 5 if boot.rank == 1 else None, 0, drv))
    for error in got:
        assert isinstance(error, UbnextError)
        assert str(error) == ("Communicator: local rank 1: device 5 does not exist (2 visible); pass device= "
                              "within range or fix CUDA_VISIBLE_DEVICES")
