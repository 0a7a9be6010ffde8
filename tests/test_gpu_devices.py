"""GPU: every public call works while another GPU, or none, is current, and leaves the
caller's current device as it found it.

A call runs in its communicator's CUDA context whatever the calling thread has current,
launches on a stream of the communicator's device (a torch tensor's: its device's current
stream; CuPy and other arrays and int handles: the communicator device's; handle 0: that
device's null stream), allocates new outputs there, and returns with the caller's current
device as it was: torch's (``torch.cuda.current_device()``), CuPy's
(``cupy.cuda.runtime.getDevice()``) and the driver's current context (``cuCtxGetCurrent``).
A ``stream=`` of another device raises ``UbnextError`` before anything is launched.

Every entry point is called under each way of making the device foreign
(``MODES``): a ``torch.cuda.device(k)`` block; ``cupy.cuda.Device(k).use()``; a new thread
that never set a device; and the device the process had before the communicator existed
(ordinal 0 in a fresh process: this module never calls ``torch.cuda.set_device`` and makes
every tensor on an explicit device). Arrays of JAX (made on GPU 0, moved to the
communicator's), numba and cuda.core are passed too. The entry points: all_reduce (every
algorithm, out of place, in place, into a new array; on arrays from ``empty()``; the
quantized one), all_reduce_add_rmsnorm, reduce_scatter, all_gather,
reduce_scatter_add_rmsnorm, ``empty()``, ``synchronize()``, explicit streams (int handles,
0, torch and CuPy streams; one of another device must be refused), a CUDA graph captured
under a foreign device, ubnext.torch's ops and a tensor-parallel layer's forward,
``tune.run``, the selftest, and ``close()`` / ``abort()`` of a second communicator.
Every result is compared bit for bit
with the host reference (``ubnext/_tools/reference.py``, through the helpers of
``gpu_support`` and the other GPU test modules), outputs are poisoned and bordered by canary
bytes, every returned array must be on the communicator's device, and after every test a
tiny kernel must still run on every visible device (the bug this guards against killed the
CUDA context).

It proves something only with one rank per GPU: where ranks share a GPU (``mpirun
--oversubscribe -n 4`` on one GPU) or a rank sees only its own, the communicator's device
is the current one anyway in every mode but the new thread's, which hides device bugs (the
module passes there too). Run it as

    python -m pytest -q tests/test_gpu_devices.py                  # 1 rank
    mpirun -n 2 python -m pytest -q tests/test_gpu_devices.py      # one rank per GPU
    mpirun -n 4 python -m pytest -q tests/test_gpu_devices.py
    mpiexec -n 4 bash -c 'CUDA_VISIBLE_DEVICES=$MPI_LOCALRANKID python -m pytest -q tests/test_gpu_devices.py'

(the last: each rank sees only its own GPU, every ordinal is 0; Open MPI names the local
rank ``$OMPI_COMM_WORLD_LOCAL_RANK``). Where a rank sees a single GPU, the cases that need
another one skip ("needs a second visible GPU"); the new-thread and no-set-device cases run
everywhere. Skipped without a GPU.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
from gpu_support import (
    SMALL,
    WIDTH,
    Bordered,
    as_framework,
    check_add_rmsnorm,
    check_all_reduce,
    collected,
    cuda_core_api,
    device,
    expected_add_rmsnorm,
    expected_all_reduce,
    host,
    jax_gpu_devices,
    make_input,
    norm_operands,
    ran,
    rank_inputs,
    recorded_launches,
    reference,
    require_gpu_and_torch,
    seed_of,
    to_torch,
)
from test_gpu_quant import check_quantized
from test_gpu_rsag import check_all_gather, check_reduce_scatter, resolved
from test_gpu_rsag import ran as rsag_ran

from ubnext._protocol.algorithms import ALGORITHMS

# JAX takes 75 % of a GPU's memory at its first use unless told otherwise; four ranks that
# each see every GPU would starve each other. Set before jax can be imported (in a test).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytestmark = pytest.mark.gpu

#: the ways a call's device is made foreign (see Foreign)
MODES = ("torch-device", "cupy-device", "thread", "no-set-device")
NEEDS_SECOND = ("torch-device", "cupy-device")
NEEDS_SECOND_GPU = ("needs a second visible GPU (a rank sees only one: a one-GPU machine, or CUDA_VISIBLE_DEVICES "
                    "per rank)")
#: compare the driver's current context too, not only torch's and CuPy's current device
CHECK_DRIVER_CONTEXT = True
THREAD_TIMEOUT_S = 300
#: torch.cuda._sleep cycles: about 0.2 s at H100 clocks, far longer than a call takes to return
SLEEP_CYCLES = 400_000_000

KERNELS = ("lamport", "lamport_twoshot", "twoshot")
#: every algorithm ubnext has (those this communicator cannot run skip, saying so)
AR_ALGORITHMS = (*ALGORITHMS, "auto")
FUSED_ALGORITHMS = (*(name for name, a in ALGORITHMS.items() if a.norm_entry or not a.is_kernel), "auto")
RS_ALGORITHMS = (*(name for name, a in ALGORITHMS.items() if a.serves("reduce_scatter")), "auto")
#: a second communicator (test_gpu_api's buffers)
SECOND_COMM = {"pool_mb": 64, "staging_mb": 8, "lamport_max_kb": 256, "lamport_twoshot_max_kb": 2048}


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def home():
    """The device current in the process before this module's communicator existed (what
    a caller that never set one has; the constructor makes its own device current)."""
    require_gpu_and_torch()
    import torch

    return torch.cuda.current_device()


@pytest.fixture(scope="module")
def comm(home):
    """A communicator of every rank on small buffers. Unlike gpu_support's
    small_torch_communicator, torch's current device is never set to its device."""
    import ubnext

    c = ubnext.Communicator(**SMALL)
    yield c
    c.close()


@pytest.fixture(scope="module")
def second(comm):
    """Another visible GPU than the communicator's (this process's ordinal), or None where
    some rank sees only one (agreed over the ranks, so that every rank skips alike)."""
    import torch

    count = torch.cuda.device_count()
    if min(comm.bootstrap.allgather_obj(count)) < 2:
        return None
    return (comm.device + 1) % count


@pytest.fixture(scope="module")
def quantized_comm(comm):
    """A communicator that opted in to the quantized all-reduce (test_gpu_quant's), on comm's device."""
    import ubnext

    with on_comm_device(comm):
        c = ubnext.Communicator(device=comm.device, quantized="int8", **{**SMALL, "pool_mb": 160})
    yield c
    c.close()


