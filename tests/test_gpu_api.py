"""GPU API behaviour: bad input rejected before any launch, size 0, streams, graphs,
back-to-back calls, create/close cycles, debug-mode mismatch detection.

Runs at any world size (``mpirun -n N python -m pytest tests/test_gpu_api.py``).
"""

from __future__ import annotations

import pytest
from gpu_support import (
    Bordered,
    collected,
    device,
    expected_all_reduce,
    host,
    rank_inputs,
    recorded_launches,
    reference,
    require_gpu_and_torch,
)
from memory_gauge import assert_memory_given_back

pytestmark = pytest.mark.gpu

SMALL = dict(pool_mb=64, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)


@pytest.fixture(scope="module")
def comm():
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator(**SMALL)
    yield c
    c.close()


def test_bad_input_raises_before_launch(comm):
    import torch

    import ubnext

    x = torch.ones(16, device="cuda")
    big = torch.ones(32, device="cuda")
    cases = [
        (lambda: comm.all_reduce(torch.ones(16)), "host memory"),
        (lambda: comm.all_reduce(torch.ones(4, 4, device="cuda").t()), "not contiguous"),
        (lambda: comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.complex64)), "unsupported dtype"),
        (lambda: comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.int32), op="avg"), "floating-point"),
        (lambda: comm.all_reduce(x, op="prod"), "unsupported op"),
        (lambda: comm.all_reduce(x, algorithm="ring"), "unknown algorithm"),
        (lambda: comm.all_reduce(x, out=torch.ones(15, device="cuda")), "must match"),
        (lambda: comm.all_reduce(x, out=torch.ones(16, device="cuda", dtype=torch.float16)), "must match"),
        (lambda: comm.all_reduce(big[:16], out=big[8:24]), "partially overlaps"),
        (lambda: comm.all_reduce(torch.ones(1 << 20, device="cuda"), algorithm="lamport"), "cannot take"),
        (lambda: comm.all_reduce([1.0, 2.0]), "expected a CUDA array"),
    ]
    if torch.cuda.device_count() > 1:
        other = (comm.device + 1) % torch.cuda.device_count()
        cases.append((lambda: comm.all_reduce(torch.ones(4, device=f"cuda:{other}")), "device"))
    for fn, words in cases:
        with pytest.raises(ubnext.UbnextError, match=words):
            fn()


def test_size_zero_is_a_no_op(comm):
    import torch

    x = torch.empty(0, device="cuda")
    assert comm.all_reduce(x, out=x) is x
    assert comm.all_reduce(x).numel() == 0


def test_explicit_stream_and_cupy_current_stream(comm):
    import cupy
    import torch

    s = torch.cuda.Stream()
    inputs = rank_inputs(3000, "float32", comm.size, 21)
    x = device(inputs[comm.rank])
    torch.cuda.current_stream().synchronize()
    results = []
    with recorded_launches(comm) as launches:
        with torch.cuda.stream(s):
            got = comm.all_reduce(x)  # torch's current stream is s
    results.append((got, launches))
    with recorded_launches(comm) as launches:
        got = comm.all_reduce(x, stream=s)
    results.append((got, launches))
    s.synchronize()
    cs = cupy.cuda.Stream(non_blocking=True)
    with recorded_launches(comm) as launches:
        with cs:
            y = comm.all_reduce(cupy.asarray(x))
    cs.synchronize()
    results.append((torch.from_dlpack(y), launches))
    for got, launches in results:
        reference.assert_same_bits(host(got), expected_all_reduce(launches, inputs, "sum"))


def test_back_to_back_calls_with_changing_sizes_and_algorithms(comm):
    """10,000 calls, no host sync between them; exact integer sums checked in batches of 16."""
    import numpy as np
    import torch

    rng = np.random.default_rng(1234)  # the same sequence on every rank
    sizes = [1, 7, 64, 1000, 4096, 33333, 100000, 1 << 20]
    batch = 16
    outs = [torch.empty(1 << 20, device="cuda") for _ in range(batch)]
    base = torch.arange(1 << 20, device="cuda", dtype=torch.float32) % 13
    x_all = base + comm.rank
    expected = base * comm.size + sum(range(comm.size))
    pending = []
    for call in range(10_000):
        n = int(rng.choice(sizes))
        algo = ("lamport", "lamport_twoshot", "twoshot")[call % 3]
        if not comm._selector.fits(algo, n * 4):  # larger than its buffers
            algo = "twoshot"
        k = call % batch
        outs[k][:n].fill_(float("nan"))
        comm.all_reduce(x_all[:n], out=outs[k][:n], algorithm=algo)
        pending.append((k, n, algo, call))
        if len(pending) == batch:
            torch.cuda.synchronize()
            for k, n, algo, c in pending:
                assert torch.equal(outs[k][:n], expected[:n]), f"call {c} ({algo}, {n} elements) is wrong"
            pending.clear()


