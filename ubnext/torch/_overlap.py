"""All-gather + matmul and matmul + reduce-scatter with the communication under the GEMMs,
on the symmetric pool (issue 38): the runners behind ``torch.ops.ubnext.all_gather_matmul``,
``matmul_reduce_scatter`` and ``matmul_reduce_scatter_add_rmsnorm``.

Design (the choices, and why):

* **Copy engines move the data, cuBLAS does the GEMMs.** The transfers are
  ``cudaMemcpyAsync`` between pool addresses of two ranks (``SymmetricPool.ptr``) on a side
  stream, so they take no SM from the GEMMs they run under; the GEMMs are ``torch.matmul``
  into rows of the result (``out=``), so their shapes are plain cuBLAS calls that a
  reference can repeat bit for bit. The barrier is ubnext's one-shot
  Lamport all-reduce of a 4-float flag (its completion on a rank means every peer's
  kernel ran, hence every peer's work queued before it on the side stream finished).
* **All-gather side** (per round): each rank copies its own rows of the round into its
  half of the area (side stream), barrier, then pulls the peers' rows from their halves
  straight into the gathered result, src = rank+1, rank+2, ... (each rank starts at a
  different peer), an event after each pull. The caller's stream multiplies its own rows
  first (no communication), then each peer's rows once its event has fired.
* **Reduce-scatter side** (per round): for dst = rank+1, ..., rank (own last), the GEMM of
  rank dst's rows into a staging buffer (two, alternating), pushed by the side stream into
  slot [rank] of dst's half; the own product lands in the own slot directly while the
  last push moves. Barrier, then each rank sums its slots in rank order 0..size-1 in
  fp32 (float64 in float64), rounded once, in one pass (ubnext's slot sum kernel,
  ``_engine.slot_sum``, on the caller's stream): the result is bit-identical to the same
  chunks' GEMMs reduced in that order, whatever the timing. A round's sum covers whole
  rows, so ``matmul_reduce_scatter_add_rmsnorm`` finishes them in the same pass: the
  bias + residual add and the RMSNorm of the separate add + RMSNorm kernel, on the sum as
  rounded (the slot sum's second entry point), instead of a pass of its own afterwards.
* **Bounded area**: ``_overlap_plan.AREA_BYTES`` of the pool (one area per communicator,
  ``Communicator._symmetric_area``), in two halves; inputs of any size move in rounds of
  as many rows as a half takes (``_overlap_plan.split``). The gathered tensor itself is
  never in the pool.

Why reusing a half is safe (no rank writes a half while a peer still reads it): every
call opens with a barrier on the side stream, after the fork and before any write into
an area, and every round j takes one; on every rank (a) a round's reads of half j % 2
come before the next barrier: the all-gather's pulls are on the side stream before it,
and after a reduce-scatter round's reduction (on the caller's stream) the side stream
waits for the caller's stream (the next call's fork waits for it too); (b) its writes
come after a barrier that follows the previous reads of that half: the all-gather's own
copy and the reduce-scatter's pushes are on the side stream after the round's preceding
barrier, and the reduce-scatter's own-slot GEMM (into a slot only this rank reads) on the
caller's stream after the caller waited for the opening barrier (an all-gather's slot of
a half spans the reduce-scatter's slots: a peer may still pull from it); (c) rounds
alternate halves within a call, and a call's first round writes half 0 only after its opening barrier,
which on every rank follows all of that rank's reads of earlier calls (CUDA graph
replays included). So a write into half h follows the completion of a barrier that
follows every rank's earlier reads of h.

Streams: the side stream is forked from the caller's stream (it waits for the caller's
work so far) and joined back (the caller waits for it) within the call, also where the
call raises (a barrier of a broken communicator: copies already queued on the side stream
are then ordered before the caller's next work, so nothing still writes into tensors the
caching allocator takes back), so the op is one unit on the caller's stream, capturable in
a CUDA graph after a first eager call (which allocates the area, collectively, and compiles
the barrier's and the slot sum's kernels; a first call under capture raises before it
queues anything: ``_refuse_capture``). The ordering is by raw events on the streams'
handles (``_interop.streams.CUDA``), no torch stream or device guard.

One section: a call runs whole in the communicator's launch section
(``LaunchOrder.composite``): the GEMMs into the pool, the copies, the barriers (calls of
the communicator, which enter the same section and keep its launch order), the slot sums
and the joins. A ``close()`` or ``abort()`` of another thread waits for it or, where it
comes first, makes the call raise (ClosedError, BrokenCommunicatorError) before anything
is launched into the pool. Where the
communicator has no pool (NCCL only), a single rank, or empty operands (no rows, or no
columns of a gathered a or of a scattered product: extents every rank shares), the ops
run unoverlapped: the communicator's all-gather or reduce-scatter (the fused form: its
``reduce_scatter_add_rmsnorm``, or with empty operands nothing), and the GEMM.
"""

