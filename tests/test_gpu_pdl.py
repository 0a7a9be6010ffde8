"""GPU: programmatic dependent launch (``Config.pdl``).

A producer kernel lets its dependents start at once (``griddepcontrol.launch_dependents``),
spins, and only then writes the collective's input, which held NaN until then: the
collective's result must be the one of the finished input, eager, from a call plan and
replayed from a CUDA graph, for every kernel family. And PDL must be in effect: with it
on, the collective's kernel enters (block 0's global-timer stamp, LaunchState.entered_ns,
taken before its grid-dependency wait) before the producer's last block ends; with
``pdl=False`` after. Runs at any world size (``mpirun -n N python -m pytest
tests/test_gpu_pdl.py``); the stamps need sm_90 or later.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import SMALL, ranks_share_a_gpu, require_gpu_and_torch, small_integers

pytestmark = pytest.mark.gpu

#: how long the producer spins before it writes: far longer than the host takes from the
#: producer's launch to the collective's (at 100 µs a first call's sometimes took longer)
SPIN_NS = 2_000_000
COUNT = 4096  # float32 elements: every kernel family takes it in one launch

_PRODUCER = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 now() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Copies src to dst after spinning spin_ns, having let its dependents start first;
// end_ns gets the latest block's end (after its stores).
extern "C" __global__ void late_copy(const unsigned* src, unsigned* dst, u64 words, u64 spin_ns,
                                     u64* end_ns) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const u64 t0 = now();
  while (now() - t0 < spin_ns) {
  }
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x)
    dst[i] = src[i];
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(end_ns, now());
}
"""


def _communicator(pdl: bool, **config):
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator(**SMALL, pdl=pdl, **config)
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm():
    yield from _communicator(True, quantized="int8")


@pytest.fixture(scope="module")
def comm_off():
    yield from _communicator(False)


@pytest.fixture(scope="module")
def producer(comm):
    import cupy

    with cupy.cuda.Device(comm.device):
        return cupy.RawModule(code=_PRODUCER).get_function("late_copy")


def _sm90(comm) -> bool:
    import cupy

    return int(cupy.cuda.Device(comm.device).compute_capability) >= 90


def _words(a):
    """A CuPy uint32 view of a CuPy array or torch tensor (any dtype, even byte count)."""
    import cupy

    if hasattr(a, "data_ptr"):
        import torch

        a = cupy.asarray(a.view(torch.int32))
    return a.view(cupy.uint32)


class Late:
    """Writes ``src`` into ``dst`` late, by the producer kernel, on ``stream``; ``end``
    holds the producer's end stamp once it ran."""

    def __init__(self, producer, src, dst, stream):
        import cupy

        self.producer, self.src, self.dst, self.stream = producer, _words(src), _words(dst), stream
        self.end = cupy.zeros(1, cupy.uint64)

    def __call__(self, spin_ns: int = SPIN_NS):
        import cupy

        self.dst.fill(0x7FC07FC0)  # NaN (float32, and both halves as 16-bit floats) until the producer writes
        self.end.fill(0)
        self.producer((8,), (256,), (self.src, self.dst, cupy.uint64(self.src.size), cupy.uint64(spin_ns),
                                     self.end), stream=self.stream)


def _on_time_then_late(late, stream, call) -> list:
    """The results of ``call()`` (which launches the collective on ``stream``, waits for it
    and returns host copies) with the input written well before, then written late."""
    results = []
    with stream:
        for spin in (0, SPIN_NS):
            late(spin_ns=spin)
            if spin == 0:
                stream.synchronize()
            results.append(call())
    return results


def _state(algorithm: str) -> str:
    return {"lamport": "lamport4", "lamport_twoshot": "lamport_twoshot4",
            "twoshot": "twoshot.unicast"}[algorithm] + ".state"


def _collective(comm, kind: str, x, out, algorithm: str, stream):
    if kind == "all_reduce":
        return comm.all_reduce(x, out=out, algorithm=algorithm, stream=stream)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, out=out, algorithm=algorithm, stream=stream)
    return comm.all_gather(x, out=out, algorithm=algorithm, stream=stream)


ALGORITHMS = ("lamport", "lamport_twoshot", "twoshot")


