"""Call plans of eager all-reduces and fused all-reduce + add + RMSNorm calls (no GPU): a
repeated call with the same arguments launches the plan its first call made, and anything
that could change what a call validates or launches misses the plan and runs the full path.

The communicator here runs ubnext's kernel path on fakes: a real ``Engine`` and
``Dispatcher`` over a fake pool, kernels that are never compiled, and a recording driver
that reads every launch's argument pack. Arrays are CuPy arrays over addresses that are
never dereferenced (and torch CPU tensors that say they are on device 0).
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest
from stream_fakes import PROGRAMMATIC, FakeContexts, FakeCuda, bare_communicator, fake_order, read_launch_config, read_pack
from thread_ranks import run_threads

from ubnext import ClosedError, CollectiveTimeoutError, UbnextError
from ubnext._api.plans import MAX_PLANS
from ubnext._engine import engine as _engine
from ubnext._engine import launch as _launch
from ubnext._engine.dispatch import Dispatcher
from ubnext._environment.config import Config
from ubnext._interop import arrays as _arrays
from ubnext._interop import context as _context
from ubnext._interop import streams as _streams
from ubnext._memory.heap import STATES, plan_layout
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS
from ubnext._protocol.quant import quant_area_bytes
from ubnext._protocol.signature import encode, encode_fused
from ubnext._selection.select import Selector, buffer_limits

CURRENT = 0x5100  # the current stream of CuPy (and torch) here
A, B = 0x7A00, 0x7B00  # other streams
SEGMENT = 1 << 40  # this rank's pool segment starts here
#: parameters of each entry point
NPARAMS = {entry: len(types) for entry, types in _engine._PARAMS.items()}
#: fake kernel address -> its entry point's parameters, over every fake engine (addresses are unique)
PARAMS_AT: dict[int, int] = {}
_ADDRESSES = itertools.count(0xF000)


class FakePool:
    """What the engine and the dispatcher read of a SymmetricPool: one rank's segment."""

    base, stride, local_size, local_rank, device = SEGMENT, 1 << 30, 1, 0, 0

    def local_ptr(self, offset):
        return self.base + offset

    def contains(self, ptr, nbytes):
        offset = ptr - self.base
        return offset if 0 <= offset and offset + nbytes <= self.stride else None


class FakeNode:
    """A node whose failure records say ``error`` (None: no failure)."""

    def __init__(self, engine, pool):
        self.engine, self.pool, self.error = engine, pool, None
        self.closed, self.announced, self.held = None, [], []

    def failure(self, name, timeout_s):
        return self.error

    def announce(self, kind, rank):
        self.announced.append((kind, rank))

    def announce_abort(self, rank):
        self.announce("aborted", rank)

    def hold(self, stream):
        self.held.append(stream)

    def on_release(self, fn):  # no array or graph holds its memory after close
        fn()

    def close(self, local=False, exchange=None):
        self.closed = local
        return local


class Driver:
    """CuPy's driver binding, recording each launch: (kernel, blocks, threads, stream, args)."""

    class CUDADriverError(Exception):
        status = 1

    def __init__(self):
        self.launches = []

    def launchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, pack_ptr, extra):  # noqa: N802 - CuPy's
        self.launches.append((func, gx, bx, stream, tuple(read_pack(pack_ptr, PARAMS_AT[func]))))

    def launch_ex(self, config_ptr, func, pack_ptr, extra) -> int:  # libcuda's cuLaunchKernelEx
        blocks, threads, stream, attributes = read_launch_config(config_ptr)
        assert attributes == PROGRAMMATIC and extra is None
        self.launches.append((func, blocks, threads, stream, tuple(read_pack(pack_ptr, PARAMS_AT[func]))))
        return 0


class Counted:
    """Wraps a function of ``_arrays``, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def make_engine(monkeypatch, config):
    """A real Engine over a fake pool; its kernels are fakes named by ``kernels``."""
    kernels = {}

    def compile_module(source, defines, device):
        def get_function(entry):
            ptr = next(_ADDRESSES)
            kernels[ptr], PARAMS_AT[ptr] = (source, entry, tuple(sorted(defines.items()))), NPARAMS[entry]
            return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=ptr))
        return types.SimpleNamespace(get_function=get_function)

    monkeypatch.setattr(_engine, "compile_module", compile_module)
    import cupy

    device = types.SimpleNamespace(attributes={"MultiProcessorCount": 132}, compute_capability="90")
    lamport, lamport_twoshot = config.lamport_max_kb << 10, config.lamport_twoshot_max_kb << 10
    staging = max(config.staging_mb << 20, lamport, lamport_twoshot)
    plan = plan_layout(1, lamport, lamport_twoshot, staging, quant_area_bytes(1, config.quantized))
    records = {name: 0x1000 + 64 * i for i, name in enumerate(STATES)}
    with monkeypatch.context() as m:
        m.setattr(cupy.cuda, "Device", lambda ordinal: device)
        engine = _engine.Engine(FakePool(), plan, records, 0x900, config.timeout_s, 0)
    return engine, kernels


@pytest.fixture
def fakes(monkeypatch):
    """The recording fakes (driver, runtime, validation counters) every test here uses."""
    import cupy

    driver = Driver()
    monkeypatch.setattr(_context, "_DRIVER", [FakeContexts()])  # keep_current around producers
    monkeypatch.setattr(_launch, "_cupy_driver", driver)
    monkeypatch.setattr(_launch, "_launch_ex", driver.launch_ex)
    cuda = FakeCuda()
    monkeypatch.setattr(_streams, "CUDA", cuda)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device=-1: types.SimpleNamespace(ptr=CURRENT))
    as_buffer = Counted(_arrays.as_buffer)
    monkeypatch.setattr(_arrays, "as_buffer", as_buffer)
    recorded = []
    monkeypatch.setattr(_arrays, "record_stream", lambda stream, owner, buffers: recorded.append(
        (stream, [None if b is None else (b.framework, b.obj, b.device) for b in buffers])))
    copies = []
    monkeypatch.setattr(sys.modules["ubnext._engine.dispatch"], "_copy", lambda *a: copies.append(a))
    return types.SimpleNamespace(driver=driver, cuda=cuda, as_buffer=as_buffer, recorded=recorded, copies=copies,
                                 monkeypatch=monkeypatch)


@pytest.fixture
def make_comm(fakes):
    """``make_comm(**config)``: a Communicator of one rank on the fake kernel path."""
    made = []

    def make(**overrides):
        config = Config.from_env(**overrides)
        engine, kernels = make_engine(fakes.monkeypatch, config)
        node = FakeNode(engine, engine.pool)
        usable = [name for name, alg in ALGORITHMS.items() if not alg.multicast]
        selector = Selector(1, buffer_limits(config), usable, None, None)
        local = types.SimpleNamespace(rank=0, size=1, close=lambda: None, abort=lambda: None)
        order = fake_order()
        comm = bare_communicator(
            order, config=config, _node=node, _selector=selector, _nccl_reason=None, _arch=90, _local=local,
            _owns_bootstrap=False, bootstrap=None, _dispatch=Dispatcher(node, selector.limits, order, None, 0))
        comm.kernels = kernels
        made.append(comm)
        return comm

    yield make
    for comm in made:
        comm._closed = True


def array(ptr, shape=(1024,), dtype="float32", device=0):
    """A CuPy array over device address ``ptr`` (never read or written here)."""
    import cupy

    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cupy.cuda.UnownedMemory(ptr, max(n, 1), None, device_id=device)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


X, Y, Z = 0x10000000, 0x20000000, 0x30000000  # 16-byte aligned, outside the pool


def entry(comm, launch):
    """(source, entry point, defines) of a recorded launch's kernel."""
    return comm.kernels[launch[0]]


