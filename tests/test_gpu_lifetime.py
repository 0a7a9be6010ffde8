"""What outlives a communicator on the GPU (issue 48): a model built in a function, a CUDA
graph replayed after close() and after a drop (of ubnext's kernels, and of NCCL work), arrays
of a dropped communicator beside a new one of the same pool size, a release held back while
a capture is in progress, device memory once the last holder is gone, the finalizer of a
real communicator (also collected on its own watchdog thread), and abort() while
another thread waits in empty()'s exchange.

Runs at any world size, ranks on their own GPUs or sharing one
(``mpirun --oversubscribe -n N python -m pytest tests/test_gpu_lifetime.py``).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
from gpu_support import require_gpu_and_torch

pytestmark = pytest.mark.gpu

SMALL = dict(pool_mb=64, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)
TOKENS, HIDDEN, INTERMEDIATE, HEADS_FEATURES = 8, 256, 512, 256
#: a release that runs on ubnext's graphs thread (after CUDA destroyed a graph's user object)
WAIT_S = 20.0
#: abort()'s bound here: no kernel is running, no peer is waited for
ABORT_BOUND_S = 10.0


def eventually(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def communicator():
    require_gpu_and_torch()
    import torch

    import ubnext

    c = ubnext.Communicator(**SMALL)
    torch.cuda.set_device(c.device)
    return c


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_model_built_in_a_function_works_after_the_function_returns(grad):
    """The builder scenario: the communicator and the buffer plan made in a function that
    returns only the model; its forward after the drop (no_grad: the planned GEMM writes
    into the plan's pool buffer first) gives the bits of its forward inside the function.
    After close, the forward raises ClosedError."""
    import torch
    import tp_support as tp

    import ubnext
    from ubnext.torch import BufferPlan

    dtype = torch.bfloat16

    def run(model, data):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            out = tp.run_block("mlp", model, model.gate_up.rank, model.gate_up.size, data, backward=grad)
        torch.cuda.synchronize()
        return {k: v.clone() for k, v in out.items()}

    def build():
        comm = communicator()
        w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cuda")
        plan = BufferPlan(comm, TOKENS, {"mlp": HIDDEN}, dtype)
        model = tp.mlp(comm, w, dtype, "cuda", plan)
        data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cuda")
        run(model, data)  # compiles the kernels
        return model, data, run(model, data), w, weakref.ref(comm)

    model, data, before, w, comm = build()
    gc.collect()
    world().Barrier()
    assert comm() is model.down.comm is model.norm.comm
    after = run(model, data)
    tp.assert_equal_bits(after, before)
    reference = tp.unsharded("mlp", w, data, comm().rank, comm().size)
    tp.assert_close_to(after, {k: v for k, v in reference.items() if k in after})
    model.down.comm.close()
    with pytest.raises(ubnext.ClosedError):
        run(model, data)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_cuda_graph_replayed_after_close_or_a_drop(how):
    """A captured graph holds the whole pool and the failure words: replayed after close()
    on every rank it is exact (no host code runs, its kernels meet the peers' replays); after
    a drop (whose finalizer marks the communicator aborted) its kernels give up: values
    exact or poison, no illegal address, the context usable. The next eager call on a
    closed communicator raises ClosedError. Destroying the graph releases the memory."""
    import torch

    import ubnext

    c = communicator()
    size, n = c.size, 4096
    x = torch.full((n,), float(c.rank + 1), device="cuda")
    y = torch.empty_like(x)
    c.all_reduce(x, out=y, algorithm="lamport")  # compiles
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c.all_reduce(x, out=y, algorithm="lamport")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.all_reduce(x, out=y, algorithm="lamport")
    node = c._node
    assert node.graphs.live == 1
    want = float(size * (size + 1) // 2)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert bool((y == want).all())
    world().Barrier()  # a drop marks every rank's kernels aborted: not while a peer's replay still runs
    if how == "close":
        c.close()
        with pytest.raises(ubnext.ClosedError):
            c.all_reduce(x, out=y)
    else:
        ref = weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None
    world().Barrier()
    assert node.holds_memory
    y.fill_(-1.0)
    graph.replay()
    torch.cuda.synchronize()  # raises where a kernel hit an unmapped address
    if how == "close":
        assert bool((y == want).all()), "a replay after close on every rank is exact"
    else:
        assert bool(((y == want) | y.isnan()).all()), "a replay after a drop: exact or poison"
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # the context is usable
    del graph
    gc.collect()
    eventually(lambda: not node.holds_memory, "the pool released once the graph is destroyed")
    world().Barrier()


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_cuda_graph_of_nccl_work_replayed_after_close_or_a_drop(how):
    """A captured broadcast on NCCL (ncclBroadcast) holds the NCCL communicator: replayed on
    every rank after close() or a drop, it gives the root's values bit for bit (-0.0, inf
    and NaN included) into a poisoned output; destroying the graph aborts the NCCL
    communicator on the graphs' thread. NCCL refuses ranks sharing a GPU: skipped there."""
    import numpy as np
    import torch
    from gpu_support import host, make_input, ranks_share_a_gpu

    c = communicator()
    if ranks_share_a_gpu(c):
        c.close()
        pytest.skip("NCCL cannot serve several ranks on one GPU")
    n = 4099
    x = make_input(n, "float32", c.rank, seed=48, specials=True)
    want = host(make_input(n, "float32", 0, seed=48, specials=True))  # the root's, regenerated
    out = torch.full_like(x, float("nan"))
    c.broadcast(x, root=0, out=out, algorithm="nccl")  # connects NCCL (eager, collective)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c.broadcast(x, root=0, out=out, algorithm="nccl")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.broadcast(x, root=0, out=out, algorithm="nccl")
    dispatch = c._dispatch
    nccl = dispatch.nccl
    assert dispatch.graphs.live == 1
    world().Barrier()
    if how == "close":
        c.close()
    else:
        ref = weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None
    world().Barrier()
    assert nccl.connected, "the graph's NCCL communicator was released under it"
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(host(out).view(np.uint32), want.view(np.uint32)), "the replay after close is the root's"
    world().Barrier()  # every rank's replay done before a rank aborts its NCCL communicator
    del graph
    gc.collect()
    torch.cuda.empty_cache()  # the graph's private pool
    eventually(lambda: not nccl.connected, "the NCCL communicator aborted once the graph is destroyed")
    eventually(lambda: dispatch.graphs._signal is None, "the graphs' thread ended")
    world().Barrier()


def test_arrays_of_a_dropped_communicator_beside_a_new_one_of_the_same_size():
    """A notebook cell run again: an array of a dropped communicator keeps its segment (and
    its addresses), a new communicator of the same pool size maps elsewhere: both exact."""
    import torch

    n = 1 << 16

    def make():
        c = communicator()
        a = c.empty(n, "float32", framework="torch")
        a.fill_(7.0)
        return a, c._node

    old, old_node = make()
    gc.collect()
    world().Barrier()
    c = communicator()
    b = c.empty(n, "float32", framework="torch")
    b.fill_(3.0)
    c.all_reduce(b, out=b)
    torch.cuda.synchronize()
    pool = c._node.pool
    assert not pool.base <= old.data_ptr() < pool.base + pool.local_size * pool.stride
    assert bool((old == 7.0).all()), "the old array reads the new pool's data"
    assert bool((b == 3.0 * c.size).all())
    assert float((old * 2).sum()) == 14.0 * n
    c.close()
    assert bool((b == 3.0 * c.size).all())  # an array of a closed communicator is still readable
    del old, b
    gc.collect()
    assert not old_node.holds_memory


@pytest.mark.parametrize("where", ["another thread", "the capturing thread"])
def test_a_release_waits_for_a_capture_in_progress(where):
    """The last array of a closed communicator is dropped while a CUDA graph capture (torch's
    default, global mode) that a call of another communicator joined is in progress: on
    another thread, or inside the capture. Its release (a device wait and unmaps, which the
    capture forbids) waits until the capture has ended: the capture completes, its replay
    is exact, and the memory is released after. (The array goes by reference count, no
    garbage collection runs during the capture: another library's finalizers could break it.)"""
    import torch

    old = communicator()
    a = old.empty(1 << 20, "float32")  # CuPy's: its owner goes by reference count with it
    a.fill(1.0)
    old_node = old._node
    old.close()
    c = communicator()
    n = 4096
    x = torch.full((n,), float(c.rank + 1), device="cuda")
    y = torch.empty_like(x)
    c.all_reduce(x, out=y, algorithm="lamport")  # compiles
    torch.cuda.synchronize()
    gc.collect()
    graph = torch.cuda.CUDAGraph()
    during = []  # (the heap's bytes in use, whether the segment is held) right after the drop
    if where == "the capturing thread":
        with torch.cuda.graph(graph):
            c.all_reduce(x, out=y, algorithm="lamport")
            del a
            during.append((old_node.heap.used, old_node.holds_memory))
    else:
        errors, captured, go = [], threading.Event(), threading.Event()

        def capture():
            try:
                torch.cuda.set_device(c.device)
                with torch.cuda.graph(graph):
                    c.all_reduce(x, out=y, algorithm="lamport")
                    captured.set()
                    assert go.wait(30), "the test never let the capture end"
            except BaseException as e:  # handed to the test
                errors.append(e)
            finally:
                captured.set()

        thread = threading.Thread(target=capture, name="capturing")
        thread.start()
        assert captured.wait(30)
        del a
        time.sleep(0.2)
        during.append((old_node.heap.used, old_node.holds_memory))
        go.set()
        thread.join(30)
        assert not thread.is_alive() and errors == [], f"the capture failed: {errors}"
    assert during == [(0, True)], "the array was not dropped, or its release ran during the capture"
    eventually(lambda: not old_node.holds_memory, "released once the capture ended")
    want = float(c.size * (c.size + 1) // 2)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert bool((y == want).all())
    world().Barrier()
    c.close()  # the graph holds its pool until the test returns


def test_device_memory_comes_back_once_the_last_holder_is_gone():
    """What this rank holds on its device (memory_gauge: NVML's figure for this process, or
    the device's where this job is alone on it) is back after communicators outlived by an
    array and a graph are gone. The gauge must see a leak: the same cycles keeping each
    array (its segment, 64 MiB, held) fail the assertion."""
    import torch
    from memory_gauge import assert_memory_given_back

    devices = []

    def cycle(keep=None):
        c = communicator()
        devices.append(c.device)
        node = c._node
        a = c.empty(1 << 20, "float32", framework="torch")
        a.fill_(1.0)
        c.all_reduce(a, out=a)
        x = torch.ones(2048, device="cuda")
        c.all_reduce(x, out=x, algorithm="lamport")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.all_reduce(x, out=x, algorithm="lamport")
        c.close()
        graph.replay()
        torch.cuda.synchronize()
        del graph
        gc.collect()
        torch.cuda.empty_cache()  # the graph's private pool
        eventually(lambda: node.graphs.live == 0, "the graph counted gone")
        assert node.holds_memory  # the array
        if keep is not None:  # the planted leak: the array outlives the cycle
            keep.append(a)
            return
        del a
        gc.collect()
        eventually(lambda: not node.holds_memory, "the segment released with the array")  # or by the graphs' thread

    cycle()  # compiles the kernels, sets the caching allocators up
    assert_memory_given_back(world(), devices[-1], cycle, 3, "communicators outlived by arrays and graphs")
    kept = []
    with pytest.raises(AssertionError, match="^device memory held grew by"):
        assert_memory_given_back(world(), devices[-1], lambda: cycle(kept), 3, "cycles keeping their arrays")
    assert len(kept) == 3
    kept.clear()
    gc.collect()
    world().Barrier()


@pytest.mark.parametrize("where", ["caller", "watchdog"])
def test_a_real_communicator_dropped_is_released_by_its_finalizer(where):
    """The finalizer of a communicator made by the real constructor (watchdog and closures
    included): collected on the caller's thread, or on its own watchdog's thread (which
    cannot stop itself: released on a thread of its own)."""
    import torch

    c = communicator()
    x = torch.ones(2048, device="cuda")
    c.all_reduce(x, out=x)
    torch.cuda.synchronize()
    owned, node = c._owned, c._node
    watchdog = owned.watchdog
    threads = []
    release = owned._drop

    def recorded():
        threads.append(threading.current_thread().name)
        release()

    owned._drop = recorded
    world().Barrier()  # nobody drops while a peer still calls
    if where == "caller":
        del c
        gc.collect()
    else:
        box, poll = [c], watchdog._poll
        del c

        def dropping():
            box.clear()
            gc.collect()
            return poll()

        watchdog._poll = dropping
    eventually(lambda: owned.released and threads, "the communicator released by its finalizer")
    assert threads == (["MainThread"] if where == "caller" else ["ubnext-dropped"])
    eventually(lambda: not watchdog._thread.is_alive(), "the watchdog stopped")
    assert not node.holds_memory
    world().Barrier()


def test_abort_returns_while_another_thread_waits_in_empty_for_a_peer():
    """A peer that never comes to empty()'s exchange (a stand-in bootstrap holds every rank's
    exchange back): abort() from another thread returns within its bound, and the call
    raises BrokenCommunicatorError when its exchange returns, having allocated nothing."""
    from test_abort import DeadPeer

    import ubnext

    c = communicator()
    node = c._node
    local = node._local = DeadPeer(node._local)
    got = []

    def user():
        try:
            got.append(c.empty(1024))
        except BaseException as e:  # handed to the test
            got.append(e)

    caller = threading.Thread(target=user, name="user")
    caller.start()
    assert local.arrived.wait(30), "empty() never reached its exchange"
    start = time.monotonic()
    c.abort()
    took = time.monotonic() - start
    assert took < ABORT_BOUND_S, f"abort took {took:.1f} s"
    local.come()
    caller.join(30)
    assert len(got) == 1 and isinstance(got[0], ubnext.BrokenCommunicatorError), got
    assert not node.holds_memory and node.heap.used == 0
    world().Barrier()
