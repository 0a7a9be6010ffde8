"""ExpertParallel's host side on the CPU, over a recording stand-in of its communicator and
launchers: what dispatch and combine check before any launch (shapes, dtypes, T, alignment,
the handle), and the arguments each launch passes in the entry points' order
(kernels/moe_dispatch.cu, kernels/moe_combine.cu)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from moe_support import NP

from ubnext._interop.arrays import Buffer
from ubnext._moe import layout
from ubnext._moe.expert_parallel import ExpertParallel, Handle
from ubnext._protocol import signature
from ubnext._protocol.constants import THREADS
from ubnext._protocol.errors import UbnextError

KEYS = ("recv_x", "counts", "src", "weights", "route", "tokens", "dest")
STREAM = 0x5EED


class FakeOrder(contextlib.nullcontext):
    def __init__(self):
        super().__init__()
        self.followed = []

    def follow(self, stream, owner=None):
        self.followed.append(stream)


class FakeComm:
    """The communicator steps ExpertParallel's calls use, over host numpy arrays."""

    device = 0

    def __init__(self):
        self._order = FakeOrder()

    def _check_open(self, name):
        pass

    def _launch_stream(self, name, stream, x):
        return STREAM, None, False

    def _input(self, name, arr, handle):
        dtype = "bfloat16" if arr.dtype == NP["bfloat16"] else str(arr.dtype)
        return Buffer(arr, "cupy", arr.ctypes.data, arr.size, dtype, 0, arr.shape, arr.nbytes)

    def _new(self, name, yb, handle, owner, side, shape):
        return self._input(name, np.zeros(shape, yb.obj.dtype), handle)


def recording(ep, shape, keys, sig):
    """``ep`` (made without its constructor) of ``shape`` over a FakeComm, 7 blocks, an address
    and a view per array of ``keys``, the signatures ``sig``, and launchers that record
    (kind, args) in ``ep.launches`` instead of launching."""
    ep.shape = shape
    ep._comm, ep._generation, ep._blocks = FakeComm(), 0, 7
    ep._ptr = {key: 0x10000 * (i + 1) for i, key in enumerate(keys)}
    ep._views = {key: f"view of {key}" for key in keys}
    ep._sig = sig
    ep.launches = []
    ep._launchers = {kind: (lambda kind: lambda *args: ep.launches.append((kind, args)))(kind)
                     for kind in ("dispatch", "combine")}
    return ep


def fake(dtype="bfloat16", fp8=False):
    """An ExpertParallel of 2 ranks, 8 experts, hidden 64 (512 with fp8), 5 tokens, top-2,
    whose launches are recorded instead of made."""
    hidden = 512 if fp8 else 64
    sig = {kind: signature.encode_moe(f"moe_{kind}", dtype, 8, 2, 5, hidden) for kind in ("dispatch", "combine")}
    if fp8:
        sig["dispatch"] = signature.encode_moe("moe_dispatch", dtype, 8, 2, 5, hidden, wire=layout.FP8_WIRE)
    sig["combine", "bfloat16"] = signature.encode_moe("moe_combine", dtype, 8, 2, 5, hidden, wire=1)
    ep = recording(object.__new__(ExpertParallel), layout.shape(2, 8, hidden, 5, 2, dtype, fp8=fp8),
                   KEYS + ("scales",) if fp8 else KEYS, sig)
    ep._partials = "float32"
    return ep


def operands(t=4, dtype="bfloat16", hidden=64):
    x = np.ones((t, hidden), NP[dtype])
    idx = np.tile(np.array([0, 5], np.int32), (t, 1))
    w = np.ones((t, 2), np.float32)
    return x, idx, w


