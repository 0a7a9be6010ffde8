"""GPU API behaviour: bad input rejected before any launch, size 0, streams, graphs,
back-to-back calls, create/close cycles, debug-mode mismatch detection.

Runs at any world size (``mpirun -n N python -m pytest tests/test_gpu_api.py``).
"""

from __future__ import annotations

import pytest

from gpu_support import check_close, make_input, reference, require_gpu_and_torch

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
        (lambda: comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.float64)), "unsupported dtype"),
        (lambda: comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.int32)), "unsupported dtype"),
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
    x = make_input(3000, "float32", comm.rank, 21, specials=False)
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(s):
        got = comm.all_reduce(x)  # torch's current stream is s
    got2 = comm.all_reduce(x, stream=s)
    s.synchronize()
    ref = reference(3000, "float32", comm.size, 21, specials=False)
    check_close(got, ref, "float32")
    check_close(got2, ref, "float32")
    cs = cupy.cuda.Stream(non_blocking=True)
    with cs:
        y = comm.all_reduce(cupy.asarray(x))
    cs.synchronize()
    check_close(torch.from_dlpack(y), ref, "float32")


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
    replayed 100 times with new inputs."""
    import torch

    n_small, n_mid, n_big = 2000, 100_003, 300_000
    xs = torch.empty(n_small, device="cuda", dtype=torch.bfloat16)
    xm = torch.empty(n_mid, device="cuda", dtype=torch.bfloat16)
    xb = torch.empty(n_big, device="cuda", dtype=torch.bfloat16)
    ys, ym, yb = torch.empty_like(xs), torch.empty_like(xm), torch.empty_like(xb)
    calls = ((xs, ys, "lamport"), (xm, ym, "lamport_twoshot"), (xb, yb, "twoshot"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm up: compiles the kernels outside capture
        for x, y, algo in calls:
            comm.all_reduce(x, out=y, algorithm=algo)
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for x, y, algo in calls:
            comm.all_reduce(x, out=y, algorithm=algo)
    for it in range(100):
        for k, (x, y, _) in enumerate(calls):
            x.copy_(make_input(x.numel(), "bfloat16", comm.rank, 1000 * k + it, specials=False))
            y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for k, (x, y, _) in enumerate(calls):
            check_close(y, reference(x.numel(), "bfloat16", comm.size, 1000 * k + it, specials=False), "bfloat16")


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
    import cupy
    import torch

    import ubnext

    def cycle():
        with ubnext.Communicator(**SMALL) as c:
            x = torch.ones(5000, device="cuda")
            c.all_reduce(x, out=x, algorithm="lamport")
            c.all_reduce(x, out=x, algorithm="twoshot")
            torch.cuda.synchronize()
            assert x[0].item() == comm_size_sq(c.size)

    for _ in range(3):
        cycle()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    for _ in range(50):
        cycle()
    free_after = cupy.cuda.runtime.memGetInfo()[0]
    assert free_before - free_after < 8 << 20, f"device memory shrank by {(free_before - free_after) >> 20} MiB"


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