@pytest.fixture(autouse=True)
def cuda_stays_usable(comm):
    """After every test: the communicator's device synchronizes and a tiny kernel runs on
    every visible device (a launch with another device's pointers kills a context)."""
    yield
    assert_cuda_usable(comm)


def assert_cuda_usable(comm) -> None:
    import cupy
    import torch

    torch.cuda.synchronize(comm.device)
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
        t = torch.arange(1, 5, device=f"cuda:{d}", dtype=torch.float32) * 2
        assert t.sum().item() == 20.0, f"a tiny kernel on device {d} computed {t.tolist()}"
    with cupy.cuda.Device(comm.device):
        assert int(cupy.arange(5).sum()) == 10, "a tiny CuPy kernel on the communicator's device failed"


def agreed(comm, probe):
    """``probe()``'s value where it succeeds on every rank; where it skips or fails on some
    rank (a framework missing or unusable there), every rank skips, naming that rank.
    Collective (an allgather), so that no rank makes a collective call that others skip."""
    value, reason = None, None
    try:
        value = probe()
    except pytest.skip.Exception as e:
        reason = str(getattr(e, "msg", e))
    except Exception as e:  # noqa: BLE001 (e.g. a numba-cuda release that breaks on this numpy)
        reason = f"{type(e).__name__}: {e}"
    reasons = comm.bootstrap.allgather_obj(reason)
    for rank, why in enumerate(reasons):
        if why:
            pytest.skip(why if comm.size == 1 else f"rank {rank}: {why}")
    return value


# ---- the caller's state, foreign devices -------------------------------------------------------
def on_comm_device(comm):
    """The block where a test prepares and checks its arrays: gpu_support's helpers
    allocate on torch's current device ("cuda"), so it is the communicator's there. The
    calls under test run inside it with another device current (Foreign.run)."""
    import torch

    return torch.cuda.device(comm.device)


def caller_state() -> dict:
    """The calling thread's current device, as torch, CuPy (the runtime) and the driver see it."""
    import cupy
    import torch
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    assert int(err) == 0, f"cuCtxGetCurrent: {err}"
    ctx_device = None
    if int(ctx):
        err, dev = driver.cuCtxGetDevice()
        ctx_device = int(dev) if int(err) == 0 else f"cuCtxGetDevice: {err}"
    return {"torch": torch.cuda.current_device(), "cupy": cupy.cuda.runtime.getDevice(),
            "context": hex(int(ctx)), "context_device": ctx_device}


def settled_state() -> dict:
    """caller_state() once its own reads have had any effect they have (a runtime read may
    bind a context in a thread that had none)."""
    caller_state()
    return caller_state()


def state_changes(before: dict, after: dict) -> list[str]:
    """What a call changed of the caller's state. A thread that had no current context may
    end with the one of the device it reported as current (the runtime binds that lazily,
    as torch's device guards do); any other change of the context counts."""
    changed = [f"{key}: {before[key]} -> {after[key]}" for key in ("torch", "cupy") if before[key] != after[key]]
    if CHECK_DRIVER_CONTEXT and before["context"] != after["context"]:
        lazily_bound = before["context"] == "0x0" and after["context_device"] == before["cupy"]
        if not lazily_bound:
            changed.append(f"driver context: {before['context']} (device {before['context_device']}) -> "
                           f"{after['context']} (device {after['context_device']})")
    return changed


def arrays_in(result):
    """The torch tensors and CuPy arrays in a call's result (tuples, lists, dicts)."""
    if isinstance(result, (tuple, list)):
        for r in result:
            yield from arrays_in(r)
    elif isinstance(result, dict):
        for r in result.values():
            yield from arrays_in(r)
    elif array_device(result) is not None:
        yield result


def array_device(a):
    """The device ordinal of a torch tensor or CuPy array ("cpu" for a host tensor), else None."""
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.device.index if a.is_cuda else "cpu"
    if cupy is not None and isinstance(a, cupy.ndarray):
        return a.device.id
    return None


