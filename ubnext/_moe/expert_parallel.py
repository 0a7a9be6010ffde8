"""The expert-parallel object: dispatch and combine in the low-latency mode (docs/moe.md).

``ExpertParallel(comm, ...)`` reserves its area in the communicator's pool
(``Communicator._symmetric_area``; ``layout`` gives its regions), fills the polled regions
with the sentinel, allocates its outputs once and compiles its two kernels
(kernels/moe_dispatch.cu, kernels/moe_combine.cu) at creation, so that nothing compiles,
allocates or reads the device at a call: a call checks its arguments on the host, then
issues one launch on the caller's stream, capturable in a CUDA graph. The launch states of
the two kernels are the communicator's (``heap.STATES``: ``moe_dispatch.state``,
``moe_combine.state``), so their failures are raised as every kernel's are.
"""

from __future__ import annotations

from dataclasses import dataclass

from ubnext._engine.launch import I32, U64
from ubnext._interop import arrays as _arrays
from ubnext._moe import layout as _layout
from ubnext._moe.base import MoeObject
from ubnext._protocol import signature as _signature
from ubnext._protocol.constants import THREADS
from ubnext._protocol.errors import UbnextError

#: the kernels, by call: (source in kernels/, entry point), each compiled per dtype and rank count
SOURCES = {"dispatch": ("moe_dispatch.cu", "ub_moe_dispatch"), "combine": ("moe_combine.cu", "ub_moe_combine")}
#: base, stride, rank, mc, then the regions and sizes (10 and 9), the call's (13 and 8), the state
_PARAMS = {"dispatch": (U64, U64, I32) + (U64,) * 25, "combine": (U64, U64, I32) + (U64,) * 19}
#: the dispatch's outputs, in the entry point's order (scales: an FP8 dispatch's, else 0)
_DISPATCH_OUT = ("recv_x", "scales", "counts", "src", "weights", "route", "tokens", "dest")


@dataclass(frozen=True)
class Handle:
    """What ``combine`` needs of a ``dispatch``: valid until the object's next dispatch.

    Attributes:
        src: ``[L, C]`` int32, ``source_rank * max_tokens + token`` of each row of recv_x.
        weights: ``[L, C]`` float32, each row's router weight (-0.0 as +0.0).
        tokens: T of this rank's dispatch (the combine's output rows).
    """

    src: object
    weights: object
    tokens: int
    _owner: object
    _generation: int