from __future__ import annotations

import weakref

import torch

from ubnext._engine.copies import copy as _copy
from ubnext._engine.slot_sum import SlotSum
from ubnext._interop import streams as _streams
from ubnext._interop.context import keep_current

from . import _overlap_plan as plan

#: the key of the overlap area of a communicator (``Communicator._symmetric_area``)
AREA_KEY = "ubnext.torch.overlap"
#: the algorithm of the barrier: the one-shot all-reduce (pushes into every peer, polled)
BARRIER_ALGORITHM = "lamport"


class _Side:
    """What a communicator's overlapped calls keep: the side stream (a torch stream of its
    device and its raw handle), the barrier's flag (4 floats: one 16-byte vector; zeros,
    whose sum stays zero), the reduce-scatter's slot sum and whether a call has completed
    (``ready``: the area allocated, the barrier's kernel compiled). Made in the
    communicator's section (its context current: the slot sum's modules load into it)."""

    def __init__(self, comm):
        device = comm.device
        # torch's pool streams live as long as the process (nothing to destroy on another thread);
        # its constructor enters torch's device guard, whose exit may switch contexts: kept current
        self.stream = keep_current(torch.cuda.Stream, device)
        self.handle = self.stream.cuda_stream
        self.flag = torch.zeros(4, dtype=torch.float32, device=device)
        self.sum = SlotSum(device, torch.cuda.get_device_properties(device).multi_processor_count, comm.size,
                           comm.config.pdl)
        self.ready = False


#: communicator -> its _Side, or None where it cannot overlap (kept while the communicator lives)
_SIDES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _overlaps(comm) -> bool:
    """Whether the communicator runs the overlapped path, else the unoverlapped one: not a
    single rank, nor one without a pool (NCCL only, or not a ubnext Communicator) or
    without a one-shot kernel.

    The paths are collectives of their own, so every rank must take the same one: the
    decision reads only what the ranks agree on, the size, the pool (there or not on every
    rank: agreed at the communicator's creation) and the algorithms (the same list on
    every rank). Not the local rank: with a pool all ranks are on one node, whose local
    ranks are the ranks in order (``Bootstrap.split_local``), so the pool's addresses, in
    local-rank order, are in rank order."""
    try:
        return _SIDES[comm] is not None
    except (KeyError, TypeError):
        return comm.size > 1 and getattr(comm, "pool", None) is not None and BARRIER_ALGORITHM in comm.algorithms()


def _side(comm, name: str) -> _Side:
    """The _Side of a communicator that overlaps (``_overlaps``), made at its first
    overlapped call, in its section. Raises before a first overlapped call that would be
    captured (``_refuse_capture``)."""
    try:
        side = _SIDES[comm]
    except (KeyError, TypeError):
        _refuse_capture(name, comm.device)  # before the flag's allocation and zeroing
        side = _Side(comm)
        try:
            _SIDES[comm] = side
        except TypeError:  # not weakly referable: made again next time
            pass
        return side
    if not side.ready:  # no call completed yet (the first one failed)
        _refuse_capture(name, comm.device)
    return side


def _current(device: int) -> int:
    """torch's current stream of ``device``, its raw handle (no device guard)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _refuse_capture(name: str, device: int) -> None:
    """``_streams.refuse_capture`` for the current stream of ``device``: a communicator's
    first overlapped call allocates the area (collectively: a host exchange), zeroes the
    barrier's flag and compiles the barrier's and the slot sum's kernels, none of which a
    graph can hold."""
    _streams.refuse_capture(f"ubnext::{name}", _current(device), "it allocates the overlap area of the pool, "
                            "collectively, and compiles the barrier's and the slot sum's kernels",
                            call="overlapped call")


class _Events:
    """The raw events of one overlapped call (in its section: the communicator's context
    current), destroyed when it ends (a wait queued on an event holds after that)."""

    def __init__(self):
        self._cuda = _streams.CUDA
        self._live = []

    def mark(self, stream: int) -> int:
        """An event recorded on ``stream`` now."""
        event = self._cuda.event()
        self._live.append(event)
        self._cuda.record(event, stream)
        return event

    def wait(self, stream: int, event: int) -> None:
        """``stream``'s later work waits for ``event``."""
        self._cuda.wait(stream, event)

    def after(self, consumer: int, producer: int) -> None:
        """``consumer``'s later work waits for ``producer``'s work queued so far (as torch's
        ``wait_stream``: also a fork into, or a join out of, a capture)."""
        self.wait(consumer, self.mark(producer))

    def close(self) -> None:
        live, self._live = self._live, []
        for event in live:
            self._cuda.destroy(event)