def in_new_thread(fn, what: str):
    """``fn()`` on a new thread (which never set a device); its result, or its exception."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
            box["error"] = e

    t = threading.Thread(target=target, name=f"foreign-device: {what}", daemon=True)
    t.start()
    t.join(THREAD_TIMEOUT_S)
    if t.is_alive():
        raise AssertionError(f"{what}: still running in a new thread after {THREAD_TIMEOUT_S} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class Foreign:
    """Runs calls with a device other than the communicator's current, one of MODES:

    * ``torch-device``: inside ``torch.cuda.device(second)``;
    * ``cupy-device``: after ``cupy.cuda.Device(second).use()`` (restored afterwards);
    * ``thread``: on a new thread that never set a device (no context current, ordinal 0);
    * ``no-set-device``: with the device the process had before the communicator existed
      (``home``; Communicator() itself makes its device current);
    * ``as-is``: in whatever state the thread is (after another framework's work).

    Each call records, in ``problems``, a change of the caller's current device
    (``state_changes``), an array of its result on another device than the
    communicator's, and a mode that did not make its device current. A test asserts
    ``assert_clean()`` at its end, after its collective calls.
    """

    def __init__(self, comm, mode: str, home: int, second: int | None):
        if mode in NEEDS_SECOND and second is None:
            pytest.skip(NEEDS_SECOND_GPU)
        self.device, self.mode, self.home, self.other = comm.device, mode, home, second
        self.problems: list[str] = []

    def call(self, what: str, fn, *args, **kwargs):
        return self.run(what, lambda: fn(*args, **kwargs))

    def run(self, what: str, fn, setup=None):
        """``fn()`` (``fn(setup())`` with ``setup``, which makes its arguments inside the
        mode) under the mode; returns its result."""
        def body():
            made = None if setup is None else setup()
            before = settled_state()
            if setup is None:
                self._check_mode(what, before)
            result = fn() if setup is None else fn(made)
            after = caller_state()
            for change in state_changes(before, after):
                self.problems.append(f"{what} [{self.mode}]: changed the caller's current {change}")
            for a in arrays_in(result):
                if array_device(a) != self.device:
                    self.problems.append(f"{what} [{self.mode}]: returned a {type(a).__name__} on device "
                                         f"{array_device(a)}, the communicator's is {self.device}")
            return result

        if self.mode == "torch-device":
            import torch

            with torch.cuda.device(self.other):
                return body()
        if self.mode == "cupy-device":
            import cupy

            previous = cupy.cuda.runtime.getDevice()
            cupy.cuda.Device(self.other).use()
            try:
                return body()
            finally:
                cupy.cuda.Device(previous).use()
        if self.mode == "thread":
            return in_new_thread(body, what)
        if self.mode == "no-set-device":
            import torch

            with torch.cuda.device(self.home):
                return body()
        assert self.mode == "as-is", self.mode
        return body()

    def _check_mode(self, what: str, before: dict) -> None:
        key, want = {"torch-device": ("torch", self.other), "cupy-device": ("cupy", self.other),
                     "no-set-device": ("torch", self.home)}.get(self.mode, (None, None))
        if key is not None and before[key] != want:
            self.problems.append(f"{what} [{self.mode}]: the test did not make device {want} current ({before})")

    def assert_clean(self) -> None:
        assert not self.problems, "\n".join(self.problems[:10])


class Away:
    """A communicator whose public calls run under a Foreign mode (every other attribute is
    the communicator's), so that gpu_support's check_* helpers, which prepare and check on
    the communicator's device, make their calls with another device current. With
    ``stream``, every collective is given it as ``stream=`` (the device synchronized
    first: the caller orders its data before a stream of its own)."""

    CALLS = frozenset({"all_reduce", "all_reduce_add_rmsnorm", "reduce_scatter", "all_gather",
                       "reduce_scatter_add_rmsnorm", "empty", "synchronize", "close", "abort"})
    COLLECTIVES = frozenset({"all_reduce", "all_reduce_add_rmsnorm", "reduce_scatter", "all_gather",
                             "reduce_scatter_add_rmsnorm"})

    def __init__(self, comm, foreign: Foreign, stream=None):
        self._comm, self._foreign, self._stream = comm, foreign, stream

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self.CALLS:
            return attr

        def call(*args, **kwargs):
            if self._stream is not None and name in self.COLLECTIVES:
                import torch

                kwargs.setdefault("stream", self._stream)
                torch.cuda.synchronize(self._comm.device)
            return self._foreign.call(name, attr, *args, **kwargs)

        return call


def usable(comm, algorithm: str, nbytes: int) -> None:
    """Skips where this communicator cannot run ``algorithm`` on ``nbytes`` (the same on every rank)."""
    if algorithm != "auto" and not comm.selector.fits(algorithm, nbytes):
        pytest.skip(f"this communicator cannot run {algorithm} on {nbytes} bytes (it runs {comm.algorithms()})")


def data_ptr(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


def expected_reduce_scatter_add_rmsnorm(comm, launches, inputs, residual, bias, weight, eps: float):
    """(normed, residual_out) of one reduce_scatter_add_rmsnorm (test_gpu_rsag's reference):
    the reduce-scatter of the kernel that ran (reference.exact where NCCL ran; its inputs
    must then be exact), then the separate add + RMSNorm kernel's arithmetic."""
    n = comm.size
    rows, hidden = inputs[0].shape
    k = rows // n * hidden
    flat = [x.reshape(-1) for x in inputs]
    algo = rsag_ran([launch for launch in launches if launch.kernel != "add_rmsnorm"], "reduce_scatter")
    shard = (reference.exact(flat)[comm.rank * k:(comm.rank + 1) * k] if algo == "nccl"
             else reference.reduce_scatter(algo, flat)[comm.rank])
    separate = [launch for launch in launches if launch.kernel == "add_rmsnorm"]
    assert len(separate) == 1, f"expected one separate add + RMSNorm launch, got {launches}"
    by_vectors = hidden * inputs[0].dtype.itemsize % reference.VEC_BYTES == 0
    return reference.add_rmsnorm(shard.reshape(rows // n, hidden), residual, bias, weight, eps, separate[0].threads,
                                 by_vectors=by_vectors)


def expected_fused(launches, inputs, residual, bias, weight, eps: float, arrays):
    """(normed, residual_out) of one all_reduce_add_rmsnorm (gpu_support.expected_add_rmsnorm),
    the separate kernel by vectors where check_add_rmsnorm says it is: ``arrays`` are the
    call's (out, residual_out, weight, residual, bias), None where absent."""
    hidden = inputs[0].shape[1]
    by_vectors = hidden % (reference.VEC_BYTES // inputs[0].dtype.itemsize) == 0 and all(
        data_ptr(a) % reference.VEC_BYTES == 0 for a in arrays if a is not None)
    return expected_add_rmsnorm(launches, inputs, residual, bias, weight, eps, by_vectors)


# ---- the collectives ---------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", AR_ALGORITHMS)
@pytest.mark.parametrize("mode", MODES)
def test_all_reduce(comm, home, second, mode, algorithm):
    """all_reduce with another device current: out of place into a poisoned, bordered out,
    in place (out=x), into a new array (torch; CuPy, whose new arrays come from the current
    device's pool unless the call takes the communicator's), and CuPy into an out: each bit
    for bit against the reference of the launches that ran (check_all_reduce: canaries,
    the input unchanged, the same bits on every rank), the caller's device unchanged, every
    result on the communicator's device. NCCL on exact inputs; skipped where it cannot run."""
    count, dtype = 4099, "bfloat16"
    usable(comm, algorithm, count * WIDTH[dtype])
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    failures = []
    with on_comm_device(comm):
        for k, (place, fw) in enumerate((("out", "torch"), ("in", "torch"), ("new", "torch"), ("new", "cupy"),
                                         ("out", "cupy"))):
            with collected(failures):
                check_all_reduce(away, count, dtype, seed_of("ar", mode, algorithm, k), algorithm=algorithm,
                                 place=place, framework=fw)
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


@pytest.mark.parametrize("algorithm", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_on_arrays_from_empty(comm, home, second, mode, algorithm):
    """comm.empty() called with another device current (Bordered's buffers: check_all_reduce
    with symmetric memory), then all_reduce in place on such an array and out of place into
    another one, bit for bit, canaries intact (views next to other data of the pool)."""
    count, dtype = 4099, "bfloat16"
    usable(comm, algorithm, count * WIDTH[dtype])
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    failures = []
    with on_comm_device(comm):
        for place in ("in", "out"):
            with collected(failures):
                check_all_reduce(away, count, dtype, seed_of("sym", mode, algorithm, place), algorithm=algorithm,
                                 place=place, x_memory="symmetric", out_memory="symmetric")
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


@pytest.mark.parametrize("mode", MODES)
def test_empty_arrays_are_on_the_communicators_device(comm, home, second, mode):
    """comm.empty() with another device current gives CuPy and torch arrays on the
    communicator's device; an all_reduce into a row of one and in place on the other is
    exact, the rows around the first still poisoned."""
    import cupy
    import torch

    count, dtype = 4099, "bfloat16"
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    a = away.empty((count,), dtype)
    t = away.empty((3, count), dtype, framework="torch")
    assert isinstance(a, cupy.ndarray) and a.device.id == comm.device, f"empty() gave a CuPy array on {a.device}"
    assert isinstance(t, torch.Tensor) and t.device == torch.device("cuda", comm.device), \
        f"empty(framework='torch') gave a tensor on {t.device}"
    with on_comm_device(comm):
        inputs = rank_inputs(count, dtype, comm.size, seed_of("empty", mode))
        to_torch(a).copy_(device(inputs[comm.rank]))
        t.fill_(float("nan"))
        torch.cuda.synchronize()
        with recorded_launches(comm) as into:
            away.all_reduce(a, out=t[1])
        with recorded_launches(comm) as in_place:
            away.all_reduce(a, out=a)
        torch.cuda.synchronize()
        failures = []
        with collected(failures):
            reference.assert_same_bits(host(t[1]), expected_all_reduce(into, inputs, "sum"), "into a row of empty()")
            reference.assert_same_bits(host(to_torch(a)), expected_all_reduce(in_place, inputs, "sum"),
                                       "in place on empty()")
            nan = np.full(count, np.nan, reference.DTYPES[dtype])
            for row in (0, 2):
                reference.assert_same_bits(host(t[row]), nan, f"row {row} of the out's buffer")
    assert not failures, "\n".join(failures)
    f.assert_clean()


@pytest.mark.parametrize("algorithm", FUSED_ALGORITHMS)
@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_add_rmsnorm(comm, home, second, mode, algorithm):
    """all_reduce_add_rmsnorm with another device current (check_add_rmsnorm): the fused
    kernel (torch, 5 x 1024) and the all-reduce + separate kernel path (CuPy, hidden 100,
    residual_out=residual), both outputs bit for bit, canaries intact."""
    usable(comm, algorithm, 0)
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    failures = []
    with on_comm_device(comm):
        with collected(failures):
            check_add_rmsnorm(away, 5, 1024, "bfloat16", seed_of("norm", mode, algorithm), algorithm=algorithm)
        with collected(failures):
            check_add_rmsnorm(away, 3, 100, "bfloat16", seed_of("norm-unfused", mode, algorithm), algorithm=algorithm,
                              place="in", framework="cupy")
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


@pytest.mark.parametrize("algorithm", RS_ALGORITHMS)
@pytest.mark.parametrize("mode", MODES)
def test_reduce_scatter_and_all_gather(comm, home, second, mode, algorithm):
    """reduce_scatter and all_gather with another device current (test_gpu_rsag's
    check_reduce_scatter / check_all_gather): out of place (torch) and in place (CuPy),
    bit for bit, canaries intact."""
    k, dtype = 1000, "bfloat16"
    usable(comm, algorithm, comm.size * k * WIDTH[dtype])
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    failures = []
    with on_comm_device(comm):
        for place, fw in (("out", "torch"), ("in", "cupy")):
            with collected(failures):
                check_reduce_scatter(away, k, dtype, seed_of("rs", mode, algorithm, place), algorithm, place=place,
                                     framework=fw)
            with collected(failures):
                check_all_gather(away, k, dtype, seed_of("ag", mode, algorithm, place), algorithm, place=place,
                                 framework=fw)
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


@pytest.mark.parametrize("algorithm", RS_ALGORITHMS)
@pytest.mark.parametrize("mode", MODES)
def test_reduce_scatter_add_rmsnorm(comm, home, second, mode, algorithm):
    """reduce_scatter_add_rmsnorm with another device current, into new outputs: both bit
    for bit against the reduce-scatter's reference followed by the separate kernel's."""
    import torch

    n, hidden, dtype, eps = comm.size, 1024, "bfloat16", 1e-5
    rows = 3 * n
    usable(comm, algorithm, rows * hidden * WIDTH[dtype])
    # the algorithm that runs (skips where it is NCCL and NCCL cannot run: collective)
    algo = resolved(comm, algorithm, "reduce_scatter", rows * hidden * WIDTH[dtype], dtype)
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    seed = seed_of("rs-norm", mode, algorithm)
    with on_comm_device(comm):
        inputs, _, weight, b = norm_operands(comm, rows, hidden, dtype, seed, residual=False, exact=algo == "nccl")
        residual = host(make_input(rows // n * hidden, dtype, comm.rank, seed + 5, False)).reshape(rows // n, hidden)
        x, r, w, bd = device(inputs[comm.rank]), device(residual), device(weight), device(b)
        torch.cuda.synchronize()
        with recorded_launches(comm) as launches:
            normed, res_out = away.reduce_scatter_add_rmsnorm(x, r, w, eps=eps, bias=bd, algorithm=algorithm)
        torch.cuda.synchronize()
        failures = []
        with collected(failures):
            want_n, want_r = expected_reduce_scatter_add_rmsnorm(comm, launches, inputs, residual, b, weight, eps)
            reference.assert_same_bits(host(res_out), want_r, "reduce_scatter_add_rmsnorm residual_out")
            reference.assert_same_bits(host(normed), want_n, "reduce_scatter_add_rmsnorm normed")
    assert not failures, "\n".join(failures)
    f.assert_clean()


@pytest.mark.parametrize("mode", MODES)
def test_quantized_all_reduce(quantized_comm, home, second, mode):
    """The quantized all-reduce (precision="int8", a communicator that opted in) with
    another device current (test_gpu_quant's check_quantized: bit for bit against the
    emulation, within the bound): out of place, in place, unaligned avg."""
    f = Foreign(quantized_comm, mode, home, second)
    away = Away(quantized_comm, f)
    failures = []
    with on_comm_device(quantized_comm):
        for k, case in enumerate(({}, {"place": "in"}, {"offset": 1, "op": "avg"})):
            with collected(failures):
                check_quantized(away, 4099, "bfloat16", "int8", seed=seed_of("quant", mode, k), **case)
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("mode", MODES)
def test_new_outputs_are_on_the_communicators_device(comm, home, second, mode, framework):
    """Every call that allocates its outputs, with another device current, allocates them
    on the communicator's device, in the input's framework, and they hold the reference's
    bits: all_reduce, reduce_scatter, all_gather, all_reduce_add_rmsnorm,
    reduce_scatter_add_rmsnorm (exact inputs: NCCL may run any of them)."""
    import torch

    n, rank = comm.size, comm.rank
    rows, hidden, dtype, eps = 2 * n, 512, "bfloat16", 1e-6
    f = Foreign(comm, mode, home, second)
    away = Away(comm, f)
    seed = seed_of("new", mode, framework)
    with on_comm_device(comm):
        inputs, res, weight, b = norm_operands(comm, rows, hidden, dtype, seed, exact=True)
        flat = [a.reshape(-1) for a in inputs]
        shard_rows = rows // n
        rs_res = res[rank * shard_rows:(rank + 1) * shard_rows]
        x, r, w, bd, rs_r = (as_framework(device(a), framework) for a in (inputs[rank], res, weight, b, rs_res))
        torch.cuda.synchronize()
        got, logs = {}, {}
        calls = {
            "all_reduce": lambda: away.all_reduce(x),
            "reduce_scatter": lambda: away.reduce_scatter(x),
            "all_gather": lambda: away.all_gather(x),
            "all_reduce_add_rmsnorm": lambda: away.all_reduce_add_rmsnorm(x, r, w, eps=eps, bias=bd),
            "reduce_scatter_add_rmsnorm": lambda: away.reduce_scatter_add_rmsnorm(x, rs_r, w, eps=eps, bias=bd),
        }
        for name, call in calls.items():
            with recorded_launches(comm) as logs[name]:
                got[name] = call()
        torch.cuda.synchronize()
        failures = []
        for name, result in got.items():
            for a in arrays_in(result):
                with collected(failures):
                    assert type(a) is type(x), f"{name} returned a {type(a).__name__} for a {type(x).__name__}"
                    assert array_device(a) == comm.device, \
                        f"{name} allocated its output on device {array_device(a)}, the communicator's is {comm.device}"
        k = rows * hidden // n
        with collected(failures):
            reference.assert_same_bits(host(to_torch(got["all_reduce"])).reshape(-1),
                                       expected_all_reduce(logs["all_reduce"], flat, "sum"), "all_reduce")
        with collected(failures):
            algo = rsag_ran(logs["reduce_scatter"], "reduce_scatter")
            want = (reference.exact(flat)[rank * k:(rank + 1) * k] if algo == "nccl"
                    else reference.reduce_scatter(algo, flat)[rank])
            reference.assert_same_bits(host(to_torch(got["reduce_scatter"])).reshape(-1), want, "reduce_scatter")
        with collected(failures):
            algo = rsag_ran(logs["all_gather"], "all_gather")
            reference.assert_same_bits(host(to_torch(got["all_gather"])).reshape(-1),
                                       reference.all_gather(algo, flat), "all_gather")
        with collected(failures):
            normed, rsum = got["all_reduce_add_rmsnorm"]
            want_n, want_r = expected_fused(logs["all_reduce_add_rmsnorm"], inputs, res, b, weight, eps,
                                            (normed, rsum, w, r, bd))
            reference.assert_same_bits(host(to_torch(rsum)), want_r, "all_reduce_add_rmsnorm residual_out")
            reference.assert_same_bits(host(to_torch(normed)), want_n, "all_reduce_add_rmsnorm normed")
        with collected(failures):
            normed, rsum = got["reduce_scatter_add_rmsnorm"]
            want_n, want_r = expected_reduce_scatter_add_rmsnorm(comm, logs["reduce_scatter_add_rmsnorm"], inputs,
                                                                 rs_res, b, weight, eps)
            reference.assert_same_bits(host(to_torch(rsum)), want_r, "reduce_scatter_add_rmsnorm residual_out")
            reference.assert_same_bits(host(to_torch(normed)), want_n, "reduce_scatter_add_rmsnorm normed")
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


# ---- streams -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["int-handle", "zero-handle", "torch-stream", "cupy-stream"])
@pytest.mark.parametrize("mode", MODES)
def test_explicit_streams_of_the_communicators_device(comm, home, second, mode, kind):
    """stream= a stream of the communicator's device, with another device current: an int
    handle, 0 (the communicator device's null stream, not the current device's), a torch
    and a CuPy stream object. all_reduce out of place and into a new array, torch and CuPy,
    bit for bit (check_all_reduce)."""
    import cupy
    import torch

    f = Foreign(comm, mode, home, second)
    with on_comm_device(comm):
        ts = torch.cuda.Stream()
    with cupy.cuda.Device(comm.device):
        cs = cupy.cuda.Stream(non_blocking=True)
    stream = {"int-handle": ts.cuda_stream, "zero-handle": 0, "torch-stream": ts, "cupy-stream": cs}[kind]
    away = Away(comm, f, stream=stream)
    failures = []
    with on_comm_device(comm):
        for k, (place, fw) in enumerate((("out", "torch"), ("new", "torch"), ("out", "cupy"), ("new", "cupy"))):
            with collected(failures):
                check_all_reduce(away, 4099, "bfloat16", seed_of("stream", mode, kind, k), place=place, framework=fw)
    ts.synchronize()
    cs.synchronize()
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


@pytest.mark.parametrize("which", ["device", "torch-stream", "int-handle", "zero-handle"])
@pytest.mark.parametrize("mode", MODES)
def test_synchronize_waits_for_the_communicators_device(comm, home, second, mode, which):
    """synchronize() and synchronize(stream=...) with another device current wait for the
    communicator's device: a ~0.2 s sleep kernel there (on a stream of its own, or on its
    null stream for stream=0) is done when the call returns."""
    import torch

    f = Foreign(comm, mode, home, second)
    with on_comm_device(comm):
        s = torch.cuda.default_stream() if which == "zero-handle" else torch.cuda.Stream()
        if which == "zero-handle" and s.cuda_stream != 0:
            pytest.skip("torch's default stream is not the legacy null stream here (per-thread default streams)")
        done = torch.cuda.Event()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
            done.record()
    stream = {"device": None, "torch-stream": s, "int-handle": s.cuda_stream, "zero-handle": 0}[which]
    if stream is None:
        f.run("synchronize()", comm.synchronize)
    else:
        f.run(f"synchronize(stream={which})", lambda: comm.synchronize(stream=stream))
    finished = done.query()
    torch.cuda.synchronize(comm.device)
    assert finished, f"synchronize ({which}) returned while the communicator's device still ran the sleep kernel"
    f.assert_clean()


@pytest.mark.parametrize("kind", ["torch-stream", "cupy-stream", "int-handle"])
@pytest.mark.parametrize("mode", MODES)
def test_a_stream_of_another_device_raises_before_launching(comm, home, second, mode, kind):
    """stream= a stream of another device (a torch or CuPy stream, or its int handle)
    raises UbnextError naming the device, with no kernel launched: the poisoned out stays
    poisoned, every canary and the input intact; the communicator then still reduces
    (every rank skipped the same call)."""
    import cupy
    import torch

    import ubnext

    if second is None:
        pytest.skip(NEEDS_SECOND_GPU)
    f = Foreign(comm, mode, home, second)
    count, dtype = 4099, "bfloat16"
    seed = seed_of("other-stream", mode, kind)
    with on_comm_device(comm):
        inputs = rank_inputs(count, dtype, comm.size, seed)
        x = Bordered(count, dtype, seed + 1)
        x.view.copy_(device(inputs[comm.rank]))
        out = Bordered(count, dtype, seed + 2)
        out.view.fill_(float("nan"))
        torch.cuda.synchronize()
    with torch.cuda.device(second):
        ts = torch.cuda.Stream()
    with cupy.cuda.Device(second):
        cs = cupy.cuda.Stream(non_blocking=True)
    stream = {"torch-stream": ts, "cupy-stream": cs, "int-handle": ts.cuda_stream}[kind]

    def call():
        try:
            comm.all_reduce(x.view, out=out.view, stream=stream)
        except ubnext.UbnextError as e:
            return e
        return None

    with recorded_launches(comm) as launches:
        error = f.run(f"all_reduce on a {kind} of device {second}", call)
    torch.cuda.synchronize(comm.device)
    torch.cuda.synchronize(second)
    failures = []
    with on_comm_device(comm):
        with collected(failures):  # collective: every rank reduces once more, whatever it found above
            check_all_reduce(comm, count, dtype, seed + 3)
        with collected(failures):
            assert error is not None, f"all_reduce with a {kind} of device {second} did not raise"
            assert "device" in str(error), f"the error does not name the device: {error}"
            assert launches == [], f"it raised after launching {launches}"
            reference.assert_same_bits(host(out.view), np.full(count, np.nan, reference.DTYPES[dtype]),
                                       "the poisoned out")
            out.assert_intact("the refused call (out)")
            x.assert_intact("the refused call (input)")
            reference.assert_same_bits(host(x.view), inputs[comm.rank], "the refused call modified its input")
    assert not failures, "\n".join(failures)
    f.assert_clean()


# ---- ubnext.torch --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_torch_ops(comm, home, second, mode):
    """ubnext.torch's forms and torch.ops.ubnext.* with another device current, each bit
    for bit against the reference of the kernels that ran (exact inputs: NCCL may run any):
    functional.all_reduce, all_reduce (in place), torch.ops.ubnext.all_reduce,
    functional.reduce_scatter, reduce_scatter_tensor, functional.all_gather,
    all_gather_into_tensor, functional.all_reduce_add_rmsnorm and
    functional.reduce_scatter_add_rmsnorm."""
    import torch

    import ubnext.torch as ut

    n, rank = comm.size, comm.rank
    rows, hidden, dtype, eps = 2 * n, 256, "bfloat16", 1e-6
    f = Foreign(comm, mode, home, second)
    seed = seed_of("torch-ops", mode)
    with on_comm_device(comm):
        inputs, res, weight, b = norm_operands(comm, rows, hidden, dtype, seed, exact=True)
        flat = [a.reshape(-1) for a in inputs]
        shard_rows = rows // n
        k = shard_rows * hidden
        rs_res = res[rank * shard_rows:(rank + 1) * shard_rows]
        x, r, w, bd, rs_r = (device(a) for a in (inputs[rank], res, weight, b, rs_res))
        in_place = x.clone()
        rs_into = torch.full((shard_rows, hidden), float("nan"), dtype=x.dtype, device=x.device)
        ag_into = torch.full((n * rows, hidden), float("nan"), dtype=x.dtype, device=x.device)
        torch.cuda.synchronize()
        ops = {
            "functional.all_reduce": lambda: ut.functional.all_reduce(x, "sum", group=comm),
            "all_reduce": lambda: ut.all_reduce(in_place, group=comm),
            "torch.ops.ubnext.all_reduce": lambda: torch.ops.ubnext.all_reduce(x, "sum", "exact", ut.handle(comm)),
            "functional.reduce_scatter": lambda: ut.functional.reduce_scatter(x, "sum", group=comm),
            "reduce_scatter_tensor": lambda: ut.reduce_scatter_tensor(rs_into, x, group=comm),
            "functional.all_gather": lambda: ut.functional.all_gather(x, group=comm),
            "all_gather_into_tensor": lambda: ut.all_gather_into_tensor(ag_into, x, group=comm),
            "functional.all_reduce_add_rmsnorm":
                lambda: ut.functional.all_reduce_add_rmsnorm(x, r, w, bd, eps, group=comm),
            "functional.reduce_scatter_add_rmsnorm":
                lambda: ut.functional.reduce_scatter_add_rmsnorm(x, rs_r, w, bd, eps, group=comm),
        }
        got, logs = {}, {}
        for name, op in ops.items():
            with recorded_launches(comm) as logs[name]:
                got[name] = f.run(f"ubnext.torch {name}", op)
        torch.cuda.synchronize()
        got["all_reduce"], got["reduce_scatter_tensor"], got["all_gather_into_tensor"] = in_place, rs_into, ag_into
        failures = []
        for name in ("functional.all_reduce", "all_reduce", "torch.ops.ubnext.all_reduce"):
            with collected(failures):
                reference.assert_same_bits(host(got[name]).reshape(-1), expected_all_reduce(logs[name], flat, "sum"),
                                           name)
        for name in ("functional.reduce_scatter", "reduce_scatter_tensor"):
            with collected(failures):
                algo = rsag_ran(logs[name], "reduce_scatter")
                want = (reference.exact(flat)[rank * k:(rank + 1) * k] if algo == "nccl"
                        else reference.reduce_scatter(algo, flat)[rank])
                reference.assert_same_bits(host(got[name]).reshape(-1), want, name)
        for name in ("functional.all_gather", "all_gather_into_tensor"):
            with collected(failures):
                reference.assert_same_bits(host(got[name]).reshape(-1),
                                           reference.all_gather(rsag_ran(logs[name], "all_gather"), flat), name)
        with collected(failures):
            name = "functional.all_reduce_add_rmsnorm"
            normed, rsum = got[name]
            want_n, want_r = expected_fused(logs[name], inputs, res, b, weight, eps, (normed, rsum, w, r, bd))
            reference.assert_same_bits(host(rsum), want_r, f"{name} residual_out")
            reference.assert_same_bits(host(normed), want_n, f"{name} normed")
        with collected(failures):
            name = "functional.reduce_scatter_add_rmsnorm"
            normed, rsum = got[name]
            want_n, want_r = expected_reduce_scatter_add_rmsnorm(comm, logs[name], inputs, rs_res, b, weight, eps)
            reference.assert_same_bits(host(rsum), want_r, f"{name} residual_out")
            reference.assert_same_bits(host(normed), want_n, f"{name} normed")
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


TP_TOKENS, TP_HIDDEN, TP_INTERMEDIATE, TP_HEADS_FEATURES = 16, 512, 1024, 512


@pytest.mark.parametrize("kind", ["mlp", "attention"])
@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_layer_forward(comm, home, second, mode, kind):
    """A tensor-parallel layer's forward (ubnext.torch.tp, test_gpu_torch_tp's blocks) with
    another device current: bit for bit against the emulation of the shards, the partial
    sums reduced by the reference of the fused kernels that ran."""
    import torch
    import tp_support as tp

    f = Foreign(comm, mode, home, second)
    dev, dtype = f"cuda:{comm.device}", torch.bfloat16
    with on_comm_device(comm):
        w = tp.weights(TP_HIDDEN, TP_INTERMEDIATE, TP_HEADS_FEATURES, dtype, dev)
        data = tp.inputs(TP_TOKENS, TP_HIDDEN, TP_HEADS_FEATURES, dtype, dev)
        block = (tp.mlp if kind == "mlp" else tp.attention_output)(comm, w, dtype, dev)
        torch.cuda.synchronize()
    with recorded_launches(comm) as launches:
        got = f.run(f"{kind} forward", lambda: tp.run_block(kind, block, comm.rank, comm.size, data, backward=False))
    with on_comm_device(comm):
        torch.cuda.synchronize()
        fused = [launch for launch in launches if launch.fused]
        if not fused:
            pytest.skip(f"the epilogue did not run a fused kernel ({ran(launches)}): no kernel order to emulate")

        def fused_reference(parts, residual, weight, bias, eps):
            normed, res = expected_add_rmsnorm(fused, [host(p) for p in parts],
                                               None if residual is None else host(residual),
                                               None if bias is None else host(bias), host(weight), eps, False)
            return device(normed), device(res)

        want = tp.emulate(kind, w, data, comm.rank, comm.size, fused_reference, None, backward=False)
        tp.assert_equal_bits(got, want)
    f.assert_clean()


# ---- graphs, other frameworks, a second communicator ----------------------------------------------
@pytest.mark.parametrize("mode", NEEDS_SECOND)
def test_cuda_graph_captured_under_a_foreign_device(comm, home, second, mode):
    """An all_reduce captured into a CUDA graph on a stream of the communicator's device
    while another device is current (switched inside the capture: torch.cuda.graph makes
    the capture stream's device current), replayed three times with new inputs into a
    poisoned, bordered out: bit for bit, canaries intact."""
    import torch

    count, dtype, algorithm = 20_000, "bfloat16", "lamport"
    usable(comm, algorithm, count * WIDTH[dtype])
    f = Foreign(comm, mode, home, second)
    with on_comm_device(comm):
        x = torch.ones(count, dtype=torch.bfloat16, device=f"cuda:{comm.device}")
        y = Bordered(count, dtype, seed_of("graph", mode))
        s = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):  # an eager call first: a capture needs its kernel compiled
            comm.all_reduce(x, out=y.view, algorithm=algorithm)
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            with recorded_launches(comm) as launches:
                f.run("all_reduce captured", lambda: comm.all_reduce(x, out=y.view, algorithm=algorithm))
        failures = []
        for it in range(3):
            inputs = rank_inputs(count, dtype, comm.size, seed_of("graph", mode, it))
            x.copy_(device(inputs[comm.rank]))
            y.view.fill_(float("nan"))
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            with collected(failures):
                assert ran(launches) == algorithm, f"the capture holds {ran(launches)}"
                reference.assert_same_bits(host(y.view), expected_all_reduce(launches, inputs, "sum"),
                                           f"replay {it}")
                y.assert_intact(f"replay {it}")
    assert not failures, "\n".join(failures[:5])
    f.assert_clean()


def reduced_exactly(comm, f, what: str, call, inputs, setup=None):
    """``f.run(what, call, setup)``: an all_reduce of another framework's array under f's
    mode, its launches recorded; checked bit for bit against the host reference of
    ``inputs`` (every rank's), and the caller's state unchanged (``f.assert_clean``).
    Returns the output."""
    import torch

    with recorded_launches(comm) as launches:
        out = f.run(what, call, setup=setup)
    torch.cuda.synchronize(comm.device)
    with on_comm_device(comm):
        reference.assert_same_bits(host(to_torch(out)), expected_all_reduce(launches, inputs, "sum"), what)
    f.assert_clean()
    return out


@pytest.fixture(scope="module")
def jax_gpus(comm):
    """(JAX's GPU 0, JAX's device of the communicator's GPU); every rank skips alike."""
    return agreed(comm, lambda: jax_gpu_devices(comm.device))


@pytest.mark.parametrize("mode", ("as-jax-left-it", *MODES))
def test_jax_array_moved_from_gpu_0(comm, home, second, jax_gpus, mode):
    """A JAX array made on GPU 0 and moved to the communicator's GPU (JAX's work on GPU 0
    leaves that one current), all_reduced as JAX left the thread, and under each mode: a
    CuPy result on the communicator's device, bit for bit."""
    import cupy
    import jax

    first, mine = jax_gpus
    count, dtype = 4099, "float32"
    f = Foreign(comm, "as-is" if mode == "as-jax-left-it" else mode, home, second)
    with on_comm_device(comm):
        inputs = rank_inputs(count, dtype, comm.size, seed_of("jax", mode))
    a = jax.device_put(jax.device_put(inputs[comm.rank], first), mine)
    a.block_until_ready()
    out = reduced_exactly(comm, f, "all_reduce of a JAX array", lambda: comm.all_reduce(a), inputs)
    assert isinstance(out, cupy.ndarray) and out.device.id == comm.device, f"got a {type(out).__name__} on {out.device}"


@pytest.fixture(scope="module")
def numba_cuda(comm):
    def probe():
        pytest.importorskip("numba")
        cuda = pytest.importorskip("numba.cuda")
        if not cuda.is_available():
            pytest.skip("numba.cuda sees no GPU")
        return cuda

    return agreed(comm, probe)


@pytest.mark.parametrize("mode", MODES)
def test_numba_array_made_on_the_communicators_device(comm, home, second, numba_cuda, mode):
    """A numba device array made on the communicator's device (``numba.cuda.gpus[d]``)
    while another device is current, all_reduced there: a CuPy result on the
    communicator's device, bit for bit."""

    cuda = numba_cuda
    count, dtype = 4099, "float32"
    f = Foreign(comm, mode, home, second)
    with on_comm_device(comm):
        inputs = rank_inputs(count, dtype, comm.size, seed_of("numba", mode))
    kept = []

    def make():
        with cuda.gpus[comm.device]:
            d = cuda.to_device(inputs[comm.rank])
            cuda.synchronize()
        kept.append(d)
        return d

    reduced_exactly(comm, f, "all_reduce of a numba array", lambda d: comm.all_reduce(d), inputs, setup=make)


@pytest.fixture(scope="module")
def cuda_core(comm):
    """cuda.core's Device and StridedMemoryView (``gpu_support.cuda_core_api``)."""
    return agreed(comm, cuda_core_api)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_core_array_made_on_the_communicators_device(comm, home, second, cuda_core, mode):
    """A cuda.core buffer on the communicator's device (cuda.core makes its device current
    to allocate; the test gives the caller's context back at once), viewed as a
    StridedMemoryView and all_reduced with another device current: a CuPy result on the
    communicator's device, bit for bit."""
    import torch
    from cuda.bindings import driver

    device_class, view_class = cuda_core
    count, dtype = 4099, "float32"
    f = Foreign(comm, mode, home, second)
    with on_comm_device(comm):
        inputs = rank_inputs(count, dtype, comm.size, seed_of("cuda.core", mode))
        source = device(inputs[comm.rank])
        torch.cuda.synchronize()
    kept = []

    def make():
        err, saved = driver.cuCtxGetCurrent()
        assert int(err) == 0, err
        dev = device_class(comm.device)
        dev.set_current()
        stream = dev.create_stream()
        buf = dev.allocate(count * 4, stream=stream)
        stream.sync()
        view = view_class.from_buffer(buf, shape=(count,), dtype=np.dtype(np.float32))
        with torch.cuda.device(comm.device):
            torch.from_dlpack(view).copy_(source)
            torch.cuda.synchronize()
        (err,) = driver.cuCtxSetCurrent(saved)
        assert int(err) == 0, err
        kept.extend((stream, buf))
        return view

    reduced_exactly(comm, f, "all_reduce of a cuda.core view", lambda view: comm.all_reduce(view), inputs,
                    setup=make)


@pytest.mark.parametrize("mode", MODES)
def test_tune_under_a_foreign_device(comm, home, second, mode, tmp_path):
    """A short ``ubnext.tune`` run on the module's communicator with another device current
    (its stream and arrays must be the communicator's device's): it measures, writes a
    table with a positive time for every algorithm that took the size, and leaves the
    caller's device as it was."""
    from ubnext import tune
    from ubnext._selection.table_format import load_table

    f = Foreign(comm, mode, home, second)
    path = comm.bootstrap.bcast_obj(str(tmp_path / "tune.json") if comm.rank == 0 else None)
    argv = ["-o", path, "-b", "4K", "-e", "4K", "-n", "2", "-G", "1", "--repeats", "1", "-w", "1",
            "--dtype", "bfloat16"]
    status = f.run("tune.run", lambda: tune.run(comm, tune.parse_args(argv), argv))
    comm.bootstrap.barrier()  # rank 0 has written the table
    assert status == 0, f"tune.run returned {status}"
    (entry,) = load_table(path).entries  # a new file: the entry of the GPU tune ran on
    record = entry.entry["measured"][str(comm.size)]["bfloat16"]
    assert record["sizes"] == [4 << 10]
    times = [t for row in record["us"].values() for t in row if t is not None]
    assert times and all(t > 0 for t in times), record["us"]
    f.assert_clean()


@pytest.mark.parametrize("mode", ["thread", "no-set-device"])
def test_selftest_under_a_foreign_device(comm, home, second, mode, monkeypatch):
    """``python -m ubnext selftest``'s main (sizes 1 and 7 only, as test_gpu_selftest's
    failure test) from a thread that never set a device, and with the process's original
    device current: it passes on every rank and leaves the caller's device as it was
    (main creates and closes its own communicator; a caller's non-zero current device
    would become that communicator's, so the torch-device and cupy-device modes prove
    nothing here)."""
    import io

    from ubnext._tools import selfcheck as _selfcheck
    from ubnext._tools import selftest as _selftest

    monkeypatch.setattr(_selfcheck, "COUNTS", (1, 7))
    f = Foreign(comm, mode, home, second)
    out = io.StringIO()
    status = f.run("selftest", lambda: _selftest.main(out=out))
    assert status == _selftest.OK, out.getvalue()
    if out.getvalue():  # rank 0
        assert out.getvalue().splitlines()[-1].startswith("selftest passed: "), out.getvalue()
    f.assert_clean()


@pytest.mark.parametrize("mode,how", [("thread", "close"), ("thread", "abort"), ("torch-device", "close"),
                                      ("torch-device", "abort"), ("cupy-device", "close"), ("no-set-device", "abort")])
def test_close_and_abort_under_a_foreign_device(comm, home, second, mode, how):
    """A second communicator (created collectively, on comm's device) reduces, synchronizes
    and is closed or aborted with another device current (from a new thread, too): every
    call exact and leaving the caller's device as it was, the communicator closed
    afterwards, the module's communicator still exact (and, by the autouse check, every
    device still runs kernels)."""
    import torch

    import ubnext

    f = Foreign(comm, mode, home, second)  # skips on every rank alike, before the collective creation
    with on_comm_device(comm):
        other = ubnext.Communicator(device=comm.device, **SECOND_COMM)
    failures = []
    try:
        away = Away(other, f)
        with on_comm_device(comm):
            with collected(failures):
                check_all_reduce(away, 4099, "bfloat16", seed_of("second", mode, how))
        away.synchronize()
        comm.bootstrap.barrier()  # every rank is done with `other` before any gives it up
        getattr(away, how)()
    finally:
        other.abort()  # idempotent; releases it where the test failed before
    with on_comm_device(comm):
        with collected(failures):  # collective: before any check that one rank alone may fail
            check_all_reduce(comm, 4099, "bfloat16", seed_of("after", mode, how))
        x = torch.ones(16, device=f"cuda:{comm.device}")
        with pytest.raises(ubnext.ClosedError):
            other.all_reduce(x)
    assert not failures, "\n".join(failures)
    f.assert_clean()


def test_the_process_is_healthy_at_the_end(comm):
    """After every call above: the communicator still reduces exactly, its device
    synchronizes, and a tiny kernel runs on every visible device."""
    import torch

    with on_comm_device(comm):
        check_all_reduce(comm, 4099, "bfloat16", seed_of("end"))
        torch.cuda.synchronize()
    assert_cuda_usable(comm)
