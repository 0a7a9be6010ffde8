"""Fused all-reduce + residual add + RMSNorm on GPUs, against an fp64 reference.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_fused.py``;
skipped without a GPU. Residual, weight and bias are the same on every rank (as in
tensor parallelism); x differs per rank.
"""

from __future__ import annotations

import zlib

import pytest

from gpu_support import (TOL, TOL_NCCL, as_framework, assert_same_bits_everywhere, check_close, make_input,
                         require_gpu_and_torch, to_torch, torch_dtype)

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16", "float32")
SHARED = 10**6  # rank id of the operands every rank shares


@pytest.fixture(scope="module")
def comm():
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator()
    yield c
    c.close()


def operands(comm, tokens, hidden, dtype, seed, residual=True, bias=True):
    """x (this rank's), residual, weight, bias (shared); weight around 1."""
    x = make_input(tokens * hidden, dtype, comm.rank, seed, specials=False).view(tokens, hidden)
    res = make_input(tokens * hidden, dtype, SHARED, seed + 1, False).view(tokens, hidden) if residual else None
    weight = (1 + 0.25 * make_input(hidden, "float32", SHARED, seed + 2, False)).to(torch_dtype(dtype))
    b = make_input(hidden, dtype, SHARED, seed + 3, False) if bias else None
    return x, res, weight, b


def reference(comm, tokens, hidden, dtype, seed, eps, residual=True, bias=True):
    """(normed, residual_out) in fp64, rounded where the kernels round: the all-reduced
    values and the residual sum are stored in ``dtype`` before they are used."""
    import torch

    td = torch_dtype(dtype)
    acc = sum(make_input(tokens * hidden, dtype, r, seed, False).double() for r in range(comm.size))
    _, res, weight, b = operands(comm, tokens, hidden, dtype, seed, residual, bias)
    s = acc.view(tokens, hidden).to(td).double()
    if b is not None:
        s = s + b.double()
    if res is not None:
        s = s + res.double()
    s = s.to(td).double()
    normed = s * torch.rsqrt(s.pow(2).mean(dim=1, keepdim=True) + eps) * weight.double()
    return normed, s


def run_and_check(comm, tokens, hidden, dtype, algo="auto", residual=True, bias=True, place="out",
                  fw="torch", eps=1e-6, seed=None):
    import torch

    if seed is None:
        seed = zlib.crc32(f"{tokens}{hidden}{dtype}{algo}{residual}{bias}{place}".encode()) % 10000
    x, res, weight, b = operands(comm, tokens, hidden, dtype, seed, residual, bias)
    x_copy = x.clone()
    out = torch.full_like(x, float("nan"))  # poisoned
    if place == "in" and res is not None:
        res_out = res
    else:
        res_out = torch.full_like(x, float("nan"))
    f = lambda t: None if t is None else as_framework(t, fw)  # noqa: E731
    normed, rsum = comm.all_reduce_add_rmsnorm(f(x), f(res), f(weight), eps=eps, bias=f(b), out=f(out),
                                               residual_out=f(res_out), algorithm=algo)
    torch.cuda.synchronize()
    ref_n, ref_r = reference(comm, tokens, hidden, dtype, seed, eps, residual, bias)
    tol = TOL_NCCL if algo == "nccl" else TOL
    check_close(to_torch(rsum), ref_r, dtype, tol)
    check_close(to_torch(normed), ref_n, dtype, tol)
    assert torch.equal(x.view(torch.int8), x_copy.view(torch.int8)), "x was modified"
    assert_same_bits_everywhere(comm, to_torch(normed))
    assert_same_bits_everywhere(comm, to_torch(rsum))


KERNELS = ("lamport", "lamport_twoshot", "twoshot")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [128, 4096, 8192, 12288])
@pytest.mark.parametrize("tokens", [1, 3, 64, 1000])
@pytest.mark.parametrize("algo", KERNELS)
def test_fused_matches_fp64(comm, algo, tokens, hidden, dtype):
    """Messages larger than a kernel's buffers go in launches of whole rows."""
    run_and_check(comm, tokens, hidden, dtype, algo)