# -- a repeated call launches its plan --------------------------------------------------------------


@pytest.mark.parametrize("place", ["out", "in"])
@pytest.mark.parametrize(("algorithm", "where"), [("lamport", X), ("lamport_twoshot", X), ("twoshot", SEGMENT + 4096)])
def test_a_repeated_call_launches_what_its_first_call_launched_without_validating_again(
        make_comm, fakes, algorithm, where, place):
    comm = make_comm()
    x = array(where)
    out = x if place == "in" else array(where + (1 << 20))
    for _ in range(3):
        assert comm.all_reduce(x, out=out, algorithm=algorithm) is out
    assert fakes.as_buffer.calls == (1 if place == "in" else 2)  # the first call's
    first, *later = fakes.driver.launches
    assert len(later) == 2 and all(launch == first for launch in later)
    _, entry_point, defines = entry(comm, first)
    assert entry_point == ALGORITHMS[algorithm].entry and ("UB_OP", "OpSum") in defines
    # the signature the full path computes, in the slot before the launch state
    assert first[4][-2] == encode("all_reduce", "float32", "sum", 1024)
    assert first[3] == CURRENT
    assert len(comm._plans) == 1


def test_the_plan_launches_the_arguments_the_full_path_packs(make_comm, fakes):
    """The same call on a communicator without the plan (a new one) packs the same bytes."""
    x, out = array(X), array(Y)
    warm = make_comm()
    warm.all_reduce(x, out=out, op="max")
    warm.all_reduce(x, out=out, op="max")
    cold = make_comm()
    cold.all_reduce(x, out=out, op="max")
    planned, full = fakes.driver.launches[1], fakes.driver.launches[2]
    assert planned[1:] == full[1:] and entry(warm, planned) == entry(cold, full)


def test_a_plan_holds_no_array(make_comm, fakes):
    comm = make_comm()
    x, out = array(X), array(Y)
    refs = weakref.ref(x), weakref.ref(out)
    comm.all_reduce(x, out=out)
    del x, out
    gc.collect()
    assert refs[0]() is None and refs[1]() is None
    assert len(comm._plans) == 1


# -- anything else misses the plan --------------------------------------------------------------------


CHANGES = {
    "x's pointer": dict(x=array(X + 4096)),
    "x's shape": dict(x=array(X, (32, 32)), out=array(Y, (32, 32))),
    "x's dtype": dict(x=array(X, dtype="float16"), out=array(Y, dtype="float16")),
    "out's pointer": dict(out=array(Z)),
    "in place": dict(out=None),  # out=x
    "op": dict(op="min"),
    "algorithm": dict(algorithm="lamport_twoshot"),
    "algorithm auto": dict(algorithm="auto"),
    "precision": dict(precision="exact"),
    "stream": dict(stream=A),
}
#: the changes whose launch differs in more than its stream
DIFFERENT = ("x's pointer", "x's dtype", "out's pointer", "in place", "op", "algorithm")


@pytest.mark.parametrize("change", list(CHANGES))
def test_changing_a_key_field_validates_again(make_comm, fakes, change):
    comm = make_comm()
    call = dict(x=array(X), out=array(Y), op="sum", algorithm="lamport", precision="auto", stream=None)
    comm.all_reduce(**call)
    comm.all_reduce(**call)
    assert fakes.as_buffer.calls == 2
    changed = {**call, **CHANGES[change]}
    if changed["out"] is None:
        changed["out"] = changed["x"]
    comm.all_reduce(**changed)
    assert fakes.as_buffer.calls == (3 if change == "in place" else 4), "the changed call took the plan"
    comm.all_reduce(**changed)  # now planned too
    assert fakes.as_buffer.calls == (3 if change == "in place" else 4)
    assert len(comm._plans) == 2
    launches = fakes.driver.launches
    assert launches[2] == launches[3] and launches[0] == launches[1]
    if change in DIFFERENT:
        assert launches[2][1:] != launches[0][1:] or entry(comm, launches[2]) != entry(comm, launches[0])


def test_the_current_stream_named_or_implied_is_one_plan(make_comm, fakes):
    comm = make_comm()
    x, out = array(X), array(Y)
    comm.all_reduce(x, out=out)
    comm.all_reduce(x, out=out, stream=CURRENT)
    assert fakes.as_buffer.calls == 2 and len(comm._plans) == 1


def test_the_same_count_in_another_shape_is_another_plan(make_comm, fakes):
    comm = make_comm()
    comm.all_reduce(array(X), out=array(Y))
    comm.all_reduce(array(X, (2, 512)), out=array(Y, (2, 512)))
    assert fakes.as_buffer.calls == 4 and len(comm._plans) == 2


def test_a_non_contiguous_view_of_planned_memory_is_refused(make_comm, fakes):
    comm = make_comm()
    x, out = array(X, (32, 32)), array(Y, (32, 32))
    comm.all_reduce(x, out=out)
    with pytest.raises(UbnextError, match="not C-contiguous"):
        comm.all_reduce(x.T, out=out)
    with pytest.raises(UbnextError, match="not C-contiguous"):
        comm.all_reduce(x, out=out.T)
    assert len(fakes.driver.launches) == 1


