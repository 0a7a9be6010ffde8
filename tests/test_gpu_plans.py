"""GPU: call plans of eager all-reduces and fused all-reduce + add + RMSNorm calls
(``ubnext/_api/plans.py``). A repeated call with the same arrays launches the plan of its
first call: the same kernel with the same arguments, reducing the arrays' contents at
the time of the call, on torch tensors and CuPy arrays, out of place and in place, on the
current stream, a side stream and in a CUDA graph. Calls that are not one kernel launch
are never planned.

Every all-reduce result is exact: inputs are small integers, so every sum is exact in
float32. Fused calls are compared bit for bit with the host reference of the launches
that ran (``gpu_support.expected_add_rmsnorm``, as tests/test_gpu_fused.py checks them).
Runs at any world size (``mpirun -n N python -m pytest tests/test_gpu_plans.py``).
"""

from __future__ import annotations

import pytest
from gpu_support import (
    assert_same_bits_everywhere,
    device,
    expected_add_rmsnorm,
    host,
    norm_operands,
    recorded_launches,
    reference,
    small_torch_communicator,
)

from ubnext._protocol.algorithms import ALGORITHMS

pytestmark = pytest.mark.gpu

N = 4096  # float32 elements: 16 KiB, within every kernel's buffers


comm = pytest.fixture(scope="module", name="comm")(small_torch_communicator)


def as_torch(a):
    import torch

    return a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)


def fill(comm, x, seed: int):
    """Writes this rank's input for ``seed`` into ``x`` (current stream); returns the exact sum."""
    import torch

    base = (torch.arange(N, device="cuda", dtype=torch.float32) * (seed + 3)) % 61
    as_torch(x).copy_(base + seed + comm.rank)
    return base * comm.size + seed * comm.size + sum(range(comm.size))


def arrays(comm, framework: str, memory: str, place: str):
    """(x, out) of N float32: plain (the framework's allocator) or from ``comm.empty``."""
    import cupy
    import torch

    def new():
        if memory == "symmetric":
            return comm.empty((N,), "float32", framework)
        return torch.empty(N, device="cuda") if framework == "torch" else cupy.empty(N, cupy.float32)

    x = new()
    return x, x if place == "in" else new()


@pytest.mark.parametrize("memory", ["plain", "symmetric"])
@pytest.mark.parametrize("place", ["out", "in"])
@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot", "auto"])
def test_repeated_calls_launch_their_plan_on_the_current_contents(comm, algorithm, framework, place, memory):
    import torch

    if algorithm != "auto" and not comm._selector.fits(algorithm, N * 4):
        pytest.skip(f"{algorithm} cannot take {N * 4} bytes here")
    x, out = arrays(comm, framework, memory, place)
    comm._plans.clear()
    logs = []
    for seed in range(4):
        want = fill(comm, x, seed)
        with recorded_launches(comm) as launches:
            result = comm.all_reduce(x, out=out, algorithm=algorithm)
        assert result is out
        torch.cuda.synchronize()
        got = as_torch(result)
        assert_same_bits_everywhere(comm, got)
        assert torch.equal(got, want), f"call {seed} ({algorithm}) is wrong"
        logs.append(launches)
    ran = logs[0][0].kernel
    pool = comm._node.pool
    planned = ALGORITHMS[ran].pushed or pool.contains(as_torch(out).data_ptr(), N * 4) is not None
    assert len(comm._plans) == (1 if planned else 0)
    if planned:  # the same kernel with the same arguments, every call
        assert all(len(log) == 1 for log in logs)
        assert all(log[0] == logs[0][0] for log in logs[1:])