def test_cluster_row_groups_finish_several_rows_in_turn(comm):
    """A cluster's row sums use two mailbox slots in turn (kernels/rmsnorm.cuh). The
    engine's launch shapes give a cluster at most two rows, so this puts a grid of one
    cluster in its shape cache: that cluster finishes all 5 of the rank's rows in turn
    (both slots reused)."""
    engine = comm._node.engine
    tokens = 5 * comm.size
    for dtype in DTYPES:
        key = ("lamport_twoshot", dtype, tokens, 8192)
        launcher, _, threads, cluster = engine._norm_launch(*key)
        if cluster == 1:
            pytest.skip("no thread-block clusters on this device")
        engine._norm_launches[key] = (launcher, cluster, threads, cluster)
        try:
            run_and_check(comm, tokens, 8192, dtype, "lamport_twoshot")
            run_and_check(comm, tokens, 8192, dtype, "lamport_twoshot", residual=False, place="in")
        finally:
            engine._norm_launches.pop(key)


def test_auto_past_the_lamport_twoshot_buffers_takes_it_in_launches(comm):
    """Past the Lamport two-shot's buffers (16 MiB) the fused call takes it in launches
    of whole rows, also where the shipped table gives plain all-reduces of the size to
    NCCL (4 ranks, past 32 MiB; at 2 ranks they too take the two-shot in launches)."""
    nbytes = 4200 * 4096 * 2
    plain = {4: "nccl", 2: "lamport_twoshot"}.get(comm.size)
    assert comm.select(nbytes, "bfloat16", fused=True) == "lamport_twoshot"
    assert plain is None or comm.select(nbytes, "bfloat16") == plain
    run_and_check(comm, 4200, 4096, "bfloat16")
    run_and_check(comm, 4200, 4096, "bfloat16", place="in", bias=False)


def test_rows_larger_than_one_launch_take_the_unfused_path():
    """A row that one fused launch cannot hold: all-reduce + the separate kernel, the
    all-reduce by the same algorithm when it takes the message."""
    import ubnext

    with ubnext.Communicator(lamport_twoshot_max_kb=64) as c:
        run_and_check(c, 1, 12288, "float32", "lamport_twoshot")


@pytest.mark.parametrize("algo", [*KERNELS, "nccl", "auto"])
@pytest.mark.parametrize("residual,bias", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("place", ["in", "out"])
@pytest.mark.parametrize("fw", ["torch", "cupy"])
def test_fused_variants(comm, algo, residual, bias, place, fw):
    run_and_check(comm, 64, 4096, "bfloat16", algo, residual, bias, place, fw)


@pytest.mark.parametrize("hidden", [16384, 16392])
def test_large_hidden(comm, hidden):
    run_and_check(comm, 5, hidden, "float32", "twoshot")
    run_and_check(comm, 5, hidden, "bfloat16", "lamport")
    run_and_check(comm, 5, hidden, "float32", "lamport_twoshot")


@pytest.mark.parametrize("algo", [*KERNELS, "nccl"])
@pytest.mark.parametrize("hidden", [100, 4099])
def test_unfused_fallback_for_odd_hidden(comm, algo, hidden):
    """Hidden sizes that are not a multiple of 8: all-reduce + the separate kernel."""
    run_and_check(comm, 7, hidden, "float16", algo)


def test_nccl_engine_takes_the_separate_kernel(comm):
    run_and_check(comm, 33, 4096, "bfloat16", "nccl")


@pytest.mark.parametrize("tokens,hidden,dtype", [(1000, 8192, "bfloat16"), (1000, 4099, "float16"),
                                                 (300, 12288, "float32")])
def test_separate_kernel_on_many_rows(comm, tokens, hidden, dtype):
    """Arrays larger than a full block on every SM covers: the separate kernel keeps
    several vectors per thread (by vectors, and element by element for odd hidden)."""
    run_and_check(comm, tokens, hidden, dtype, "nccl")


def test_misaligned_arrays_take_the_unfused_path(comm):
    import torch

    tokens, hidden, dtype = 9, 256, "bfloat16"
    x, res, weight, b = operands(comm, tokens, hidden, dtype, 5)
    shift = lambda t: torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)  # noqa: E731  2-byte offset
    out = shift(torch.full_like(x, float("nan")))
    normed, rsum = comm.all_reduce_add_rmsnorm(shift(x), shift(res), weight, bias=b, out=out)
    torch.cuda.synchronize()
    ref_n, ref_r = reference(comm, tokens, hidden, dtype, 5, 1e-6)
    check_close(rsum, ref_r, dtype)
    check_close(normed, ref_n, dtype)