class ExpertParallel(MoeObject):
    """Expert-parallel dispatch and combine of a mixture-of-experts layer over the GPUs of
    one node, low-latency mode (docs/moe.md): fixed buffers sized by ``max_tokens``, no
    host synchronization, static shapes.

    Collective: yes: every rank creates it with the same arguments at the same point of its
    program. Blocks the host (it fills its area and waits for every rank).
    Graph-capturable: no (it allocates and compiles); its calls are.

    Args:
        comm: the Communicator (one node, with a symmetric pool).
        num_experts: E, experts in all, a multiple of the ranks; rank r holds experts
            ``r * E / N`` to ``(r + 1) * E / N - 1``.
        hidden: H, elements of a token row; H times the element bytes a multiple of 16.
        max_tokens: M, the most tokens a rank dispatches per call.
        top_k: K, experts per token (1..16).
        dtype: ``"bfloat16"`` or ``"float32"``: the payload of x, recv_x, y and out.
        capacity: C, rows per local expert of ``recv_x`` (default N x M: no token is ever
            lost; more tokens for one expert fail the call, see ``dispatch``).
        framework: ``"cupy"`` or ``"torch"``: the type of the outputs.
        partials: the default of ``combine``'s ``partials``: ``"float32"``, or
            ``"bfloat16"`` (a bfloat16 payload only: half the bytes on the link, a second
            rounding; docs/moe.md, "Numerics").
        fp8: the dispatch quantizes each row to e4m3 codes with one fp32 scale per 128
            channels (DeepEP's format; a bfloat16 payload whose hidden is a multiple of
            512; sm_89 and up) and returns ``(codes, scales)`` in place of ``recv_x``.

    Raises:
        UbnextError: a size out of range, no symmetric pool (NCCL only, several nodes), the
            pool too small for the area (docs/moe.md gives its size), a closed or broken
            communicator.
    """

    SOURCES, PARAMS = SOURCES, _PARAMS

    def __init__(self, comm, num_experts: int, hidden: int, max_tokens: int, top_k: int, dtype: str = "bfloat16",
                 capacity: int | None = None, framework: str = "cupy", partials: str = "float32", fp8: bool = False):
        import cupy

        name = "ExpertParallel"
        node = self._node_of(name, comm, framework)
        self.shape = _layout.shape(node.pool.local_size, num_experts, hidden, max_tokens, top_k, dtype, capacity,
                                   fp8)
        arch = int(cupy.cuda.Device(comm.device).compute_capability)
        if fp8 and arch < 89:
            raise UbnextError(f"{name}: fp8 needs compute capability 8.9 or higher (e4m3 conversions), "
                              f"this GPU has {arch // 10}.{arch % 10}")
        self._partials = self._partials_of(name, partials)
        self._create(name, comm, node, framework)
        sms = cupy.cuda.Device(comm.device).attributes["MultiProcessorCount"]
        self._blocks = max(1, min(node.engine._blocks, sms))  # every block resident (docs/moe.md)
        self._sig = {kind: _signature.encode_moe(f"moe_{kind}", dtype, num_experts, top_k, max_tokens, hidden,
                                                 wire=_layout.FP8_WIRE if fp8 and kind == "dispatch" else 0)
                     for kind in SOURCES}
        self._sig["combine", "bfloat16"] = _signature.encode_moe("moe_combine", dtype, num_experts, top_k, max_tokens,
                                                                 hidden, wire=_layout.PARTIALS["bfloat16"])
        self._publish()

    def _specs(self) -> dict[str, tuple[tuple, str]]:
        s = self.shape
        n, lo, c, m, k = s.nranks, s.local_experts, s.capacity, s.max_tokens, s.top_k
        specs = {"recv_x": ((lo, c, s.hidden), "uint8" if s.fp8 else s.dtype), "counts": ((lo,), "int32"),
                 "src": ((lo, c), "int32"), "weights": ((lo, c), "float32"), "route": ((n, m, k), "int32"),
                 "tokens": ((n,), "uint32"), "dest": ((m,), "uint32")}
        if s.fp8:
            specs["scales"] = ((lo, c, s.hidden // _layout.FP8_GROUP), "float32")
        return specs

    def _allocate(self, device: int, framework: str) -> None:
        """``MoeObject._allocate``; with fp8 and torch, recv_x viewed as float8_e4m3fn."""
        super()._allocate(device, framework)
        if self.shape.fp8 and framework == "torch":  # CuPy has no e4m3 dtype: its codes stay uint8
            import torch

            self._views["recv_x"] = self._views["recv_x"].view(torch.float8_e4m3fn)

    def _prefixes(self, regions: dict) -> dict[str, tuple]:
        s = self.shape
        sizes = (s.num_experts, s.local_experts, s.top_k, s.hidden, s.max_tokens, s.capacity)
        return {"dispatch": (regions["rotation"], regions["dispatch_headers"], regions["records"], regions["rows"])
                + sizes, "combine": (regions["rotation"], regions["combine_headers"], regions["partials"]) + sizes}

    # -- calls ------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, stream=None):
        """Sends each token to the GPUs of its experts and lays them out per local expert.

        Collective: yes: every rank calls it (T may differ, and be 0), in the same order
        among this object's calls. Never blocks the host.
        Graph-capturable: yes (fixed shapes and addresses; the kernel advances its own
        state).

        Args:
            x: ``[T, H]`` of the object's dtype, T <= max_tokens (torch, CuPy, DLPack).
            topk_idx: ``[T, K]`` int32: each token's experts, -1 for a dropped slot.
            topk_weights: ``[T, K]`` float32: the router's weight of each slot.
            stream: the stream to launch on, as ``Communicator.all_reduce`` takes it.

        Returns:
            ``(recv_x, recv_counts, handle)``: ``recv_x`` ``[L, C, H]``, row j of expert e
            the j-th token routed to local expert e by (source rank, token index); rows
            from ``recv_counts[e]`` on are not written; with ``fp8``, the pair ``(codes
            [L, C, H] float8_e4m3fn (uint8 for CuPy), scales [L, C, H / 128] float32)``,
            a row's value ``codes * scale`` per group of 128 channels; ``recv_counts``
            ``[L]`` int32 on the device; ``handle`` (``Handle``) for ``combine``. The
            arrays are the object's own: the next dispatch overwrites them.

        Raises:
            UbnextError: before any launch: shapes, dtypes, device, T > max_tokens, a
                closed or broken communicator.
            RoutingError (at the next call of the communicator, on this rank, and
                BrokenCommunicatorError on the others): an expert id below -1 or at
                least E, one expert twice in a token's top-k, more than C tokens for one
                local expert; nothing was written out of bounds.
        """
        name = "ExpertParallel.dispatch"
        s, comm = self.shape, self._comm
        with comm._order:
            comm._check_open(name)
            handle, owner, side = comm._launch_stream(name, stream, x)
            xb, ib, wb = self._dispatch_operands(name, x, topk_idx, topk_weights, handle, owner, side)
            count, a = xb.shape[0], self._ptr
            self._launchers["dispatch"](self._blocks, THREADS["moe_dispatch.cu"], handle, xb.ptr, ib.ptr, wb.ptr,
                                        count, *(a.get(key, 0) for key in _DISPATCH_OUT), self._sig["dispatch"])
            self._generation += 1
            v = self._views
            recv = (v["recv_x"], v["scales"]) if s.fp8 else v["recv_x"]
            return recv, v["counts"], Handle(v["src"], v["weights"], count, self, self._generation)

    def combine(self, y, handle: Handle, out=None, weights=None, stream=None, partials: str | None = None):
        """Sums each token's experts' outputs with its router weights, in its original order.

        ``out[t] = round(sum over GPUs g in rank order (sum over the token's slots k on g,
        in top-k order, of w_k * y_k))``, every product and sum in fp32 from +0.0, rounded
        once to the dtype (docs/moe.md, "Numerics"); ``w_k`` is the dispatch's weight of
        the row, or the row's entry of ``weights``. With bfloat16 partials, each GPU's
        inner sum is rounded to bfloat16 before it crosses the link (a second rounding).

        Collective: yes, as ``dispatch``. Never blocks the host.
        Graph-capturable: yes.

        Args:
            y: ``[L, C, H]`` of the object's dtype: the experts' outputs, row for row as
                the dispatch's ``recv_x`` (it may be ``recv_x`` itself).
            handle: the latest dispatch's handle.
            out: ``[T, H]`` of the dtype (T of that dispatch), or None for a new array (of
                y's framework, on the launch stream).
            weights: None (the router's, ``handle.weights``), or ``[L, C]`` float32: a
                weight per row of y in their place (ones: the plain sum of the rows, the
                dispatch's transpose).
            stream: as ``dispatch``.
            partials: None (the object's, ``ExpertParallel(..., partials=)``),
                ``"float32"`` or ``"bfloat16"`` (a bfloat16 payload only): the format of
                each GPU's partial on the link. Every rank passes the same (a difference
                fails the call: ``CollectiveMismatchError``).

        Returns:
            ``out``.

        Raises:
            UbnextError: before any launch: shapes, dtypes, device, a handle of another
                object or of an earlier dispatch, an unknown ``partials`` or bfloat16
                partials of a float32 payload, a closed or broken communicator.
        """
        name = "ExpertParallel.combine"
        s, comm = self.shape, self._comm
        with comm._order:
            comm._check_open(name)
            half = self._partials_of(name, self._partials if partials is None else partials) == "bfloat16"
            self._check_handle(name, handle, Handle)
            stream_handle, yb, ob, wb = self._combine_operands(name, y, (s.local_experts, s.capacity), handle.tokens,
                                                               out, weights, stream)
            a = self._ptr
            self._launchers["combine"](self._blocks, THREADS["moe_combine.cu"], stream_handle, yb.ptr,
                                       a["weights"] if wb is None else wb.ptr,
                                       *(a[key] for key in ("route", "tokens", "dest")),
                                       ob.ptr, int(half), self._sig["combine", "bfloat16"] if half
                                       else self._sig["combine"])
            if out is not None:
                _arrays.mark_written((ob,))
            return ob.obj

    def _partials_of(self, name: str, partials) -> str:
        """``partials`` checked: a key of ``layout.PARTIALS``, bfloat16 for a bfloat16 payload only."""
        if partials not in _layout.PARTIALS:
            raise UbnextError(f"{name}: partials must be one of {', '.join(_layout.PARTIALS)}, got {partials!r}")
        if partials == "bfloat16" and self.shape.dtype != "bfloat16":
            raise UbnextError(f"{name}: bfloat16 partials take a bfloat16 payload, not {self.shape.dtype}")
        return partials
