"""ubnext.torch.moe's throughput mode on CPU (``packed_dispatch``, ``combine`` of its handle:
``torch.ops.ubnext.moe_packed_*``): its schemas, side effects and host-visible errors,
over a host PackedExpertParallel (tests/moe_torch_support.py). Its fakes (static ``[R, H]``
shapes), forward, gradients, torch.compile and opcheck run in tests/test_moe_torch.py, in
both modes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moe_torch_support import HostPackedExpertParallel  # noqa: E402
from torch_fakes import run_ranks  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import UbnextError  # noqa: E402


def test_schemas():
    ops = torch.ops.ubnext
    assert str(ops.moe_packed_dispatch.default._schema) == (
        "ubnext::moe_packed_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int ep) -> (Tensor, Tensor, "
        "Tensor, Tensor)")
    assert str(ops.moe_packed_combine.default._schema) == (
        "ubnext::moe_packed_combine(Tensor y, Tensor weights, Tensor topk_idx, int ep) -> Tensor")
    assert str(ops.moe_packed_dispatch_backward.default._schema) == (
        "ubnext::moe_packed_dispatch_backward(Tensor? grad_recv_x, Tensor? grad_weights, Tensor src, "
        "Tensor offsets, Tensor topk_idx, int ep) -> (Tensor, Tensor)")


def test_every_op_is_side_effecting():
    """A rank without tokens has zero-size outputs: no compiler may drop its calls."""
    import torch.fx.node

    for name in ("dispatch", "combine", "dispatch_backward"):
        assert getattr(torch.ops.ubnext, f"moe_packed_{name}").default in torch.fx.node._side_effectful_functions


def test_bad_shapes_raise_naming_the_op():
    def body(comm):
        ep = HostPackedExpertParallel(comm, "small", "float32")
        s, h = ep.shape, ut.handle(ep)
        x, idx, w = torch.zeros(2, s.hidden), torch.zeros(2, s.top_k, dtype=torch.int32), torch.zeros(2, s.top_k)
        rows = torch.zeros(s.max_rows, s.hidden)
        cases = [(lambda: ut.moe.packed_dispatch(x.double(), idx, w, ep), "moe_packed_dispatch: x must be float32"),
                 (lambda: ut.moe.packed_dispatch(x, idx[:1], w, ep),
                  r"moe_packed_dispatch: topk_idx must be int32 of shape \[2 x"),
                 (lambda: torch.ops.ubnext.moe_packed_combine(rows[:-1], torch.zeros(s.max_rows), idx, h),
                  rf"moe_packed_combine: y must be float32 of shape \[{s.max_rows} x {s.hidden}\]"),
                 (lambda: torch.ops.ubnext.moe_packed_combine(rows, torch.zeros(s.max_rows - 1), idx, h),
                  rf"moe_packed_combine: weights must be float32 of shape \[{s.max_rows}\]"),
                 (lambda: torch.ops.ubnext.moe_packed_dispatch_backward(
                     None, torch.zeros(s.max_rows), torch.zeros(s.max_rows, dtype=torch.int32),
                     torch.zeros(s.local_experts, dtype=torch.int32), idx, h),
                  rf"moe_packed_dispatch_backward: offsets must be int32 of shape \[{s.local_experts + 1}\]"),
                 (lambda: torch.ops.ubnext.moe_packed_combine(rows, torch.zeros(s.max_rows), idx, h),
                  "moe_packed_combine: no dispatch of this object")]
        for call, words in cases:
            with pytest.raises(UbnextError, match=f"^ubnext::{words}"):
                call()
        return ep.calls

    assert run_ranks(1, body) == [[]]  # nothing reached the object
