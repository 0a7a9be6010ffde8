"""Launcher detection and ``ubnext.bootstrap.default()``: every launcher from a faked
environment (no Slurm here: srun is faked only), the size check against a fake and a
real MPI, StoreBootstrap over a fake store with ranks as threads, and, where torch is
installed, StoreBootstrap over a real TCPStore in several processes and under torchrun."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest
from launch_support import LAUNCH_VARS, REPO, SCRIPTS, clean_env, free_port, run_all
from thread_ranks import raise_first, run_ranks

from ubnext import bootstrap
from ubnext._protocol.errors import UbnextError
from ubnext.bootstrap import SelfBootstrap, StoreBootstrap, TorchBootstrap
from ubnext.bootstrap._launch import detect

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


# -- detect(): a pure function of the environment --------------------------------------

@pytest.mark.parametrize(("env", "kind", "rank", "size"), [
    ({}, "single", 0, 1),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}, "mpi", 2, 4),  # Open MPI mpirun
    ({"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": "9"}, "mpi", 1, 2),  # MPICH / Intel MPI hydra
    ({"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "1"}, "mpi", 1, 2),  # MVAPICH
    ({"PMIX_RANK": "3"}, "mpi", 3, None),  # PMIx without a size variable
    ({"PMIX_RANK": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, "mpi", 3, 8),  # srun --mpi=pmix
    ({"PMI_SIZE": "2", "PMI_RANK": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, "mpi", 0, 2),  # pmi2
    (TORCHRUN, "torchrun", 1, 2),
    ({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}, "single", 0, 1),  # torchrun --nproc-per-node 1
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "2"}, "srun-mpi", 2, 4),  # srun alone
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"},
     "srun", 2, 4),
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, "single", 0, 1),  # srun -n 1
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "single", 0, 1),  # sbatch's batch script
    ({**TORCHRUN, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, "mpi", 1, 2),  # MPI first
])
def test_detect_each_launcher(env, kind, rank, size):
    launch = detect(env)
    assert (launch.kind, launch.rank, launch.size) == (kind, rank, size)


def test_detect_torchrun_details():
    launch = detect({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert launch.master == ("10.0.0.1", 29500) and launch.agent_store and launch.attempt == "3"
    assert "RANK=1 WORLD_SIZE=2" in launch.evidence
    plain = detect(TORCHRUN)
    assert not plain.agent_store and plain.attempt == "0"


def test_detect_precedence_of_an_initialized_torch_group_and_of_running_mpi():
    assert detect({"OMPI_COMM_WORLD_SIZE": "2"}, torch_initialized=True).kind == "torch"
    assert detect({}, mpi_initialized=True).kind == "mpi-running"
    assert detect(TORCHRUN, mpi_initialized=True).kind == "torchrun"


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "2", "RANK": "0"}, r"WORLD_SIZE=2 announces several ranks but MASTER_ADDR, MASTER_PORT is not set"),
    ({**TORCHRUN, "RANK": "x"}, r"RANK='x' is not an integer"),
    ({**TORCHRUN, "RANK": "2"}, r"rank 2 is outside \[0, 2\) \(RANK=2 WORLD_SIZE=2"),
    ({**TORCHRUN, "MASTER_PORT": "0"}, r"MASTER_PORT=0 is not a TCP port"),
    ({"OMPI_COMM_WORLD_SIZE": "0"}, r"the launcher announces 0 ranks"),
])
def test_detect_refuses_what_cannot_be_right(env, message):
    with pytest.raises(UbnextError, match=rf"^bootstrap.default: {message}"):
        detect(env)


# -- default(): the bootstrap each launch gets, and the size check ---------------------

@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment: set(**vars) fakes one; torch and mpi4py look unused."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)

    def set_vars(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_vars


class World(SelfBootstrap):
    """A bootstrap that sees rank ``rank`` of ``size`` (its collectives are never called)."""

    def __init__(self, rank: int, size: int) -> None:
        self._world = rank, size

    rank = property(lambda self: self._world[0])
    size = property(lambda self: self._world[1])


class FakeMPI(World):
    """Stands in for MPIBootstrap: sees the class's ``world``, records what it made."""

    world = (0, 1)
    made: list[FakeMPI] = []

    def __init__(self) -> None:
        super().__init__(*FakeMPI.world)
        FakeMPI.made.append(self)


@pytest.fixture
def fake_mpi(monkeypatch):
    FakeMPI.made = []
    monkeypatch.setattr(bootstrap, "MPIBootstrap", FakeMPI)
    return FakeMPI