class _Call:
    """``with _Call(comm, name, device) as (side, events, caller):`` one overlapped call: in the
    communicator's section, its _Side, the call's events and the caller's stream (raw);
    the side stream forked from the caller's on entry and joined back on exit, whether the
    call completes or raises; the side marked ready where it completes."""

    def __init__(self, comm, name: str, device: int):
        self._comm, self._name, self._device = comm, name, device

    def __enter__(self):
        self._section = self._comm._order.composite()
        self._section.__enter__()
        self._events = None
        try:
            self._comm._check_open(f"ubnext::{self._name}")  # closed or broken: before anything is made or queued
            self._side = _side(self._comm, self._name)
            self._caller = _current(self._device)
            self._events = _Events()
            self._events.after(self._side.handle, self._caller)  # fork: the caller's work so far first
        except BaseException:
            self._leave()
            raise
        return self._side, self._events, self._caller

    def __exit__(self, kind, *exc) -> None:
        try:
            self._events.after(self._caller, self._side.handle)  # join, also where the call raised
            if kind is None:
                self._side.ready = True
        finally:
            self._leave()

    def _leave(self) -> None:
        try:
            if self._events is not None:
                self._events.close()
        finally:
            self._section.__exit__(None, None, None)


def _barrier(comm, side: _Side) -> None:
    comm.all_reduce(side.flag, out=side.flag, algorithm=BARRIER_ALGORITHM, stream=side.stream)


def all_gather_matmul(comm, a: torch.Tensor, b: torch.Tensor):
    """``(gathered, gathered @ b)``: ``a`` (m x k, this rank's rows, the same shape on every
    rank) gathered in rank order, and its product with ``b`` (k x n, n this rank's own).
    Collective: the path taken depends on m and k, not on n (``_overlaps``)."""
    if 0 in a.shape or not _overlaps(comm):
        gathered = comm.all_gather(a) if comm.size > 1 else a.clone()
        return gathered, torch.matmul(gathered, b)
    size, rank = comm.size, comm.rank
    m, k = a.shape
    gathered = a.new_empty((size * m, k))
    out = a.new_empty((size * m, b.shape[1]))
    with _Call(comm, "all_gather_matmul", a.get_device()) as (side, events, caller):
        _, ptrs = comm._symmetric_area(AREA_KEY, plan.AREA_BYTES, "torch")
        row = k * a.element_size()
        rounds = plan.gather_rounds(m, row)
        stream = side.handle
        gathered[rank * m:(rank + 1) * m].copy_(a)
        _barrier(comm, side)  # opening: every peer's reads of earlier calls are done
        g0, a0, peers = gathered.data_ptr(), a.data_ptr(), plan.pull_order(rank, size)
        for j, (r0, rows) in enumerate(rounds.parts):
            off, nbytes = rounds.offset(j), rows * row
            if rows:
                _copy(ptrs[rank] + off, a0 + r0 * row, nbytes, stream)
            _barrier(comm, side)
            if not rows:
                continue
            arrived = []
            for src in peers:
                _copy(g0 + (src * m + r0) * row, ptrs[src] + off, nbytes, stream)
                arrived.append(events.mark(stream))
            mine = rank * m + r0
            torch.matmul(a[r0:r0 + rows], b, out=out[mine:mine + rows])
            for src, event in zip(peers, arrived):
                events.wait(caller, event)
                first = src * m + r0
                torch.matmul(gathered[first:first + rows], b, out=out[first:first + rows])
    return gathered, out