@pytest.mark.parametrize("mode", ["eager", "planned", "graph"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_late_producer_never_yields_a_wrong_sum_and_the_kernel_enters_before_it_ends(
        comm, producer, algorithm, mode, monkeypatch):
    """"eager" takes the full (unplanned) path at every call (no ``out``: a call that
    allocates its output is never planned), "planned" the call plan of the first call's
    arguments, "graph" a replay; the path each call took is checked."""
    import cupy

    if algorithm not in comm.algorithms():
        pytest.skip(f"{algorithm} does not run on this communicator")
    shared = ranks_share_a_gpu(comm)
    full_paths = []  # the Dispatcher's full-path launches (a planned call launches its plan instead)
    full = comm._dispatch.all_reduce
    monkeypatch.setattr(comm._dispatch, "all_reduce", lambda *a, **k: full_paths.append(1) or full(*a, **k))
    with cupy.cuda.Device(comm.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        host, expected = small_integers(comm, COUNT, seed=len(mode) + len(algorithm))
        src, x, out = cupy.asarray(host), comm.empty(COUNT, "float32"), comm.empty(COUNT, "float32")
        late = Late(producer, src, x, stream)
        with stream:
            late(spin_ns=0)
            comm.all_reduce(x, out=out, algorithm=algorithm, stream=stream)  # compiles; a first plan
            stream.synchronize()
            calls = 3 if mode == "planned" else 1
            if mode == "graph":
                stream.begin_capture()
                late()
                comm.all_reduce(x, out=out, algorithm=algorithm, stream=stream)
                graph = stream.end_capture()
            for _ in range(calls):
                out.fill(np.nan)
                result = out
                if mode == "graph":
                    graph.launch(stream)
                else:
                    late()
                    before = len(full_paths)
                    result = comm.all_reduce(x, out=None if mode == "eager" else out, algorithm=algorithm,
                                             stream=stream)
                    assert len(full_paths) == before + (mode == "eager"), f"the {mode} call took the other path"
                stream.synchronize()
                np.testing.assert_array_equal(cupy.asnumpy(result), expected, strict=True)
        entered = comm._node.engine.entries()[_state(algorithm)]
        end = int(late.end.get()[0])
    if _sm90(comm) and not shared:  # ranks that take turns on one GPU enter when their turn comes
        assert 0 < entered < end, (f"{algorithm} ({mode}) entered {(entered - end) / 1e3:+.1f} µs after the "
                                   "producer ended: programmatic dependent launch is not in effect")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_with_pdl_off_the_kernel_enters_after_the_producer_ends(comm_off, producer, algorithm):
    import cupy

    if algorithm not in comm_off.algorithms():
        pytest.skip(f"{algorithm} does not run on this communicator")
    assert not comm_off._node.engine.dependent
    with cupy.cuda.Device(comm_off.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        host, expected = small_integers(comm_off, COUNT, seed=7)
        src, x, out = cupy.asarray(host), comm_off.empty(COUNT, "float32"), comm_off.empty(COUNT, "float32")
        late = Late(producer, src, x, stream)
        with stream:
            for _ in range(2):
                late()
                comm_off.all_reduce(x, out=out, algorithm=algorithm, stream=stream)
            stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), expected, strict=True)
        entered = comm_off._node.engine.entries()[_state(algorithm)]
        assert entered > int(late.end.get()[0]) > 0


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("algorithm", ["lamport_twoshot", "twoshot"])
def test_reduce_scatter_and_all_gather_wait_for_a_late_producer(comm, producer, kind, algorithm):
    """The result from a late input equals the result from the same input written well
    before (both exact: small integers)."""
    import cupy

    if algorithm not in comm.algorithms():
        pytest.skip(f"{algorithm} does not run on this communicator")
    shard = COUNT // 4
    count_in, count_out = (shard * comm.size, shard) if kind == "reduce_scatter" else (shard, shard * comm.size)
    with cupy.cuda.Device(comm.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        host, _ = small_integers(comm, count_in, seed=11)
        src, x, out = cupy.asarray(host), comm.empty(count_in, "float32"), comm.empty(count_out, "float32")
        late = Late(producer, src, x, stream)

        def call():
            out.fill(np.nan)
            _collective(comm, kind, x, out, algorithm, stream)
            stream.synchronize()
            return cupy.asnumpy(out)

        results = _on_time_then_late(late, stream, call)
    assert not np.isnan(results[0]).any()
    np.testing.assert_array_equal(results[1], results[0], strict=True)


@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot"])
def test_the_fused_add_rmsnorm_waits_for_a_late_producer(comm, producer, algorithm):
    """The fused call's outputs from a late input equal those from the input written well
    before, bit for bit."""
    import cupy

    if algorithm not in comm.algorithms():
        pytest.skip(f"{algorithm} does not run on this communicator")
    tokens, hidden = 4, 1024
    with cupy.cuda.Device(comm.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        host, _ = small_integers(comm, tokens * hidden, seed=13)
        src = cupy.asarray(host)
        x = comm.empty((tokens, hidden), "float32")
        residual = cupy.asarray((np.arange(tokens * hidden, dtype=np.float32) % 7).reshape(tokens, hidden))
        weight = cupy.asarray(np.linspace(0.5, 1.5, hidden, dtype=np.float32))
        late = Late(producer, src, x, stream)

        def call():
            normed, res_out = comm.all_reduce_add_rmsnorm(x, residual, weight, algorithm=algorithm, stream=stream)
            stream.synchronize()
            return cupy.asnumpy(normed), cupy.asnumpy(res_out)

        results = _on_time_then_late(late, stream, call)
    assert not np.isnan(results[0][1]).any()
    for late_result, on_time in zip(results[1], results[0]):
        np.testing.assert_array_equal(late_result, on_time, strict=True)


@pytest.mark.parametrize("collective, precision, seed", [("all_reduce", "int8", 17), ("reduce_scatter", "int4", 19)])
def test_the_quantized_collectives_wait_for_a_late_producer(comm, producer, collective, precision, seed):
    """The quantized two-shot's all-reduce and its reduce-scatter (an entry point of its own,
    launched as the all-reduce's) from a late input equal the ones from the input written
    well before, bit for bit, and the kernel enters before the producer ends."""
    import cupy
    import torch

    if comm.size < 2:
        pytest.skip("the quantized collectives run at 2 ranks or more")
    count = (1 << 16) * (comm.size if collective == "reduce_scatter" else 1)
    shared = ranks_share_a_gpu(comm)
    with cupy.cuda.Device(comm.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        host, _ = small_integers(comm, count, seed=seed)
        src = torch.from_numpy(host).to(device=f"cuda:{comm.device}", dtype=torch.bfloat16)
        x = comm.empty(count, "bfloat16", framework="torch")
        late = Late(producer, src, x, stream)

        def call():
            out = getattr(comm, collective)(x, precision=precision, stream=stream)
            stream.synchronize()
            return out.float().cpu().numpy()

        results = _on_time_then_late(late, stream, call)
        entered = comm._node.engine.entries()["quant.state"]
        end = int(late.end.get()[0])
    assert not np.isnan(results[0]).any()
    np.testing.assert_array_equal(results[1], results[0], strict=True)
    if _sm90(comm) and not shared:  # ranks that take turns on one GPU enter when their turn comes
        assert 0 < entered < end
