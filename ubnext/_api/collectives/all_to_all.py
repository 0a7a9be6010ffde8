"""``all_to_all``: every rank's rows cut into one part per rank, part j to rank j, the
parts received stacked in rank order (``torch.distributed.all_to_all_single``'s layout
along dim 0), with even splits, uneven splits given as host lists, or uneven splits in
device arrays. Runs on NCCL: grouped sends and receives (CuPy's binding has no
``ncclAlltoAll``), or, with even splits, on the pool's copy form or low-latency kernel
(``pool_copy``), or, with uneven splits, on the pool's point-to-point kernel (``p2p``:
one message per pair; device splits read and checked by the kernel, no host sync).

Splits count rows (elements along dim 0): rank i's ``in_splits[j]`` rows go to rank j,
which takes them as its ``out_splits[i]``; so rank i's ``in_splits[j]`` must equal rank
j's ``out_splits[i]``. Rank i's part for rank j starts at row ``sum(in_splits[:j])`` of
x; what it receives from rank j lands at row ``sum(out_splits[:j])`` of out.

On the pool's point-to-point kernel, a call repeated with the same x, out, splits (host
lists of the same counts, or the same device arrays, whose counts the kernel reads each
time), algorithm and stream launches the plan its first call made (``ubnext._api.plans``;
key: ``all_to_all_key``).
"""

from __future__ import annotations

import numbers

from ubnext._api.collectives.p2p import P2P
from ubnext._api.collectives.pool_copy import AREA_BYTES, PoolCopy, all_to_all_plan
from ubnext._interop import arrays as _arrays
from ubnext._interop.streams import CUDA
from ubnext._protocol.algorithms import DTYPES
from ubnext._protocol import signature as _signature
from ubnext._protocol.errors import UbnextError

#: the dtypes of device split arrays
SPLIT_DTYPES = ("int32", "int64")
_D2H = 2  # cudaMemcpyDeviceToHost


