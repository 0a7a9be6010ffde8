"""The throughput-mode expert-parallel object: dispatch into a packed layout with per-expert
offsets, and its combine (docs/moe.md, "Throughput mode").

``PackedExpertParallel(comm, ...)`` reserves its area in the communicator's pool
(``Communicator._symmetric_area``; ``packed_layout`` gives its regions), fills its headers
with the sentinel, allocates its outputs once and compiles its two kernels
(kernels/moe_packed_dispatch.cu, kernels/moe_packed_combine.cu) at creation. A call checks
its arguments on the host, then issues one launch on the caller's stream; only
``dispatch(..., sync=True)`` then reads the row count on the host. It is a sibling of the
low-latency ``ExpertParallel``, not a mode of it: its area (one set, headers first, bulk
flags), its outputs (``[R, H]`` and offsets, not ``[L, C, H]`` and counts) and the shapes
its combine takes differ, and it shares that object's host steps (``base.MoeObject``: creation,
the checks of a call) and its kernels' headers (kernels/moe.cuh). Its launch states are the
communicator's (``heap.STATES``: ``moe_packed_dispatch.state``, ``moe_packed_combine.state``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ubnext._engine.launch import I32, U64
from ubnext._interop import arrays as _arrays
from ubnext._interop.streams import CUDA
from ubnext._moe import packed_layout as _layout
from ubnext._moe.base import MoeObject
from ubnext._protocol import signature as _signature
from ubnext._protocol.constants import THREADS
from ubnext._protocol.errors import UbnextError

#: the kernels, by call: (source in kernels/, entry point), each compiled per dtype and rank count
SOURCES = {"dispatch": ("moe_packed_dispatch.cu", "ub_moe_packed_dispatch"),
           "combine": ("moe_packed_combine.cu", "ub_moe_packed_combine")}
#: base, stride, rank, then mc, the regions, sizes and senders (13 and 10), the call's (13 and 7), the state
_PARAMS = {"dispatch": (U64, U64, I32) + (U64,) * 27, "combine": (U64, U64, I32) + (U64,) * 18}
#: the dispatch's sender blocks: a third of its grid (at least 1) sends the rows while the rest
#: lays them out as they arrive (kernels/moe_packed_dispatch.cu); the split to tune by
#: bench/moe_perf.py --mode packed
SENDER_SHARE = 3
#: the object's arrays, in its buffer's order: what the dispatch returns, then its scratch
OUTPUTS = ("recv_x", "offsets", "src", "weights", "route", "tokens", "dest", "counts")


@dataclass(frozen=True)
class PackedHandle:
    """What ``combine`` needs of a packed ``dispatch``: valid until the object's next dispatch.

    Attributes:
        offsets: ``[L + 1]`` int32 on the device: local expert e's rows are
            ``offsets[e]:offsets[e + 1]`` of recv_x; ``offsets[L]`` the rows in all.
        src: ``[R]`` (or ``[rows]``) int32, ``source_rank * max_tokens + token`` of each row.
        weights: ``[R]`` (or ``[rows]``) float32, each row's router weight (-0.0 as +0.0).
        tokens: T of this rank's dispatch (the combine's output rows).
        rows: the rows in all, where the dispatch read them (``sync=True``), else None.
    """

    offsets: object
    src: object
    weights: object
    tokens: int
    rows: int | None
    _owner: object
    _generation: int


class PackedExpertParallel(MoeObject):
    """Expert-parallel dispatch and combine of a mixture-of-experts layer over the GPUs of one
    node, throughput mode (docs/moe.md, "Throughput mode"): thousands of tokens per rank,
    bandwidth-bound kernels, a packed layout with per-expert offsets.

    Collective: yes: every rank creates it with the same arguments (``max_rows`` may
    differ) at the same point of its program. Blocks the host (it fills its area and waits
    for every rank).
    Graph-capturable: no (it allocates and compiles); its calls are, but for
    ``dispatch(..., sync=True)``.

    Args:
        comm: the Communicator (one node, with a symmetric pool).
        num_experts: E, experts in all, a multiple of the ranks; rank r holds experts
            ``r * E / N`` to ``(r + 1) * E / N - 1``.
        hidden: H, elements of a token row; H times the element bytes a multiple of 16.
        max_tokens: M, the most tokens a rank dispatches per call.
        top_k: K, experts per token (1..16).
        dtype: ``"bfloat16"`` or ``"float32"``: the payload of x, recv_x, y and out.
        max_rows: R, rows of the packed output, a bound on the rows this rank receives
            per call (default N x M x min(K, L): no token is ever lost; more rows fail the
            call, see ``dispatch``).
        framework: ``"cupy"`` or ``"torch"``: the type of the outputs.

    Raises:
        UbnextError: a size out of range, no symmetric pool (NCCL only, several nodes), the
            pool too small for the area (docs/moe.md gives its size), a closed or broken
            communicator.
    """

    SOURCES, PARAMS = SOURCES, _PARAMS

    def __init__(self, comm, num_experts: int, hidden: int, max_tokens: int, top_k: int, dtype: str = "bfloat16",
                 max_rows: int | None = None, framework: str = "cupy"):
        import cupy

        name = _layout.NAME
        node = self._node_of(name, comm, framework)
        self.shape = _layout.shape(node.pool.local_size, num_experts, hidden, max_tokens, top_k, dtype, max_rows)
        sms = cupy.cuda.Device(comm.device).attributes["MultiProcessorCount"]
        self._blocks = max(2, min(node.engine._blocks, sms))  # every block resident: the grid barriers
        self._senders = max(1, self._blocks // SENDER_SHARE)  # and at least one receiver
        self._create(name, comm, node, framework)
        self._sig = {kind: _signature.encode_moe(f"moe_packed_{kind}", dtype, num_experts, top_k, max_tokens, hidden)
                     for kind in SOURCES}
        self._rows_host = cupy.cuda.alloc_pinned_memory(4)  # sync=True's read of offsets[L]

        self._publish()

    def _specs(self) -> dict[str, tuple[tuple, str]]:
        s = self.shape
        n, lo, r, m, k = s.nranks, s.local_experts, s.max_rows, s.max_tokens, s.top_k
        return dict(zip(OUTPUTS, (((r, s.hidden), s.dtype), ((lo + 1,), "int32"), ((r,), "int32"), ((r,), "float32"),
                                  ((n, m, k), "int32"), ((n,), "uint32"), ((m,), "uint32"), ((lo,), "uint32"))))

    def _prefixes(self, regions: dict) -> dict[str, tuple]:
        s = self.shape
        sizes = (s.num_experts, s.local_experts, s.top_k, s.hidden, s.max_tokens, s.max_rows)
        dispatch = (regions["dispatch_headers"], regions["progress"], regions["records"], regions["data"])
        return {"dispatch": (regions["rotation"],) + dispatch + sizes + (self._senders,),
                "combine": (regions["rotation"], regions["combine_headers"], regions["data"]) + sizes}

    # -- calls ------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, stream=None, sync: bool = False):
        """Sends each token to the GPUs of its experts and lays the rows out packed, expert
        after expert, each expert's rows by (source rank, token index).

        Collective: yes: every rank calls it (T may differ, and be 0), in the same order
        among this object's calls. ``sync=False`` never blocks the host; ``sync=True``
        waits for the launch stream and reads the row count.
        Graph-capturable: yes with ``sync=False`` (fixed shapes and addresses); no with
        ``sync=True`` (it raises under capture).

        Args:
            x: ``[T, H]`` of the object's dtype, T <= max_tokens (torch, CuPy, DLPack).
            topk_idx: ``[T, K]`` int32: each token's experts, -1 for a dropped slot.
            topk_weights: ``[T, K]`` float32: the router's weight of each slot.
            stream: the stream to launch on, as ``Communicator.all_reduce`` takes it.
            sync: False: ``recv_x`` is ``[R, H]`` (rows from ``offsets[L]`` on not
                written), a static shape; True: ``recv_x``, ``src`` and ``weights`` are
                cut to the rows received (``offsets[L]``, read on the host).

        Returns:
            ``(recv_x, offsets, handle)``: ``recv_x`` ``[R, H]`` or ``[rows, H]``, local
            expert e's rows ``offsets[e]:offsets[e + 1]``; ``offsets`` ``[L + 1]`` int32 on
            the device; ``handle`` (``PackedHandle``) for ``combine``. The arrays are the
            object's own: the next dispatch overwrites them.

        Raises:
            UbnextError: before any launch: shapes, dtypes, device, T > max_tokens,
                ``sync=True`` under capture, a closed or broken communicator.
            RoutingError (at the next call of the communicator, on this rank, or at once
                with ``sync=True``; BrokenCommunicatorError on the others): an expert id
                below -1 or at least E, one expert twice in a token's top-k, more than R
                rows received; nothing was written out of bounds.
        """
        name = "PackedExpertParallel.dispatch"
        comm = self._comm
        with comm._order:
            comm._check_open(name)
            handle, owner, side = comm._launch_stream(name, stream, x)
            if sync and CUDA.capture(handle):
                raise UbnextError(f"{name}: sync=True reads the row count on the host, which a CUDA graph cannot "
                                  f"capture; use sync=False (recv_x of max_rows rows)")
            xb, ib, wb = self._dispatch_operands(name, x, topk_idx, topk_weights, handle, owner, side)
            count = xb.shape[0]
            self._launchers["dispatch"](self._blocks, THREADS["moe_packed_dispatch.cu"], handle, xb.ptr, ib.ptr,
                                        wb.ptr, count, *(self._ptr[key] for key in OUTPUTS), self._sig["dispatch"])
            self._generation += 1
            v, rows = self._views, self._read_rows(name, handle) if sync else None
            cut = (lambda a: a) if rows is None else (lambda a: a[:rows])
            return cut(v["recv_x"]), v["offsets"], PackedHandle(v["offsets"], cut(v["src"]), cut(v["weights"]),
                                                                count, rows, self, self._generation)

    def _read_rows(self, name: str, handle: int) -> int:
        """``offsets[L]`` read on the host after the launch stream: the rows received; raises
        what the kernels recorded (a routing error) first."""
        import cupy
        import numpy as np

        at = self._ptr["offsets"] + 4 * self.shape.local_experts
        cupy.cuda.runtime.memcpyAsync(self._rows_host.ptr, at, 4, cupy.cuda.runtime.memcpyDeviceToHost, handle)
        cupy.cuda.runtime.streamSynchronize(handle)
        self._comm._check_failures(name)
        return int(np.frombuffer(self._rows_host, np.int32, 1)[0])

    def combine(self, y, handle: PackedHandle, out=None, weights=None, stream=None):
        """Sums each token's experts' outputs with its router weights, in its original order.

        ``out[t] = round(sum over GPUs g in rank order (sum over the token's slots k on g,
        in top-k order, of w_k * y_k))``, every product and sum in fp32 from +0.0, rounded
        once to the dtype (docs/moe.md, "Numerics": the low-latency mode's arithmetic).

        Collective: yes, as ``dispatch``. Never blocks the host.
        Graph-capturable: yes.

        Args:
            y: ``[R, H]``, or ``[rows, H]`` after a ``sync=True`` dispatch, of the object's
                dtype: the experts' outputs, row for row as the dispatch's ``recv_x`` (it
                may be ``recv_x`` itself).
            handle: the latest dispatch's handle.
            out: ``[T, H]`` of the dtype (T of that dispatch), or None for a new array (of
                y's framework, on the launch stream).
            weights: None (the router's, ``handle.weights``), or float32 of y's rows: a
                weight per row of y in their place (ones: the plain sum of the rows).
            stream: as ``dispatch``.

        Returns:
            ``out``.

        Raises:
            UbnextError: before any launch: shapes, dtypes, device, a handle of another
                object or of an earlier dispatch, a closed or broken communicator.
        """
        name = "PackedExpertParallel.combine"
        s, comm = self.shape, self._comm
        with comm._order:
            comm._check_open(name)
            self._check_handle(name, handle, PackedHandle)
            rows = s.max_rows if handle.rows is None else handle.rows
            stream_handle, yb, ob, wb = self._combine_operands(name, y, (rows,), handle.tokens, out, weights, stream)
            a = self._ptr
            self._launchers["combine"](self._blocks, THREADS["moe_packed_combine.cu"], stream_handle, yb.ptr,
                                       a["weights"] if wb is None else wb.ptr,
                                       *(a[key] for key in ("route", "tokens", "dest")), ob.ptr, self._sig["combine"])
            if out is not None:
                _arrays.mark_written((ob,))
            return ob.obj