def test_fused_matches_unfused_closely(comm):
    """Fused kernels and all-reduce + separate kernel compute the same formula."""
    import torch

    x, res, weight, b = operands(comm, 16, 1024, "float32", 9)
    fused = comm.all_reduce_add_rmsnorm(x, res, weight, bias=b, algorithm="twoshot")
    ar = comm.all_reduce(x, algorithm="twoshot")
    s = ar + b + res
    ref = s * torch.rsqrt(s.pow(2).mean(dim=1, keepdim=True) + 1e-6) * weight
    torch.cuda.synchronize()
    assert torch.allclose(fused[1], s, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fused[0], ref, rtol=1e-5, atol=1e-5)


def test_graph_capture_and_replay(comm):
    """Every fused kernel in one graph, replayed with new inputs."""
    import torch

    cases = [(2, 4096, "lamport"), (130, 4096, "lamport_twoshot"), (300, 2048, "twoshot")]
    bufs = []
    for tokens, hidden, _ in cases:
        x, res, weight, b = operands(comm, tokens, hidden, "bfloat16", 0)
        bufs.append((x, res, weight, b, torch.empty_like(x), torch.empty_like(x)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())

    def calls():
        for (x, res, weight, b, out, rout), (_, _, algo) in zip(bufs, cases):
            comm.all_reduce_add_rmsnorm(x, res, weight, bias=b, out=out, residual_out=rout, algorithm=algo)

    with torch.cuda.stream(s):
        calls()  # compiles outside capture
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        calls()
    for it in range(1, 30):
        for (x, res, weight, b, out, rout), (tokens, hidden, _) in zip(bufs, cases):
            nx, nres, nw, nb = operands(comm, tokens, hidden, "bfloat16", it)
            x.copy_(nx), res.copy_(nres), weight.copy_(nw), b.copy_(nb)
            out.fill_(float("nan")), rout.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for (x, res, weight, b, out, rout), (tokens, hidden, _) in zip(bufs, cases):
            ref_n, ref_r = reference(comm, tokens, hidden, "bfloat16", it, 1e-6)
            check_close(rout, ref_r, "bfloat16")
            check_close(out, ref_n, "bfloat16")


def test_interleaves_with_plain_all_reduce(comm):
    """Fused and plain launches share the Lamport rotations and the two-shot epochs."""
    import torch

    from gpu_support import reference as ar_reference

    for it in range(40):
        algo = KERNELS[it % 3]
        run_and_check(comm, 1 + it % 5, 512, "bfloat16", algo, seed=it)
        n = 1000 + 37 * it
        y = comm.all_reduce(make_input(n, "float32", comm.rank, it, False), algorithm=algo)
        torch.cuda.synchronize()
        check_close(y, ar_reference(n, "float32", comm.size, it, False), "float32")


def test_bad_input_raises_before_launch(comm):
    import torch

    import ubnext

    x, res, weight, b = operands(comm, 4, 64, "bfloat16", 1)
    f32 = torch.ones(4, 64, device="cuda")
    cases = [
        (dict(x=x.flatten()), "2-D"),
        (dict(residual=res[:3]), "residual must be"),
        (dict(residual=f32), "residual must be"),
        (dict(weight=weight[:32]), "weight must be"),
        (dict(weight=weight.float()), "weight must be"),
        (dict(bias=torch.ones(64, device="cuda", dtype=torch.float16)), "bias must be"),
        (dict(out=torch.empty(4, 65, device="cuda", dtype=torch.bfloat16)), "out must be"),
        (dict(residual_out=torch.empty(64, 4, device="cuda", dtype=torch.bfloat16)), "residual_out must be"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(eps=float("inf")), "eps must be finite"),
        (dict(eps=-1.0), "eps must be finite"),
        (dict(eps="small"), "eps must be a number"),
        (dict(x=torch.ones(4, 64, dtype=torch.bfloat16)), "host memory"),
        (dict(algorithm="ring"), "unknown algorithm"),
    ]
    shared = torch.empty_like(x)
    cases.append((dict(out=shared, residual_out=shared), "overlap"))
    cases.append((dict(out=x), "overlaps x"))
    for change, words in cases:
        kw = dict(x=x, residual=res, weight=weight, bias=b)
        kw.update(change)
        with pytest.raises(ubnext.UbnextError, match=words):
            comm.all_reduce_add_rmsnorm(kw.pop("x"), kw.pop("residual"), kw.pop("weight"), **kw)


def test_zero_tokens_is_a_no_op(comm):
    import torch

    x = torch.empty(0, 64, device="cuda", dtype=torch.float32)
    normed, rsum = comm.all_reduce_add_rmsnorm(x, None, torch.ones(64, device="cuda"))
    assert normed.shape == (0, 64) and rsum.shape == (0, 64)
