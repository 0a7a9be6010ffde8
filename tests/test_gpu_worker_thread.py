"""GPU: a worker thread that never set its device calls every entry point (issue 48, item 3).

The scenario, as a new user writes it: a thread that never set a device makes ``x =
torch.full((4096,), ..., device=f"cuda:{comm.device}")`` and ``s =
torch.cuda.Stream(device=comm.device)`` (torch then holds a lazy per-thread device, 0,
while the runtime's current device is the communicator's), then calls each entry point:
the Communicator's collectives with ``stream=s`` and no ``out`` (all_reduce,
all_reduce_add_rmsnorm, reduce_scatter, all_gather, reduce_scatter_add_rmsnorm),
``ubnext.torch``'s ops (on the thread's current stream, then inside ``with
torch.cuda.stream(s)``), the overlapped GEMMs, a tensor-parallel MLP writing into a
``BufferPlan`` and a sequence-parallel one. Each call must

* be exact: sums of small integers (exact in any order) against the host's sums, the
  overlapped GEMMs of small integers against the host's products; the normalized outputs
  (not integers) bit for bit against the same call made on the main thread with the
  communicator's device current (those are checked against the kernels' references in
  test_gpu_fused.py, test_gpu_rsag.py, test_gpu_overlap.py and test_gpu_torch_tp.py);
* create no context on any other GPU (``cuDevicePrimaryCtxGetState`` of every other
  device unchanged across the call);
* leave the thread's current device as it was (torch's, the runtime's, the driver's
  current context: test_gpu_devices.caller_state).

Inside ``with torch.cuda.stream(s)`` the checks are taken inside the block: leaving it is
torch's own code, which sets the device of the stream it restores (on such a thread
``cudaSetDevice(0)``: a context on GPU 0 whatever ubnext did), so that block comes last.

It proves something only with one rank per GPU, on every rank (the rank whose device is
0 included: a context must not appear on GPU 1 either). Run it as

    python -m pytest -q tests/test_gpu_worker_thread.py                      # 1 rank
    mpirun -n 2 python -m pytest -q tests/test_gpu_worker_thread.py          # one rank per GPU
    mpirun -n 4 python -m pytest -q tests/test_gpu_worker_thread.py
    mpirun --oversubscribe -n 2 python -m pytest -q tests/test_gpu_worker_thread.py  # sharing a GPU (on 1 GPU)

Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import communicator, small_integers
from test_gpu_devices import array_device, arrays_in, caller_state, in_new_thread, settled_state, state_changes

pytestmark = pytest.mark.gpu

COUNT = 4096
#: rows x hidden of the fused calls and the layers' tokens (rows divide by 1, 2 and 4 ranks)
ROWS, HIDDEN, INTERMEDIATE = 16, 256, 512
#: the overlapped GEMMs: m rows of a per rank, k, n (small integers: exact products)
M, K, N = 8, 64, 32
EPS = 1e-6

#: a communicator of every rank, made on the main thread (its constructor makes its device current there)
comm = pytest.fixture(scope="module", name="comm")(communicator)


def other_contexts(device: int) -> dict:
    """Whether each visible device other than ``device`` has a primary context in this process."""
    from cuda.bindings import driver

    err, count = driver.cuDeviceGetCount()
    assert int(err) == 0, f"cuDeviceGetCount: {err}"
    states = {}
    for d in range(count):
        if d != device:
            err, _flags, active = driver.cuDevicePrimaryCtxGetState(d)
            assert int(err) == 0, f"cuDevicePrimaryCtxGetState({d}): {err}"
            states[d] = bool(active)
    return states


def _ints(shape, rank: int, seed: int, high: int = 4) -> np.ndarray:
    """Small non-negative integers as float32, different for every rank and seed."""
    count = int(np.prod(shape))
    return (((np.arange(count) * (seed + 5) + rank * 7 + seed) % high).astype(np.float32)).reshape(shape)


def _rows_of(rank: int, size: int, a: np.ndarray) -> np.ndarray:
    rows = a.shape[0] // size
    return a[rank * rows:(rank + 1) * rows]


class Checked:
    """The checks of one worker thread: each call measured (other GPUs' contexts, the
    thread's current device), its result's arrays on the communicator's device."""

    def __init__(self, device: int):
        self.device = device
        self.problems: list[str] = []

    def call(self, what: str, fn):
        contexts = other_contexts(self.device)
        before = settled_state()
        result = fn()
        after = caller_state()
        for change in state_changes(before, after):
            self.problems.append(f"{what}: changed the thread's current {change}")
        now = other_contexts(self.device)
        created = [d for d in now if now[d] and not contexts[d]]
        if created:
            self.problems.append(f"{what}: created a primary context on device(s) {created}")
        for a in arrays_in(result):
            if array_device(a) != self.device:
                self.problems.append(f"{what}: returned a tensor on device {array_device(a)}, "
                                     f"the communicator's is {self.device}")
        return result


def _host(t) -> np.ndarray:
    return t.detach().float().cpu().numpy() if hasattr(t, "detach") else t.get()


def in_worker(fn):
    """``fn()`` on a new thread that never set a device; its result, or its exception."""
    return in_new_thread(fn, "a worker that never set its device")


def _scenario(comm):
    """The worker's first steps (the issue's): a tensor on the communicator's device, a
    stream of it, nothing set."""
    import torch

    dev = f"cuda:{comm.device}"
    x = torch.full((COUNT,), 1.0 + comm.rank, device=dev)
    s = torch.cuda.Stream(device=comm.device)
    return dev, x, s


def _collectives_scenario(comm, h: dict):
    """The scenario with the collectives' inputs ``h`` (``_collective_inputs``) in x and on
    the device, ready (torch's current stream synchronized): ``(x, s, tensors, Checked)``."""
    import torch

    dev, x, s = _scenario(comm)
    x.copy_(torch.from_numpy(h["mine"]))
    d = _on(dev, x2d=h["x2d"], res=h["res"], weight=h["weight"], res_shard=h["res_shard"], shard=h["shard"])
    torch.cuda.current_stream(comm.device).synchronize()  # the inputs before the calls on s
    return x, s, d, Checked(comm.device)


def _main_thread(comm, fn):
    """``fn()`` on the main thread with the communicator's device current (the references
    of the normalized outputs), its arrays on the host."""
    import torch

    with torch.cuda.device(comm.device), torch.no_grad():
        result = fn()
        torch.cuda.synchronize()
    return _to_host(result)


def _to_host(result):
    if isinstance(result, (tuple, list)):
        return [_to_host(r) for r in result]
    if isinstance(result, dict):
        return {k: _to_host(v) for k, v in result.items()}
    return _host(result)


def _on(dev: str, **arrays) -> dict:
    """The host arrays as float32 torch tensors on ``dev``."""
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(dev) for k, v in arrays.items()}