def test_the_plan_launches_the_bits_of_the_full_path(comm):
    """bfloat16 sums that round: a planned call stores the bits of the full path's call."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(1234 + comm.rank)
    x = torch.randn(N, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(x)
    comm._plans.clear()
    comm.all_reduce(x, out=out)
    torch.cuda.synchronize()
    first = out.clone()
    out.fill_(float("nan"))
    comm.all_reduce(x, out=out)
    torch.cuda.synchronize()
    assert len(comm._plans) == 1
    assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    assert_same_bits_everywhere(comm, out)


@pytest.mark.parametrize("how", ["stream=", "current"])
def test_planned_calls_on_a_side_stream(comm, how):
    import torch

    x, out = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    s = torch.cuda.Stream()
    comm._plans.clear()
    for seed in range(3):
        want = fill(comm, x, seed)
        s.wait_stream(torch.cuda.current_stream())
        if how == "stream=":
            comm.all_reduce(x, out=out, algorithm="lamport", stream=s)
        else:
            with torch.cuda.stream(s):
                comm.all_reduce(x, out=out, algorithm="lamport")
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"call {seed} on a side stream ({how}) is wrong"
    assert len(comm._plans) == 1


def test_a_planned_call_is_captured_and_replayed(comm):
    """The call planned eagerly on the capture stream is captured from its plan; each
    replay reduces the contents of x at that time."""
    import torch

    x, out = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    s = torch.cuda.Stream()
    comm._plans.clear()
    fill(comm, x, 0)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(x, out=out, algorithm="lamport")  # eager: compiles and plans
    s.synchronize()
    assert len(comm._plans) == 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        with recorded_launches(comm) as launches:
            comm.all_reduce(x, out=out, algorithm="lamport")
    assert len(comm._plans) == 1 and [launch.kernel for launch in launches] == ["lamport"]
    for seed in (1, 2, 3):
        want = fill(comm, x, seed)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {seed} is wrong"


# -- the fused all-reduce + add + RMSNorm ----------------------------------------------------------------

TOKENS, HIDDEN, EPS = 8, 1024, 1e-5  # bfloat16: 16 KiB, one launch of every kernel


class FusedCall:
    """The arrays of a fused call with out= and residual_out= (bfloat16 torch tensors), filled
    anew from ``gpu_support.norm_operands`` for each seed."""

    def __init__(self, residual: bool = True, bias: bool = True, in_place: bool = False):
        import torch

        def rows():
            return torch.empty(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)

        self.x, self.out = rows(), rows()
        self.residual = rows() if residual else None
        self.weight = torch.empty(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.bias = torch.empty(HIDDEN, device="cuda", dtype=torch.bfloat16) if bias else None
        self.residual_out = self.residual if in_place else rows()

    def fill(self, comm, seed: int) -> tuple:
        """Writes the operands of ``seed`` and poisons the outputs (current stream); returns
        the host operands (every rank's x, residual, weight, bias)."""
        operands = norm_operands(comm, TOKENS, HIDDEN, "bfloat16", seed, self.residual is not None,
                                 self.bias is not None)
        inputs, residual, weight, bias = operands
        for buf, value in ((self.x, inputs[comm.rank]), (self.residual, residual), (self.weight, weight),
                           (self.bias, bias)):
            if buf is not None:
                buf.copy_(device(value))
        self.out.fill_(float("nan"))
        if self.residual_out is not self.residual:
            self.residual_out.fill_(float("nan"))
        return operands

    def __call__(self, comm, **kwargs):
        return comm.all_reduce_add_rmsnorm(self.x, self.residual, self.weight, eps=EPS, bias=self.bias,
                                           out=self.out, residual_out=self.residual_out, **kwargs)

    def check(self, comm, operands, launches, what: str) -> None:
        """Both outputs against the reference of ``launches`` (after a synchronize), bit for bit."""
        inputs, residual, weight, bias = operands
        assert_same_bits_everywhere(comm, self.out)
        assert_same_bits_everywhere(comm, self.residual_out)
        want_n, want_r = expected_add_rmsnorm(launches, inputs, residual, bias, weight, EPS, True)
        reference.assert_same_bits(host(self.residual_out), want_r, f"residual_out ({what})")
        reference.assert_same_bits(host(self.out), want_n, f"normed ({what})")


@pytest.mark.parametrize("operands", ["all", "no residual", "no bias", "in place"])
@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot", "auto"])
def test_repeated_fused_calls_launch_their_plan_on_the_current_contents(comm, algorithm, operands):
    import torch

    if algorithm != "auto" and not comm._selector.fits(algorithm, 0):
        pytest.skip(f"{algorithm} does not run here")
    call = FusedCall(operands != "no residual", operands != "no bias", operands == "in place")
    comm._plans.clear()
    logs = []
    for seed in range(4):
        values = call.fill(comm, seed)
        with recorded_launches(comm) as launches:
            normed, summed = call(comm, algorithm=algorithm)
        assert normed is call.out and summed is call.residual_out
        torch.cuda.synchronize()
        call.check(comm, values, launches, f"call {seed}, {algorithm}")
        logs.append(launches)
    planned = len(logs[0]) == 1 and logs[0][0].fused
    assert len(comm._plans) == (1 if planned else 0)
    if planned:  # the same kernel with the same arguments, every call
        assert all(log == logs[0] for log in logs[1:])


def test_the_fused_plan_stores_the_bits_of_the_full_path(comm):
    import torch

    call = FusedCall()
    outputs = []
    for planned in (False, True):
        if not planned:
            comm._plans.clear()
        call.fill(comm, 7)
        call(comm)
        torch.cuda.synchronize()
        outputs.append((call.out.clone(), call.residual_out.clone()))
    assert len(comm._plans) == 1
    for full, plan in zip(*outputs):
        assert torch.equal(full.view(torch.int16), plan.view(torch.int16))


@pytest.mark.parametrize("how", ["stream=", "current"])
def test_planned_fused_calls_on_a_side_stream(comm, how):
    import torch

    call = FusedCall()
    s = torch.cuda.Stream()
    comm._plans.clear()
    for seed in range(3):
        values = call.fill(comm, seed)
        s.wait_stream(torch.cuda.current_stream())
        with recorded_launches(comm) as launches:
            if how == "stream=":
                call(comm, algorithm="lamport", stream=s)
            else:
                with torch.cuda.stream(s):
                    call(comm, algorithm="lamport")
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        call.check(comm, values, launches, f"call {seed} on a side stream ({how})")
    assert len(comm._plans) == 1


def test_a_planned_fused_call_is_captured_and_replayed(comm):
    import torch

    call = FusedCall()
    s = torch.cuda.Stream()
    comm._plans.clear()
    call.fill(comm, 0)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(comm, algorithm="lamport")  # eager: compiles and plans
    s.synchronize()
    assert len(comm._plans) == 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        with recorded_launches(comm) as launches:
            call(comm, algorithm="lamport")
    assert len(comm._plans) == 1 and [(launch.kernel, launch.fused) for launch in launches] == [("lamport", True)]
    for seed in (1, 2, 3):
        values = call.fill(comm, seed)
        g.replay()
        torch.cuda.synchronize()
        call.check(comm, values, launches, f"replay {seed}")
