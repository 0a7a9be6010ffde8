"""Fused all-reduce + residual add + RMSNorm on GPUs. Both outputs are compared bit for
bit with the host reference (ubnext/_tools/reference.py) computed in the order of the kernels
that ran, their row groups included; outputs are poisoned and bordered by canary bytes.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_fused.py``;
skipped without a GPU. Residual, weight and bias are the same on every rank (as in
tensor parallelism); x differs per rank.
"""

from __future__ import annotations

import zlib

import pytest
from gpu_support import (
    DTYPES,
    SHARED,
    check_add_rmsnorm,
    check_all_reduce,
    collected,
    communicator,
    device,
    expected_add_rmsnorm,
    host,
    make_input,
    norm_operands,
    recorded_launches,
    reference,
)

pytestmark = pytest.mark.gpu


comm = pytest.fixture(scope="module", name="comm")(communicator)


def run_and_check(comm, tokens, hidden, dtype, algo="auto", residual=True, bias=True, place="out",
                  fw="torch", eps=1e-6, seed=None, offset=0):
    """check_add_rmsnorm with a seed from the parameters (the same on every rank)."""
    if seed is None:
        seed = zlib.crc32(f"{tokens}{hidden}{dtype}{algo}{residual}{bias}{place}".encode()) % 10000
    return check_add_rmsnorm(comm, tokens, hidden, dtype, seed, algorithm=algo, residual=residual, bias=bias,
                             place=place, framework=fw, eps=eps, offset=offset)


def device_operands(comm, tokens, hidden, dtype, seed):
    """(x of this rank, residual, weight, bias) as CUDA tensors."""
    inputs, res, weight, b = norm_operands(comm, tokens, hidden, dtype, seed)
    return device(inputs[comm.rank]), device(res), device(weight), device(b)


KERNELS = ("lamport", "lamport_twoshot", "twoshot")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [128, 4096, 8192, 12288])
@pytest.mark.parametrize("tokens", [1, 3, 64, 1000])
@pytest.mark.parametrize("algo", KERNELS)
def test_fused_matches_the_reference(comm, algo, tokens, hidden, dtype):
    """Messages larger than a kernel's buffers go in launches of whole rows."""
    run_and_check(comm, tokens, hidden, dtype, algo)


def test_cluster_row_groups_finish_several_rows_in_turn(comm):
    """A cluster's row sums use two mailbox slots in turn (kernels/rmsnorm.cuh). The
    engine's launch shapes give a cluster at most two rows, so this puts a grid of one
    cluster in its shape cache: that cluster finishes all 5 of the rank's rows in turn
    (both slots reused). Call plans made before or with that grid are dropped (a plan
    keeps the launch of its first call: _plans)."""
    engine = comm._node.engine
    tokens = 5 * comm.size
    for dtype in DTYPES:
        key = ("lamport_twoshot", dtype, tokens, 8192)
        launcher, _, threads, cluster = engine._norm_launch(*key)
        if cluster == 1:
            pytest.skip("no thread-block clusters on this device")
        engine._norm_launches[key] = (launcher, cluster, threads, cluster)
        comm._plans.clear()
        try:
            run_and_check(comm, tokens, 8192, dtype, "lamport_twoshot")
            run_and_check(comm, tokens, 8192, dtype, "lamport_twoshot", residual=False, place="in")
        finally:
            engine._norm_launches.pop(key)
            comm._plans.clear()


def test_auto_past_the_lamport_twoshot_buffers_takes_it_in_launches(comm):
    """Past the Lamport two-shot's buffers (16 MiB) the fused call takes it in launches
    of whole rows, also where the shipped table gives plain all-reduces of the size to
    NCCL (4 ranks, past 32 MiB; at 2 ranks they too take the two-shot in launches)."""
    nbytes = 4200 * 4096 * 2
    if comm.size == 1:
        pytest.skip("at 1 rank auto gives fused calls of this size to NCCL (comm.select(..., fused=True))")
    plain = {4: "nccl", 2: "lamport_twoshot"}.get(comm.size)
    if plain == "nccl" and comm.selector.nccl_problem:  # ranks sharing a GPU: the two-shot in NCCL's place
        plain = "twoshot"
    assert comm.select(nbytes, "bfloat16", fused=True) == "lamport_twoshot"
    assert plain is None or comm.select(nbytes, "bfloat16") == plain
    for place, bias in (("out", True), ("in", False)):
        with recorded_launches(comm) as launches:
            run_and_check(comm, 4200, 4096, "bfloat16", place=place, bias=bias)
        fused = [launch for launch in launches if launch.fused]
        assert len(fused) > 1 and {launch.kernel for launch in fused} == {"lamport_twoshot"}


