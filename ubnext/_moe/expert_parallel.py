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

import math
from dataclasses import dataclass

from ubnext._engine.kernels import compile_module
from ubnext._engine.launch import I32, U64, Launcher
from ubnext._interop import arrays as _arrays
from ubnext._memory.heap import round_up
from ubnext._moe import layout as _layout
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import DTYPES, compile_defines
from ubnext._protocol.constants import THREADS, VEC_BYTES, sentinel_word
from ubnext._protocol.errors import UbnextError

#: the kernels, by call: (source in kernels/, entry point), each compiled per dtype and rank count
SOURCES = {"dispatch": ("moe_dispatch.cu", "ub_moe_dispatch"), "combine": ("moe_combine.cu", "ub_moe_combine")}
#: base, stride, rank, mc, then the regions and sizes (10 and 9), the call's (13 and 8), the state
_PARAMS = {"dispatch": (U64, U64, I32) + (U64,) * 25, "combine": (U64, U64, I32) + (U64,) * 19}
#: the dispatch's outputs, in the entry point's order (scales: an FP8 dispatch's, else 0)
_DISPATCH_OUT = ("recv_x", "scales", "counts", "src", "weights", "route", "tokens", "dest")
#: bytes between and around the object's arrays in its buffer, and their byte at creation
GAP_BYTES, CANARY = 256, 0xA5


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


