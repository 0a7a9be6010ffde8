"""MulticastRange against a recording fake of the CUDA driver (CPU only).

The ranks of a node run as threads (``thread_ranks``) sharing one
:class:`~fake_driver.MulticastFakeDriver`, with the real ``FdChannel`` and
``SymmetricPool`` between them, so the whole collective sequence runs: local
rank 0 creates and exports, the descriptor travels, the others import, all add
their devices, agree, bind, map.
"""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
from fake_driver import MIB, MulticastFakeDriver
from thread_ranks import raise_first, run_ranks

from ubnext._memory.descriptors import FdChannel
from ubnext._memory.multicast import MulticastRange
from ubnext._memory.pool import SymmetricPool
from ubnext._protocol.errors import ClosedError, UbnextError

N = 4
POOL_BYTES = 7 * MIB  # rounded to 8 MiB by the pool (2 MiB granularity)
SEGMENT = 8 * MIB

COMMON = ["cuDeviceGet", "cuMulticastGetGranularity", "cuMulticastGetGranularity"]
MAP = ["cuMulticastAddDevice", "cuMulticastBindMem", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]
CREATOR_SETUP = COMMON + ["cuMulticastCreate", "cuMemExportToShareableHandle"] + MAP
IMPORTER_SETUP = COMMON + ["cuMemImportFromShareableHandle"] + MAP
TEARDOWN = ["cuMemUnmap", "cuMemAddressFree", "cuMulticastUnbind", "cuMemRelease"]


def make_fake(**kwargs):
    kwargs.setdefault("mc_granularity_recommended", 32 * MIB)
    return MulticastFakeDriver(**kwargs)


def on_node(fake, n, body, pool_bytes=POOL_BYTES):
    """Run ``body(boot, pool, fds)`` on every rank of an n-rank node; pool and channel
    are closed afterwards. Returns what each rank returned or raised."""

    def rank(boot):
        with FdChannel(boot, 10.0) as fds:
            with SymmetricPool(boot.rank, pool_bytes, boot.rank, boot.size, fds.allgather_fds,
                               driver=fake) as pool:
                return body(boot, pool, fds)

    return run_ranks(n, rank)


def me() -> str:
    return threading.current_thread().name


def setup_and_close(fake):
    """A body that sets up, records what it saw, and closes."""

    def body(boot, pool, fds):
        start = len(fake.calls_of(me()))
        mc = MulticastRange(pool, boot, fds, driver=fake)
        setup = fake.calls_of(me())[start:]
        seen = dict(ptr=mc.ptr, size=mc.size, object_size=mc.object_size,
                    mapping=fake.mappings.get(mc.ptr), live_mc_handles=live_multicast_handles(fake))
        boot.barrier()  # everyone has looked before anyone closes
        mid = len(fake.calls_of(me()))
        mc.close()
        return dict(seen, setup=setup, teardown=fake.calls_of(me())[mid:])

    return body


def live_multicast_handles(fake) -> list[int]:
    return [h for h, a in fake.handles.items() if a in fake.multicast]


def test_setup_sequence_per_rank():
    fake = make_fake()
    results = raise_first(on_node(fake, N, setup_and_close(fake)))
    for r, res in enumerate(results):
        expected = CREATOR_SETUP if r == 0 else IMPORTER_SETUP
        assert [c.name for c in res["setup"]] == expected, f"rank {r}"
        assert [c.name for c in res["teardown"]] == TEARDOWN, f"rank {r}"
    assert fake.leaks() == []


def test_only_local_rank_0_creates_and_everyone_shares_its_object():
    fake = make_fake()
    results = raise_first(on_node(fake, N, setup_and_close(fake)))
    creators = [t for c, t in zip(fake.calls, fake.threads) if c.name == "cuMulticastCreate"]
    assert creators == ["rank0"]
    (allocation,) = fake.multicast  # one object
    for res in results:
        size, handle = res["mapping"]
        assert size == SEGMENT and fake.handles.get(handle, allocation) == allocation
        # the creator keeps its reference while every rank holds an import
        assert len(res["live_mc_handles"]) == N
    assert fake.multicast[allocation].devices == set(range(N))


def test_sizes_and_granularity_rounding():
    fake = make_fake(mc_granularity_min=2 * MIB, mc_granularity_recommended=32 * MIB)
    results = raise_first(on_node(fake, N, setup_and_close(fake)))
    (create,) = [c for c in fake.calls if c.name == "cuMulticastCreate"]
    prop = create.args[0]
    assert prop.size == 32 * MIB  # 8 MiB segment rounded up to the recommended granularity
    assert prop.numDevices == N
    assert prop.handleTypes == fake.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    for r, res in enumerate(results):
        assert (res["size"], res["object_size"]) == (SEGMENT, 32 * MIB)
        by_name = {c.name: c for c in res["setup"]}
        assert by_name["cuMulticastBindMem"].args[1:] == (0, by_name["cuMulticastBindMem"].args[2], 0, SEGMENT, 0)
        assert by_name["cuMemAddressReserve"].args[:2] == (SEGMENT, 32 * MIB)
        assert res["ptr"] % (32 * MIB) == 0
        assert by_name["cuMemMap"].args[1:3] == (SEGMENT, 0)
        va, size, (desc,), count = by_name["cuMemSetAccess"].args
        assert (int(va), size, count, desc.location.id) == (res["ptr"], SEGMENT, 1, r)
        assert int(by_name["cuDeviceGet"].args[0]) == r