def test_rows_larger_than_one_launch_take_the_unfused_path():
    """A row that one fused launch cannot hold (80 KiB; buffers for 64 KiB, at any world
    size): all-reduce + the separate kernel, the all-reduce by the same algorithm, which
    takes the message in launches."""
    import ubnext

    with ubnext.Communicator(lamport_twoshot_max_kb=64) as c:
        assert c._node.engine.norm_rows("lamport_twoshot", "float32", 20480, 1) == 0
        with recorded_launches(c) as launches:
            run_and_check(c, 1, 20480, "float32", "lamport_twoshot")
        assert not any(launch.fused for launch in launches)
        assert [launch.kernel for launch in launches][-1] == "add_rmsnorm"


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
    """x, residual and both outputs 2 bytes past 16-byte alignment: the all-reduce, then
    the separate kernel element by element."""
    with recorded_launches(comm) as launches:
        run_and_check(comm, 9, 256, "bfloat16", offset=1, seed=5)
    assert [launch.kernel for launch in launches][-1] == "add_rmsnorm"
    assert not any(launch.fused for launch in launches)


def test_fused_matches_unfused_closely(comm):
    """Fused kernels compute the formula torch computes on the all-reduced values."""
    import torch

    x = make_input(16 * 1024, "float32", comm.rank, 9, specials=False).view(16, 1024)
    res = make_input(16 * 1024, "float32", SHARED, 10, specials=False).view(16, 1024)
    weight = 1 + 0.25 * make_input(1024, "float32", SHARED, 11, specials=False)
    b = make_input(1024, "float32", SHARED, 12, specials=False)
    fused = comm.all_reduce_add_rmsnorm(x, res, weight, bias=b, algorithm="twoshot")
    ar = comm.all_reduce(x, algorithm="twoshot")
    s = ar + b + res
    ref = s * torch.rsqrt(s.pow(2).mean(dim=1, keepdim=True) + 1e-6) * weight
    torch.cuda.synchronize()
    assert torch.allclose(fused[1], s, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fused[0], ref, rtol=1e-5, atol=1e-5)


def test_graph_capture_and_replay(comm):
    """Every fused kernel in one graph, replayed with new inputs (specials included),
    poisoned outputs, every element checked after each replay."""
    import torch

    cases = [(2, 4096, "lamport"), (130, 4096, "lamport_twoshot"), (300, 2048, "twoshot")]
    bufs = []
    for tokens, hidden, _ in cases:
        x, res, weight, b = device_operands(comm, tokens, hidden, "bfloat16", 0)
        bufs.append((x, res, weight, b, torch.empty_like(x), torch.empty_like(x)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())

    def calls():
        logs = []
        for (x, res, weight, b, out, rout), (_, _, algo) in zip(bufs, cases):
            with recorded_launches(comm) as launches:
                comm.all_reduce_add_rmsnorm(x, res, weight, bias=b, out=out, residual_out=rout, algorithm=algo)
            logs.append(launches)
        return logs

    with torch.cuda.stream(s):
        calls()  # compiles outside capture
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        logs = calls()
    failures = []
    for it in range(1, 30):
        operands = []
        for (x, res, weight, b, out, rout), (tokens, hidden, _) in zip(bufs, cases):
            inputs, nres, nw, nb = norm_operands(comm, tokens, hidden, "bfloat16", it)
            for buf, value in ((x, inputs[comm.rank]), (res, nres), (weight, nw), (b, nb)):
                buf.copy_(device(value))
            out.fill_(float("nan"))
            rout.fill_(float("nan"))
            operands.append((inputs, nres, nb, nw))
        g.replay()
        torch.cuda.synchronize()
        for (_, _, _, _, out, rout), (inputs, nres, nb, nw), launches, case in zip(bufs, operands, logs, cases):
            want_n, want_r = expected_add_rmsnorm(launches, inputs, nres, nb, nw, 1e-6, by_vectors=True)
            with collected(failures):
                reference.assert_same_bits(host(rout), want_r, f"replay {it} {case}: residual_out")
                reference.assert_same_bits(host(out), want_n, f"replay {it} {case}: normed")
    assert not failures, "\n".join(failures[:5])


def test_interleaves_with_plain_all_reduce(comm):
    """Fused and plain launches share the Lamport rotations and the two-shot epochs."""
    for it in range(40):
        algo = KERNELS[it % 3]
        run_and_check(comm, 1 + it % 5, 512, "bfloat16", algo, seed=it)
        check_all_reduce(comm, 1000 + 37 * it, "float32", it, algorithm=algo, place="new")


def test_bad_input_raises_before_launch(comm):
    import torch

    import ubnext

    x, res, weight, b = device_operands(comm, 4, 64, "bfloat16", 1)
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
