"""Fake ubnext communicators for CPU tests of the torch.distributed backend
(``ubnext.torch.backend``): ``StoreComm`` has the Communicator's collective methods, with
the signatures ubnext gives them, on CPU tensors, exchanging through a c10d store (a
``HashStore`` shared by thread ranks, or the group's store across processes). It reduces
in rank order in fp32, rounded once, and records every call (name, keyword arguments)
so tests see which communicator call served which c10d op.

``factory(log)`` is a ``make_communicator`` for ``register``/``ProcessGroupUbnext``: each
group's communicator is created at its first op and appended to ``log``.
"""

from __future__ import annotations

import io
import itertools
import types

import torch

_TIMEOUT_KEYS = 60  # seconds a rank waits for another's key (the store's own timeout)


def _dump(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().clone(), buf)
    return buf.getvalue()


def _load(b) -> torch.Tensor:
    return torch.load(io.BytesIO(bytes(b)))


def reduce_in_order(parts, op: str):
    """``parts`` reduced in rank order in fp32 (fp64 for fp64), rounded once."""
    wide = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0].to(wide)
    for p in parts[1:]:
        p = p.to(wide)
        acc = acc + p if op in ("sum", "avg") else torch.fmax(acc, p) if op == "max" else torch.fmin(acc, p)
    if op == "avg":
        acc = acc / len(parts)
    return acc.to(parts[0].dtype)


class StoreComm:
    """A fake Communicator of ``size`` ranks over ``store`` (see the module docstring)."""

    device_type = "cpu"
    selector = types.SimpleNamespace(nccl_problem=None)  # NCCL can run: a Communicator's every dtype

    def __init__(self, store, rank: int, size: int, device_index=None):
        self.store, self.rank, self.size, self.device_index = store, rank, size, device_index
        self.calls: list[tuple] = []
        self.closed = None
        self._seq = itertools.count()
        self._p2p: dict = {}

    def _record(self, name, **kw):
        self.calls.append((name, kw))

    def _all(self, x):
        """Every rank's ``x``, in rank order."""
        key = f"fake/{next(self._seq)}"
        self.store.set(f"{key}/{self.rank}", _dump(x))
        return [_load(self.store.get(f"{key}/{r}")) for r in range(self.size)]

    def all_reduce(self, x, out=None, op="sum", precision="auto"):
        self._record("all_reduce", op=op, precision=precision, inplace=out is x)
        r = reduce_in_order([p.reshape(-1) for p in self._all(x)], op)
        out = torch.empty_like(x) if out is None else out
        out.copy_(r.view(out.shape))
        return out

    def reduce_scatter(self, x, out=None, op="sum", precision="auto"):
        self._record("reduce_scatter", op=op, precision=precision)
        k = x.numel() // self.size
        r = reduce_in_order([p.reshape(-1) for p in self._all(x)], op)[self.rank * k:(self.rank + 1) * k]
        out = torch.empty(k, dtype=x.dtype) if out is None else out
        out.copy_(r.view(out.shape))
        return out

    def all_gather(self, x, out=None):
        self._record("all_gather")
        g = torch.cat([p.reshape(-1) for p in self._all(x)])
        if out is None:
            return g.reshape(self.size * x.shape[0], *x.shape[1:]) if x.dim() else g
        out.copy_(g.view(out.shape))
        return out

    def broadcast(self, x, root=0, out=None):
        self._record("broadcast", root=root)
        r = self._all(x)[root]
        out = torch.empty_like(x) if out is None else out
        out.copy_(r)
        return out

    def reduce(self, x, root=0, op="sum", out=None):
        self._record("reduce", root=root, op=op)
        r = reduce_in_order([p.reshape(-1) for p in self._all(x)], op).view(x.shape)
        if self.rank != root:
            return None
        out = torch.empty_like(x) if out is None else out
        out.copy_(r)
        return out

    def all_to_all(self, x, out=None, in_splits=None, out_splits=None):
        self._record("all_to_all", in_splits=in_splits, out_splits=out_splits)
        rows = x.shape[0] if x.dim() else 1
        ins = in_splits or [rows // self.size] * self.size
        parts = self._all(x)
        splits = self._all(torch.tensor(ins))
        mine = []
        for r, p in enumerate(parts):
            offs = [0, *itertools.accumulate(splits[r].tolist())]
            mine.append(p[offs[self.rank]:offs[self.rank + 1]])
        got = torch.cat(mine)
        if out_splits is not None:
            assert [m.shape[0] for m in mine] == list(out_splits), "all_to_all: out_splits disagree"
        out = torch.empty_like(got) if out is None else out
        out.copy_(got.view(out.shape))
        return out

    def _p2p_key(self, src, dst):
        n = self._p2p.get((src, dst), 0)
        self._p2p[(src, dst)] = n + 1
        return f"p2p/{src}->{dst}/{n}"

    def send(self, x, peer):
        self._record("send", peer=peer)
        self.store.set(self._p2p_key(self.rank, peer), _dump(x))

    def recv(self, out, peer):
        self._record("recv", peer=peer)
        out.copy_(_load(self.store.get(self._p2p_key(peer, self.rank))))
        return out

    def batch_isend_irecv(self, ops):
        self._record("batch_isend_irecv", ops=[(k, p) for k, _, p in ops])
        for kind, x, peer in ops:  # sends first: a store keeps them until read
            if kind == "send":
                self.store.set(self._p2p_key(self.rank, peer), _dump(x))
        for kind, x, peer in ops:
            if kind == "recv":
                x.copy_(_load(self.store.get(self._p2p_key(peer, self.rank))))

    def gather(self, x, root=0, out=None):
        self._record("gather", root=root)
        parts = self._all(x)
        if self.rank != root:
            return None
        out = torch.empty((self.size, *x.shape), dtype=x.dtype) if out is None else out
        out.copy_(torch.stack(parts))
        return out

    def scatter(self, x, root=0, out=None):
        self._record("scatter", root=root)
        r = self._all(x)[root][self.rank]
        out = torch.empty_like(r) if out is None else out
        out.copy_(r)
        return out

    def barrier(self):
        self._record("barrier")
        self._all(torch.zeros(1))

    def close(self):
        self.closed = "close"

    def abort(self):
        self.closed = "abort"


class LimitedComm(StoreComm):
    """A StoreComm with only the collectives ubnext's Communicator had before the rest of
    NCCL's set (all_reduce, reduce_scatter, all_gather)."""

    def __getattribute__(self, name):
        if name in ("broadcast", "reduce", "all_to_all", "send", "recv", "batch_isend_irecv", "gather", "scatter",
                    "barrier"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def factory(log: list, kind=StoreComm):
    """A ``make_communicator`` whose communicators are ``kind`` over the group's store."""

    def make_communicator(store, rank, size, options):
        def make(device_index):
            comm = kind(store, rank, size, device_index)
            log.append(comm)
            return comm, None

        return make

    return make_communicator