def _collective_inputs(comm) -> dict:
    """Every host input and exact result of the collectives' test."""
    size, rank = comm.size, comm.rank
    mine, total = small_integers(comm, COUNT, seed=3)
    k = COUNT // size
    every = [small_integers(_Rank(r, size), COUNT, 3)[0] for r in range(size)]
    res = _ints((ROWS, HIDDEN), rank, 9)
    return dict(mine=mine, total=total, shard=mine[rank * k:(rank + 1) * k],
                gathered=np.concatenate([e[r * k:(r + 1) * k] for r, e in enumerate(every)]),
                x2d=mine.reshape(ROWS, HIDDEN), total2d=total.reshape(ROWS, HIDDEN), res=res,
                res_shard=_rows_of(rank, size, res), weight=0.5 + _ints((HIDDEN,), 0, 11) / 4)


def _check_collectives(comm, h: dict, got: dict, refs: dict) -> None:
    size, rank = comm.size, comm.rank
    k = COUNT // size
    np.testing.assert_array_equal(got["all_reduce"], h["total"], strict=True)
    np.testing.assert_array_equal(got["reduce_scatter"], h["total"][rank * k:(rank + 1) * k], strict=True)
    np.testing.assert_array_equal(got["all_gather"], h["gathered"], strict=True)
    normed, res_out = got["all_reduce_add_rmsnorm"]
    np.testing.assert_array_equal(res_out, h["total2d"] + h["res"], strict=True)
    np.testing.assert_array_equal(normed, refs["all_reduce_add_rmsnorm"][0], strict=True)
    normed, res_out = got["reduce_scatter_add_rmsnorm"]
    np.testing.assert_array_equal(res_out, _rows_of(rank, size, h["total2d"]) + h["res_shard"], strict=True)
    np.testing.assert_array_equal(normed, refs["reduce_scatter_add_rmsnorm"][0], strict=True)


