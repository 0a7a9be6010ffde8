"""GPU: subnormal values survive every kernel algorithm.

CuPy compiles with ``-ftz=true``, which flushes fp32 subnormals in every addition; ubnext
compiles its kernels itself without it (``ubnext._engine.kernels.compile_module``), so an
all-reduce of subnormal float32 or bfloat16 values gives the host's sums, bit for bit, as
NCCL does. Runs at any world size (``mpirun -n N python -m pytest tests/test_gpu_subnormal.py``).
"""

from __future__ import annotations

import pytest
from gpu_support import small_torch_communicator

pytestmark = pytest.mark.gpu

comm = pytest.fixture(scope="module", name="comm")(small_torch_communicator)


def _input(rank: int, count: int, dtype: str):
    """Rank ``rank``'s subnormal input (multiples of 2^-133 below 2^-126: subnormal in
    float32 and in bfloat16), built on the host, which keeps subnormals."""
    import torch

    k = torch.arange(count, dtype=torch.float32) % 15 + 1
    x = k * (rank + 1) * 2.0**-133
    return x.to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm", ["lamport", "lamport_twoshot", "twoshot"])
def test_an_all_reduce_of_subnormals_keeps_them(comm, algorithm, dtype):
    import torch

    if algorithm not in comm.algorithms():
        pytest.skip(f"{algorithm} does not run on this communicator")
    count = 4096
    inputs = [_input(r, count, dtype) for r in range(comm.size)]
    assert (inputs[0].float().abs() < 2.0**-126).all() and (inputs[0] != 0).all()
    expected = sum(x.float() for x in inputs).to(getattr(torch, dtype))  # exact in fp32, rounded once
    x = inputs[comm.rank].to(f"cuda:{comm.device}")
    got = comm.all_reduce(x, algorithm=algorithm).cpu()
    bits = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(got.view(bits), expected.view(bits)), (
        f"{(got.view(bits) != expected.view(bits)).sum().item()} of {count} differ; first got "
        f"{got[:4].tolist()} want {expected[:4].tolist()}")
