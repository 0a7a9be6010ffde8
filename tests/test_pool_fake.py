"""SymmetricPool against a recording fake of the CUDA driver (CPU only)."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
from fake_driver import MIB, FakeDriver, fd_is_open

from ubnext._memory.pool import PeerAccessError, SymmetricPool
from ubnext._protocol.errors import ClosedError, CudaError, UbnextError

LOCAL_SIZE = 4
LOCAL_RANK = 1
DEVICE = 3

SETUP_CALLS = (
    ["cuInit", "cuDeviceGet"]
    + ["cuMemGetAllocationGranularity"] * 2
    + ["cuMemAddressReserve", "cuMemCreate", "cuMemExportToShareableHandle"]
    + ["cuMemImportFromShareableHandle"] * (LOCAL_SIZE - 1)
    + ["cuMemMap"] * LOCAL_SIZE
    + ["cuMemSetAccess"]
)
TEARDOWN_CALLS = ["cuMemUnmap"] * LOCAL_SIZE + ["cuMemRelease"] * LOCAL_SIZE + ["cuMemAddressFree"]


def make_pool(
    fake, size=5 * MIB, received=None, local_rank=LOCAL_RANK, local_size=LOCAL_SIZE, exchange=None
):
    exchange = exchange or fake.exchange(local_rank, local_size, received)
    return SymmetricPool(DEVICE, size, local_rank, local_size, exchange, driver=fake)


@pytest.fixture
def fake():
    return FakeDriver(granularity_min=2 * MIB, granularity_recommended=4 * MIB)


def test_setup_calls_in_order(fake):
    with make_pool(fake):
        assert fake.names() == SETUP_CALLS


def test_size_rounded_to_recommended_granularity(fake):
    with make_pool(fake, size=5 * MIB) as pool:
        assert pool.stride == pool.size == 8 * MIB
        (create,) = [c for c in fake.calls if c.name == "cuMemCreate"]
        assert create.args[0] == 8 * MIB
        prop = create.args[1]
        assert prop.location.id == DEVICE
        fd_type = fake.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        assert prop.requestedHandleTypes == fd_type
        assert prop.type == fake.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED


def test_va_range_covers_all_segments(fake):
    with make_pool(fake) as pool:
        (reserve,) = [c for c in fake.calls if c.name == "cuMemAddressReserve"]
        size, alignment = reserve.args[:2]
        assert size == LOCAL_SIZE * pool.stride
        assert alignment == 4 * MIB
        assert fake.reservations == {pool.base: LOCAL_SIZE * pool.stride}


def test_segment_r_mapped_at_base_plus_r_stride(fake):
    with make_pool(fake) as pool:
        expected = {pool.base + r * pool.stride for r in range(LOCAL_SIZE)}
        assert set(fake.mappings) == expected
        assert all(size == pool.stride for size, _ in fake.mappings.values())
        own_slot = pool.base + LOCAL_RANK * pool.stride
        assert fake.mappings[own_slot][1] == int(pool.handle)
        # Every segment is backed by a different allocation.
        allocations = {fake.handles[h] for _, h in fake.mappings.values()}
        assert len(allocations) == LOCAL_SIZE


def test_access_set_over_full_range(fake):
    with make_pool(fake) as pool:
        ((va, size, descs),) = fake.access
        assert (va, size) == (pool.base, LOCAL_SIZE * pool.stride)
        (desc,) = descs
        assert desc.location.type == fake.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert desc.location.id == DEVICE
        assert desc.flags == fake.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE


def test_fds_closed_after_import(fake):
    received = []
    with make_pool(fake, received=received):
        assert len(received) == LOCAL_SIZE
        for fd in received:
            with pytest.raises(OSError):
                os.fstat(fd)
        assert [fd for fd, inode in fake.exported if fd_is_open(fd, inode)] == []


def test_teardown_order_and_nothing_left(fake):
    pool = make_pool(fake)
    n = len(fake.calls)
    pool.close()
    assert fake.names()[n:] == TEARDOWN_CALLS
    assert fake.leaks() == []


def test_close_idempotent_and_closed_state(fake):
    with make_pool(fake) as pool:
        pass
    n = len(fake.calls)
    pool.close()
    assert len(fake.calls) == n
    assert pool.closed
    for use in (lambda: pool.base, lambda: pool.handle, lambda: pool.ptr(0),
                lambda: pool.local_ptr(), lambda: pool.contains(0, 1)):
        with pytest.raises(ClosedError):
            use()


@pytest.mark.parametrize("index", range(len(SETUP_CALLS)))
def test_failure_at_every_setup_step_leaves_nothing(fake, index):
    fake.fail_at(index)
    received = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cleanup warning, no ResourceWarning
        with pytest.raises(CudaError) as info:
            make_pool(fake, received=received)
        gc.collect()
    failed = fake.calls[index]
    assert failed.failed and failed.name == SETUP_CALLS[index]
    assert info.value.call == failed.name
    assert str(info.value).split(":")[0] in (failed.name, "SymmetricPool")
    assert len(fake.calls) - index - 1 == _expected_undo_count(index)
    assert fake.leaks() == []
    assert not any(fd_is_open(fd) for fd in received)


def _expected_undo_count(index):
    """Undo calls that must follow a failure at setup call ``index``."""
    done = SETUP_CALLS[:index]
    return sum(done.count(name) for name in
               ("cuMemAddressReserve", "cuMemCreate", "cuMemImportFromShareableHandle", "cuMemMap"))


def test_import_failure_names_the_peer(fake):
    fake.fail_on("cuMemImportFromShareableHandle", occurrence=1,
                 error=fake.CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(PeerAccessError) as info:
        make_pool(fake)
    assert info.value.peer == 2  # ranks 0, 2, 3 are imported; second import is rank 2
    assert str(info.value).startswith(
        "SymmetricPool: cuMemImportFromShareableHandle failed for local rank 2: "
        "CUDA_ERROR_NOT_SUPPORTED"
    )
    assert info.value.code == int(fake.CUresult.CUDA_ERROR_NOT_SUPPORTED)
    assert fake.leaks() == []


def test_set_access_failure_is_a_peer_access_error(fake):
    fake.fail_on("cuMemSetAccess", error=fake.CUresult.CUDA_ERROR_INVALID_DEVICE)
    with pytest.raises(PeerAccessError) as info:
        make_pool(fake)
    assert info.value.peer is None
    assert str(info.value).startswith("SymmetricPool: cuMemSetAccess failed for the peer segments")
    assert fake.leaks() == []


def test_exchange_failure_leaves_nothing(fake):
    def exchange(fd):
        raise ConnectionError("peer died")

    with pytest.raises(ConnectionError):
        make_pool(fake, exchange=exchange)
    assert fake.leaks() == []


def test_exchange_wrong_count_leaves_nothing(fake):
    received = []
    inner = fake.exchange(LOCAL_RANK, LOCAL_SIZE - 1, received)
    with pytest.raises(UbnextError, match="SymmetricPool: exchange_fds returned 3 descriptors"):
        make_pool(fake, exchange=inner)
    assert fake.leaks() == []
    assert not any(fd_is_open(fd) for fd in received)


def test_teardown_failure_still_releases_the_rest(fake):
    pool = make_pool(fake)
    fake.fail_on("cuMemUnmap", occurrence=1)
    with pytest.raises(CudaError, match="^cuMemUnmap"):
        pool.close()
    assert pool.closed
    assert fake.handles == {}  # every handle released despite the failure
    assert len(fake.mappings) == 1  # only the failed one
    pool.close()  # still idempotent


def test_finalizer_warns_without_driver_calls(fake):
    pool = make_pool(fake)
    n = len(fake.calls)
    with pytest.warns(ResourceWarning, match=r"SymmetricPool\(device=3, local_rank=1, .* was not closed; its device memory"):
        del pool
        gc.collect()
    assert len(fake.calls) == n


def test_closed_pool_finalizer_is_silent(fake):
    pool = make_pool(fake)
    pool.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del pool
        gc.collect()


def test_ptr_bounds(fake):
    with make_pool(fake) as pool:
        assert pool.ptr(0) == pool.base
        assert pool.ptr(3, 10) == pool.base + 3 * pool.stride + 10
        assert pool.local_ptr(7) == pool.base + LOCAL_RANK * pool.stride + 7
        assert pool.ptr(3, pool.stride - 1) == pool.base + LOCAL_SIZE * pool.stride - 1
        for rank, offset in ((-1, 0), (LOCAL_SIZE, 0), (0, -1), (0, pool.stride)):
            with pytest.raises(IndexError, match="SymmetricPool.ptr"):
                pool.ptr(rank, offset)


def test_contains(fake):
    with make_pool(fake) as pool:
        own = pool.local_ptr()
        assert pool.contains(own, pool.stride) == 0
        assert pool.contains(own + 256, 1024) == 256
        assert pool.contains(own + pool.stride - 1, 1) == pool.stride - 1
        assert pool.contains(own + pool.stride - 1, 2) is None  # runs past the end
        assert pool.contains(own - 1, 2) is None  # starts before
        assert pool.contains(pool.ptr(0), 16) is None  # a peer's segment
        assert pool.contains(own, -1) is None


def test_single_rank(fake):
    with make_pool(fake, local_rank=0, local_size=1) as pool:
        assert "cuMemImportFromShareableHandle" not in fake.names()
        assert pool.ptr(0) == pool.base
    assert fake.leaks() == []


@pytest.mark.parametrize("size, rank, ranks", [(0, 0, 1), (MIB, 2, 2), (MIB, -1, 2)])
def test_invalid_arguments(fake, size, rank, ranks):
    with pytest.raises(ValueError, match="^SymmetricPool"):
        SymmetricPool(0, size, rank, ranks, lambda fd: [fd], driver=fake)
    assert fake.calls == []


def test_fake_refuses_unstubbed_calls(fake):
    with pytest.raises(AttributeError, match="no stub for cuMulticastCreate"):
        fake.cuMulticastCreate