def test_single_process_needs_no_mpi(env, monkeypatch):
    def no_mpi():
        raise AssertionError("MPI must not be initialized for a single process")

    monkeypatch.setattr(bootstrap, "MPIBootstrap", no_mpi)
    with bootstrap.default() as boot:
        assert type(boot) is SelfBootstrap


def test_mpi_launch_gets_mpi(env, fake_mpi):
    env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3")
    fake_mpi.world = (3, 4)
    assert bootstrap.default() is fake_mpi.made[0]


@pytest.mark.parametrize(("vars_", "fix"), [
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, "mpi4py's MPI library is not the one"),
    ({"PMIX_RANK": "1"}, "mpi4py's MPI library is not the one"),  # no size announced: the rank tells
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, r"run srun --mpi=pmix .* MASTER_ADDR and MASTER_PORT"),
])
def test_several_ranks_announced_but_mpi_sees_one_raises(env, fake_mpi, vars_, fix):
    env(**vars_)
    fake_mpi.world = (0, 1)
    with pytest.raises(UbnextError, match=rf"^bootstrap.default: the launcher started .* but MPI sees rank 0 of 1; {fix}"):
        bootstrap.default()
    assert fake_mpi.made[0].closed  # nothing left open


def test_torchrun_launch_connects_to_its_store(env, monkeypatch):
    env(**TORCHRUN, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="2")
    calls = []
    monkeypatch.setattr(StoreBootstrap, "connect",
                        classmethod(lambda cls, *a, **k: calls.append((a, k)) or World(1, 2)))
    monkeypatch.setattr(bootstrap, "MPIBootstrap", None)  # never reached
    bootstrap.default()
    assert calls == [(("10.0.0.1", 29500, 1, 2), {"agent_store": True, "attempt": "2"})]