def test_dispatch_launches_once_with_the_entry_points_arguments():
    ep = fake()
    x, idx, w = operands()
    recv_x, counts, handle = ep.dispatch(x, idx, w)
    (kind, args), = ep.launches
    assert kind == "dispatch" and args[:3] == (7, THREADS["moe_dispatch.cu"], STREAM)
    assert args[3:] == (x.ctypes.data, idx.ctypes.data, w.ctypes.data, 4, ep._ptr["recv_x"], 0,
                        *(ep._ptr[k] for k in KEYS[1:]), ep._sig["dispatch"])
    assert (recv_x, counts) == ("view of recv_x", "view of counts") and ep._comm._order.followed == [STREAM]
    assert isinstance(handle, Handle) and handle.tokens == 4 and handle.src == "view of src"


def test_combine_launches_with_the_dispatch_state_and_a_new_output():
    ep = fake("float32")
    _, _, handle = ep.dispatch(*operands(3, "float32"))
    y = np.zeros((4, 10, 64), np.float32)
    out = ep.combine(y, handle)
    kind, args = ep.launches[-1]
    assert kind == "combine" and out.shape == (3, 64) and out.dtype == np.float32
    assert args[:3] == (7, THREADS["moe_combine.cu"], STREAM)
    assert args[3:] == (y.ctypes.data, *(ep._ptr[k] for k in ("weights", "route", "tokens", "dest")),
                        out.ctypes.data, 0, ep._sig["combine"])
    given = np.zeros((3, 64), np.float32)
    assert ep.combine(y, handle, out=given) is given


def test_bf16_partials_per_call_or_by_default_with_their_own_signature():
    """partials="bfloat16" (per call, or the object's default): the kernel's flag 1 and a
    signature of its own (ranks that differ mismatch); a float32 object refuses it."""
    ep = fake()
    _, _, handle = ep.dispatch(*operands(3))
    y = np.zeros((4, 10, 64), NP["bfloat16"])
    ep.combine(y, handle, partials="bfloat16")
    assert ep.launches[-1][1][-2:] == (1, ep._sig["combine", "bfloat16"]) != (1, ep._sig["combine"])
    assert "bfloat16 partials" in signature.text(ep._sig["combine", "bfloat16"])
    ep.combine(y, handle)
    assert ep.launches[-1][1][-2:] == (0, ep._sig["combine"])
    ep._partials = "bfloat16"  # what ExpertParallel(..., partials="bfloat16") keeps
    ep.combine(y, handle)
    assert ep.launches[-1][1][-2:] == (1, ep._sig["combine", "bfloat16"])
    ep.combine(y, handle, partials="float32")
    assert ep.launches[-1][1][-2:] == (0, ep._sig["combine"])
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: partials must be"):
        ep.combine(y, handle, partials="float16")
    f32 = fake("float32")
    _, _, handle = f32.dispatch(*operands(3, "float32"))
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: bfloat16 partials take a bfloat16 payload"):
        f32.combine(np.zeros((4, 10, 64), np.float32), handle, partials="bfloat16")
    assert len(f32.launches) == 1


def test_fp8_dispatch_passes_its_scales_and_returns_codes_with_scales():
    """fp8: the launch carries the scales' array after recv_x and the e4m3 wire's signature;
    the dispatch returns (codes, scales) where recv_x was."""
    ep = fake(fp8=True)
    x, idx, w = operands(hidden=512)
    (recv_x, scales), counts, handle = ep.dispatch(x, idx, w)
    (kind, args), = ep.launches
    assert args[7:9] == (ep._ptr["recv_x"], ep._ptr["scales"]) and args[-1] == ep._sig["dispatch"]
    assert (recv_x, scales, counts) == ("view of recv_x", "view of scales", "view of counts")
    assert "e4m3" in signature.text(ep._sig["dispatch"])
    assert ep._sig["dispatch"] != signature.encode_moe("moe_dispatch", "bfloat16", 8, 2, 5, 512)


def test_t_zero_dispatches():
    ep = fake()
    _, _, handle = ep.dispatch(*operands(0))
    assert ep.launches[0][1][6] == 0 and handle.tokens == 0


