"""CPU tests of ubnext._engine.nccl.NcclComm against a recording stand-in for cupy.cuda.nccl."""

from __future__ import annotations

import sys

import bench_fakes as fakes
import pytest

from ubnext._engine.nccl import NcclComm
from ubnext._protocol.errors import ClosedError, UbnextError

UID = bytes(range(128))


class Boot:
    """A bootstrap seen from one rank; ``bcast`` records calls and returns rank 0's payload;
    ``allgather_obj`` gives the other ranks' ``peers[r]`` (each its own GPU by default)."""

    def __init__(self, rank: int, size: int = 4, root_payload: bytes = UID, peers=None) -> None:
        self.rank, self.size, self.root_payload, self.bcasts = rank, size, root_payload, []
        self.peers = peers or [f"GPU-{r}" for r in range(size)]

    def bcast(self, data, root):
        self.bcasts.append((data, root))
        return data if self.rank == root else self.root_payload

    def allgather_obj(self, obj):
        return [obj if r == self.rank else self.peers[r] for r in range(self.size)]


@pytest.fixture(autouse=True)
def device_uuids(monkeypatch):
    """Device ordinal d is GPU-d (no driver on this machine)."""
    monkeypatch.setattr("ubnext._environment.devices.device_uuid", lambda ordinal: f"GPU-{ordinal}")


def install_nccl(monkeypatch, *, names_new_enums=True, uid_error=False):
    """Fake cupy with a fake ``cupy.cuda.nccl`` that records communicators and calls."""
    fakes.install(monkeypatch)
    nccl = sys.modules["cupy.cuda.nccl"]
    nccl.available = True
    consts = dict(NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_UINT32=3, NCCL_INT64=4, NCCL_UINT64=5, NCCL_FLOAT16=6,
                  NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3)
    if names_new_enums:
        consts.update(NCCL_BFLOAT16=9, NCCL_AVG=4)
    for k, v in consts.items():
        setattr(nccl, k, v)

    class NcclError(RuntimeError):
        pass

    class NcclCommunicator:
        created = []

        def __init__(self, ndev, uid, rank):
            self.args, self.calls, self.destroyed = (ndev, uid, rank), [], 0
            NcclCommunicator.created.append(self)

        def allReduce(self, *args):  # noqa: N802 - cupy's name
            if args[2] == 13:
                raise NcclError("NCCL_ERROR_INVALID_ARGUMENT")
            self.calls.append(args)

        def reduceScatter(self, *args):  # noqa: N802 - cupy's name
            self.calls.append(("reduceScatter", *args))

        def allGather(self, *args):  # noqa: N802 - cupy's name
            self.calls.append(("allGather", *args))

        def destroy(self):
            self.destroyed += 1

    def get_unique_id():
        if uid_error:
            raise NcclError("NCCL_ERROR_SYSTEM_ERROR")
        return UID

    nccl.NcclError, nccl.NcclCommunicator, nccl.get_unique_id = NcclError, NcclCommunicator, get_unique_id
    return nccl


def test_rank0_creates_and_broadcasts_the_id(monkeypatch):
    nccl = install_nccl(monkeypatch)
    boot = Boot(rank=0)
    comm = NcclComm(boot, device=0)
    assert not comm.connected and not nccl.NcclCommunicator.created  # lazy
    comm.connect()
    comm.connect()  # idempotent
    assert boot.bcasts == [(UID, 0)]
    assert [c.args for c in nccl.NcclCommunicator.created] == [(4, UID, 0)]


def test_other_ranks_join_with_rank0_id(monkeypatch):
    nccl = install_nccl(monkeypatch)
    boot = Boot(rank=2)
    NcclComm(boot, device=2).connect()
    assert boot.bcasts == [(None, 0)]
    assert nccl.NcclCommunicator.created[0].args == (4, UID, 2)


def test_rank0_failure_reaches_every_rank(monkeypatch):
    install_nccl(monkeypatch, uid_error=True)
    boot = Boot(rank=0)
    with pytest.raises(UbnextError, match="^nccl.all_reduce: ncclGetUniqueId failed"):
        NcclComm(boot, 0).all_reduce(1, 2, 3, "float32", "sum", 0)
    assert boot.bcasts == [(b"", 0)]  # the others are told instead of waiting forever
    with pytest.raises(UbnextError, match="^nccl.connect: rank 0 could not create an NCCL unique id"):
        NcclComm(Boot(rank=1, root_payload=b""), 1).connect()


@pytest.mark.parametrize("names_new_enums", [True, False])
def test_all_reduce_maps_names_and_connects_lazily(monkeypatch, names_new_enums):
    nccl = install_nccl(monkeypatch, names_new_enums=names_new_enums)
    comm = NcclComm(Boot(rank=0), 0)
    for dtype, op in (("bfloat16", "sum"), ("float16", "avg"), ("float32", "max"), ("float32", "min"),
                      ("float64", "avg"), ("int8", "sum"), ("uint64", "max")):
        comm.all_reduce(0x1000, 0x2000, 5, dtype, op, 0x99)
    assert nccl.NcclCommunicator.created[0].calls == [
        (0x1000, 0x2000, 5, 9, 0, 0x99), (0x1000, 0x2000, 5, 6, 4, 0x99),
        (0x1000, 0x2000, 5, 7, 2, 0x99), (0x1000, 0x2000, 5, 7, 3, 0x99),
        (0x1000, 0x2000, 5, 8, 4, 0x99), (0x1000, 0x2000, 5, 0, 0, 0x99), (0x1000, 0x2000, 5, 5, 2, 0x99),
    ]