def test_srun_with_master_connects_with_slurm_ranks(env, monkeypatch):
    env(SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3", MASTER_ADDR="node1", MASTER_PORT="29400")
    calls = []
    monkeypatch.setattr(StoreBootstrap, "connect",
                        classmethod(lambda cls, *a, **k: calls.append(a) or World(3, 4)))
    bootstrap.default()
    assert calls == [("node1", 29400, 3, 4)]


def test_an_initialized_torch_group_comes_first(env, monkeypatch, fake_mpi):
    class Dist:
        is_available = staticmethod(lambda: True)
        is_initialized = staticmethod(lambda: True)

    monkeypatch.setitem(sys.modules, "torch.distributed", Dist)
    env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    made = SelfBootstrap()
    monkeypatch.setattr(TorchBootstrap, "over_world", classmethod(lambda cls: made))
    assert bootstrap.default() is made and not fake_mpi.made


# -- TorchBootstrap.over_world: never stage through a CUDA device -----------------------

class FakeDist:
    """The torch.distributed functions TorchBootstrap uses, for a group of ``backend``."""

    def __init__(self, backend: str):
        self.backend, self.calls = backend, []

    is_available = staticmethod(lambda: True)
    is_initialized = staticmethod(lambda: True)
    get_rank = staticmethod(lambda group=None: 1)
    get_world_size = staticmethod(lambda group=None: 2)

    def get_backend(self, group=None):
        return self.backend

    def new_group(self, backend):
        self.calls.append(("new_group", backend))
        return "gloo-group"

    def destroy_process_group(self, group=None):
        self.calls.append(("destroy", group))


@pytest.mark.parametrize(("backend", "own_group"), [
    ("nccl", True), ("gloo", False), ("cpu:gloo,cuda:nccl", False), ("mpi", False),
])
def test_over_world_uses_a_cpu_group(monkeypatch, backend, own_group):
    dist = FakeDist(backend)
    monkeypatch.setattr("ubnext.bootstrap._torch._import_dist", lambda: dist)
    boot = TorchBootstrap.over_world()
    assert (boot.rank, boot.size) == (1, 2)
    assert dist.calls == ([("new_group", "gloo")] if own_group else [])
    boot.close()
    assert dist.calls[1:] == ([("destroy", "gloo-group")] if own_group else [])


def test_a_given_torch_group_is_not_destroyed(monkeypatch):
    dist = FakeDist("nccl")
    monkeypatch.setattr("ubnext.bootstrap._torch._import_dist", lambda: dist)
    TorchBootstrap("users-group").close()
    assert dist.calls == []


# -- StoreBootstrap over a fake store, ranks as threads ---------------------------------

class FakeStore:
    """The Store calls StoreBootstrap makes, thread-safe; get/multi_get/wait block."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.log: list[tuple[str, str]] = []

    def set(self, key, value):
        with self.cond:
            self.data[key] = bytes(value)
            self.cond.notify_all()

    def _await(self, keys):
        assert self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout=20), f"no {keys}"

    def multi_get(self, keys):
        with self.cond:
            self._await(keys)
            return [self.data[k] for k in keys]

    def wait(self, keys):
        with self.cond:
            self._await(keys)

    def add(self, key, n):
        with self.cond:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def delete_key(self, key):
        with self.cond:
            self.log.append(("delete", key))
            return self.data.pop(key, None) is not None


def test_store_bootstrap_collectives_and_cleanup():
    store = FakeStore()

    def rank(boot):
        me = StoreBootstrap(store, boot.rank, boot.size, prefix="t")
        got = me.allgather(b"r%d" % me.rank * (me.rank + 1))
        assert got == [b"r%d" % r * (r + 1) for r in range(me.size)]
        assert me.bcast(b"root" if me.rank == 2 else None, root=2) == b"root"
        assert me.allgather_obj({"rank": me.rank}) == [{"rank": r} for r in range(me.size)]
        me.barrier()
        local = me.split_local()  # every rank is on this node
        assert (local.rank, local.size) == (me.rank, me.size)
        local.close()
        me.close()
        return True

    assert raise_first(run_ranks(4, rank)) == [True] * 4
    assert store.data == {}  # every exchange and the close protocol cleaned up after itself


def test_store_bootstrap_host_leaves_last():
    """Rank 0 (the TCPStore host) must not drop the server while a peer still uses it."""
    store, order = FakeStore(), []

    def rank(boot):
        me = StoreBootstrap(store, boot.rank, boot.size, prefix="t")
        if me.rank == 2:  # the slowest rank
            threading.Event().wait(0.3)
        me.close()
        order.append(me.rank)

    raise_first(run_ranks(3, rank))
    assert order[-1] == 0


def test_store_failures_are_one_line():
    class Broken(FakeStore):
        def multi_get(self, keys):
            raise RuntimeError("Socket Timeout")

    boot = StoreBootstrap(Broken(), 0, 2, prefix="t")
    with pytest.raises(UbnextError, match=r"^bootstrap.allgather: rank 0: the store \(keys t/...\) failed "
                                          r"\(RuntimeError: Socket Timeout\); a rank died"):
        boot.allgather(b"x")
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        StoreBootstrap(FakeStore(), 2, 2)


def test_store_connect_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(UbnextError, match=r"^bootstrap.store: torch is not importable .* launch with mpirun"):
        StoreBootstrap.connect("127.0.0.1", 29500, 0, 2)


# -- real processes -------------------------------------------------------------------

def test_real_mpi_sees_one_rank_where_the_launcher_announced_two():
    """A process whose environment says Open MPI started 2 ranks, while mpi4py's MPI
    (here MPICH, which ignores Open MPI's variables) starts a 1-rank world."""
    pytest.importorskip("mpi4py", reason="needs mpi4py")
    code = "import ubnext.bootstrap as b; b.default()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1"))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ubnext._protocol.errors.UbnextError: bootstrap.default: the launcher started 2 ranks "
                           "(OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=1) but MPI sees rank 0 of 1"), proc.stderr


@pytest.mark.parametrize("nranks", [2, 4])
def test_store_bootstrap_in_processes(nranks):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as a launcher without an agent sets them:
    rank 0 hosts the store; a later init_process_group shares its port."""
    pytest.importorskip("torch.distributed", reason="needs torch")
    port = str(free_port())
    envs = [clean_env(RANK=str(r), WORLD_SIZE=str(nranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port) for r in range(nranks)]
    outs = run_all([[sys.executable, str(SCRIPTS / "store_check.py")]] * nranks, envs)
    assert [o.strip().splitlines()[-1] for o in outs] == [f"store_check OK rank={r} size={nranks}"
                                                          for r in range(nranks)]


def test_store_bootstrap_under_torchrun():
    """The same checks under torchrun, whose agent hosts the store."""
    pytest.importorskip("torch.distributed", reason="needs torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "store_check.py")]
    (out,) = run_all([cmd], [clean_env()])
    # the ranks share torchrun's stdout, so their lines may run together
    assert sorted(re.findall(r"store_check OK rank=\d+ size=\d+", out)) == [
        "store_check OK rank=0 size=2", "store_check OK rank=1 size=2"]


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 3])
def test_mpiexec_is_detected_before_mpi_starts(run_mpi, nranks):
    result = run_mpi(REPO / "tests" / "mpi_scripts" / "launch_check.py", nranks, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == f"launch_check OK size={nranks}"