@pytest.mark.parametrize(("bad", "message"), [
    (lambda: array(Z, (1000,)), "out has 1000 float32 elements, input has 1024 float32"),
    (lambda: array(Z, dtype="float16"), "out has 1024 float16 elements"),
    (lambda: array(X + 16), "out partially overlaps the input"),
])
def test_an_invalid_new_out_still_raises(make_comm, fakes, bad, message):
    comm = make_comm()
    x = array(X)
    comm.all_reduce(x, out=array(Y))
    comm.all_reduce(x, out=array(Y))
    with pytest.raises(UbnextError, match=message):
        comm.all_reduce(x, out=bad())
    assert len(fakes.driver.launches) == 2


def test_invalid_arguments_raise_as_before(make_comm, fakes):
    comm = make_comm()
    x, out = array(X), array(Y)
    comm.all_reduce(x, out=out)
    with pytest.raises(UbnextError, match="unsupported op 'prod'"):
        comm.all_reduce(x, out=out, op="prod")
    with pytest.raises(UbnextError, match="unknown precision"):
        comm.all_reduce(x, out=out, precision="int2")
    with pytest.raises(UbnextError, match="unknown algorithm"):
        comm.all_reduce(x, out=out, algorithm="ring")
    with pytest.raises(UbnextError, match="input is on device 1, communicator on device 0"):
        comm.all_reduce(array(X, device=1), out=out, op=["sum"])  # unhashable: the full path's error
    with pytest.raises(UbnextError, match="stream"):
        comm.all_reduce(x, out=out, stream=object())
    assert len(fakes.driver.launches) == 1 and len(comm._plans) == 1


# -- what is never planned ------------------------------------------------------------------------------


def test_a_new_output_is_allocated_and_validated_every_call(make_comm, fakes):
    made = []
    fakes.monkeypatch.setattr(_arrays, "empty_like", lambda x, *a, **k: made.append(1) or array(Z + len(made) * 8192))
    comm = make_comm()
    x = array(X)
    for _ in range(3):
        comm.all_reduce(x, algorithm="lamport")
    assert len(made) == 3 and fakes.as_buffer.calls == 6 and len(comm._plans) == 0


def test_nccl_calls_are_not_planned(make_comm, fakes):
    calls = []
    comm = make_comm()
    comm._dispatch.nccl = types.SimpleNamespace(all_reduce=lambda *a: calls.append(a))
    x, out = array(X), array(Y)
    for _ in range(3):
        comm.all_reduce(x, out=out, algorithm="nccl")
    assert len(calls) == 3 and fakes.as_buffer.calls == 6 and len(comm._plans) == 0


@pytest.mark.parametrize(("algorithm", "x", "out", "launches", "copies"), [
    ("lamport", X + 2, Y, 1, 2),  # not 16-byte aligned: copied through the staging slot
    ("twoshot", X, Y, 1, 0),  # out outside the pool: the kernel reads and writes the staging slot
    ("lamport_twoshot", X, Y, 2, 0),  # past its buffers (2 KiB here): in launches of them
])
def test_calls_of_several_launches_or_through_the_staging_slot_are_not_planned(make_comm, fakes, algorithm, x, out,
                                                                               launches, copies):
    comm = make_comm(lamport_twoshot_max_kb=2)
    for _ in range(2):
        comm.all_reduce(array(x), out=array(out), algorithm=algorithm)
    assert fakes.as_buffer.calls == 4 and len(comm._plans) == 0
    assert len(fakes.driver.launches) == 2 * launches and len(fakes.copies) == 2 * copies


def test_empty_arrays_are_not_planned(make_comm, fakes):
    comm = make_comm()
    x, out = array(X, (0,)), array(Y, (0,))
    for _ in range(2):
        assert comm.all_reduce(x, out=out) is out
    assert fakes.driver.launches == [] and len(comm._plans) == 0


def test_debug_mode_compares_the_ranks_every_call(make_comm, fakes):
    sent = []
    comm = make_comm(debug=True)
    comm.bootstrap = types.SimpleNamespace(allgather=lambda b: sent.append(b) or [b])
    x, out = array(X), array(Y)
    for _ in range(3):
        comm.all_reduce(x, out=out)
    assert len(sent) == 3 and len(fakes.driver.launches) == 3 and len(comm._plans) == 0


def test_quantized_calls_are_not_planned(make_comm, fakes):
    comm = make_comm(quantized="int8")
    x, out = array(X, dtype="float16"), array(Y, dtype="float16")
    for _ in range(2):
        comm.all_reduce(x, out=out, precision="int8")
    assert [entry(comm, launch)[1] for launch in fakes.driver.launches] == ["ub_quant_twoshot"] * 2
    assert fakes.as_buffer.calls == 4 and len(comm._plans) == 0
    comm.all_reduce(x, out=out)  # the same arrays at full precision: planned
    comm.all_reduce(x, out=out)
    assert fakes.as_buffer.calls == 6 and len(comm._plans) == 1
    assert entry(comm, fakes.driver.launches[-1])[1] != "ub_quant_twoshot"


def test_quantized_launches_take_the_slots_and_the_gather_area_after_them(make_comm, fakes):
    """kernels/quant_twoshot.cu gets the reduce-scatter slots and the all-gather area as
    offsets: the area from _quant.slots_bytes past the slots (their room for any launch),
    to the end of the pool's quant slot."""
    comm = make_comm(quantized="int8")
    comm.all_reduce(array(X, dtype="float16"), out=array(Y, dtype="float16"), precision="int4")
    (launch,) = fakes.driver.launches
    plan = comm._node.engine.plan
    slots = plan.offset("quant")
    assert launch[4][4:7] == (plan.offset("flags.quant"), slots, slots + _quant.slots_bytes(1))
    assert slots + _quant.slots_bytes(1) + _quant.gather_bytes(1) == slots + plan.nbytes("quant")


def test_the_quantized_reduce_scatter_launches_its_entry_of_the_all_reduces_module(make_comm, fakes):
    """One module per format, dtype and op holds both entry points; the reduce-scatter's
    takes the flags and the slots (no all-gather area), then the input, the output, k, the
    slices' pitch in bytes and the tagged signature; it is not planned."""
    comm = make_comm(quantized="int8")
    x, out = array(X, dtype="float16"), array(Y, dtype="float16")
    comm.all_reduce(x, out=out, precision="int4")
    for _ in range(2):
        comm.reduce_scatter(x, out=out, precision="int4")
    ar, rs, again = fakes.driver.launches
    assert [entry(comm, launch)[1] for launch in (ar, rs)] == list(_quant.ENTRIES.values())
    assert entry(comm, ar)[2] == entry(comm, rs)[2] and len(comm._node.engine._modules) == 1
    plan = comm._node.engine.plan
    sig = _quant.signature(encode("reduce_scatter", "float16", "sum", 1024), "int4")
    assert rs[4][4:] == (plan.offset("flags.quant"), plan.offset("quant"), X, Y, 1024, 2048, sig,
                         SEGMENT + plan.offset("quant.state"))
    assert rs[1:3] == (1, _quant.BLOCK_UNITS * 32) and again == rs and len(comm._plans) == 0


