"""GPU: arrays of other frameworks, produced asynchronously, are complete before a
kernel reads them, and the host does not wait for their producers.

JAX (DLPack: the producer orders its work before the stream it is handed), numba
(``__cuda_array_interface__`` version 3 naming the producing stream: waited for through
an event) and cuda.core (a stream object of the CUDA stream protocol as ``stream=``).
Each is skipped, with the reason, where the framework or its GPU support is missing.
Runs at any world size (``mpirun -n N python -m pytest tests/test_gpu_interop.py``);
every sum is of small integers, so every result is exact.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gpu_support import cuda_core_api, jax_gpu_devices, require_gpu_and_torch

# JAX takes 75 % of the GPU's memory at its first use unless told otherwise; the ranks
# sharing a GPU, ubnext's pool and torch need room. Set before jax can be imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytestmark = pytest.mark.gpu

SMALL = dict(pool_mb=128, staging_mb=16, lamport_max_kb=256, lamport_twoshot_max_kb=4096)
N = 1 << 20  # 4 MiB of float32


@pytest.fixture(scope="module")
def comm():
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator(**SMALL)
    yield c
    c.close()


def host_input(rank: int, i: int) -> np.ndarray:
    """Rank ``rank``'s input of call ``i``: small integers as float32."""
    return ((np.arange(N) % 251) + 7 * i + rank).astype(np.float32)


def expected_sum(comm, i: int, scale: float = 1.0) -> np.ndarray:
    return sum(host_input(r, i) * np.float32(scale) for r in range(comm.size))


def to_host(a) -> np.ndarray:
    import cupy

    return cupy.asnumpy(a)


def non_blocking_stream(comm):
    """A CuPy stream that does not wait for the legacy default stream: a wait it gets must
    come from ubnext (numba's and the legacy stream's work would otherwise be ordered
    before it implicitly)."""
    import cupy

    with cupy.cuda.Device(comm.device):
        return cupy.cuda.Stream(non_blocking=True)


# -- JAX -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_device(comm):
    return jax_gpu_devices(comm.device)[1]


@pytest.mark.parametrize("explicit", [False, True], ids=["cupy-current-stream", "stream="])
def test_jax_arrays_passed_at_once_are_complete(comm, jax_device, explicit):
    """``jnp.asarray(host) * 3``, passed at once, 20 times: JAX computes it
    asynchronously, so the call must make its stream wait for JAX's work (JAX's
    ``__cuda_array_interface__`` is version 2, names no stream and does not wait: it
    must not be what ubnext reads)."""
    import cupy
    import jax
    import jax.numpy as jnp

    stream = non_blocking_stream(comm) if explicit else None
    kept, outs = [], []
    with jax.default_device(jax_device):
        for i in range(20):
            a = jnp.asarray(host_input(comm.rank, i)) * 3
            outs.append(comm.all_reduce(a, stream=stream))
            kept.append(a)
    cupy.cuda.Device(comm.device).synchronize()
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(to_host(out), expected_sum(comm, i, 3.0), err_msg=f"call {i}")


# -- numba -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numba_cuda(comm):
    pytest.importorskip("numba")
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("numba.cuda sees no GPU")
    cuda.select_device(comm.device)
    try:  # numba-cuda releases that predate the installed numpy fail on their first compile
        cuda.jit("void(float32[:])")(lambda a: None)
    except AttributeError as e:
        import numpy

        pytest.skip(f"this numba-cuda cannot compile a kernel with numpy {numpy.__version__} ({e})")
    return cuda


def test_numba_array_produced_on_its_stream_is_waited_for_without_the_host(comm, numba_cuda):
    """A numba kernel on a numba stream fills the array after ~200 ms; its interface
    (version 3) names that stream. The call must order its own stream after it, and
    return while the producer still runs (CuPy's ``asarray`` of the interface would
    block the host until it is done)."""
    import cupy

    cuda = numba_cuda

    @cuda.jit
    def slow_fill(out, value, naps, nap_ns):
        for _ in range(naps):
            cuda.nanosleep(nap_ns)  # at most 1 ms each
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = value + (i % 251)

    producer = cuda.stream()
    d = cuda.device_array(N, dtype=np.float32, stream=producer)
    assert d.__cuda_array_interface__["stream"] == int(producer)
    launch = non_blocking_stream(comm)
    blocks, threads, nap = 128, 256, np.uint32(1_000_000)
    slow_fill[blocks, threads, producer](d, np.float32(0), np.uint32(0), nap)  # compiles
    producer.synchronize()
    comm.all_reduce(d, stream=launch)  # first use of the kernel (collective compile)
    launch.synchronize()

    slow_fill[blocks, threads, producer](d, np.float32(comm.rank + 1), np.uint32(200), nap)
    out = comm.all_reduce(d, stream=launch)
    still_running = cupy.cuda.runtime.streamQuery(int(producer)) != 0
    launch.synchronize()
    assert still_running, "the call waited on the host for the producer's stream"
    want = sum((np.arange(N) % 251 + r + 1).astype(np.float32) for r in range(comm.size))
    np.testing.assert_array_equal(to_host(out), want)


# -- cuda.core -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_core(comm):
    """cuda.core's Device (current: the communicator's) and StridedMemoryView."""
    Device, StridedMemoryView = cuda_core_api()
    device = Device(comm.device)
    device.set_current()
    return device, StridedMemoryView


def test_cuda_core_view_reduced_on_the_stream_that_produced_it(comm, cuda_core):
    """cuda.core's DLPack export ignores the consumer stream (its documented contract:
    the user keeps the order), so the caller passes the producing cuda.core stream as
    ``stream=`` (the CUDA stream protocol). The data is written on that stream after a
    delay; the call must launch on it."""
    import cupy
    import torch

    device, view_class = cuda_core
    stream = device.create_stream()
    handle = int(stream.__cuda_stream__()[1])
    buf = device.allocate(N * 4, stream=stream)
    view = view_class.from_buffer(buf, shape=(N,), dtype=np.dtype(np.float32))
    data = torch.from_dlpack(view)  # torch's view of the same memory, to write it
    assert data.data_ptr() == int(buf.handle)
    source = torch.from_numpy(host_input(comm.rank, 0)).to(f"cuda:{comm.device}")
    producer = torch.cuda.ExternalStream(handle, device=torch.device("cuda", comm.device))
    comm.all_reduce(view, stream=stream)  # first use (compile) on whatever the buffer holds
    stream.sync()
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):  # on the cuda.core stream: a delay, then the data
        torch.cuda._sleep(200_000_000)
        data.copy_(source)
    out = comm.all_reduce(view, stream=stream)
    stream.sync()
    np.testing.assert_array_equal(cupy.asnumpy(out), expected_sum(comm, 0))