def test_the_communicators_collectives_on_a_worker_stream_without_out(comm):
    """Each collective with ``stream=s`` and no ``out``: the new outputs are ordered for s."""
    import torch

    h = _collective_inputs(comm)

    def work():
        x, s, d, check = _collectives_scenario(comm, h)
        got = {
            "all_reduce": check.call("all_reduce", lambda: comm.all_reduce(x, stream=s)),
            "all_reduce_add_rmsnorm": check.call("all_reduce_add_rmsnorm", lambda: comm.all_reduce_add_rmsnorm(
                d["x2d"], d["res"], d["weight"], eps=EPS, stream=s)),
            "reduce_scatter": check.call("reduce_scatter", lambda: comm.reduce_scatter(x, stream=s)),
            "all_gather": check.call("all_gather", lambda: comm.all_gather(d["shard"], stream=s)),
            "reduce_scatter_add_rmsnorm": check.call("reduce_scatter_add_rmsnorm", lambda: (
                comm.reduce_scatter_add_rmsnorm(d["x2d"], d["res_shard"], d["weight"], eps=EPS, stream=s))),
        }
        s.synchronize()
        return check.problems, _to_host(got)

    problems, got = in_worker(work)

    def references():
        d = _on(f"cuda:{comm.device}", x2d=h["x2d"], res=h["res"], weight=h["weight"], res_shard=h["res_shard"])
        return {"all_reduce_add_rmsnorm": comm.all_reduce_add_rmsnorm(d["x2d"], d["res"], d["weight"], eps=EPS),
                "reduce_scatter_add_rmsnorm": comm.reduce_scatter_add_rmsnorm(d["x2d"], d["res_shard"], d["weight"],
                                                                              eps=EPS)}

    _check_collectives(comm, h, got, _main_thread(comm, references))
    assert problems == [], "\n".join(problems)


def _torch_op_calls(comm, ut, d: dict, check: Checked) -> dict:
    """ubnext.torch's forms on the worker's tensors ``d`` (on torch's current stream)."""
    import torch

    k = COUNT // comm.size
    inplace, rs_into, ag_into = d["x"].clone(), torch.empty_like(d["shard"]), torch.empty_like(d["x"])
    f = ut.functional
    check.call("ut.all_reduce", lambda: ut.all_reduce(inplace, group=comm))
    check.call("ut.reduce_scatter_tensor", lambda: ut.reduce_scatter_tensor(rs_into, d["x"], group=comm))
    check.call("ut.all_gather_into_tensor", lambda: ut.all_gather_into_tensor(ag_into, d["shard"], group=comm))
    assert rs_into.numel() == k
    return {
        "all_reduce": inplace,
        "functional.all_reduce": check.call("functional.all_reduce", lambda: f.all_reduce(d["x"], "sum", group=comm)),
        "reduce_scatter": rs_into,
        "functional.reduce_scatter": check.call("functional.reduce_scatter",
                                                lambda: f.reduce_scatter(d["x"], "sum", group=comm)),
        "all_gather": ag_into,
        "functional.all_gather": check.call("functional.all_gather", lambda: f.all_gather(d["shard"], group=comm)),
        "all_reduce_add_rmsnorm": check.call("functional.all_reduce_add_rmsnorm", lambda: f.all_reduce_add_rmsnorm(
            d["x2d"], d["res"], d["weight"], None, EPS, group=comm)),
        "reduce_scatter_add_rmsnorm": check.call("functional.reduce_scatter_add_rmsnorm",
                                                 lambda: f.reduce_scatter_add_rmsnorm(d["x2d"], d["res_shard"],
                                                                                      d["weight"], None, EPS,
                                                                                      group=comm)),
    }