def test_arrays_of_other_frameworks_are_not_planned(make_comm, fakes):
    """Viewing them orders their producer's stream before the launch: every call."""
    fakes.monkeypatch.setattr(_arrays, "_pointer_device", lambda ptr, op, kind: 0)

    class Interface:
        def __init__(self, ptr, stream):
            self.__cuda_array_interface__ = {"shape": (1024,), "typestr": "<f4", "data": (ptr, False),
                                             "version": 3, "stream": stream}

    comm = make_comm()
    x, out = Interface(X, A), Interface(Y, None)
    for _ in range(2):
        comm.all_reduce(x, out=out)
    assert fakes.as_buffer.calls == 4 and len(comm._plans) == 0
    assert [c[2] for c in fakes.cuda.calls if c[0] == "record"] == [A, A]  # the producer's stream, each call


# -- the communicator's state ------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_closed_or_aborted_communicator_drops_its_plans_and_raises_on_a_planned_call(make_comm, fakes, end):
    comm = make_comm()
    x, out = array(X), array(Y)
    comm.all_reduce(x, out=out)
    getattr(comm, end)()
    assert len(comm._plans) == 0
    with pytest.raises(ClosedError, match="all_reduce: the communicator is closed"):
        comm.all_reduce(x, out=out)
    assert len(fakes.driver.launches) == 1


def test_every_call_lets_a_graph_being_captured_hold_the_pool_before_it_launches(make_comm, fakes):
    """Each collective, planned or not, names its launch stream to the node (``Node.hold``:
    a CUDA graph being captured on it then holds the pool) before its first launch."""
    comm = make_comm()
    launched = fakes.driver.launches
    order = []
    node_hold = comm._node.hold
    comm._node.hold = lambda stream: (order.append(("hold", stream, len(launched))), node_hold(stream))
    x, out = array(X), array(Y)
    for stream in (None, A, A):
        comm.all_reduce(x, out=out, stream=stream)
    comm.all_reduce_add_rmsnorm(array(X, (4, 256)), None, array(WEIGHT, (256,)), out=array(Y, (4, 256)),
                                residual_out=array(Z, (4, 256)), stream=B)
    assert [stream for _, stream, _ in order] == [CURRENT, A, A, B]
    assert [before for _, _, before in order] == [0, 1, 2, 3]  # each before its call's launch
    assert len(launched) == 4


@pytest.mark.parametrize("end", ["close", "abort"])
def test_close_from_another_thread_waits_for_the_call_in_flight(make_comm, fakes, end):
    """The call's section holds the communicator: a close (or abort) of another thread
    releases nothing under a call that is launching, and drops the plan it kept."""
    comm = make_comm()
    dispatch = comm._dispatch.all_reduce
    inside, go = threading.Event(), threading.Event()

    def launch_then_wait(*args):
        launch = dispatch(*args)
        inside.set()
        assert go.wait(10)
        return launch

    comm._dispatch.all_reduce = launch_then_wait
    caller = threading.Thread(target=lambda: comm.all_reduce(array(X), out=array(Y)))
    closer = threading.Thread(target=getattr(comm, end))
    caller.start()
    assert inside.wait(10)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and comm._node.closed is None  # waiting for the call
    go.set()
    caller.join(10)
    closer.join(10)
    assert not caller.is_alive() and not closer.is_alive()
    assert comm._owned.released and len(fakes.driver.launches) == 1 and len(comm._plans) == 0
    with pytest.raises(ClosedError):
        comm.all_reduce(array(X), out=array(Y))


def test_a_broken_communicator_raises_on_a_planned_call_and_drops_its_plans(make_comm, fakes):
    comm = make_comm()
    x, out = array(X), array(Y)
    comm.all_reduce(x, out=out)
    comm.all_reduce(x, out=out)
    comm._node.error = CollectiveTimeoutError("all_reduce", 0, 1, "Lamport poll, launch 2", 4.0)
    with pytest.raises(CollectiveTimeoutError, match="rank 0 waited more than 4 s for rank 1"):
        comm.all_reduce(x, out=out)
    assert len(comm._plans) == 0
    with pytest.raises(CollectiveTimeoutError):
        comm.all_reduce(x, out=out)
    assert len(fakes.driver.launches) == 2


def test_the_plans_are_bounded_the_oldest_dropped_first(make_comm, fakes):
    comm = make_comm()
    outs = [array(Z + i * 8192) for i in range(MAX_PLANS + 8)]
    x = array(X)
    for out in outs:
        comm.all_reduce(x, out=out)
    assert len(comm._plans) == MAX_PLANS
    calls = fakes.as_buffer.calls
    comm.all_reduce(x, out=outs[-1])  # among the newest: planned
    assert fakes.as_buffer.calls == calls
    comm.all_reduce(x, out=outs[0])  # the oldest: dropped
    assert fakes.as_buffer.calls == calls + 2
    assert len(comm._plans) == MAX_PLANS


# -- streams and threads ----------------------------------------------------------------------------------


def test_planned_calls_on_other_streams_keep_their_order(make_comm, fakes):
    comm = make_comm()
    x, out = array(X), array(Y)
    for stream in (A, B, A, B):
        comm.all_reduce(x, out=out, stream=stream)
        comm.all_reduce(x, out=out, stream=stream)
    assert fakes.as_buffer.calls == 4  # a plan per stream
    waits = [c for c in fakes.cuda.calls if c[0] == "wait"]
    assert [w[1] for w in waits] == [B, A, B]  # every change of stream waits for the previous one
    assert [launch[3] for launch in fakes.driver.launches] == [A, A, B, B, A, A, B, B]
    assert not fakes.cuda.live


def test_planned_calls_on_a_side_stream_record_their_arrays_every_call(make_comm, fakes):
    comm = make_comm()
    x, out = array(X), array(Y)
    for _ in range(3):
        comm.all_reduce(x, out=out, stream=A)
    comm.all_reduce(x, out=out)  # on the current stream: nothing recorded
    assert fakes.as_buffer.calls == 4
    assert fakes.recorded == [(A, [("cupy", x, 0), ("cupy", out, 0)])] * 3
    comm.all_reduce(x, out=x, stream=A)
    comm.all_reduce(x, out=x, stream=A)
    assert fakes.recorded[-2:] == [(A, [("cupy", x, 0), ("cupy", x, 0)])] * 2


