"""Helpers of the GPU tests: one communicator per session, inputs every rank can
regenerate for every other rank, an fp64 reference, bit-identity across ranks.

The same test bodies run at 1 rank (plain pytest) and at N ranks
(``mpirun -n N python -m pytest tests``); without a usable GPU they are skipped.
"""

from __future__ import annotations

import hashlib

import pytest


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def require_gpu_and_torch():
    if gpu_count() == 0:
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("torch", reason="the GPU tests build their inputs with torch")


TOL = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-6}
#: NCCL reduces in the data type itself (one rounding per step), so its bf16/fp16
#: results on short messages can be a few ulps off; ubnext accumulates in fp32.
TOL_NCCL = {"bfloat16": 3e-2, "float16": 4e-3, "float32": 1e-6}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def make_input(count: int, dtype: str, rank: int, seed: int, specials: bool):
    """Rank ``rank``'s input of a test: random normal values, the same on any GPU.

    With ``specials``: -0.0 on every rank at every 97th element and at a rank-dependent
    31st, +inf at element 3 and NaN at element 5 on rank 0.
    """
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed * 1009 + rank)
    x = torch.randn(count, generator=g, device="cuda", dtype=torch.float32)
    if specials:
        x[1::97] = -0.0
        x[(2 + rank)::31] = -0.0
        if rank == 0 and count > 3:
            x[3] = float("inf")
        if rank == 0 and count > 5:
            x[5] = float("nan")
    return x.to(torch_dtype(dtype))


def reference(count: int, dtype: str, nranks: int, seed: int, specials: bool, op: str = "sum"):
    """fp64 result of the op over every rank's input (regenerated locally)."""
    import torch

    acc = None
    for r in range(nranks):
        x = make_input(count, dtype, r, seed, specials).double()
        if acc is None:
            acc = x
        elif op in ("sum", "avg"):
            acc = acc + x
        elif op == "max":
            acc = torch.fmax(acc, x)
        else:
            acc = torch.fmin(acc, x)
    return acc / nranks if op == "avg" else acc


def check_close(out, ref, dtype: str, tol: dict = TOL) -> None:
    """‖out−ref‖/‖ref‖ over finite reference entries within ``tol``; specials equal."""
    import torch

    out, ref = out.double().flatten(), ref.flatten()
    finite = torch.isfinite(ref)
    o, r = out[finite], ref[finite]
    assert torch.isfinite(o).all(), "output has non-finite values where the reference is finite (unwritten?)"
    err = (torch.linalg.vector_norm(o - r) / max(torch.linalg.vector_norm(r).item(), 1e-30)).item()
    assert err < tol[dtype], f"relative error {err:.3e} >= {tol[dtype]:.0e}"
    special = ~finite
    if special.any():
        assert torch.equal(torch.isnan(out[special]), torch.isnan(ref[special])), "NaN positions differ"
        inf = torch.isinf(ref)
        assert torch.equal(out[inf], ref[inf]), "infinities differ"


def digest(t) -> bytes:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).digest()


def assert_same_bits_everywhere(comm, t) -> None:
    digests = comm.bootstrap.allgather(digest(t))
    assert all(d == digests[0] for d in digests), "ranks got different bits"


def as_framework(t, framework: str):
    """``t`` (a torch tensor) as a CuPy array sharing its memory, or itself."""
    if framework == "torch":
        return t
    import cupy

    from ubnext._arrays import _cupy_dtype

    import torch

    ints = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    return cupy.from_dlpack(ints).view(_cupy_dtype(str(t.dtype).replace("torch.", "")))


def to_torch(a):
    """A torch view of a CuPy or torch array."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    dtype = a.dtype.name
    width = a.dtype.itemsize
    ints = a.view({2: "int16", 4: "int32"}[width])
    return torch.from_dlpack(ints).view(torch_dtype(dtype))
