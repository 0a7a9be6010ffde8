"""Communicators of threads for CPU tests of ubnext.torch: ``run_ranks(n, fn)`` runs
``fn(comm)`` on ``n`` threads, each with a ``ThreadComm`` of the group, and returns what
each returned (raising the first error). A ThreadComm reduces CPU tensors in rank order
in fp32, rounded once (``rank_order``), as ubnext's Lamport kernels do, and its fused calls
are that all-reduce (or its rank's slice, the reduce-scatter, in the layout of
torch.distributed.reduce_scatter_tensor) followed by ubnext.torch's add + RMSNorm
reference; its all-gather concatenates in rank order; every exchange
waits on a barrier with a timeout, so a rank that skips a collective fails the test.
``run_ranks(n, fn, quantized="int8")`` gives communicators that opted in to the quantized
all-reduce and reduce-scatter: where ubnext's rule (``_quant.choose``, every size above
a threshold of 0) picks a format, each rank's part is rounded to an int8 grid of its
largest magnitude before the sum (a lossy stand-in for the quantized two-shot), so a call
that quantizes where it should not changes the bits."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from ubnext._api import handles
from ubnext._protocol import quant as _quant
from ubnext.torch import _rmsnorm

TIMEOUT_S = 60.0

# torch's CUDA wheels (2.11) on a machine without a GPU: the first FakeTensorMode entered
# (every torch.compile) registers a no-op CUDA device guard that dies with the thread that
# entered it, and a compile on a later thread then crashes the process (SIGSEGV). Registered
# here, on the importing thread, which outlives the rank threads.
if not torch.cuda.is_available():
    torch._C._ensureCUDADeviceGuardSet()


def rank_order(parts, op: str = "sum"):
    """``parts`` reduced in rank order in fp32, rounded once to their dtype."""
    acc = parts[0].float()
    for p in parts[1:]:
        p = p.float()
        acc = acc + p if op in ("sum", "avg") else torch.fmax(acc, p) if op == "max" else torch.fmin(acc, p)
    if op == "avg":
        acc = acc / len(parts)
    return acc.to(parts[0].dtype)


def int8_grid(t):
    """``t`` rounded to 255 levels of its largest magnitude (the lossy stand-in)."""
    scale = t.float().abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (torch.round(t.float() / scale) * scale).to(t.dtype)


class _Group:
    def __init__(self, n: int, quantized: str = "off"):
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=TIMEOUT_S)
        self.calls = 0
        self.quantized = quantized


class ThreadComm:
    """One thread's communicator of a ``run_ranks`` group (the methods ubnext.torch calls)."""

    device = torch.device("cpu")  # its tensors' (a ubnext Communicator's is a CUDA ordinal)
    selector = SimpleNamespace(nccl_problem=None)  # as a Communicator's: NCCL could run (a GPU per rank)

    def __init__(self, group: _Group, rank: int):
        self._group, self.rank, self.size = group, rank, len(group.slots)
        self.calls = 0  # collectives this rank made
        self.precisions: list = []  # the precision= of each all_reduce and reduce_scatter, in order
        handles.assign(self)  # its handle from construction, as a Communicator's

    def _lossy(self, name: str, x, op: str, precision: str) -> bool:
        """Whether this call quantizes: ubnext's rule with this group's opt-in, a threshold
        of 0 and kernels on a pool (raises as a Communicator does for a format it cannot take)."""
        self.precisions.append(precision)
        dtype = str(x.dtype).removeprefix("torch.")
        return _quant.choose(name, precision, "auto", dtype, op, x.numel() * x.element_size(), 0,
                             self._group.quantized, self.size > 1, lambda: 90) is not None

    def __deepcopy__(self, memo):  # as a Communicator: copies of a layer share it
        return self

    def _gather(self, x):
        self.calls += 1
        g = self._group
        g.slots[self.rank] = x.detach().clone()
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()
        return parts

    def all_reduce(self, x, out=None, op: str = "sum", precision: str = "auto"):
        lossy = self._lossy("all_reduce", x, op, precision)
        # by elements, as the kernels reduce: the ranks' shapes of one count may differ
        r = rank_order([(int8_grid(p) if lossy else p).reshape(-1) for p in self._gather(x)], op).view(x.shape)
        if out is None:
            return r
        out.copy_(r.view(out.shape))  # any shape of x's count, as Communicator.all_reduce takes
        return out

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps: float = 1e-6, bias=None):
        # the fused kernels have no quantized form
        return _rmsnorm.add_rmsnorm(self.all_reduce(x, precision=_quant.EXACT), residual, weight, bias, eps)

    def reduce_scatter(self, x, out=None, op: str = "sum", precision: str = "auto"):
        lossy = self._lossy("reduce_scatter", x, op, precision)
        k = x.numel() // self.size
        parts = [(int8_grid(p) if lossy else p).reshape(-1) for p in self._gather(x)]
        flat = rank_order(parts, op)[self.rank * k:(self.rank + 1) * k]
        if out is not None:
            out.copy_(flat.view(out.shape))
            return out
        rows = x.shape[0] // self.size if x.dim() and x.shape[0] % self.size == 0 else None
        return flat.clone() if rows is None else flat.reshape(rows, *x.shape[1:]).clone()

    def all_gather(self, x, out=None):
        gathered = torch.cat([p.reshape(-1) for p in self._gather(x)])
        if out is not None:
            out.copy_(gathered.view(out.shape))
            return out
        return gathered.reshape(self.size * x.shape[0], *x.shape[1:]) if x.dim() else gathered

    def reduce_scatter_add_rmsnorm(self, x, residual_shard, weight, eps: float = 1e-6, bias=None):
        return _rmsnorm.add_rmsnorm(self.reduce_scatter(x, precision=_quant.EXACT), residual_shard, weight, bias, eps)

    def empty(self, shape, dtype: str = "float32", framework: str = "torch"):
        return torch.empty(shape, dtype=getattr(torch, dtype))


def run_ranks(n: int, fn, quantized: str = "off"):
    """``[fn(comm) for each of n ranks]``, the ranks on threads; ``quantized``: the
    communicators' opt-in (``Communicator(quantized=...)``)."""
    group = _Group(n, quantized)
    results: list = [None] * n
    errors: list = [None] * n

    def body(rank):
        try:
            results[rank] = fn(ThreadComm(group, rank))
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[rank] = e
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results


def traced_communicator(comm: ThreadComm):
    """A ``ubnext.Communicator`` for the tests of its methods under torch.compile, which
    traces them into ``torch.ops.ubnext`` ops: it holds no GPU state (an eager call of its
    methods raises ClosedError) and carries ``comm``'s handle, so the ops it is traced
    into run on ``comm``, the thread communicator (keep ``comm`` alive meanwhile: the
    registry holds it weakly). It is never used: its handle is an attribute, as
    ``Communicator.__init__`` leaves it."""
    from stream_fakes import bare_communicator, fake_order

    from ubnext.torch import handle

    stand = bare_communicator(fake_order(), _closed=True, rank=comm.rank, size=comm.size)
    stand._handle = handle(comm)
    return stand