def test_planned_calls_from_threads_launch_their_own_arguments(make_comm, fakes):
    comm = make_comm()
    threads, calls = 4, 200

    def run(t):
        x, out = array(X + t * (1 << 20)), array(Y + t * (1 << 20))
        for _ in range(calls):
            comm.all_reduce(x, out=out, algorithm="lamport", stream=A + t)

    run_threads(threads, run)
    assert fakes.as_buffer.calls == 2 * threads
    launches = fakes.driver.launches
    assert len(launches) == threads * calls
    for func, blocks, block_threads, stream, args in launches:
        t = stream - A
        assert args[6:9] == (X + t * (1 << 20), Y + t * (1 << 20), 1024)


# -- torch tensors ------------------------------------------------------------------------------------------


@pytest.fixture
def cuda_tensors(fakes):
    """CPU tensors that say they are on device 0, on a current stream CURRENT."""
    torch = pytest.importorskip("torch")
    fakes.monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    fakes.monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: CURRENT, raising=False)
    return torch


def test_torch_tensors_are_planned(make_comm, fakes, cuda_tensors):
    torch = cuda_tensors
    comm = make_comm()
    x, out = torch.empty(1024), torch.empty(1024)
    for _ in range(3):
        assert comm.all_reduce(x, out=out) is out
        assert comm.all_reduce(x, out=x) is x
    assert fakes.as_buffer.calls == 3 and len(comm._plans) == 2
    launches = fakes.driver.launches
    assert launches[0][4][6:8] == (x.data_ptr(), out.data_ptr()) and launches[0] == launches[2] == launches[4]
    assert launches[1][4][6:8] == (x.data_ptr(), x.data_ptr()) and launches[1] == launches[3] == launches[5]
    comm.all_reduce(x.view(32, 32), out=out.view(32, 32))  # another shape
    comm.all_reduce(x.bfloat16(), out=out.bfloat16())  # another dtype (and memory)
    with pytest.raises(UbnextError, match="not contiguous"):
        comm.all_reduce(x.view(32, 32).t(), out=out.view(32, 32))
    assert fakes.as_buffer.calls == 8


def test_torch_tensors_on_a_side_stream_are_recorded_every_call(make_comm, fakes, cuda_tensors):
    torch = cuda_tensors
    comm = make_comm()
    x, out = torch.empty(1024), torch.empty(1024)
    for _ in range(2):
        comm.all_reduce(x, out=out, stream=A)
    assert fakes.as_buffer.calls == 2
    assert fakes.recorded == [(A, [("torch", x, 0), ("torch", out, 0)])] * 2


def test_identity_reads_what_as_buffer_reads(cuda_tensors):
    torch = cuda_tensors
    x = torch.empty(16)
    key = _arrays.identity(x)
    assert key == _arrays.identity(x) == _arrays.identity(x.view(16))
    for other in (x[1:], x.view(4, 4), x.view(torch.int32), x[::2], torch.empty(16)):
        assert _arrays.identity(other) != key
    assert _arrays.identity(x.view(4, 4).t()) != _arrays.identity(x.view(4, 4))
    param = torch.nn.Parameter(x)  # a model's weight: a key of its own class
    assert _arrays.identity(param) is not None and _arrays.identity(param) != key
    assert _arrays.identity(x.as_subclass(type("Sub", (torch.Tensor,), {}))) is None  # other subclasses: never
    assert _arrays.identity(np.ones(4)) is None and _arrays.identity([1.0]) is None
    assert _arrays.identity(array(X)) != _arrays.identity(array(X, dtype="int32"))


# -- the fused all-reduce + add + RMSNorm ---------------------------------------------------------------

R, WEIGHT, BIAS = 0x40000000, 0x50000000, 0x50100000  # residual, weight, bias: 16-byte aligned
ROWS, HIDDEN = 4, 256  # 4 KiB of float32: one launch of every kernel here
#: a fused launch's varying arguments, the last of its parameters but the launch state:
#: x, rows, hidden, residual, bias, weight, normed, res_out, eps (fp32), signature
VALUES = slice(-11, -1)


def fused_args(shape=(ROWS, HIDDEN), dtype="float32", **changes) -> dict:
    """The arguments of a fused call (all of them given; residual_out apart from residual)."""
    rows = dict(shape=shape, dtype=dtype)
    row = dict(shape=shape[-1:], dtype=dtype)
    return {**dict(x=array(X, **rows), residual=array(R, **rows), weight=array(WEIGHT, **row),
                   bias=array(BIAS, **row), out=array(Y, **rows), residual_out=array(Z, **rows), eps=1e-6,
                   algorithm="lamport", stream=None), **changes}


def fused(comm, call: dict):
    return comm.all_reduce_add_rmsnorm(**call)


def f32(value: float) -> int:
    """The pack slot of a float32 parameter (its bits, upper bytes zero)."""
    return int(np.array(value, np.float32).view(np.uint32))


@pytest.mark.parametrize("operands", ["all", "no residual", "no bias", "in place"])
@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot"])
def test_a_repeated_fused_call_launches_its_first_launch_without_validating_again(make_comm, fakes, algorithm,
                                                                                  operands):
    comm = make_comm()
    call = fused_args(algorithm=algorithm)
    if operands == "no residual":
        call["residual"] = None
    elif operands == "no bias":
        call["bias"] = None
    elif operands == "in place":
        call["residual_out"] = call["residual"]
    for _ in range(3):
        normed, res_out = fused(comm, call)
        assert normed is call["out"] and res_out is call["residual_out"]
    validated = fakes.as_buffer.calls
    assert validated == 6 - (operands in ("no residual", "no bias"))  # the first call's: one per array given
    first, *later = fakes.driver.launches
    assert len(later) == 2 and all(launch == first for launch in later)
    assert entry(comm, first)[1] == ALGORITHMS[algorithm].norm_entry
    residual = {"no residual": 0}.get(operands, R)
    res_out = R if operands == "in place" else Z
    assert first[4][VALUES] == (X, ROWS, HIDDEN, residual, 0 if operands == "no bias" else BIAS, WEIGHT, Y, res_out,
                                f32(1e-6), encode_fused("float32", ROWS, HIDDEN))
    assert first[3] == CURRENT and len(comm._plans) == 1


@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot"])
def test_the_fused_plan_launches_the_bytes_the_full_path_packs(make_comm, fakes, algorithm):
    """The same call on a communicator without the plan (a new one) packs the same bytes."""
    call = fused_args(algorithm=algorithm, eps=1e-5)
    warm = make_comm()
    fused(warm, call)
    fused(warm, call)
    cold = make_comm()
    fused(cold, call)
    planned, full = fakes.driver.launches[1], fakes.driver.launches[2]
    assert planned[1:] == full[1:] and entry(warm, planned) == entry(cold, full)
    assert fakes.as_buffer.calls == 12  # two full paths


