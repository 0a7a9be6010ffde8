"""The fallback chain on GPUs: each rung forced, results checked, the algorithm used
checked, and each fallback logged once with its reason.

* (a) pool too small for the library slots -> NCCL for every call;
* (b) P2P reported absent (the pool's import/access step fails on every rank) -> NCCL;
* (c) ranks split as if on two nodes -> NCCL (needs 2 or more ranks);
* (d) a Lamport-sized message above ``lamport_max_kb`` -> two-shot;
* (e) the GPU machines' environment (NVLS switched off) with ``UBNEXT_NVLS=auto`` -> no
  cuMulticast* call at all, unicast kernels; ``UBNEXT_NVLS=1`` -> UbnextError.

Runs at any world size: ``mpirun -n 2|4 python -m pytest -q tests/test_gpu_fallback.py``
(and plain pytest at 1 rank).
"""

from __future__ import annotations

import logging

import gpu_support
import nvls_guard
import pytest
from gpu_support import gpu_count, require_gpu_and_torch

from ubnext.bootstrap import Bootstrap
from ubnext.bootstrap._base import _SubsetBootstrap

pytestmark = pytest.mark.gpu

SMALL = dict(pool_mb=64, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)
#: what the lent GPU machines set: NVLink multicast is off there
GPU_MACHINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SIZES = (1, 1000, 70_000, 1 << 20)  # elements


@pytest.fixture
def logged(monkeypatch):
    """The communicator's ``log_once`` calls as ``(key, message, first)``; the process-wide
    "already logged" set starts empty, so a fallback seen in an earlier test is logged again."""
    import ubnext._api.communicator
    import ubnext._environment.log

    monkeypatch.setattr(ubnext._environment.log, "_once_keys", set())
    calls = []

    def record(key, msg, level=logging.WARNING):
        first = ubnext._environment.log.log_once(key, msg, level)
        calls.append((key, msg, first))
        return first

    monkeypatch.setattr(ubnext._api.communicator, "log_once", record)
    return calls


def logged_once(calls, *words):
    """The one message containing every word; fails unless it was logged exactly once."""
    hits = [(msg, first) for _, msg, first in calls if all(w in msg for w in words)]
    assert len(hits) == 1, f"expected one log message with {words}, got {[m for m, _ in hits]}"
    assert hits[0][1], f"{hits[0][0]!r} was not emitted (key already logged)"
    return hits[0][0]


def communicator(**kwargs):
    require_gpu_and_torch()
    import torch

    import ubnext

    comm = ubnext.Communicator(**kwargs)
    torch.cuda.set_device(comm.device)
    return comm


def check_all_reduce(comm, algo, dtype="bfloat16", sizes=SIZES, seed=0, algorithm="auto"):
    """all_reduce over every size: ``select`` says ``algo`` (with ``algorithm="auto"``),
    every element matches the reference (gpu_support.check_all_reduce: poisoned, bordered
    outputs; exact inputs where NCCL reduces), and ``algo`` ran."""
    for i, count in enumerate(sizes):
        nbytes = count * gpu_support.WIDTH[dtype]
        if algorithm == "auto":
            assert comm.select(nbytes, dtype) == algo, f"{nbytes} bytes"
        _, launches = gpu_support.check_all_reduce(comm, count, dtype, seed + i, algorithm=algorithm)
        assert gpu_support.ran(launches) == algo


def assert_nccl_only(comm):
    import ubnext

    assert comm.algorithms() == ["nccl"]
    assert not comm.nvls.enabled
    with pytest.raises(ubnext.UbnextError, match="no symmetric memory pool"):
        comm.empty(16)
    for dtype in ("bfloat16", "float16", "float32"):
        check_all_reduce(comm, "nccl", dtype)


def test_a_pool_too_small_for_the_library_slots_uses_nccl(logged):
    with communicator(pool_mb=1, staging_mb=1, lamport_max_kb=1024) as comm:
        assert_nccl_only(comm)
    logged_once(logged, "using NCCL for every call", "UBNEXT_POOL_MB=1 leaves no room")