def test_cuda_graph_replay(comm):
    """One graph holding a Lamport one-shot, a Lamport two-shot and a two-shot all-reduce,
    replayed 100 times with new inputs (specials included) into poisoned, bordered outputs."""
    import torch

    sizes, algos = (2000, 100_003, 300_000), ("lamport", "lamport_twoshot", "twoshot")
    xs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    ys = [Bordered(n, "bfloat16", seed=k) for k, n in enumerate(sizes)]
    s = torch.cuda.Stream()

    def calls():
        logs = []
        for x, y, algo in zip(xs, ys, algos):
            with recorded_launches(comm) as launches:
                comm.all_reduce(x, out=y.view, algorithm=algo)
            logs.append(launches)
        return logs

    with torch.cuda.stream(s):  # warm up: compiles the kernels outside capture
        calls()
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        logs = calls()
    failures = []
    for it in range(100):
        inputs = [rank_inputs(x.numel(), "bfloat16", comm.size, 1000 * k + it) for k, x in enumerate(xs)]
        for x, y, rank_data in zip(xs, ys, inputs):
            x.copy_(device(rank_data[comm.rank]))
            y.view.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for y, rank_data, launches, algo in zip(ys, inputs, logs, algos):
            with collected(failures):
                reference.assert_same_bits(host(y.view), expected_all_reduce(launches, rank_data, "sum"),
                                           f"replay {it} ({algo})")
                y.assert_intact(f"replay {it} ({algo})")
    assert not failures, "\n".join(failures[:5])


def test_empty_returns_symmetric_arrays_and_frees_them(comm):
    import cupy
    import torch

    t = comm.empty((4, 8), "bfloat16", framework="torch")
    c = comm.empty(10, "float16")
    assert isinstance(t, torch.Tensor) and t.shape == (4, 8) and t.dtype == torch.bfloat16
    assert isinstance(c, cupy.ndarray) and c.shape == (10,) and c.dtype.name == "float16"
    used = comm._node.heap.used
    del t, c
    import gc

    gc.collect()
    assert comm._node.heap.used < used


def test_create_close_cycles_do_not_leak_device_memory():
    require_gpu_and_torch()

    import torch
    from mpi4py import MPI

    import ubnext

    devices = []

    def cycle():
        with ubnext.Communicator(**SMALL) as c:
            devices.append(c.device)
            x = torch.ones(5000, device="cuda")
            c.all_reduce(x, out=x, algorithm="lamport")
            c.all_reduce(x, out=x, algorithm="twoshot")
            torch.cuda.synchronize()
            assert x[0].item() == comm_size_sq(c.size)

    world = MPI.COMM_WORLD

    for _ in range(3):
        cycle()
    assert_memory_given_back(world, devices[-1], cycle, 50, "create/close cycles")


def test_communicators_dropped_without_close_give_their_memory_back():
    """A communicator that becomes garbage without ``close()`` (a notebook cell run again,
    an elastic restart) is released locally by its finalizer: pool, peer mappings, pinned
    words, watchdog. A peer's mapping keeps a segment alive until that peer has dropped its
    communicator too, so memory is read once every rank has dropped and collected."""
    require_gpu_and_torch()

    import torch
    from mpi4py import MPI

    import ubnext

    world = MPI.COMM_WORLD
    devices = []

    def drop():
        c = ubnext.Communicator(**SMALL)
        devices.append(c.device)
        x = torch.ones(5000, device=f"cuda:{c.device}")
        c.all_reduce(x, out=x, algorithm="lamport")
        c.all_reduce(x, out=x, algorithm="twoshot")
        torch.cuda.synchronize(c.device)
        assert x[0].item() == comm_size_sq(c.size)
        # no close(): the communicator is garbage when this returns

    drop()  # compiles the kernels, sets CuPy's pools up
    assert_memory_given_back(world, devices[-1], drop, 4, "dropped communicators")


def test_a_closed_communicator_leaves_no_cuda_object_to_the_garbage_collector():
    """``close`` releases the communicator's streams and events and drops its kernel modules itself.
    Its objects form reference cycles, and what the garbage collector frees runs on
    whatever thread collects: there a stream's destructor makes CUDA calls on that
    thread's device, device 0, creating a context (500 MiB) on another rank's GPU (the
    leak test above saw it at 4 ranks on 4 GPUs)."""
    require_gpu_and_torch()
    import gc

    import cupy
    import torch

    import ubnext

    cuda_types = (cupy.cuda.Stream, cupy.cuda.ExternalStream, cupy.cuda.Event, cupy.RawModule, cupy.RawKernel,
                  cupy.ndarray, cupy.cuda.MemoryPointer)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection frees is kept in gc.garbage instead
    try:
        with ubnext.Communicator(**SMALL) as c:
            x = torch.ones(5000, device="cuda")
            c.all_reduce(x, out=x, algorithm="lamport")
            c.all_reduce(x, out=x, algorithm="twoshot")
            ones = torch.ones(5, 1000, device="cuda")
            c.all_reduce_add_rmsnorm(x.view(5, 1000), ones, ones[0])
            stream = cupy.cuda.Stream(non_blocking=True)
            y = cupy.ones(5000, cupy.float32)
            c.all_reduce(y, out=y, stream=stream)  # the launch order keeps the stream object
            stream.synchronize()
        del c, stream, x, y, ones
        gc.collect()
        left = sorted({type(o).__qualname__ for o in gc.garbage if isinstance(o, cuda_types)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], f"left to the garbage collector: {left}"


def comm_size_sq(n: int) -> float:
    return float(n * n)


def test_debug_mode_reports_mismatched_calls():
    require_gpu_and_torch()
    import torch

    import ubnext

    with ubnext.Communicator(debug=True, **SMALL) as c:
        if c.size == 1:
            pytest.skip("needs 2 or more ranks")
        x = torch.ones(100 + c.rank, device="cuda")
        with pytest.raises(ubnext.UbnextError, match="ranks disagree"):
            c.all_reduce(x)


def test_use_after_close_raises():
    require_gpu_and_torch()
    import torch

    import ubnext

    c = ubnext.Communicator(**SMALL)
    c.close()
    c.close()  # idempotent
    with pytest.raises(ubnext.ClosedError, match="closed"):
        c.all_reduce(torch.ones(4, device="cuda"))