def test_reduce_scatter_and_all_gather_map_names(monkeypatch):
    nccl = install_nccl(monkeypatch)
    comm = NcclComm(Boot(rank=0), 0)
    comm.reduce_scatter(0x1000, 0x2000, 5, "bfloat16", "avg", 0x99)
    comm.all_gather(0x1000, 0x2000, 7, "int8", 0x98)
    assert nccl.NcclCommunicator.created[0].calls == [
        ("reduceScatter", 0x1000, 0x2000, 5, 9, 4, 0x99), ("allGather", 0x1000, 0x2000, 7, 0, 0x98)]
    with pytest.raises(ValueError, match="^nccl.all_gather: unsupported dtype 'complex64'"):
        comm.all_gather(1, 1, 4, "complex64", 0)
    with pytest.raises(ValueError, match="^nccl.reduce_scatter: unsupported op 'prod'"):
        comm.reduce_scatter(1, 1, 4, "float32", "prod", 0)


@pytest.mark.parametrize("args, error, message", [
    ((1, 1, 4, "complex64", "sum", 0), ValueError, "unsupported dtype 'complex64'"),
    ((1, 1, 4, "float32", "prod", 0), ValueError, "unsupported op 'prod'"),
    ((1, 1, -1, "float32", "sum", 0), ValueError, "count must be >= 0"),
    ((1, 1, 13, "float32", "sum", 0), UbnextError, "NCCL_ERROR_INVALID_ARGUMENT"),
])
def test_all_reduce_errors_name_the_operation(monkeypatch, args, error, message):
    install_nccl(monkeypatch)
    with pytest.raises(error, match=f"^nccl.all_reduce: .*{message}"):
        NcclComm(Boot(rank=0), 0).all_reduce(*args)


def test_close_is_idempotent_and_final(monkeypatch):
    nccl = install_nccl(monkeypatch)
    comm = NcclComm(Boot(rank=0), 0)
    comm.close()  # never connected: nothing to destroy
    comm = NcclComm(Boot(rank=0), 0)
    with comm:
        comm.connect()
    comm.close()
    assert nccl.NcclCommunicator.created[0].destroyed == 1
    with pytest.raises(ClosedError, match="^nccl.all_reduce: the NCCL communicator is closed"):
        comm.all_reduce(1, 1, 1, "float32", "sum", 0)
    with pytest.raises(ClosedError, match="^nccl.connect:"):
        comm.connect()


def test_missing_library_says_how_to_install(monkeypatch):
    fakes.install(monkeypatch)  # its nccl has available = False
    with pytest.raises(UbnextError, match="^nccl.all_reduce: cupy cannot load the NCCL library.*pip install"):
        NcclComm(Boot(rank=0), 0).all_reduce(1, 1, 1, "float32", "sum", 0)


def test_ranks_on_one_gpu_are_refused_in_one_line(monkeypatch):
    """Several ranks on one GPU: every rank says why, and none asks NCCL for anything."""
    nccl = install_nccl(monkeypatch)
    boot = Boot(rank=1, size=3, peers=["GPU-0", None, "GPU-0"])
    with pytest.raises(UbnextError, match=r"^nccl.connect: NCCL cannot serve several ranks on one GPU "
                                          r"\(ranks 0, 1, 2 use GPU-0\); give each rank its own GPU"):
        NcclComm(boot, device=0).connect()
    assert not boot.bcasts and not nccl.NcclCommunicator.created


def test_one_rank_average_is_a_copy_not_an_nccl_call(monkeypatch):
    """NCCL before 2.29.7 leaves a one-rank average's last count % blocks elements
    unwritten (NVIDIA/nccl#1950): at one rank the average is the input, copied on the
    caller's stream; in place nothing is enqueued."""
    nccl = install_nccl(monkeypatch)
    copies = []
    runtime = sys.modules["cupy.cuda"].runtime
    monkeypatch.setattr(runtime, "memcpyAsync", lambda *a: copies.append(a), raising=False)
    comm = NcclComm(Boot(rank=0, size=1), 0)
    comm.all_reduce(0x1000, 0x2000, 4099, "float64", "avg", 0x99)
    comm.all_reduce(0x1000, 0x1000, 4099, "bfloat16", "avg", 0x99)
    comm.all_reduce(0x1000, 0x2000, 5, "float32", "sum", 0x99)
    comm.reduce_scatter(0x1000, 0x3000, 7, "float16", "avg", 0x99)  # at one rank, the all-reduce
    assert copies == [(0x2000, 0x1000, 4099 * 8, 3, 0x99), (0x3000, 0x1000, 7 * 2, 3, 0x99)]
    assert nccl.NcclCommunicator.created[0].calls == [(0x1000, 0x2000, 5, 7, 0, 0x99)]
