"""The host fakes of ubnext.torch.moe's CPU tests (tests/test_moe_torch.py,
tests/test_moe_packed_torch.py): an ExpertParallel and a PackedExpertParallel whose calls
run the host references (ubnext/_moe/reference.py, packed_reference.py) over the thread
ranks of tests/torch_fakes.py, and the two modes as the tests parametrize them."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
from moe_support import NP, inputs, tokens_of

import ubnext.torch as ut
from ubnext import UbnextError
from ubnext._api import handles
from ubnext._moe import layout, packed_layout
from ubnext._moe import packed_reference as pref
from ubnext._moe import reference as ref
from ubnext._moe.expert_parallel import Handle
from ubnext._moe.packed import PackedHandle

#: (experts per rank, hidden, max tokens, top-k)
SIZES = {"small": (3, 8, 5, 3), "k1": (2, 4, 4, 1)}
TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32}
POISON = {"bfloat16": float("nan"), "float32": float("nan")}


def to_numpy(t) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(NP["bfloat16"])
    return t.numpy().copy()


def to_torch(a: np.ndarray):
    if a.dtype == NP["bfloat16"]:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class HostExpertParallel:
    """ExpertParallel's calls on the thread ranks of a ``run_ranks`` group, by the host
    reference: the same outputs (its own buffers, rows past the counts left poisoned as the
    kernel leaves them unwritten), the same pairing of a combine with the latest dispatch."""

    def __init__(self, comm, size: str, dtype: str):
        per, hidden, tokens, k = SIZES[size]
        self.comm, self.size = comm, comm.size  # ExpertParallel's properties
        self.shape = layout.shape(comm.size, per * comm.size, hidden, tokens, k, dtype)
        self._generation = 0
        self.calls: list[str] = []
        handles.assign(self)

    def _all(self, t) -> list[np.ndarray]:
        return [to_numpy(p) for p in self.comm._gather(t)]

    def dispatch(self, x, topk_idx, topk_weights):
        self.calls.append("dispatch")
        s, r = self.shape, self.comm.rank
        self._idxs = self._all(topk_idx)
        self._dispatched = ref.dispatch(s, self._all(x), self._idxs, self._all(topk_weights))
        d = self._dispatched[r]
        recv_x = torch.full((s.local_experts, s.capacity, s.hidden), POISON[s.dtype], dtype=TORCH[s.dtype])
        src = torch.full((s.local_experts, s.capacity), 0x5A5A5A5A, dtype=torch.int32)
        weights = torch.full((s.local_experts, s.capacity), float("nan"))
        kept = torch.from_numpy(np.arange(s.capacity)[None, :] < d.counts[:, None])
        recv_x[kept] = to_torch(d.recv_x)[kept]
        src[kept], weights[kept] = torch.from_numpy(d.src)[kept], torch.from_numpy(d.weights)[kept]
        self._generation += 1
        return recv_x, torch.from_numpy(d.counts), Handle(src, weights, x.shape[0], self,
                                                          self._generation)

    def combine(self, y, handle, weights=None):
        self.calls.append("combine")
        if handle._owner is not self or handle._generation != self._generation:
            raise UbnextError("ExpertParallel.combine: the handle is not this object's latest dispatch's")
        ws = None if weights is None else self._all(weights)
        out = ref.combine(self.shape, self._dispatched, self._all(y), self._idxs, ws)[self.comm.rank]
        return to_torch(out)


def rank_inputs(ep, kind: str, seed: int):
    """This rank's (x, topk_idx, topk_weights) and every rank's numpy ones."""
    xs, idxs, ws = inputs(ep.shape, kind, tokens_of(ep.shape), seed)
    r = ep.comm.rank
    return (to_torch(xs[r]), torch.from_numpy(idxs[r]), torch.from_numpy(ws[r])), (xs, idxs, ws)


def same_bits(got, want: np.ndarray) -> bool:
    from ubnext._tools import reference

    return reference.mismatches(to_numpy(got).reshape(-1), np.asarray(want).reshape(-1)).size == 0


class HostPackedExpertParallel:
    """PackedExpertParallel's calls (``sync=False``) on the thread ranks of a ``run_ranks``
    group, by the host reference: its own buffers (rows from ``offsets[L]`` on left poisoned,
    as the kernel leaves them unwritten), the same pairing of a combine with the latest
    dispatch. ``max_rows``: R below the default (the routing of these tests fits)."""

    def __init__(self, comm, size: str, dtype: str, max_rows: int | None = None):
        per, hidden, tokens, k = SIZES[size]
        self.comm, self.size = comm, comm.size  # PackedExpertParallel's properties
        self.shape = packed_layout.shape(comm.size, per * comm.size, hidden, tokens, k, dtype, max_rows)
        self._generation = 0
        self.calls: list[str] = []
        handles.assign(self)

    def _all(self, t) -> list[np.ndarray]:
        return [to_numpy(p) for p in self.comm._gather(t)]

    def dispatch(self, x, topk_idx, topk_weights, sync=False):
        assert not sync  # the ops' form
        self.calls.append("dispatch")
        s, r = self.shape, self.comm.rank
        self._idxs = self._all(topk_idx)
        self._dispatched = pref.dispatch(s, self._all(x), self._idxs, self._all(topk_weights))
        d = self._dispatched[r]
        assert not d.overflow
        rows = int(d.counts.sum())
        recv_x = torch.full((s.max_rows, s.hidden), POISON[s.dtype], dtype=TORCH[s.dtype])
        src = torch.full((s.max_rows,), 0x5A5A5A5A, dtype=torch.int32)
        weights = torch.full((s.max_rows,), float("nan"))
        recv_x[:rows] = to_torch(d.recv_x)[:rows]
        src[:rows], weights[:rows] = torch.from_numpy(d.src)[:rows], torch.from_numpy(d.weights)[:rows]
        self._generation += 1
        offsets = torch.from_numpy(pref.offsets(d))
        return recv_x, offsets, PackedHandle(offsets, src, weights, x.shape[0], None, self, self._generation)

    def combine(self, y, handle, weights=None):
        self.calls.append("combine")
        if handle._owner is not self or handle._generation != self._generation:
            raise UbnextError("PackedExpertParallel.combine: the handle is not this object's latest dispatch's")
        ws = None if weights is None else self._all(weights)
        return to_torch(pref.combine(self.shape, self._dispatched, self._all(y), self._idxs, ws)[self.comm.rank])


class Mode(NamedTuple):
    """What a test of both modes calls and compares with."""

    host: type  # the host object
    dispatch: Callable  # ubnext.torch.moe's call
    ref: object  # the reference module
    control: Callable  # a reference Dispatched -> the dispatch's second output
    prefix: str  # of the ops' names


MODES = {"low-latency": Mode(HostExpertParallel, ut.moe.dispatch, ref, lambda d: d.counts, "moe"),
         "packed": Mode(HostPackedExpertParallel, ut.moe.packed_dispatch, pref, pref.offsets, "moe_packed")}