def test_each_rank_binds_its_own_segment():
    fake = make_fake()

    def body(boot, pool, fds):
        with MulticastRange(pool, boot, fds, driver=fake):
            (bind,) = [c for c in fake.calls_of(me()) if c.name == "cuMulticastBindMem"]
            return int(bind.args[2]) == int(pool.handle)

    assert raise_first(on_node(fake, N, body)) == [True] * N
    assert fake.leaks() == []


def test_bind_waits_until_every_device_is_added():
    # The last rank adds its device late; without the agreement step the other ranks
    # would bind first (the fake refuses that, the real driver would block).
    fake = make_fake(add_device_delay={N - 1: 0.3})
    raise_first(on_node(fake, N, setup_and_close(fake)))
    names = fake.names()
    adds = [i for i, n in enumerate(names) if n == "cuMulticastAddDevice"]
    binds = [i for i, n in enumerate(names) if n == "cuMulticastBindMem"]
    maps = [i for i, c in enumerate(fake.calls) if c.name == "cuMemMap" and i > adds[0]]
    assert len(adds) == len(binds) == N
    assert max(adds) < min(binds) and max(adds) < min(maps)


FAILURES = [(0, name) for name in dict.fromkeys(CREATOR_SETUP)] + \
           [(2, name) for name in dict.fromkeys(IMPORTER_SETUP)]


@pytest.mark.parametrize("rank, step", FAILURES, ids=[f"rank{r}-{s}" for r, s in FAILURES])
def test_failure_at_every_step_unwinds_everywhere(rank, step):
    fake = make_fake()
    error = fake.CUresult.CUDA_ERROR_NOT_SUPPORTED

    def body(boot, pool, fds):
        if boot.rank == rank:
            fake.fail_in(me(), step, error)
        try:
            MulticastRange(pool, boot, fds, driver=fake)
        except UbnextError as exc:
            boot.barrier()  # every rank has unwound
            return exc, live_multicast_handles(fake), [m for m in fake.mappings.values()
                                                       if m[1] in live_multicast_handles(fake)]
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cleanup warning, no ResourceWarning
        results = raise_first(on_node(fake, 3, body))
        gc.collect()
    assert any(c.failed and c.name == step for c in fake.calls_of(f"rank{rank}"))
    for exc, handles, mappings in results:
        assert isinstance(exc, UbnextError)
        assert f"local rank {rank}: {step}: CUDA_ERROR_NOT_SUPPORTED" in str(exc)
        assert str(exc).startswith("MulticastRange: ")
        assert handles == [] and mappings == []
    assert all(not mc.bindings for mc in fake.multicast.values())
    assert fake.leaks() == []


def test_segment_not_a_multiple_of_the_multicast_granularity_is_refused_before_creating():
    fake = make_fake(mc_granularity_min=4 * MIB, mc_granularity_recommended=4 * MIB)

    def body(boot, pool, fds):
        with pytest.raises(UbnextError, match=r"not a multiple of the minimum multicast granularity \(4194304"):
            MulticastRange(pool, boot, fds, driver=fake)

    raise_first(on_node(fake, 2, body, pool_bytes=6 * MIB))
    assert "cuMulticastCreate" not in fake.names()
    assert fake.leaks() == []


def test_single_rank():
    fake = make_fake()
    (res,) = raise_first(on_node(fake, 1, setup_and_close(fake)))
    assert [c.name for c in res["setup"]] == CREATOR_SETUP
    assert "cuMemImportFromShareableHandle" not in [c.name for c in res["setup"]]
    assert fake.leaks() == []


def test_close_is_idempotent_and_closed_range_has_no_ptr():
    fake = make_fake()

    def body(boot, pool, fds):
        mc = MulticastRange(pool, boot, fds, driver=fake)
        mc.close()
        n = len(fake.calls_of(me()))
        mc.close()
        assert len(fake.calls_of(me())) == n and mc.closed
        with pytest.raises(ClosedError, match="MulticastRange.ptr"):
            mc.ptr
        assert "closed" in repr(mc)

    raise_first(on_node(fake, 2, body))
    assert fake.leaks() == []


def test_teardown_failure_still_releases_the_rest():
    fake = make_fake()

    def body(boot, pool, fds):
        mc = MulticastRange(pool, boot, fds, driver=fake)
        fake.fail_in(me(), "cuMulticastUnbind")
        with pytest.raises(UbnextError, match="^cuMulticastUnbind"):
            mc.close()
        assert mc.closed
        boot.barrier()
        return live_multicast_handles(fake)

    assert raise_first(on_node(fake, 2, body)) == [[], []]  # handles released despite the failure


def test_finalizer_warns_without_driver_calls():
    fake = make_fake()

    def body(boot, pool, fds):
        mc = MulticastRange(pool, boot, fds, driver=fake)
        n = len(fake.calls)
        with pytest.warns(ResourceWarning, match=r"MulticastRange\(device=0, .* was not closed; the multicast object"):
            mc.__del__()
        assert len(fake.calls) == n
        mc.close()

    raise_first(on_node(fake, 1, body))


def test_bootstrap_must_match_the_pool():
    fake = make_fake()

    def body(boot, pool, fds):
        class Other:
            rank, size = boot.rank, boot.size + 1

        with pytest.raises(ValueError, match="MulticastRange: bootstrap rank 0 of 2"):
            MulticastRange(pool, Other(), fds, driver=fake)

    raise_first(on_node(fake, 1, body))
    assert "cuMulticastGetGranularity" not in fake.names()