class ExpertParallel:
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

    #: extra (name, value) definitions of the dispatch kernel's compilation: none here;
    #: bench/moe_phases.py's subclasses set its timing variants (kernels/moe_dispatch.cu:
    #: UB_MOE_PHASES, UB_MOE_FENCES)
    _dispatch_defines: tuple[tuple[str, str], ...] = ()

    def __init__(self, comm, num_experts: int, hidden: int, max_tokens: int, top_k: int, dtype: str = "bfloat16",
                 capacity: int | None = None, framework: str = "cupy", partials: str = "float32", fp8: bool = False):
        import cupy

        name = "ExpertParallel"
        if framework not in ("cupy", "torch"):
            raise UbnextError(f"{name}: framework must be 'cupy' or 'torch', got {framework!r}")
        with comm._order:
            comm._check_open(name)
            node = comm._node
            if node is None:
                raise UbnextError(f"{name}: this communicator has no symmetric memory pool (it uses NCCL: "
                                  f"{comm._nccl_reason or 'no pool'})")
        shape = self.shape = _layout.shape(node.pool.local_size, num_experts, hidden, max_tokens, top_k, dtype,
                                           capacity, fp8)
        arch = int(cupy.cuda.Device(comm.device).compute_capability)
        if fp8 and arch < 89:
            raise UbnextError(f"{name}: fp8 needs compute capability 8.9 or higher (e4m3 conversions), "
                              f"this GPU has {arch // 10}.{arch % 10}")
        self._partials = self._partials_of(name, partials)
        area, ptrs = comm._symmetric_area(shape.key, shape.area_bytes)  # collective
        self._comm = comm  # its calls need it open; it holds the area
        self._generation = 0
        with comm._order:
            offset = node.pool.contains(ptrs[node.pool.local_rank], shape.area_bytes)
            regions = shape.offsets(offset)
            self._fill(name, comm, area)
            self._allocate(comm.device, framework)
            cupy.cuda.Device(comm.device).synchronize()
            self._launchers = self._compile(comm, node, regions)
        comm._exchanges.run(name, comm._local.barrier)  # no rank pushes into an area a peer is still filling
        sms = cupy.cuda.Device(comm.device).attributes["MultiProcessorCount"]
        self._blocks = max(1, min(node.engine._blocks, sms))  # every block resident (docs/moe.md)
        self._sig = {kind: _signature.encode_moe(f"moe_{kind}", dtype, num_experts, top_k, max_tokens, hidden,
                                                 wire=_layout.FP8_WIRE if fp8 and kind == "dispatch" else 0)
                     for kind in SOURCES}
        self._sig["combine", "bfloat16"] = _signature.encode_moe("moe_combine", dtype, num_experts, top_k, max_tokens,
                                                                 hidden, wire=_layout.PARTIALS["bfloat16"])

        from ubnext._api import handles  # the registry of the ints torch ops name objects by

        handles.assign(self)  # self._handle, from construction: compiled code reads it as a constant

    @property
    def size(self) -> int:
        """N, the ranks of the communicator (as a Communicator's ``size``; its handle carries it)."""
        return self.shape.nranks

    @property
    def comm(self):
        """The Communicator the object was made from."""
        return self._comm

    def _allocate(self, device: int, framework: str) -> None:
        """The outputs and the combine's inputs, in one device buffer (``_raw``): each array
        at ``_slots[key]`` (offset, bytes), with GAP_BYTES between and around them, every
        byte CANARY at creation (the GPU tests check that the gaps keep it)."""
        import cupy

        s = self.shape
        n, lo, c, m, k = s.nranks, s.local_experts, s.capacity, s.max_tokens, s.top_k
        specs = {"recv_x": ((lo, c, s.hidden), "uint8" if s.fp8 else s.dtype), "counts": ((lo,), "int32"),
                 "src": ((lo, c), "int32"), "weights": ((lo, c), "float32"), "route": ((n, m, k), "int32"),
                 "tokens": ((n,), "uint32"), "dest": ((m,), "uint32")}
        if s.fp8:
            specs["scales"] = ((lo, c, s.hidden // _layout.FP8_GROUP), "float32")
        self._slots, at = {}, GAP_BYTES
        for key, (dims, dtype) in specs.items():
            nbytes = math.prod(dims) * DTYPES[dtype][1]
            self._slots[key] = (at, nbytes)
            at = round_up(at + nbytes, GAP_BYTES) + GAP_BYTES
        self._raw = cupy.full(at, CANARY, cupy.uint8)
        base = self._raw.data.ptr
        self._ptr = {key: base + offset for key, (offset, _) in self._slots.items()}
        self._views = {key: _arrays.wrap(self._ptr[key], dims, dtype, device, framework, self._raw)
                       for key, (dims, dtype) in specs.items()}
        if s.fp8 and framework == "torch":  # CuPy has no e4m3 dtype: its codes stay uint8
            import torch

            self._views["recv_x"] = self._views["recv_x"].view(torch.float8_e4m3fn)

    def _fill(self, name: str, comm, area) -> None:
        """The polled regions to the sentinel, the rest (the rotation, the rows) to zero:
        after every rank's earlier launches (a device wait and a barrier: an area with this
        key may have served an object before). The barrier is a host exchange of ``name``,
        which ``abort()`` abandons."""
        import cupy

        cupy.cuda.Device(comm.device).synchronize()
        comm._exchanges.run(name, comm._local.barrier)
        words = area.view(cupy.uint32)
        words.fill(0)
        at = 0
        for region, nbytes in self.shape.region_bytes().items():
            if region in self.shape.polled:
                words[at // 4:(at + nbytes) // 4].fill(cupy.uint32(sentinel_word(4)))
            at += nbytes

    def _compile(self, comm, node, regions: dict) -> dict[str, Launcher]:
        """The launchers of both kernels, their constant arguments packed once."""
        s, pool = self.shape, node.pool
        sizes = (s.num_experts, s.local_experts, s.top_k, s.hidden, s.max_tokens, s.capacity)
        fixed = (pool.base, pool.stride, pool.local_rank, node.engine._mc_base, regions["rotation"])
        prefixes = {"dispatch": fixed + (regions["dispatch_headers"], regions["records"], regions["rows"]) + sizes,
                    "combine": fixed + (regions["combine_headers"], regions["partials"]) + sizes}
        launchers = {}
        for kind, (source, entry) in SOURCES.items():
            defines = compile_defines(s.dtype, "sum", s.nranks)
            if kind == "dispatch":
                defines.update(self._dispatch_defines)
            module = compile_module(source, defines, comm.device)
            state = pool.local_ptr(node.engine.plan.offset(f"moe_{kind}.state"))
            launchers[kind] = Launcher(module.get_function(entry), _PARAMS[kind], prefixes[kind], (state,),
                                       node.engine.dependent)
        return launchers

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
            xb = self._operand(name, x, "x", (None, s.hidden), s.dtype, handle)
            count = xb.shape[0]
            if count > s.max_tokens:
                raise UbnextError(f"{name}: {count} tokens; the object takes at most max_tokens={s.max_tokens}")
            ib = self._operand(name, topk_idx, "topk_idx", (count, s.top_k), "int32", handle)
            wb = self._operand(name, topk_weights, "topk_weights", (count, s.top_k), "float32", handle)
            if side:
                _arrays.record_stream(handle, owner, (xb, ib, wb))
            a = self._ptr
            comm._order.follow(handle, owner)
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
            if not isinstance(handle, Handle) or handle._owner is not self or handle._generation != self._generation:
                raise UbnextError(f"{name}: the handle is not this object's latest dispatch's (a dispatch "
                                  f"overwrites the buffers of the one before)")
            stream_handle, owner, side = comm._launch_stream(name, stream, y)
            yb = self._operand(name, y, "y", (s.local_experts, s.capacity, s.hidden), s.dtype, stream_handle)
            shape = (handle.tokens, s.hidden)
            if out is None:
                ob = comm._new(name, yb, stream_handle, owner, side, shape)
            else:
                ob = self._operand(name, out, "out", shape, s.dtype, stream_handle)
                if _arrays.overlap(ob, yb):
                    raise UbnextError(f"{name}: out overlaps y")
            a = self._ptr
            wb = None
            if weights is not None:
                wb = self._operand(name, weights, "weights", (s.local_experts, s.capacity), "float32", stream_handle)
            if side:
                _arrays.record_stream(stream_handle, owner, (yb, ob, wb))
            comm._order.follow(stream_handle, owner)
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

    def _operand(self, name: str, arr, what: str, shape: tuple, dtype: str, handle: int):
        """``arr`` as a Buffer on the communicator's device, of ``dtype`` and ``shape`` (None:
        any size there); a payload (x, y, out) 16-byte aligned."""
        b = self._comm._input(name, arr, handle)
        dims = tuple(b.shape)
        if b.dtype != dtype or len(dims) != len(shape) or any(w is not None and d != w for d, w in zip(dims, shape)):
            want = " x ".join("T" if w is None else str(w) for w in shape)
            raise UbnextError(f"{name}: {what} must be {dtype} of shape [{want}], got {b.dtype} of shape "
                              f"{list(dims)}")
        if dtype in _layout.MOE_DTYPES and b.ptr % VEC_BYTES:  # the rows move in 16-byte vectors
            raise UbnextError(f"{name}: {what} must be {VEC_BYTES}-byte aligned (its address is {b.ptr:#x}); "
                              f"pass a copy")
        return b
