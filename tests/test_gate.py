"""The NVLS gate (CPU only): environment blockers, device support, modes auto/0/1, and
the node path making no multicast call unless the gate allows it.

Ranks run as threads (``thread_ranks``) sharing one recording fake driver.
"""

from __future__ import annotations

import pytest
from fake_driver import MulticastFakeDriver
from stream_fakes import fake_context
from thread_ranks import raise_first, run_ranks

from ubnext._environment.config import Config
from ubnext._environment.nvls_gate import ENV_BLOCKERS, OPT_IN, NvlsDecision, decide, env_blockers, fallback, verdict
from ubnext._protocol.errors import UbnextError

BLOCKERS = [f"{var}={value}" for var, value in ENV_BLOCKERS]


def gate(fake, mode, environs):
    """Run ``decide`` on len(environs) ranks (rank r sees environs[r], device r)."""
    return run_ranks(len(environs), lambda boot: decide(mode, environs[boot.rank], boot, boot.rank, driver=fake))


def multicast_calls(fake):
    return [n for n in fake.names() if n.startswith("cuMulticast")]


# -- the pure parts ----------------------------------------------------------------

def test_the_four_blockers():
    assert BLOCKERS == ["NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                        "NVSHMEM_DISABLE_NVLS=1", "UBNEXT_NVLS=0"]


@pytest.mark.parametrize("var, value", ENV_BLOCKERS)
def test_env_blockers_is_a_pure_function_of_the_mapping(var, value):
    assert env_blockers({var: value}) == [f"{var}={value}"]
    assert env_blockers({var: f" {value}\n"}) == [f"{var}={value}"]
    other = "1" if value == "0" else "0"
    assert env_blockers({var: other}) == []
    assert env_blockers({var: ""}) == []
    assert env_blockers({}) == []


def test_all_blockers_are_reported_in_order():
    assert env_blockers(dict(ENV_BLOCKERS) | {"UNRELATED": "0"}) == BLOCKERS


def test_verdict_and_fallback():
    ok = ([], True)
    assert verdict("auto", [([], None), ([], None)]) == NvlsDecision(False, OPT_IN)
    assert verdict("1", [ok]).enabled
    assert verdict("0", [ok, ok]) == NvlsDecision(False, "UBNEXT_NVLS=0")
    with pytest.raises(UbnextError, match="local rank.s. 1 does not report"):
        verdict("1", [ok, ([], False)])
    assert fallback("auto", "why") == NvlsDecision(False, "why")
    with pytest.raises(UbnextError, match="^Communicator: UBNEXT_NVLS=1 requires NVLink multicast, but why"):
        fallback("1", "why")
    assert str(NvlsDecision(False, "why")) == "off (why)"
    assert str(NvlsDecision(True, "yes")) == "on (yes)"


# -- decide: collective over the node's ranks ----------------------------------------

@pytest.mark.parametrize("mode", ["auto", "0", "1"])
@pytest.mark.parametrize("blocker", BLOCKERS)
def test_every_blocker_in_every_mode(blocker, mode):
    var, value = blocker.split("=")
    fake = MulticastFakeDriver()  # the devices do support multicast
    results = gate(fake, mode, [{var: value}, {var: value}])
    if mode == "1":
        for exc in results:
            assert isinstance(exc, UbnextError)
            assert blocker in str(exc) and "UBNEXT_NVLS=1 requires NVLink multicast" in str(exc)
    else:
        decisions = raise_first(results)
        assert decisions[0] == decisions[1] and not decisions[0].enabled
        assert ("UBNEXT_NVLS=0" if mode == "0" else blocker) in decisions[0].reason
    # the environment is checked first: no device was even queried
    assert fake.calls == []


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_a_blocker_on_one_rank_decides_for_every_rank(mode):
    fake = MulticastFakeDriver()
    results = gate(fake, mode, [{}, {}, {"NVSHMEM_DISABLE_NVLS": "1"}])
    if mode == "1":
        assert all(isinstance(r, UbnextError) and "NVSHMEM_DISABLE_NVLS=1" in str(r) for r in results)
    else:
        assert {d.enabled for d in raise_first(results)} == {False}
    assert multicast_calls(fake) == []


def test_auto_is_off_until_opted_in_and_queries_no_device():
    """Multicast is opt-in while its kernels have not run on hardware: ``auto`` leaves it
    off with the reason, even where every device supports it and nothing forbids it."""
    fake = MulticastFakeDriver()
    decisions = raise_first(gate(fake, "auto", [{"NCCL_NVLS_ENABLE": "1"}] * 3))
    assert decisions == [NvlsDecision(False, OPT_IN)] * 3
    assert "UBNEXT_NVLS=1" in OPT_IN and "selftest --nvls" in OPT_IN
    assert fake.calls == []


def test_mode_1_is_on_when_every_device_supports_it_and_nothing_forbids_it():
    fake = MulticastFakeDriver()
    decisions = raise_first(gate(fake, "1", [{"NCCL_NVLS_ENABLE": "1"}] * 3))
    assert all(d.enabled for d in decisions) and "all 3 local devices" in decisions[0].reason
    queries = [c for c in fake.calls if c.name == "cuDeviceGetAttribute"]
    attr = fake.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
    assert len(queries) == 3 and all(c.args[0] == attr for c in queries)
    assert multicast_calls(fake) == []  # deciding never touches a multicast object


def test_mode_0_queries_nothing():
    fake = MulticastFakeDriver()
    decisions = raise_first(gate(fake, "0", [{}, {}]))
    assert decisions == [NvlsDecision(False, "UBNEXT_NVLS=0")] * 2
    assert fake.calls == []


def test_a_device_without_multicast_support_refuses_mode_1():
    fake = MulticastFakeDriver(unsupported={1})
    results = gate(fake, "1", [{}, {}, {}])
    assert all(isinstance(r, UbnextError) and "local rank(s) 1 does not report" in str(r) for r in results)
    assert multicast_calls(fake) == []


def test_an_unreadable_attribute_counts_as_unsupported():
    fake = MulticastFakeDriver()
    fake.fail_on("cuDeviceGetAttribute", error=fake.CUresult.CUDA_ERROR_INVALID_DEVICE)
    results = gate(fake, "1", [{}, {}])
    assert all(isinstance(r, UbnextError) and "does not report" in str(r) for r in results)


# -- the node path -----------------------------------------------------------------

class StubEngine:
    """Stands in for the Engine (which needs a GPU); keeps what the node passed."""

    def __init__(self, pool, *args, mc_base, deterministic, pdl):
        self.mc_base, self.pdl = mc_base, pdl
        self.closed = False

    def initialize(self):
        pass

    def close(self):
        self.closed = True


class StubFailureRecords:
    tripped = False

    def __init__(self, names):
        self.device_ptr = dict.fromkeys(names, 0)
        self.tripped_ptr = 0

    def close(self):
        pass


class StubStream:
    ptr = 0

    def __init__(self, non_blocking=False):
        pass

    def synchronize(self):
        pass


class StubDevice:
    def __init__(self, device):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class FailingDevice(StubDevice):
    """Device 0's wait fails (e.g. an illegal address in another library's kernel)."""

    def __init__(self, device):
        self.device = device

    def synchronize(self):
        import cupy

        if self.device == 0:
            raise cupy.cuda.runtime.CUDARuntimeError(700)  # cudaErrorIllegalAddress


@pytest.fixture
def node_path(monkeypatch):
    """``run(fake, mode, environ, n=2)``: gate + Node on n thread ranks, GPU parts stubbed.

    Returns per rank (gate decision, node.multicast ptr or None, engine mc_base),
    or the exception; every node is closed again.
    """
    import cupy

    import ubnext._engine.node as node_module

    monkeypatch.setattr(node_module, "Engine", StubEngine)
    monkeypatch.setattr(node_module, "FailureRecords", StubFailureRecords)
    monkeypatch.setattr(cupy.cuda, "Device", StubDevice)
    monkeypatch.setattr(cupy.cuda, "Stream", StubStream)
    config_args = dict(pool_mb=16, staging_mb=1, lamport_max_kb=64, lamport_twoshot_max_kb=512, timeout_s=10)

    def run(fake, mode, environ, n=2):
        config = Config(nvls=mode, **config_args)

        def rank(boot):
            decision = decide(config.nvls, environ, boot, boot.rank, driver=fake)
            node = node_module.Node(boot, fake_context(boot.rank), config, decision, driver=fake)
            try:
                ptr = None if node.multicast is None else node.multicast.ptr
                return decision, ptr, node.engine.mc_base
            finally:
                node.close()

        return run_ranks(n, rank)

    return run


def test_node_path_with_nccl_nvls_off_makes_no_multicast_call(node_path):
    fake = MulticastFakeDriver()  # devices that would support it
    for decision, ptr, mc_base in raise_first(node_path(fake, "auto", {"NCCL_NVLS_ENABLE": "0"})):
        assert not decision.enabled and "NCCL_NVLS_ENABLE=0" in decision.reason
        assert ptr is None and mc_base == 0
    assert "cuMemCreate" in fake.names()  # the pool was built
    assert multicast_calls(fake) == []
    assert "cuDeviceGetAttribute" not in fake.names()
    assert fake.leaks() == []


def test_node_path_in_auto_makes_no_multicast_call(node_path):
    fake = MulticastFakeDriver()  # devices that would support it, nothing forbids it
    for decision, ptr, mc_base in raise_first(node_path(fake, "auto", {})):
        assert decision == NvlsDecision(False, OPT_IN) and ptr is None and mc_base == 0
    assert multicast_calls(fake) == [] and "cuDeviceGetAttribute" not in fake.names()
    assert fake.leaks() == []


def test_node_path_with_nvls_opted_in_maps_multicast_and_closes_it_before_the_pool(node_path):
    fake = MulticastFakeDriver()
    for decision, ptr, mc_base in raise_first(node_path(fake, "1", {})):
        assert decision.enabled
        assert ptr and mc_base == ptr
    assert multicast_calls(fake).count("cuMulticastCreate") == 1
    for r in range(2):
        names = [c.name for c in fake.calls_of(f"rank{r}")]
        unbind = names.index("cuMulticastUnbind")
        pool_teardown = len(names) - 5  # the peer's segment, then this rank's and the address range
        assert names[pool_teardown:] == ["cuMemUnmap", "cuMemRelease"] * 2 + ["cuMemAddressFree"]
        assert names[unbind - 2:pool_teardown] == ["cuMemUnmap", "cuMemAddressFree", "cuMulticastUnbind",
                                                   "cuMemRelease"]
    assert fake.leaks() == []


def test_node_path_multicast_failure_in_mode_1_fails_the_node(node_path):
    fake = MulticastFakeDriver()
    fake.fail_in("rank0", "cuMulticastCreate")
    results = node_path(fake, "1", {})
    assert all(isinstance(r, UbnextError) and "local rank 0: cuMulticastCreate" in str(r) for r in results)
    assert fake.leaks() == []


@pytest.mark.parametrize("why", ["broken", "device error", "local"])
def test_node_close_of_a_broken_node_waits_for_no_rank_and_releases_everything(monkeypatch, why):
    """Rank 0 closes while rank 1 never calls close: with a recorded failure, a failed
    device wait, or close(local=True), rank 0 meets no other rank (a failed peer may
    never come) and still releases everything; a device error is raised after that."""
    import cupy

    import ubnext._engine.node as node_module

    monkeypatch.setattr(node_module, "Engine", StubEngine)
    monkeypatch.setattr(node_module, "FailureRecords", StubFailureRecords)
    monkeypatch.setattr(StubFailureRecords, "tripped", why == "broken")
    monkeypatch.setattr(cupy.cuda, "Device", FailingDevice if why == "device error" else StubDevice)
    monkeypatch.setattr(cupy.cuda, "Stream", StubStream)
    fake = MulticastFakeDriver()
    config = Config(nvls="0", pool_mb=16, staging_mb=1, lamport_max_kb=64, lamport_twoshot_max_kb=512)
    nodes = run_ranks(2, lambda boot: node_module.Node(boot, fake_context(boot.rank), config, NvlsDecision(False, "off"),
                                                       driver=fake))
    try:
        nodes[0].close(local=why == "local")
        closed = "closed"
    except cupy.cuda.runtime.CUDARuntimeError as e:
        closed = e
    if why == "device error":
        assert "cudaErrorIllegalAddress" in str(closed)
    else:
        assert closed == "closed"
    nodes[1].close(local=True)
    assert fake.leaks() == []
    # the kernel modules and the side stream go on this thread, not the garbage collector's
    assert all(n.engine.closed and n._side is None for n in nodes)


def test_node_announce_marks_every_family_of_every_rank(monkeypatch):
    import cupy

    import ubnext._engine.node as node_module
    from ubnext._engine.failures import broken_word
    from ubnext._memory.heap import STATES

    monkeypatch.setattr(node_module, "Engine", StubEngine)
    monkeypatch.setattr(node_module, "FailureRecords", StubFailureRecords)
    monkeypatch.setattr(cupy.cuda, "Device", StubDevice)
    monkeypatch.setattr(cupy.cuda, "Stream", StubStream)
    fake = MulticastFakeDriver()
    config = Config(nvls="0", pool_mb=16, staging_mb=1, lamport_max_kb=64, lamport_twoshot_max_kb=512)
    nodes = run_ranks(3, lambda boot: node_module.Node(boot, fake_context(boot.rank), config, NvlsDecision(False, "off"),
                                                       driver=fake))
    nodes[1].announce(1, 1)
    sets = [c.args for c in fake.calls if c.name == "cuMemsetD32Async"]
    assert len(sets) == 3 * len(STATES) and {a[1:3] for a in sets} == {(broken_word(1, 1), 1)}
    assert len({int(a[0]) for a in sets}) == len(sets)  # a word of every family of every rank
    for node in nodes:
        node.close(local=True)
    assert fake.leaks() == []


@pytest.mark.parametrize("change, ok", [
    ({}, True),
    ({"NCCL_NVLS_ENABLE": None}, False),
    ({"NCCL_NVLS_ENABLE": "1"}, False),
    ({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}, False),
    ({"NVSHMEM_DISABLE_NVLS": None}, False),
    ({"UBNEXT_NVLS": "1"}, False),
    ({"UBNEXT_NVLS": "0"}, True),
])
def test_gpu_run_scripts_refuse_to_start_with_multicast_allowed(change, ok):
    """.ci/gpu_env.sh, sourced by every GPU run script, stops unless the blocking variables
    are set as the shared hosts require and ubnext is not opted in."""
    import os
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in dict(ENV_BLOCKERS)}
    env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    for var, value in change.items():
        if value is None:
            env.pop(var)
        else:
            env[var] = value
    script = Path(__file__).resolve().parents[1] / ".ci" / "gpu_env.sh"
    done = subprocess.run(["bash", "-c", f". {script} && echo started"], env=env, capture_output=True, text=True)
    assert (done.returncode == 0 and "started" in done.stdout) == ok, done.stderr
    if not ok:
        assert done.returncode == 3 and "refusing to run" in done.stderr
