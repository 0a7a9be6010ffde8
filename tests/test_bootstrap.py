"""Bootstraps: SelfBootstrap, the subset view over a fake parent, lazy imports,
and MPIBootstrap + FdChannel under mpiexec."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from ubnext._protocol.errors import ClosedError, UbnextError
from ubnext.bootstrap import Bootstrap, MPIBootstrap, SelfBootstrap, TorchBootstrap, node_id
from ubnext.bootstrap._base import _SubsetBootstrap

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"


class FakeParent(Bootstrap):
    """Rank ``rank`` of ``size``; the other ranks contribute ``others(r, data)``."""

    def __init__(self, rank: int, size: int, others=lambda r, data: b"r%d" % r) -> None:
        self._rank, self._size, self._others = rank, size, others
        self.calls: list[str] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, data: bytes) -> list[bytes]:
        self._check_open("bootstrap.allgather")
        self.calls.append("allgather")
        return [data if r == self._rank else self._others(r, data) for r in range(self._size)]

    def barrier(self) -> None:
        self.calls.append("barrier")


def test_self_bootstrap():
    with SelfBootstrap() as boot:
        assert (boot.rank, boot.size) == (0, 1)
        assert boot.allgather(b"x") == [b"x"]
        assert boot.bcast(b"y") == b"y"
        assert boot.allgather_obj({"a": 1}) == [{"a": 1}]
        assert boot.bcast_obj([1, 2]) == [1, 2]
        boot.barrier()
        local = boot.split_local()
        assert (local.rank, local.size) == (0, 1)
        assert local.allgather(b"z") == [b"z"]
        local.close()
        assert not boot.closed and "rank=0 size=1" in repr(boot)
    assert boot.closed and "closed" in repr(boot)
    boot.close()  # idempotent
    with pytest.raises(ClosedError, match="bootstrap.allgather: the bootstrap is closed"):
        boot.allgather(b"x")
    with pytest.raises(ClosedError, match="bootstrap.barrier"):
        boot.barrier()


def test_argument_errors():
    boot = SelfBootstrap()
    with pytest.raises(TypeError, match="bootstrap.allgather: expected bytes, got str"):
        boot.allgather("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bootstrap.bcast: expected bytes"):
        boot.bcast(None)
    with pytest.raises(ValueError, match=r"bootstrap.bcast: root 1 is not a rank in \[0, 1\)"):
        boot.bcast(b"x", root=1)


def test_subset_collectives_run_on_parent():
    parent = FakeParent(rank=2, size=5)
    sub = _SubsetBootstrap(parent, [1, 2, 4])
    assert (sub.rank, sub.size, sub.parent_ranks) == (1, 3, [1, 2, 4])
    assert sub.allgather(b"me") == [b"r1", b"me", b"r4"]
    # Subset root 2 is parent rank 4; other parent ranks contribute b"" to a bcast.
    parent._others = lambda r, data: b"from 4" if r == 4 else b""
    assert sub.bcast(None, root=2) == b"from 4"
    sub.barrier()
    assert parent.calls == ["allgather", "allgather", "barrier"]
    sub.close()
    assert not parent.closed
    with pytest.raises(ClosedError):
        sub.allgather(b"x")


def test_subset_rejects_bad_rank_lists():
    parent = FakeParent(rank=2, size=5)
    with pytest.raises(ValueError, match="bootstrap.split: ranks"):
        _SubsetBootstrap(parent, [0, 1])
    with pytest.raises(ValueError, match="ascending"):
        _SubsetBootstrap(parent, [2, 1])


@pytest.mark.parametrize(
    ("others", "expected"),
    [
        ({0: "mine", 1: b"node-b", 3: "mine", 4: b"node-b"}, (1, 3, [0, 2, 3])),
        ({0: b"node-a", 1: b"node-b", 3: b"node-a", 4: b"node-b"}, (0, 1, [2])),
    ],
)
def test_default_split_local_groups_by_node_id(others, expected):
    ids = {r: node_id() if v == "mine" else v for r, v in others.items()}
    parent = FakeParent(rank=2, size=5, others=lambda r, data: ids[r])
    local = parent.split_local()
    assert (local.rank, local.size, local.parent_ranks) == expected


def test_node_id_names_the_host():
    assert node_id().startswith(socket.gethostname().encode() + b"/")
    assert node_id() == node_id()


def test_mpi_bootstrap_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(UbnextError, match="bootstrap.mpi: mpi4py is not importable"):
        MPIBootstrap()


def test_torch_bootstrap_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(UbnextError, match=r"bootstrap.torch: torch is not importable.*ubnext\[torch\]"):
        TorchBootstrap()


def test_torch_bootstrap_needs_initialized_group():
    dist = pytest.importorskip("torch.distributed")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    with pytest.raises(UbnextError, match="torch.distributed is not initialized"):
        TorchBootstrap()


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 4])
def test_mpi_bootstrap_and_fd_channel(run_mpi, nranks):
    result = run_mpi(SCRIPTS / "bootstrap_check.py", nranks, timeout=180)
    assert result.stdout.strip().splitlines()[-1] == f"bootstrap_check OK size={nranks}"


def test_abort_of_an_mpi_bootstrap_frees_nothing_collective(monkeypatch):
    """abort() drops the communicators without MPI_Comm_free, which is collective and could
    wait for a failed rank; close() frees them."""
    from ubnext.bootstrap import MPIBootstrap

    freed = []

    class Comm:
        def __init__(self, name):
            self.name = name

        def Free(self):
            freed.append(self.name)

    class MPI:
        @staticmethod
        def Is_finalized():
            return False

    def make(name):
        b = MPIBootstrap.__new__(MPIBootstrap)
        b._MPI, b._comm, b._rank, b._size, b._children = MPI, Comm(name), 0, 1, []
        return b

    parent, child = make("parent"), make("child")
    parent._children.append(child)
    parent.abort()
    assert freed == [] and parent.closed and child.closed
    other = make("other")
    other.close()
    assert freed == ["other"]