def test_b_no_p2p_uses_nccl_without_hanging(monkeypatch, logged):
    from ubnext._memory.pool import PeerAccessError, SymmetricPool

    def no_p2p(self, peer, name, *args):
        raise PeerAccessError(name, 217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: injected by the test", peer)

    monkeypatch.setattr(SymmetricPool, "_peer_call", no_p2p)  # import (N ranks) / set access (1 rank)
    with communicator(**SMALL) as comm:
        assert_nccl_only(comm)
    msg = logged_once(logged, "using NCCL for every call", "symmetric memory setup failed")
    assert "SymmetricPool: " in msg and "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED" in msg


class TwoNodes(Bootstrap):
    """Wraps a bootstrap; ``split_local`` groups the ranks as if on two nodes:
    ``[0, ceil(size/2))`` and the rest."""

    def __init__(self, inner: Bootstrap):
        self._inner = inner

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def size(self) -> int:
        return self._inner.size

    def allgather(self, data: bytes) -> list[bytes]:
        return self._inner.allgather(data)

    def barrier(self) -> None:
        self._inner.barrier()

    def split_local(self) -> Bootstrap:
        half = (self.size + 1) // 2
        ranks = range(half) if self.rank < half else range(half, self.size)
        return _SubsetBootstrap(self, list(ranks))


def test_c_ranks_on_two_nodes_use_nccl(logged):
    require_gpu_and_torch()
    from ubnext.bootstrap import MPIBootstrap

    with MPIBootstrap() as inner:
        if inner.size < 2:
            pytest.skip("a two-node split needs 2 or more ranks (run under mpirun -n 2|4)")
        with inner.split_local() as real_local:  # the GPU this rank really owns
            device = real_local.rank % gpu_count()
        with communicator(bootstrap=TwoNodes(inner), device=device, **SMALL) as comm:
            assert comm.size == inner.size and comm._local.size < comm.size
            assert_nccl_only(comm)
    logged_once(logged, "using NCCL for every call", "ranks span several nodes")


def test_d_lamport_sized_message_above_lamport_max_goes_to_twoshot(logged, tmp_path):
    import json

    import torch

    import ubnext

    # a table giving Lamport 1 MiB, then two-shot (the shipped one has Lamport two-shot between)
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": 1, "machine": "test", "tables": {
        "*": {"bfloat16": [[1 << 20, "lamport"], [None, "twoshot"]]}}}))
    with communicator(pool_mb=64, staging_mb=8, lamport_max_kb=1, lamport_twoshot_max_kb=1,
                      tune_file=str(table)) as comm:
        assert comm.algorithms() == ["lamport", "lamport_twoshot", "twoshot", "nccl"]
        check_all_reduce(comm, "lamport", "float32", sizes=(1, 256))  # up to 1 KiB
        check_all_reduce(comm, "twoshot", "float32", sizes=(257, 2048, 16_000), seed=10)  # Lamport-sized
        with pytest.raises(ubnext.UbnextError, match="cannot take"):
            comm.all_reduce(torch.ones(2048, device="cuda"), algorithm="lamport")
    logged_once(logged, "gives lamport messages up to", "go to the next algorithm", "UBNEXT_LAMPORT_MAX_KB=1")


@pytest.fixture
def multicast_forbidden(monkeypatch):
    """Any cuMulticast* attribute taken from the driver ubnext uses is recorded (and
    answered with an error, never with the real function); the test asserts none was."""
    import ubnext._environment.cuda
    import ubnext._environment.nvls_gate
    import ubnext._memory.multicast

    real = ubnext._environment.cuda.default_driver()
    seen = []

    class NoMulticast:
        def __getattr__(self, name):
            if name.startswith("cuMulticast"):
                seen.append(name)
                return lambda *args: (real.CUresult.CUDA_ERROR_NOT_PERMITTED,)
            return getattr(real, name)

    guard = NoMulticast()
    for module in (ubnext._environment.cuda, ubnext._environment.nvls_gate, ubnext._memory.multicast):
        monkeypatch.setattr(module, "default_driver", lambda: guard)
    before = len(nvls_guard.attempts)
    yield seen
    assert nvls_guard.attempts[before:] == [], "a real cuMulticast* function was reached"


def test_e_gpu_machine_env_keeps_multicast_off(monkeypatch, logged, multicast_forbidden):
    import ubnext

    for var, value in GPU_MACHINE_ENV.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("UBNEXT_NVLS", "auto")
    with communicator(**SMALL) as comm:
        assert not comm.nvls.enabled
        assert "NCCL_NVLS_ENABLE=0" in comm.nvls.reason
        assert comm._node.multicast is None and comm._node.engine._mc_base == 0
        assert comm.algorithms() == ["lamport", "lamport_twoshot", "twoshot", "nccl"]  # the unicast kernels still run
        check_all_reduce(comm, "lamport", sizes=(1000,))
        check_all_reduce(comm, "twoshot", sizes=(70_000,), seed=1, algorithm="twoshot")
    assert multicast_forbidden == []
    logged_once(logged, "NVLink multicast off", "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                "NVSHMEM_DISABLE_NVLS=1")

    monkeypatch.setenv("UBNEXT_NVLS", "1")
    with pytest.raises(ubnext.UbnextError, match="UBNEXT_NVLS=1 requires NVLink multicast, but NCCL_NVLS_ENABLE=0"):
        communicator(**SMALL)
    assert multicast_forbidden == []