def test_a_fused_plan_holds_no_array(make_comm, fakes):
    comm = make_comm()
    call = fused_args()
    refs = [weakref.ref(call[k]) for k in ("x", "residual", "weight", "bias", "out", "residual_out")]
    fused(comm, call)
    del call
    gc.collect()
    assert all(ref() is None for ref in refs) and len(comm._plans) == 1


def test_plans_of_all_reduce_and_of_the_fused_call_are_apart(make_comm, fakes):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    comm.all_reduce(call["x"], out=call["out"], algorithm="lamport")
    fused(comm, call)
    comm.all_reduce(call["x"], out=call["out"], algorithm="lamport")
    assert len(comm._plans) == 2 and fakes.as_buffer.calls == 6 + 2
    assert sorted(key[0] for key in comm._plans._plans) == ["all_reduce", "all_reduce_add_rmsnorm"]
    kinds = [entry(comm, launch)[1] for launch in fakes.driver.launches]
    assert kinds == ["ub_lamport_norm", "ub_lamport"] * 2


FUSED_CHANGES = {
    "x's pointer": dict(x=array(X + 4096, (ROWS, HIDDEN))),
    "x's shape": dict(shape=(2 * ROWS, HIDDEN // 2)),  # every array's, at the same addresses
    "x's dtype": dict(dtype="float16"),  # every array's
    "residual's pointer": dict(residual=array(R + 8192, (ROWS, HIDDEN))),
    "no residual": dict(residual=None),
    "weight's pointer": dict(weight=array(WEIGHT + 4096, (HIDDEN,))),
    "bias's pointer": dict(bias=array(BIAS + 4096, (HIDDEN,))),
    "no bias": dict(bias=None),
    "out's pointer": dict(out=array(Y + 8192, (ROWS, HIDDEN))),
    "residual_out's pointer": dict(residual_out=array(Z + 8192, (ROWS, HIDDEN))),
    "in place": dict(residual_out="residual"),  # residual_out=residual
    "in place at residual's address": dict(residual_out=array(R, (ROWS, HIDDEN))),  # another object
    "eps": dict(eps=1e-5),
    "eps rounding to the same float32": dict(eps=1e-6 * (1 + 2**-40)),
    "algorithm": dict(algorithm="lamport_twoshot"),
    "algorithm auto": dict(algorithm="auto"),
    "stream": dict(stream=A),
}
#: the changes whose launch differs in more than its stream
FUSED_DIFFERENT = ("x's pointer", "x's shape", "x's dtype", "residual's pointer", "no residual", "weight's pointer",
                   "bias's pointer", "no bias", "out's pointer", "residual_out's pointer", "in place",
                   "in place at residual's address", "eps", "algorithm")


@pytest.mark.parametrize("change", list(FUSED_CHANGES))
def test_changing_a_fused_key_field_validates_again(make_comm, fakes, change):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    fused(comm, call)
    validated = fakes.as_buffer.calls
    assert validated == 6
    changes = dict(FUSED_CHANGES[change])
    # new objects: where only their identity (_arrays.identity) is the same, the call is the same
    changed = {**fused_args(changes.pop("shape", (ROWS, HIDDEN)), changes.pop("dtype", "float32")), **changes}
    if isinstance(changed["residual_out"], str):
        changed["residual_out"] = changed["residual"]
    fused(comm, changed)
    assert fakes.as_buffer.calls > validated, "the changed call took the plan"
    validated = fakes.as_buffer.calls
    fused(comm, changed)  # now planned too
    assert fakes.as_buffer.calls == validated and len(comm._plans) == 2
    launches = fakes.driver.launches
    assert len(launches) == 4 and launches[2] == launches[3] and launches[0] == launches[1]
    if change in FUSED_DIFFERENT:
        assert launches[2][1:] != launches[0][1:] or entry(comm, launches[2]) != entry(comm, launches[0])
    else:
        assert launches[2][1:3] + launches[2][4:] == launches[0][1:3] + launches[0][4:]


def test_the_same_fused_call_on_the_current_stream_named_or_implied_is_one_plan(make_comm, fakes):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    fused(comm, {**call, "stream": CURRENT})
    assert fakes.as_buffer.calls == 6 and len(comm._plans) == 1


@pytest.mark.parametrize(("change", "message"), [
    (dict(out=array(Y, (ROWS, HIDDEN // 2))), r"out must be float32 of shape \(4, 256\)"),
    (dict(out=array(Y, (ROWS, HIDDEN), "float16")), "out must be float32"),
    (dict(out=array(X + 16, (ROWS, HIDDEN))), "out overlaps x"),
    (dict(residual_out=array(X, (ROWS, HIDDEN))), "residual_out overlaps x"),
    (dict(residual_out=array(Y + 16, (ROWS, HIDDEN))), "out and residual_out overlap"),
    (dict(residual_out=array(R + 16, (ROWS, HIDDEN))), "residual_out partially overlaps residual"),
    (dict(residual=array(R, (ROWS, HIDDEN), device=1)), "residual is on device 1, communicator on device 0"),
    (dict(weight=array(WEIGHT, (HIDDEN,), "float16")), r"weight must be float32 of shape \(256,\)"),
    (dict(bias=array(BIAS, (HIDDEN // 2,))), r"bias must be float32 of shape \(256,\)"),
    (dict(x=array(X, (ROWS * HIDDEN,))), "x must be 2-D"),
    (dict(x=array(X, (HIDDEN, ROWS)).T), "not C-contiguous"),
    (dict(eps=-1e-6), "eps must be finite and >= 0"),
    (dict(eps=float("nan")), "eps must be finite"),
    (dict(eps="small"), "eps must be a number"),
    (dict(algorithm="ring"), "unknown algorithm"),
])
def test_invalid_new_fused_arguments_still_raise(make_comm, fakes, change, message):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    fused(comm, call)
    with pytest.raises(UbnextError, match=message):
        fused(comm, {**call, **change})
    assert len(fakes.driver.launches) == 2 and len(comm._plans) == 1


def test_an_unhashable_fused_argument_gets_the_full_paths_error(make_comm, fakes):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    with pytest.raises(UbnextError, match="x is on device 1"):
        fused(comm, {**call, "x": array(X, (ROWS, HIDDEN), device=1), "algorithm": ["lamport"]})
    assert len(fakes.driver.launches) == 1 and len(comm._plans) == 1


# -- fused calls never planned ---------------------------------------------------------------------------


@pytest.mark.parametrize("new", ["out", "residual_out", "both"])
def test_fused_calls_with_new_outputs_are_validated_every_call(make_comm, fakes, new):
    made = []
    fakes.monkeypatch.setattr(_arrays, "empty_like", lambda x, *a, **k: made.append(1) or array(
        Z + (1 << 20) + len(made) * 8192, (ROWS, HIDDEN)))
    comm = make_comm()
    call = fused_args()
    for what in ("out", "residual_out") if new == "both" else (new,):
        call[what] = None
    for _ in range(3):
        fused(comm, call)
    assert len(made) == 3 * (2 if new == "both" else 1) and fakes.as_buffer.calls == 18
    assert len(comm._plans) == 0 and len(fakes.driver.launches) == 3


class Epilogue:
    """Stands in for the separate add + RMSNorm kernel (``_epilogue.AddRmsNorm``), recording calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, dtype, x, rows, hidden, norm, eps, stream):
        self.calls.append((dtype, x, rows, hidden, norm, eps, stream))


@pytest.mark.parametrize("why", ["hidden not a multiple of 8", "not aligned", "nccl"])
def test_fused_calls_taking_the_separate_kernel_are_not_planned(make_comm, fakes, why):
    comm = make_comm()
    comm._dispatch._epilogue = epilogue = Epilogue()
    nccl = []
    comm._dispatch.nccl = types.SimpleNamespace(all_reduce=lambda *a: nccl.append(a))
    call = {"hidden not a multiple of 8": fused_args((ROWS, 100)),
            "not aligned": fused_args(bias=array(BIAS + 4, (HIDDEN,))),
            "nccl": fused_args(algorithm="nccl")}[why]
    for _ in range(3):
        fused(comm, call)
    assert len(epilogue.calls) == 3 and fakes.as_buffer.calls == 18 and len(comm._plans) == 0
    assert len(nccl if why == "nccl" else fakes.driver.launches) == 3  # the all-reduces
    assert not any(entry(comm, launch)[1].endswith("_norm") for launch in fakes.driver.launches)


def test_fused_calls_in_several_launches_are_not_planned(make_comm, fakes):
    comm = make_comm(lamport_max_kb=2)  # slots of 2 KiB: rows of 1 KiB in launches of two
    assert comm._node.engine.norm_rows("lamport", "float32", HIDDEN, ROWS) == 2
    call = fused_args()
    for _ in range(2):
        fused(comm, call)
    assert fakes.as_buffer.calls == 12 and len(comm._plans) == 0
    assert len(fakes.driver.launches) == 4
    assert all(entry(comm, launch)[1] == "ub_lamport_norm" for launch in fakes.driver.launches)


def test_empty_fused_calls_are_not_planned(make_comm, fakes):
    comm = make_comm()
    call = fused_args((0, HIDDEN))
    for _ in range(2):
        assert fused(comm, call) == (call["out"], call["residual_out"])
    assert fakes.driver.launches == [] and len(comm._plans) == 0


@pytest.mark.parametrize("eps", [0.0, -0.0, 0, 1, np.float32(1e-6), np.float64(1e-6)])
def test_fused_calls_with_an_eps_other_than_a_positive_float_are_not_planned(make_comm, fakes, eps):
    """Equal eps values may pack other bits (0.0 and -0.0) or be of other types: the full path converts them."""
    comm = make_comm()
    for _ in range(2):
        fused(comm, fused_args(eps=eps))
    assert fakes.as_buffer.calls == 12 and len(comm._plans) == 0
    assert fakes.driver.launches[0] == fakes.driver.launches[1]
    assert fakes.driver.launches[0][4][-3] == f32(eps)


def test_debug_mode_compares_the_ranks_every_fused_call(make_comm, fakes):
    sent = []
    comm = make_comm(debug=True)
    comm.bootstrap = types.SimpleNamespace(allgather=lambda b: sent.append(b) or [b])
    call = fused_args()
    for _ in range(3):
        fused(comm, call)
    assert len(sent) == 3 and len(fakes.driver.launches) == 3 and len(comm._plans) == 0


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_closed_or_aborted_communicator_raises_on_a_planned_fused_call(make_comm, fakes, end):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    getattr(comm, end)()
    assert len(comm._plans) == 0
    with pytest.raises(ClosedError, match="all_reduce_add_rmsnorm: the communicator is closed"):
        fused(comm, call)
    assert len(fakes.driver.launches) == 1


def test_a_broken_communicator_raises_on_a_planned_fused_call_and_drops_its_plans(make_comm, fakes):
    comm = make_comm()
    call = fused_args()
    fused(comm, call)
    fused(comm, call)
    comm._node.error = CollectiveTimeoutError("all_reduce_add_rmsnorm", 0, 1, "Lamport poll, launch 2", 4.0)
    with pytest.raises(CollectiveTimeoutError, match="rank 0 waited more than 4 s for rank 1"):
        fused(comm, call)
    assert len(comm._plans) == 0
    with pytest.raises(CollectiveTimeoutError):
        fused(comm, call)
    assert len(fakes.driver.launches) == 2


# -- fused calls on streams, torch tensors -----------------------------------------------------------------


def test_planned_fused_calls_on_a_side_stream_record_their_arrays_every_call(make_comm, fakes):
    comm = make_comm()
    call = fused_args(stream=A, bias=None)
    for _ in range(3):
        fused(comm, call)
    fused(comm, {**call, "stream": None})  # on the current stream: nothing recorded
    assert fakes.as_buffer.calls == 10
    arrays = [None if call[k] is None else ("cupy", call[k], 0)
              for k in ("x", "residual", "weight", "bias", "out", "residual_out")]
    assert fakes.recorded == [(A, arrays)] * 3  # the full path's, then the plan's


def test_planned_fused_calls_on_other_streams_keep_their_order(make_comm, fakes):
    comm = make_comm()
    call = fused_args()
    for stream in (A, B, A, B):
        fused(comm, {**call, "stream": stream})
    assert fakes.as_buffer.calls == 12  # a plan per stream
    assert [w[1] for w in fakes.cuda.calls if w[0] == "wait"] == [B, A, B]
    assert [launch[3] for launch in fakes.driver.launches] == [A, B, A, B]


def test_torch_tensors_are_planned_in_fused_calls(make_comm, fakes, cuda_tensors):
    torch = cuda_tensors
    comm = make_comm()
    x, residual, out, res_out = (torch.empty(ROWS, HIDDEN) for _ in range(4))
    weight = torch.empty(HIDDEN)
    for _ in range(3):
        normed, rsum = comm.all_reduce_add_rmsnorm(x, residual, weight, out=out, residual_out=residual)
        assert normed is out and rsum is residual
        comm.all_reduce_add_rmsnorm(x, residual, weight, out=out, residual_out=res_out)
    assert fakes.as_buffer.calls == 10 and len(comm._plans) == 2
    launches = fakes.driver.launches
    assert launches[0][4][VALUES][3:8] == (residual.data_ptr(), 0, weight.data_ptr(), out.data_ptr(),
                                           residual.data_ptr())
    assert launches[0] == launches[2] == launches[4] and launches[1] == launches[3] == launches[5]
    comm.all_reduce_add_rmsnorm(x.bfloat16(), residual.bfloat16(), weight.bfloat16(), out=out.bfloat16(),
                                residual_out=res_out.bfloat16())  # another dtype (and memory)
    with pytest.raises(UbnextError, match="not contiguous"):
        comm.all_reduce_add_rmsnorm(x, residual, weight, out=out.t().contiguous().t(), residual_out=res_out)
    assert fakes.as_buffer.calls == 10 + 5 + 4 and len(fakes.driver.launches) == 7
    weight_param = torch.nn.Parameter(weight)  # a model's weight: planned, as a key of its own class
    for _ in range(2):
        comm.all_reduce_add_rmsnorm(x, residual, weight_param, out=out, residual_out=res_out)
    assert fakes.as_buffer.calls == 19 + 5 and len(comm._plans) == 4


def test_outputs_written_through_their_address_have_their_version_incremented(make_comm, fakes, cuda_tensors):
    """The kernels write a caller's tensor out of torch's sight: its version counter goes up
    on the full path and on the planned one (plain and fused calls), so that autograd
    refuses a tensor it saved and the call overwrote, instead of a wrong gradient. x is
    not written out of place; a new output is torch's own."""
    torch = cuda_tensors
    comm = make_comm()
    x, out = torch.empty(1024), torch.empty(1024)
    for call in range(3):  # the first call takes the full path, the others the plan
        before = x._version, out._version
        comm.all_reduce(x, out=out)
        assert (x._version, out._version) == (before[0], before[1] + 1), call
        comm.all_reduce(x, out=x)
        assert x._version == before[0] + 1, call
    xs, residual, normed, res_out = (torch.empty(ROWS, HIDDEN) for _ in range(4))
    weight = torch.empty(HIDDEN)
    for call in range(2):
        before = [t._version for t in (xs, residual, weight, normed, res_out)]
        comm.all_reduce_add_rmsnorm(xs, residual, weight, out=normed, residual_out=res_out)
        assert [t._version for t in (xs, residual, weight, normed, res_out)] == [*before[:3], before[3] + 1,
                                                                                  before[4] + 1], call

    leaf = torch.ones(1024, requires_grad=True)
    saved = leaf * 2  # saved by the product below for its gradient
    loss = (saved * saved).sum()
    with torch.no_grad():
        comm.all_reduce(saved, out=saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_communicator_dropped_without_close_is_released_locally_by_its_finalizer(fakes, logged):
    """What a communicator owns (``lifetime.Owned``) holds no reference to it: once garbage,
    its finalizer announces the abort to the node's ranks and closes the node locally (no
    rank waited for), in the launch section, and warns."""
    config = Config.from_env()
    engine, _ = make_engine(fakes.monkeypatch, config)
    node = FakeNode(engine, engine.pool)
    selector = Selector(1, buffer_limits(config), [n for n, a in ALGORITHMS.items() if not a.multicast], None, None)
    order = fake_order()
    comm = bare_communicator(order, config=config, _node=node, _selector=selector,
                             _dispatch=Dispatcher(node, selector.limits, order, None, 0))
    comm._finalizer.detach()
    comm._finalizer = weakref.finalize(comm, comm._owned.drop)  # as the constructor makes it
    ref = weakref.ref(comm)
    del comm
    gc.collect()
    assert ref() is None
    assert node.announced == [("aborted", 0)] and node.closed is True
    assert order.context._driver.retained[0] == 0  # the context's retain given back
    assert [r.levelname for r in logged() if "dropped without close()" in r.getMessage()] == ["WARNING"]


def test_a_communicator_dropped_during_a_capture_in_progress_is_released_after_it(fakes, monkeypatch):
    """The node's close and NCCL's abort wait on the device, which a capture in progress
    forbids (a collection inside one, or a capture on another thread that ubnext knows of):
    a communicator collected meanwhile is released once the capture ends, on ubnext's
    release thread."""
    from ubnext._engine import captures

    config = Config.from_env()
    engine, _ = make_engine(fakes.monkeypatch, config)
    node = FakeNode(engine, engine.pool)
    selector = Selector(1, buffer_limits(config), [n for n, a in ALGORITHMS.items() if not a.multicast], None, None)
    order = fake_order()
    comm = bare_communicator(order, config=config, _node=node, _selector=selector,
                             _dispatch=Dispatcher(node, selector.limits, order, None, 0))
    comm._finalizer.detach()
    comm._finalizer = weakref.finalize(comm, comm._owned.drop)
    capturing = threading.Event()
    capturing.set()
    monkeypatch.setattr(captures.RELEASES._captures, "busy", capturing.is_set)
    monkeypatch.setattr(captures.RELEASES._captures, "note_current", lambda context: None)
    threads = []
    close = node.close

    def noted_close(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return close(*args, **kwargs)

    node.close = noted_close
    del comm
    gc.collect()
    time.sleep(0.05)
    assert node.closed is not True and node.announced == [], "released during a capture"
    capturing.clear()
    deadline = time.monotonic() + 5
    while node.closed is not True and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.closed is True and node.announced == [("aborted", 0)]
    assert threads == ["ubnext-release"]


def test_a_failed_node_close_leaves_the_rest_released_without_waiting_for_any_rank(make_comm, fakes):
    """A step of close that fails (the device wait) means a broken job: what follows waits
    for no rank (the node's bootstrap is aborted, not closed collectively)."""
    comm = make_comm()
    ends = []
    comm._owned.local_boot = types.SimpleNamespace(close=lambda: ends.append("close"),
                                                  abort=lambda: ends.append("abort"))

    def failing_close(local=False, exchange=None):
        raise RuntimeError("cudaErrorIllegalAddress")

    comm._node.close = failing_close
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress"):
        comm.close()
    assert ends == ["abort"] and comm._closed and comm._owned.released
    comm.close()  # idempotent
    assert ends == ["abort"]