def _torch_ops(comm, inside_stream_block: bool) -> None:
    """ubnext.torch's ops from a worker thread: on its current stream, or inside ``with
    torch.cuda.stream(s)`` (the checks taken inside the block)."""
    import torch

    import ubnext.torch as ut

    h = _collective_inputs(comm)

    def work():
        x, s, d, check = _collectives_scenario(comm, h)
        d["x"] = x
        if not inside_stream_block:
            got = _torch_op_calls(comm, ut, d, check)
            torch.cuda.current_stream(comm.device).synchronize()
            return check.problems, _to_host(got)
        with torch.cuda.stream(s):
            got = _torch_op_calls(comm, ut, d, check)
            s.synchronize()
            return check.problems, _to_host(got)  # leaving the block is torch's own code

    problems, got = in_worker(work)

    def references():
        d = _on(f"cuda:{comm.device}", x2d=h["x2d"], res=h["res"], weight=h["weight"], res_shard=h["res_shard"])
        return {"all_reduce_add_rmsnorm": ut.functional.all_reduce_add_rmsnorm(d["x2d"], d["res"], d["weight"], None,
                                                                               EPS, group=comm),
                "reduce_scatter_add_rmsnorm": ut.functional.reduce_scatter_add_rmsnorm(
                    d["x2d"], d["res_shard"], d["weight"], None, EPS, group=comm)}

    refs = _main_thread(comm, references)
    for form in ("", "functional."):
        _check_collectives(comm, h, {**got, "all_reduce": got[form + "all_reduce"],
                                     "reduce_scatter": got[form + "reduce_scatter"],
                                     "all_gather": got[form + "all_gather"]}, refs)
    assert problems == [], "\n".join(problems)


def test_ubnext_torch_ops_on_a_worker_thread(comm):
    _torch_ops(comm, inside_stream_block=False)


def _overlapped_inputs(comm) -> dict:
    """The overlapped GEMMs' operands (small integers) and exact results, on the host."""
    size, rank = comm.size, comm.rank
    shards = [_ints((M, K), r, 21) for r in range(size)]
    b = _ints((K, N), rank, 23)
    a2 = [_ints((size * M, K), r, 25) for r in range(size)]
    b2 = [_ints((K, N), r, 27) for r in range(size)]
    summed = _rows_of(rank, size, sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in zip(a2, b2)))
    residual, bias = _ints((M, N), rank, 29), _ints((N,), 0, 33)
    gathered = np.concatenate(shards)
    product = (gathered.astype(np.float64) @ b).astype(np.float32)
    return dict(shard=shards[rank], b=b, gathered=gathered, product=product,
                a2=a2[rank], b2=b2[rank], summed=summed.astype(np.float32), residual=residual, bias=bias,
                weight=0.5 + _ints((N,), 0, 31) / 4)


def test_the_overlapped_gemms_on_a_worker_thread(comm):
    """all_gather_matmul, matmul_reduce_scatter and the fused one from a worker thread, the
    communicator's first overlapped calls (the side stream and the slot sum's modules are
    made there)."""
    import torch

    import ubnext.torch as ut

    h = _overlapped_inputs(comm)
    names = ("shard", "b", "a2", "b2", "residual", "bias", "weight")

    def work():
        dev, _, _ = _scenario(comm)
        check = Checked(comm.device)
        d = _on(dev, **{n: h[n] for n in names})
        torch.cuda.current_stream(comm.device).synchronize()
        got = {
            "all_gather_matmul": check.call("all_gather_matmul",
                                            lambda: ut.all_gather_matmul(d["shard"], d["b"], group=comm)),
            "matmul_reduce_scatter": check.call("matmul_reduce_scatter",
                                                lambda: ut.matmul_reduce_scatter(d["a2"], d["b2"], group=comm)),
            "matmul_reduce_scatter_add_rmsnorm": check.call("matmul_reduce_scatter_add_rmsnorm", lambda: (
                ut.matmul_reduce_scatter_add_rmsnorm(d["a2"], d["b2"], d["residual"], d["weight"], d["bias"], EPS,
                                                     group=comm))),
        }
        torch.cuda.current_stream(comm.device).synchronize()
        return check.problems, _to_host(got)

    problems, got = in_worker(work)

    def reference():
        d = _on(f"cuda:{comm.device}", **{n: h[n] for n in names})
        return ut.matmul_reduce_scatter_add_rmsnorm(d["a2"], d["b2"], d["residual"], d["weight"], d["bias"], EPS,
                                                    group=comm)

    ref_normed, _ = _main_thread(comm, reference)
    gathered, product = got["all_gather_matmul"]
    np.testing.assert_array_equal(gathered, h["gathered"], strict=True)
    np.testing.assert_array_equal(product, h["product"], strict=True)
    np.testing.assert_array_equal(got["matmul_reduce_scatter"], h["summed"], strict=True)
    normed, res_out = got["matmul_reduce_scatter_add_rmsnorm"]
    np.testing.assert_array_equal(res_out, h["summed"] + h["bias"] + h["residual"], strict=True)
    np.testing.assert_array_equal(normed, ref_normed, strict=True)
    assert problems == [], "\n".join(problems)


