"""The c10d ops on a ubnext ``Communicator``: each c10d method signature translated once
into the communicator's calls (``Communicator.all_reduce`` ... ``barrier``), nothing
looked up per call beyond one dict.

The communicator is created at the group's first op that reaches it (a collective over
every rank of the group, as NCCL's lazy communicator), so a group costs pool memory only
from then on. Reductions are full precision (``precision="exact"``) unless the group's
options ask for a quantized format. An op the communicator does not have (yet) raises
``UbnextError`` naming it; nothing runs elsewhere instead.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from ubnext._protocol.algorithms import OPS as _KERNEL_OPS
from ubnext._protocol.errors import UbnextError

from .._gather import all_gather_any
from ._work import DONE, PendingWork, Work

__all__ = ["CommOps", "reduction"]

_R = ReduceOp.RedOpType
# c10d reduction -> ubnext op name; PREMUL_SUM is a sum of pre-scaled inputs
_REDUCE = {_R.SUM: "sum", _R.AVG: "avg", _R.MAX: "max", _R.MIN: "min", _R.PREMUL_SUM: "sum"}
if "prod" in _KERNEL_OPS:  # PRODUCT: served once the communicator reduces products (its NCCL rung)
    _REDUCE[_R.PRODUCT] = "prod"
# keyed by the enum's int: hashing and comparing pybind enums costs ~0.5 us each, per call
_BY_VALUE = {kind.value: name for kind, name in _REDUCE.items()}
_PREMUL_SUM = _R.PREMUL_SUM.value


def reduction(opts, what: str) -> tuple[str, object]:
    """The communicator's op name for ``opts.reduceOp``, and PREMUL_SUM's factor (else None).

    Raises:
        UbnextError: a reduction ubnext does not serve (PRODUCT, BAND, BOR, BXOR), named;
            a PREMUL_SUM whose factor this torch does not give to Python.
    """
    op = opts.reduceOp
    kind = op.op
    value = kind.value
    name = _BY_VALUE.get(value)
    if name is None:
        raise UbnextError(f"ProcessGroupUbnext.{what}: ReduceOp.{kind.name} is not served by ubnext "
                          f"(it reduces {', '.join(sorted(set(_REDUCE.values())))} and PREMUL_SUM); "
                          f"use a gloo or nccl group for it")
    if value != _PREMUL_SUM:
        return name, None
    factor = getattr(op, "factor", None)
    if factor is None:  # torch 2.11 has no attribute; its pickled state is (type, factor)
        state = op.__getstate__()
        factor = state[1] if len(state) > 1 else None
    if factor is None:
        raise UbnextError(f"ProcessGroupUbnext.{what}: ReduceOp.PREMUL_SUM: this torch does not give its "
                          f"factor to Python")
    return name, factor


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _copy_out(flat, outs) -> None:
    for o, part in zip(outs, flat.split([o.numel() for o in outs])):
        o.copy_(part.view(o.shape))


class CommOps:
    """The c10d op set served by one ubnext communicator (``_group`` calls these).

    Not collective itself: each op is, as in c10d. Graph-capturable: each op, once the
    communicator exists and the op ran eagerly once (as the communicator's calls).

    Args:
        make_comm: ``make_comm(device_index) -> (communicator, on_close)``, called at the
            first op; ``on_close`` (or None) runs after the communicator's close.
        rank: this rank in the group.
        precision: ``precision=`` of every all-reduce and reduce-scatter ("exact").
        where: ``where(op)`` names the rank and group in a failure of pending send/recv.
    """

    def __init__(self, make_comm, rank: int, precision: str = "exact", where=lambda op: op):
        self._make, self._rank, self._precision, self._where = make_comm, rank, precision, where
        self._comm = self._on_close = None
        self._p2p: list = []  # pending (kind, tensor, peer, work) of send/recv

    # -- the communicator, created at the first op; pending p2p ops go first --
    def comm(self, where):
        """The communicator (created on the device of ``where``, a tensor or a torch.device,
        at the first op); pending point-to-point ops are issued first."""
        comm = self._comm
        if comm is None or self._p2p:
            if self._p2p:
                self._flush()
            if self._comm is None:
                device = where if isinstance(where, torch.device) else where.device
                self._comm, self._on_close = self._make(device.index)
            comm = self._comm
        return comm

    def _method(self, comm, name: str):
        fn = getattr(comm, name, None)
        if fn is None:
            raise UbnextError(f"ProcessGroupUbnext.{name}: this ubnext Communicator has no {name}() yet; "
                              f"the op is not served (nothing ran)")
        return fn

    def close(self) -> None:
        self._release("close")

    def abort(self) -> None:
        self._release("abort")

    def _release(self, how: str) -> None:
        comm, on_close, self._comm, self._on_close = self._comm, self._on_close, None, None
        self._p2p.clear()
        try:
            if comm is not None:
                getattr(comm, how)()
        finally:
            if on_close is not None:
                on_close(how)

    @staticmethod
    def _work(result, t, opts):
        """The op's work: ``DONE`` for a blocking call (``async_op=False``: torch waits on it
        at once, on the op's own stream, where nothing is left to order), else a ``Work``
        with an event recorded after the op."""
        if not getattr(opts, "asyncOp", True):
            return DONE
        if not t.is_cuda:
            return Work(result)
        stream = torch.cuda.current_stream(t.device)
        return Work(result, stream, stream.record_event())

    # -- reductions (PREMUL_SUM: the inputs pre-scaled by its factor, then summed) --
    def allreduce(self, tensors, opts):
        name, factor = reduction(opts, "allreduce")
        comm = self.comm(tensors[0])
        for t in tensors:  # PREMUL_SUM scales a temporary: a refused call leaves t as it was
            comm.all_reduce(t if factor is None else t * factor, out=t, op=name, precision=self._precision)
        return self._work(tensors, tensors[0], opts)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        name, factor = reduction(opts, "reduce")
        t = tensors[0]
        fn = self._method(self.comm(t), "reduce")
        fn(t if factor is None else t * factor, root=opts.rootRank, op=name, out=t)
        return self._work(tensors, t, opts)

    def reduce_scatter_single(self, output, input, opts):
        name, factor = reduction(opts, "reduce_scatter")
        self.comm(input).reduce_scatter(input if factor is None else input * factor, out=output, op=name,
                                        precision=self._precision)
        return self._work([output], output, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return self._work(outputs, outputs[0], opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        for o, parts in zip(outputs, input_lists):
            self.reduce_scatter_single(o, _flat(parts), opts)
        return self._work(outputs, outputs[0], opts)

    # -- gathers and copies --
    def all_gather_single(self, output, input, opts):
        all_gather_any(self.comm(input), input, output)
        return self._work([output], output, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return self._work(outputs, outputs[0], opts)

    def allgather(self, output_lists, inputs, opts):
        comm = self.comm(inputs[0])
        for outs, x in zip(output_lists, inputs):
            if any(o.numel() != x.numel() for o in outs):
                raise UbnextError("ProcessGroupUbnext.allgather: every output must have the input's size "
                                  "(uneven all_gather is not served)")
            _copy_out(all_gather_any(comm, x.reshape(-1)), outs)
        return self._work(output_lists, inputs[0], opts)

    def allgather_coalesced(self, output_lists, inputs, opts):
        # output_lists[r][i]: rank r's inputs[i]
        return self.allgather([[outs[i] for outs in output_lists] for i in range(len(inputs))], inputs, opts)

    def broadcast(self, tensors, opts):
        comm = self.comm(tensors[0])
        fn = self._method(comm, "broadcast")
        for t in tensors:
            fn(t, root=opts.rootRank, out=t)
        return self._work(tensors, tensors[0], opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        comm = self.comm(input)
        self._method(comm, "all_to_all")(input, out=output, in_splits=list(input_splits) or None,
                                         out_splits=list(output_splits) or None)
        return self._work([output], output, opts)

    def alltoall(self, outputs, inputs, opts):
        comm = self.comm(inputs[0])
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype, device=outputs[0].device)
        self._method(comm, "all_to_all")(_flat(inputs), out=flat_out, in_splits=[i.numel() for i in inputs],
                                         out_splits=[o.numel() for o in outputs])
        _copy_out(flat_out, outputs)
        return self._work(outputs, outputs[0], opts)

    def gather(self, output_lists, inputs, opts):
        x, root = inputs[0], opts.rootRank
        comm = self.comm(x)
        fn = self._method(comm, "gather")
        if self._rank != root:
            fn(x, root=root)
            return self._work([], x, opts)
        outs = output_lists[0]
        stacked = torch.empty((len(outs), *x.shape), dtype=x.dtype, device=x.device)
        fn(x, root=root, out=stacked)
        for o, part in zip(outs, stacked):
            o.copy_(part)
        return self._work(output_lists, x, opts)

    def scatter(self, outputs, input_lists, opts):
        out, root = outputs[0], opts.rootRank
        comm = self.comm(out)
        fn = self._method(comm, "scatter")
        # the root's parts stacked (size, *out.shape); elsewhere out stands for the input
        fn(torch.stack(input_lists[0]) if self._rank == root else out, root=root, out=out)
        return self._work(outputs, out, opts)

    def barrier(self, opts, device):
        self._method(self.comm(device), "barrier")()
        if device.type != "cuda":
            return Work([])
        return Work([], torch.cuda.current_stream(device), None, blocking=True)

    # -- point to point: pending until a wait or the next other op (see PendingWork) --
    def send(self, tensors, peer: int, tag: int):
        return self._pend("send", tensors, peer)

    def recv(self, tensors, peer: int, tag: int):
        return self._pend("recv", tensors, peer)

    def _pend(self, kind: str, tensors, peer: int):
        work = PendingWork(tensors, self._flush)
        self._p2p.append((kind, tensors[0], peer, work))
        return work

    def _flush(self):
        ops, self._p2p = self._p2p, []
        if not ops:
            return None
        t = ops[0][1]
        try:
            comm = self.comm(t)
            if len(ops) == 1:
                kind, x, peer, _ = ops[0]
                self._method(comm, kind)(x, peer)
            else:
                self._method(comm, "batch_isend_irecv")([(kind, x, peer) for kind, x, peer, _ in ops])
        except Exception as exc:
            exc.add_note(self._where("/".join(dict.fromkeys(kind for kind, *_ in ops))))
            for *_, work in ops:  # each work of the batch fails with it (none says it finished)
                work.mark_failed(exc)
            raise
        stream = torch.cuda.current_stream(t.device) if t.is_cuda else None
        for *_, work in ops:
            work.mark_issued(stream)
        return stream