def matmul_reduce_scatter(comm, a: torch.Tensor, b: torch.Tensor):
    """Rows ``[rank * m, (rank + 1) * m)`` of the sum over the ranks of ``a @ b`` (``a``:
    size * m x k, ``b``: k x n; size * m and n the same on every rank, k this rank's own),
    reduced in rank order in fp32 (float64 in float64), rounded once. Collective: the path
    taken depends on m and n, not on k (``_overlaps``)."""
    if 0 in (a.shape[0], b.shape[1]) or not _overlaps(comm):
        product = torch.matmul(a, b)
        return comm.reduce_scatter(product, precision="exact") if comm.size > 1 else product
    n = b.shape[1]
    out = a.new_empty((a.shape[0] // comm.size, n))
    dtype = _dtype(a)

    def reduce(side: _Side, slots: int, stride: int, r0: int, rows: int, stream: int) -> None:
        side.sum(dtype, slots, stride, rows * n, out[r0].data_ptr(), stream)

    _scatter(comm, "matmul_reduce_scatter", a, b, reduce)
    return out


def matmul_reduce_scatter_add_rmsnorm(comm, a: torch.Tensor, b: torch.Tensor, residual, weight: torch.Tensor,
                                      bias, eps: float):
    """``(normed, residual_out)`` of this rank's rows: ``matmul_reduce_scatter``'s sum,
    rounded to a's dtype, plus ``bias`` and ``residual``, RMS-normalized with ``weight``,
    in the arithmetic of the separate add + RMSNorm kernel (kernels/rmsnorm.cuh), each
    round's rows in its slot sum's pass (``SlotSum.add_rmsnorm``). ``residual`` (m x n, or
    None), ``weight`` and ``bias`` (n, or None): contiguous, of a's dtype (one the add +
    RMSNorm takes) and device. Collective: the path taken depends on m and n, not on k;
    without rows or columns, empty results and no collective; unoverlapped, the GEMM then
    the communicator's ``reduce_scatter_add_rmsnorm``."""
    m, n = a.shape[0] // comm.size, b.shape[1]
    if 0 in (m, n):  # nothing to sum or normalize, on every rank alike (m and n are shared)
        return a.new_empty((m, n)), a.new_empty((m, n))
    if not _overlaps(comm):
        return comm.reduce_scatter_add_rmsnorm(torch.matmul(a, b), residual, weight, eps=eps, bias=bias)
    normed, res_out = a.new_empty((m, n)), a.new_empty((m, n))
    dtype = _dtype(a)
    shared = (0 if bias is None else bias.data_ptr(), weight.data_ptr())

    def reduce(side: _Side, slots: int, stride: int, r0: int, rows: int, stream: int) -> None:
        norm = (0 if residual is None else residual[r0].data_ptr(), *shared, normed[r0].data_ptr(),
                res_out[r0].data_ptr())
        side.sum.add_rmsnorm(dtype, slots, stride, rows, n, norm, eps, stream)

    _scatter(comm, "matmul_reduce_scatter_add_rmsnorm", a, b, reduce)
    return normed, res_out


def _dtype(t: torch.Tensor) -> str:
    """ubnext's name of t's dtype (``torch.bfloat16``: ``"bfloat16"``)."""
    return str(t.dtype).removeprefix("torch.")


def _scatter(comm, name: str, a: torch.Tensor, b: torch.Tensor, reduce) -> None:
    """The rounds of the reduce-scatter side (the module docstring), in the call's section:
    each rank's products pushed into its peers' slots under the GEMMs, a barrier, then
    ``reduce(side, slots, stride, r0, rows, stream)`` of each round with rows (slot 0's
    address, the slots' stride in bytes, the round's first output row and its rows; on the
    caller's stream ``stream``), which reads the slots and writes the round's output rows."""
    size, rank = comm.size, comm.rank
    m, n = a.shape[0] // size, b.shape[1]
    with _Call(comm, name, a.get_device()) as (side, events, caller):
        area, ptrs = comm._symmetric_area(AREA_KEY, plan.AREA_BYTES, "torch")
        row = n * a.element_size()
        rounds = plan.scatter_rounds(m, row, size)
        staging = a.new_empty((2, rounds.parts[0][1], n))  # the products on their way to a peer
        stream = side.handle
        _barrier(comm, side)  # opening: every peer's reads of earlier calls are done
        opened = events.mark(stream)
        pushed = []  # an event after each push: its staging buffer is free again
        for j, (r0, rows) in enumerate(rounds.parts):
            for dst in (plan.push_order(rank, size) if rows else ()):
                first = dst * m + r0
                if dst == rank:
                    if j == 0:
                        # the own-slot GEMMs write the area: after the opening barrier, so after
                        # every rank's reads of earlier calls (a peer's all-gather pulls from
                        # this half; at 2 ranks no push wait comes before this GEMM) and this
                        # rank's own (on another caller stream, or in a graph replayed elsewhere)
                        events.wait(caller, opened)
                    own = rounds.offset(j, rank)
                    torch.matmul(a[first:first + rows], b, out=area[own:own + rows * row].view(a.dtype).view(rows, n))
                    continue
                if len(pushed) >= 2:
                    events.wait(caller, pushed[-2])
                buf = staging[len(pushed) % 2, :rows]
                torch.matmul(a[first:first + rows], b, out=buf)
                events.after(stream, caller)
                _copy(ptrs[dst] + rounds.offset(j, rank), buf.data_ptr(), rows * row, stream)
                pushed.append(events.mark(stream))
            _barrier(comm, side)
            events.after(caller, stream)  # every rank's pushes into this rank's slots are done
            if rows:  # the slots in rank order, one pass, rounded once
                reduce(side, ptrs[rank] + rounds.offset(j), rounds.slot_bytes, r0, rows, caller)
            events.after(stream, caller)  # the next round's barrier after these reads