def _fill(module, rank: int) -> None:
    """Deterministic small parameters (eighths), this rank's own."""
    import torch

    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            values = (_ints(tuple(p.shape), rank, 50 + i, high=7) - 3) / 8
            p.copy_(torch.from_numpy(values.astype(np.float32)).to(p.dtype))


@pytest.mark.parametrize("kind", ["buffer plan", "sequence parallel"])
def test_tensor_parallel_layers_on_a_worker_thread(comm, kind):
    """A tensor-parallel MLP whose row-parallel GEMM writes into a BufferPlan made by the
    worker, and a sequence-parallel one (the overlapped GEMMs), built and run forward by
    the worker: bit for bit the main thread's forward of the same layer and inputs."""
    import torch

    import ubnext.torch as ut

    sequence_parallel = kind == "sequence parallel"
    rows = ROWS // comm.size if sequence_parallel else ROWS
    owner = comm.rank if sequence_parallel else 0  # replicated inputs without sequence parallelism
    x, residual = _ints((rows, HIDDEN), owner, 41, high=9) / 8, _ints((rows, HIDDEN), owner, 43, high=9) / 8

    def work():
        dev, _, _ = _scenario(comm)
        check = Checked(comm.device)
        dtype = torch.bfloat16
        plan = None if sequence_parallel else check.call(
            "BufferPlan", lambda: ut.BufferPlan(comm, ROWS, {"mlp": HIDDEN}, dtype=dtype))
        mlp = check.call("TensorParallelMLP", lambda: ut.TensorParallelMLP(
            HIDDEN, INTERMEDIATE, comm, plan=plan, dtype=dtype, device=dev, sequence_parallel=sequence_parallel))
        _fill(mlp, comm.rank)
        d = {k: v.to(dtype) for k, v in _on(dev, x=x, residual=residual).items()}
        torch.cuda.current_stream(comm.device).synchronize()
        with torch.no_grad():
            got = check.call(f"{kind} forward", lambda: mlp(d["x"], d["residual"]))
        torch.cuda.current_stream(comm.device).synchronize()
        return check.problems, _to_host(got), mlp

    problems, got, mlp = in_worker(work)

    def reference():
        d = {k: v.to(torch.bfloat16) for k, v in _on(f"cuda:{comm.device}", x=x, residual=residual).items()}
        return mlp(d["x"], d["residual"])

    want = _main_thread(comm, reference)
    for g, w, what in zip(got, want, ("normed", "residual")):
        np.testing.assert_array_equal(g, w, strict=True, err_msg=f"{kind}: {what}")
    assert problems == [], "\n".join(problems)


def test_ubnext_torch_ops_inside_a_torch_stream_block_on_a_worker_thread(comm):
    """Last in the module: leaving ``torch.cuda.stream(s)`` on such a thread is torch's
    own ``cudaSetDevice`` of its lazy device (a context on GPU 0 in the processes of the
    other GPUs), which would change the scenario of a test after it."""
    _torch_ops(comm, inside_stream_block=True)


class _Rank:
    """What small_integers reads of a communicator: a rank and the size."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