class AllToAll(PoolCopy, P2P):
    """The Communicator's ``all_to_all`` (module docstring)."""

    def all_to_all(self, x, out=None, in_splits=None, out_splits=None, stream=None, algorithm: str = "auto"):
        """Sends part j of this rank's rows to rank j and stacks the parts received, in rank
        order; bit for bit, never blocks the host but with device splits on NCCL.

        The layout of ``torch.distributed.all_to_all_single`` along dim 0 (the module
        docstring): a row is ``x[i]`` (x.shape[1:] elements); with no splits every rank
        sends x.shape[0] / size rows to each rank.

        Splits: None (even), host lists of ``size`` row counts, or device arrays (int32 or
        int64, ``size`` elements, torch or CuPy or any CUDA array) that a previous kernel
        wrote, as mixture-of-experts layers hold them. With device splits ``out`` is
        required and sized by the caller (the rows received may not fill it: the rest is
        left untouched). On NCCL the counts are checked against every rank's before
        anything moves: a count past x's or out's rows, or two ranks that disagree on a
        pair, raises the same UbnextError on every rank, and nothing is written. On the
        pool's kernel (``"ll"``) the kernel checks them as it moves, without a host sync:
        nothing is written out of bounds nor into a part whose counts disagree, and the
        rank that found it raises SplitError after the call (at its next call or
        ``synchronize()``), the others BrokenCommunicatorError (the communicator fails, as
        on a timeout).

        Runs on NCCL: one group of ``ncclSend``/``ncclRecv`` calls (logged once); or, with
        no splits given, on the pool's copy form (each rank copies part j into its slot of
        rank j's area, then its slots out, barriers between), which ``auto`` takes where
        NCCL cannot run; with even splits ``auto`` takes, at each size (x's bytes), the
        algorithm of the selector table's all_to_all rows where the machine has them
        (``python -m ubnext.tune --movers``); or, with splits, on the pool's point-to-point
        kernel (``"ll"``, which ``auto`` takes where NCCL cannot run: each rank pushes its
        part for rank j through the pair's slots of rank j, a header with the part's bytes
        first, which rank j checks against its own count; any size: in LL lines below 64
        KiB, in flagged chunks moved by several blocks per pair from there). NCCL needs
        the counts on the host: with device splits this call synchronizes the host with
        ``stream`` (a device-to-host copy of the splits, then a wait) and exchanges them
        over the bootstrap; that form blocks the host and cannot be captured in a CUDA
        graph. Host lists are checked against the other ranks' only in debug mode
        (``UBNEXT_DEBUG=1``): elsewhere ranks that disagree leave NCCL waiting.

        Collective: yes: every rank calls it, in the same order, with the same dtype and
        row length.
        Graph-capturable: yes with even splits or host lists, after a first eager call
        (which sets NCCL up, collectively); with device splits on the pool's kernel only
        (NCCL's form reads them on the host).

        Args:
            x: CUDA array as ``all_reduce`` takes it (any dtype of ``ubnext.DTYPES``), at
                least 1-D.
            out: where to write (x's dtype and row length, apart from x); default: a new
                array of x's framework of shape (rows received, *x.shape[1:]) (with host
                or no splits only).
            in_splits: rows of x for each rank, in rank order: None (x.shape[0] / size
                each), a list of ints summing to x.shape[0], or a device array (the rows
                from row 0 on; their sum may be less than x.shape[0]).
            out_splits: rows received from each rank, in rank order: None (out's rows /
                size each, x.shape[0] / size where out is not given), a list of ints
                (summing to out's rows where out is given), or a device array (their sum
                at most out's rows). Host and device splits are not mixed.
            stream: as for ``all_reduce``.
            algorithm: ``"auto"``, ``"ll"`` (the low-latency kernels: with no splits
                ``ll_move``, parts of at most ``LL_MAX_BYTES``, 64 KiB; with splits the
                point-to-point kernel, any size), ``"copy"`` (the pool's copy form; no
                splits) or ``"nccl"``.

        Returns:
            ``out`` (x's framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: bad arguments (splits of another length, negative, not summing to
                the rows, a row count that the world size does not divide where a split is
                even, an out of another dtype or row length or overlapping x, device splits
                without out, overlapping out or mixed with host ones or, on NCCL, inside a CUDA graph
                capture), or NCCL cannot run here (ranks sharing a GPU) where it is named,
                raised before anything is launched; on NCCL, device split counts that do
                not fit or agree, raised on every rank before anything moves; an error NCCL
                reports; a closed communicator. BrokenCommunicatorError and its kinds, as
                ``all_reduce`` raises them (SplitError: device split counts the pool's
                kernel found wrong; CollectiveMismatchError: host lists that disagree
                there).
        """
        name = "all_to_all"
        even = in_splits is None and out_splits is None
        algo = self._mover(name, algorithm, even=even) if even or algorithm == "copy" else \
            "p2p" if self._p2p_algorithm(name, algorithm, 2 * self.size) == "ll" else "nccl"
        with self._order:
            self._check_open(name)
            handle, owner, side = self._launch_stream(name, stream, x)
            key = None if algo != "p2p" or self._node is None else \
                all_to_all_key(x, out, in_splits, out_splits, algorithm, handle, side)
            planned, key = self._planned(key, handle, owner, side, (x, out, in_splits, out_splits))
            if planned:
                return out
            xb = self._input(name, x, handle)
            if not xb.shape:
                raise UbnextError(f"{name}: x is 0-d; its rows (dim 0) are what is split")
            algo = self._sized(name, algo, xb.nbytes, xb.dtype)
            rows = int(xb.shape[0])
            row = 1
            for d in xb.shape[1:]:
                row *= int(d)
            row_bytes = row * DTYPES[xb.dtype][1]  # from the dtype: a rank with no rows may receive some
            on_device = [s is not None and not _is_host_list(s) for s in (in_splits, out_splits)]
            if any(on_device):
                if not all(on_device):
                    raise UbnextError(f"{name}: give both splits as device arrays, or both as host lists (or None)")
                if out is None:
                    raise UbnextError(f"{name}: device splits need an out sized by the caller (the rows received "
                                      f"are known on the device only)")
                ob, out_rows = self._rows_out(name, xb, row, out, handle)
                ins, outs = (self._split_buffer(name, s, what, handle, ob)
                             for s, what in ((in_splits, "in_splits"), (out_splits, "out_splits")))
                if algo == "p2p":  # the kernel reads and checks the counts: no host sync
                    self._record(handle, owner, side, (xb, ob, ins, outs))
                    launch = self._run_alltoallv(xb, ob, rows, out_rows, row_bytes, ins, outs, handle, owner)
                    self._keep(key, launch, (xb, ob, ins, outs), (1,))
                    _arrays.mark_written((ob,))
                    return ob.obj
                ins, outs = (self._read(name, b, handle) for b in (ins, outs))
                self._agree(name, ins, outs, rows, out_rows, exact=False)
            else:
                ins = _host(name, in_splits, "in_splits", rows, self.size)
                ob, out_rows = (None, None) if out is None else self._rows_out(name, xb, row, out, handle)
                outs = _host(name, out_splits, "out_splits",
                             rows if out_rows is None and out_splits is None else out_rows, self.size)
                out_rows = sum(outs) if out_rows is None else out_rows
                if self.config.debug:
                    self._agree(name, ins, outs, rows, out_rows, exact=True)
                if ob is None:
                    ob = self._new(name, xb, handle, owner, side, (out_rows, *xb.shape[1:]))
            self._record(handle, owner, side, (xb, ob))
            if algo in ("copy", "ll"):
                if ob.count != xb.count:
                    raise UbnextError(f"{name}: algorithm {algo!r} takes an out of x's {xb.count} elements (even "
                                      f"splits both ways), not {ob.count}")
                sig = _signature.encode(name, xb.dtype, "sum", xb.count)
                if not xb.count:
                    pass
                elif algo == "ll":
                    self._run_ll(name, xb.ptr, ob.ptr, ins[0] * row_bytes, sig, handle, owner)
                else:
                    plan = all_to_all_plan(self.rank, self._copy_area(), xb.ptr, ob.ptr, ins[0] * row_bytes,
                                           AREA_BYTES // 2)
                    self._run_copies(name, plan, sig, handle, owner)
            elif algo == "p2p":  # one message per pair, empty ones included (their headers check the counts)
                items = [("send", ptr, n, r) for ptr, n, r in _parts(xb.ptr, ins, row_bytes, every=True)]
                items += [("recv", ptr, n, r) for ptr, n, r in _parts(ob.ptr, outs, row_bytes, every=True)]
                self._keep(key, self._run_p2p(name, items, handle, owner), (xb, ob, None, None), (1,))
            else:
                sends, recvs = _parts(xb.ptr, ins, row_bytes), _parts(ob.ptr, outs, row_bytes)
                if sends or recvs:
                    self._dispatch.nccl_for(handle, owner).exchange(sends, recvs, handle, name)
            if out is not None:
                _arrays.mark_written((ob,))
            return ob.obj

    def _rows_out(self, name: str, xb, row: int, out, handle: int) -> tuple:
        """``out`` checked (x's dtype and device, whole rows of x's length, apart from x)
        as a Buffer, and its rows."""
        ob = self._on_device(name, _arrays.as_buffer(out, name, handle), "out")
        if ob.dtype != xb.dtype:
            raise UbnextError(f"{name}: out is {ob.dtype}, x is {xb.dtype}; they must match")
        if row and ob.count % row:
            raise UbnextError(f"{name}: out has {ob.count} elements, not whole rows of x's {row}")
        if _arrays.overlap(ob, xb):
            raise UbnextError(f"{name}: out overlaps x; an all-to-all needs separate arrays")
        return ob, ob.count // row if row else (int(ob.shape[0]) if ob.shape else 0)

    def _split_buffer(self, name: str, splits, what: str, handle: int, ob):
        """Device ``splits`` as a Buffer, checked: on this device, ``size`` int32 or int64,
        apart from ``ob`` (the kernel reads the counts while other blocks write out)."""
        b = self._on_device(name, _arrays.as_buffer(splits, name, handle), what)
        if b.dtype not in SPLIT_DTYPES or b.count != self.size:
            raise UbnextError(f"{name}: {what} must hold {self.size} {' or '.join(SPLIT_DTYPES)} elements (one per "
                              f"rank), got {b.count} {b.dtype}")
        if _arrays.overlap(b, ob):
            raise UbnextError(f"{name}: {what} overlaps out; the counts are read while out is written, so they "
                              f"need memory of their own")
        return b

    def _read(self, name: str, b, handle: int) -> list:
        """Device splits (a Buffer) as a host list of ints, read after the work queued on
        ``handle`` (a device-to-host copy there, then the host waits for it)."""
        import numpy as np
        from cupy.cuda import runtime

        if CUDA.capture(handle):
            raise UbnextError(f"{name}: device splits are read on the host (NCCL needs the counts there), which a "
                              f"CUDA graph capture cannot take; capture with host lists, or call it eagerly")
        host = np.empty(b.count, dtype=b.dtype)
        runtime.memcpyAsync(host.ctypes.data, b.ptr, b.nbytes, _D2H, handle)
        runtime.streamSynchronize(handle)
        return [int(v) for v in host]

    def _agree(self, name: str, ins: list, outs: list, rows: int, out_rows: int, exact: bool) -> None:
        """Every rank's splits gathered (over the bootstrap: collective, blocks the host) and
        checked alike on every rank: non-negative, within (``exact``: summing to) the rows of
        x and out, rank i's ``in_splits[j]`` equal to rank j's ``out_splits[i]``. Raises the
        same UbnextError on every rank."""
        views = self._exchanges.run(name, self.bootstrap.allgather_obj, (ins, outs, rows, out_rows))
        problem = _disagreement(views, exact)
        if problem:
            raise UbnextError(f"{name}: {problem}; nothing was moved")


def all_to_all_key(x, out, in_splits, out_splits, algorithm: str, stream: int, side: bool) -> tuple | None:
    """The plan key (``ubnext._api.plans``) of an all-to-all with splits on the pool's
    point-to-point kernel (one launch) on the launch stream ``stream`` (``side``: another
    than the current one), or None where it is never planned: no ``out`` (one is
    allocated), splits other than two host lists of plain ints or two device arrays, arrays
    that ``_arrays.identity`` does not name. Device splits are named by their arrays: the
    kernel reads their counts at every launch."""
    identity = _arrays.identity
    xi, oi = identity(x), identity(out)
    if xi is None or oi is None:
        return None
    if _is_host_list(in_splits) and _is_host_list(out_splits):
        if any(type(s) is not int for s in (*in_splits, *out_splits)):
            return None
        splits = "host", tuple(in_splits), tuple(out_splits)
    else:
        ii, io = identity(in_splits), identity(out_splits)
        if ii is None or io is None:
            return None
        splits = "device", ii, io
    return "all_to_all", xi, oi, splits, algorithm, stream, side


def _is_host_list(splits) -> bool:
    """Whether ``splits`` are given on the host: a list or a plain tuple (not an array)."""
    return isinstance(splits, list) or type(splits) is tuple


def _host(name: str, splits, what: str, rows: int | None, size: int) -> list:
    """Host ``splits`` (None: ``rows`` / size each) checked: ``size`` non-negative ints
    summing to ``rows`` (None: any sum)."""
    if splits is None:
        if rows % size:
            raise UbnextError(f"{name}: {rows} rows, which {size} ranks do not divide; give {what}")
        return [rows // size] * size
    if len(splits) != size or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0
                                  for s in splits):
        raise UbnextError(f"{name}: {what} must be {size} non-negative ints (one per rank), got {list(splits)!r}")
    if rows is not None and sum(splits) != rows:
        raise UbnextError(f"{name}: {what} sum to {sum(splits)} rows, but the array has {rows}")
    return [int(s) for s in splits]


def _parts(ptr: int, splits: list, row_bytes: int, every: bool = False) -> list:
    """``(address, bytes, rank)`` of each rank's nonempty part (``every``: each rank's part)
    of the array at ``ptr``."""
    parts, start = [], 0
    for rank, n in enumerate(splits):
        if n or every:
            parts.append((ptr + start * row_bytes, n * row_bytes, rank))
        start += n
    return parts


def _disagreement(views: list, exact: bool) -> str | None:
    """What is wrong with every rank's ``(in_splits, out_splits, x rows, out rows)``, or None."""
    for i, (ins, outs, rows, out_rows) in enumerate(views):
        for what, splits, bound in (("in_splits", ins, rows), ("out_splits", outs, out_rows)):
            if any(s < 0 for s in splits):
                return f"rank {i}'s {what} {splits} hold a negative count"
            if sum(splits) > bound or (exact and sum(splits) != bound):
                return f"rank {i}'s {what} {splits} sum to {sum(splits)} rows, {'not' if exact else 'past'} its {bound}"
    for i, (ins, *_) in enumerate(views):
        for j, view in enumerate(views):
            if ins[j] != view[1][i]:
                return f"rank {i} sends {ins[j]} rows to rank {j}, which expects {view[1][i]}"
    return None