def misaligned(shape, dtype):
    raw = np.zeros(int(np.prod(shape)) + 8, dtype)
    start = next(i for i in range(1, 8) if (raw[i:].ctypes.data % 16))
    return raw[start:start + int(np.prod(shape))].reshape(shape)


@pytest.mark.parametrize("case,words", [
    ("x dtype", "x must be bfloat16 of shape \\[T x 64\\], got float32"),
    ("x hidden", "x must be bfloat16 of shape"),
    ("too many", "6 tokens; the object takes at most max_tokens=5"),
    ("idx dtype", "topk_idx must be int32 of shape \\[4 x 2\\], got int64"),
    ("idx rows", "topk_idx must be int32 of shape \\[4 x 2\\]"),
    ("w dtype", "topk_weights must be float32"),
    ("x aligned", "x must be 16-byte aligned"),
])
def test_dispatch_refuses_before_any_launch(case, words):
    ep = fake()
    x, idx, w = operands()
    args = {"x dtype": (x.astype(np.float32), idx, w), "x hidden": (x[:, :56].copy(), idx, w),
            "too many": (np.ones((6, 64), x.dtype), idx, w), "idx dtype": (x, idx.astype(np.int64), w),
            "idx rows": (x, idx[:3].copy(), w), "w dtype": (x, idx, w.astype(np.float64)),
            "x aligned": (misaligned((4, 64), x.dtype), idx, w)}[case]
    with pytest.raises(UbnextError, match=f"^ExpertParallel.dispatch: {words}"):
        ep.dispatch(*args)
    assert ep.launches == [] and ep._generation == 0


def test_combine_refuses_a_stale_or_foreign_handle_and_wrong_arrays():
    ep, other = fake(), fake()
    _, _, first = ep.dispatch(*operands())
    y = np.zeros((4, 10, 64), NP["bfloat16"])
    for bad, words in (((y[:, :8].copy(), first), "y must be bfloat16 of shape \\[4 x 10 x 64\\]"),
                       ((y, first, np.zeros((5, 64), NP["bfloat16"])), "out must be bfloat16 of shape \\[4 x 64\\]"),
                       ((y, other.dispatch(*operands())[2]), "the handle is not")):
        with pytest.raises(UbnextError, match=f"^ExpertParallel.combine: {words}"):
            ep.combine(*bad)
    ep.dispatch(*operands())
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: the handle is not"):
        ep.combine(y, first)
    assert [kind for kind, _ in ep.launches] == ["dispatch", "dispatch"]


def test_combine_takes_weights_of_its_own():
    ep = fake()
    _, _, handle = ep.dispatch(*operands())
    y = np.zeros((4, 10, 64), NP["bfloat16"])
    ones = np.ones((4, 10), np.float32)
    ep.combine(y, handle, weights=ones)
    assert ep.launches[-1][1][4] == ones.ctypes.data
    with pytest.raises(UbnextError, match="^ExpertParallel.combine: weights must be float32 of shape \\[4 x 10\\]"):
        ep.combine(y, handle, weights=ones[:3].copy())


def test_the_areas_fill_barrier_is_abandoned_by_abort(monkeypatch):
    """The fill's barrier is a host exchange in the launch section: abort() abandons it (the
    constructor raises rather than waiting for a peer that may never come)."""
    from types import SimpleNamespace

    import cupy

    from ubnext._api.lifetime import Exchanges
    from ubnext._protocol.errors import BrokenCommunicatorError

    monkeypatch.setattr(cupy.cuda, "Device", lambda device: SimpleNamespace(synchronize=lambda: None))
    exchanges = Exchanges()
    exchanges.abandon()
    comm = SimpleNamespace(device=0, _exchanges=exchanges,
                           _local=SimpleNamespace(barrier=lambda: pytest.fail("the barrier ran after abort")))
    ep = ExpertParallel.__new__(ExpertParallel)
    with pytest.raises(BrokenCommunicatorError, match="^ExpertParallel: the communicator was aborted"):
        ep._fill("ExpertParallel", comm, area=None)
