"""What the two expert-parallel objects do alike on the host (docs/moe.md): ``ExpertParallel``
(low-latency) and ``PackedExpertParallel`` (throughput) differ in their areas, outputs and
kernels, and share every step around them, written once here.

``MoeObject`` is their base: creation (the communicator's pool checked, the area reserved,
filled and the outputs allocated, the kernels compiled, every rank met) and, per call, the
checks of the operands, of the handle and of ``out``. A subclass names its kernels
(``SOURCES``, ``PARAMS``: the launchers' parameter types) and gives its arrays (``_specs``)
and its launchers' constant arguments (``_prefixes``).
"""

from __future__ import annotations

import math

from ubnext._engine.kernels import compile_module
from ubnext._engine.launch import Launcher
from ubnext._interop import arrays as _arrays
from ubnext._memory.heap import round_up
from ubnext._moe.layout import MOE_DTYPES
from ubnext._protocol.algorithms import DTYPES, compile_defines
from ubnext._protocol.constants import VEC_BYTES, sentinel_word
from ubnext._protocol.errors import UbnextError

#: bytes between and around an object's arrays in its buffer, and their byte at creation
GAP_BYTES, CANARY = 256, 0xA5
#: the frameworks an object's outputs may be arrays of
FRAMEWORKS = ("cupy", "torch")


class MoeObject:
    """The host steps both expert-parallel objects share (not public: its subclasses are).

    A subclass sets ``SOURCES`` (call -> (source in kernels/, entry point)) and ``PARAMS``
    (call -> the Launcher's parameter types), ``shape`` (its layout's checked shape) and
    implements ``_specs`` and ``_prefixes``.
    """

    SOURCES: dict[str, tuple[str, str]] = {}
    PARAMS: dict[str, tuple] = {}

    @staticmethod
    def _node_of(name: str, comm, framework: str):
        """The communicator's node (its pool and engine), checked: ``framework`` known, the
        communicator open, with a symmetric pool.

        Raises:
            UbnextError: otherwise (the message starts with ``name``).
        """
        if framework not in FRAMEWORKS:
            raise UbnextError(f"{name}: framework must be 'cupy' or 'torch', got {framework!r}")
        with comm._order:
            comm._check_open(name)
            node = comm._node
            if node is None:
                raise UbnextError(f"{name}: this communicator has no symmetric memory pool (it uses NCCL: "
                                  f"{comm._nccl_reason or 'no pool'})")
        return node

    def _publish(self) -> None:
        """The object's int handle (``self._handle``), given at the end of its construction:
        the ``ubnext.torch.moe`` ops name the object by it, and compiled code reads it as a
        constant."""
        from ubnext._api import handles  # the registry of the ints torch ops name objects by

        handles.assign(self)

    @property
    def size(self) -> int:
        """N, the ranks of the communicator (as a Communicator's ``size``; its handle carries it)."""
        return self.shape.nranks

    @property
    def comm(self):
        """The Communicator the object was made from."""
        return self._comm

    def _create(self, name: str, comm, node, framework: str) -> None:
        """Reserves the area of ``self.shape`` (collective), fills it, allocates the arrays,
        compiles the kernels, then meets every rank: no rank pushes into an area a peer is
        still filling. Sets ``_comm``, ``_generation``, the arrays and ``_launchers``."""
        import cupy

        shape = self.shape
        area, ptrs = comm._symmetric_area(shape.key, shape.area_bytes)  # collective
        self._comm = comm  # its calls need it open; it holds the area
        self._generation = 0
        with comm._order:
            offset = node.pool.contains(ptrs[node.pool.local_rank], shape.area_bytes)
            self._fill(name, comm, area)
            self._allocate(comm.device, framework)
            cupy.cuda.Device(comm.device).synchronize()
            self._launchers = self._compile(comm, node, shape.offsets(offset))
        comm._exchanges.run(name, comm._local.barrier)

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

    def _specs(self) -> dict[str, tuple[tuple, str]]:
        """The object's arrays in its buffer's order: key -> (dims, dtype)."""
        raise NotImplementedError

    def _allocate(self, device: int, framework: str) -> None:
        """The outputs and the combine's inputs (``_specs``), in one device buffer (``_raw``):
        each array at ``_slots[key]`` (offset, bytes), with GAP_BYTES between and around
        them, every byte CANARY at creation (the GPU tests check that the gaps keep it);
        ``_ptr`` and ``_views`` (arrays of ``framework``) by key."""
        import cupy

        specs = self._specs()
        self._slots, at = {}, GAP_BYTES
        for key, (dims, dtype) in specs.items():
            nbytes = math.prod(dims) * DTYPES[dtype][1]
            self._slots[key] = (at, nbytes)
            at = round_up(at + nbytes, GAP_BYTES) + GAP_BYTES
        self._raw = cupy.full(at, CANARY, cupy.uint8)
        self._ptr = {key: self._raw.data.ptr + offset for key, (offset, _) in self._slots.items()}
        self._views = {key: _arrays.wrap(self._ptr[key], dims, dtype, device, framework, self._raw)
                       for key, (dims, dtype) in specs.items()}

    def _prefixes(self, regions: dict) -> dict[str, tuple]:
        """Each launcher's constant arguments after the pool's (base, stride, rank, mc)."""
        raise NotImplementedError

    def _compile(self, comm, node, regions: dict) -> dict[str, Launcher]:
        """The launchers of the kernels (``SOURCES``), their constant arguments packed once;
        each kernel's launch state is the communicator's ``<source>.state``."""
        s, pool = self.shape, node.pool
        fixed = (pool.base, pool.stride, pool.local_rank, node.engine._mc_base)
        prefixes = self._prefixes(regions)
        launchers = {}
        for kind, (source, entry) in self.SOURCES.items():
            module = compile_module(source, compile_defines(s.dtype, "sum", s.nranks), comm.device)
            state = pool.local_ptr(node.engine.plan.offset(f"{source.removesuffix('.cu')}.state"))
            launchers[kind] = Launcher(module.get_function(entry), self.PARAMS[kind], fixed + prefixes[kind],
                                       (state,), node.engine.dependent)
        return launchers

    # -- a call's checks (in the launch section) --------------------------------------------
    def _operand(self, name: str, arr, what: str, shape: tuple, dtype: str, handle: int):
        """``arr`` as a Buffer on the communicator's device, of ``dtype`` and ``shape`` (None:
        any size there); a payload (x, y, out) 16-byte aligned."""
        b = self._comm._input(name, arr, handle)
        dims = tuple(b.shape)
        if b.dtype != dtype or len(dims) != len(shape) or any(w is not None and d != w for d, w in zip(dims, shape)):
            want = " x ".join("T" if w is None else str(w) for w in shape)
            raise UbnextError(f"{name}: {what} must be {dtype} of shape [{want}], got {b.dtype} of shape "
                              f"{list(dims)}")
        if dtype in MOE_DTYPES and b.ptr % VEC_BYTES:  # the rows move in 16-byte vectors
            raise UbnextError(f"{name}: {what} must be {VEC_BYTES}-byte aligned (its address is {b.ptr:#x}); "
                              f"pass a copy")
        return b

    def _dispatch_operands(self, name: str, x, topk_idx, topk_weights, handle: int, owner, side: bool):
        """The dispatch's inputs checked (T <= max_tokens), kept alive for a side stream and
        ordered after the communicator's queue: (xb, ib, wb)."""
        s, comm = self.shape, self._comm
        xb = self._operand(name, x, "x", (None, s.hidden), s.dtype, handle)
        count = xb.shape[0]
        if count > s.max_tokens:
            raise UbnextError(f"{name}: {count} tokens; the object takes at most max_tokens={s.max_tokens}")
        ib = self._operand(name, topk_idx, "topk_idx", (count, s.top_k), "int32", handle)
        wb = self._operand(name, topk_weights, "topk_weights", (count, s.top_k), "float32", handle)
        if side:
            _arrays.record_stream(handle, owner, (xb, ib, wb))
        comm._order.follow(handle, owner)
        return xb, ib, wb

    def _check_handle(self, name: str, handle, kind: type) -> None:
        """Raises unless ``handle`` is a ``kind`` of this object's latest dispatch."""
        if not isinstance(handle, kind) or handle._owner is not self or handle._generation != self._generation:
            raise UbnextError(f"{name}: the handle is not this object's latest dispatch's (a dispatch "
                              f"overwrites the buffers of the one before)")

    def _combine_operands(self, name: str, y, rows: tuple, tokens: int, out, weights, stream):
        """The combine's operands checked: y ``rows + (H,)``, out ``[tokens, H]`` (None: a new
        array, of y's framework, on the launch stream) not overlapping y, weights None or
        float32 of ``rows``; kept alive for a side stream and ordered after the
        communicator's queue: (stream handle, yb, ob, wb)."""
        s, comm = self.shape, self._comm
        stream_handle, owner, side = comm._launch_stream(name, stream, y)
        yb = self._operand(name, y, "y", rows + (s.hidden,), s.dtype, stream_handle)
        shape = (tokens, s.hidden)
        if out is None:
            ob = comm._new(name, yb, stream_handle, owner, side, shape)
        else:
            ob = self._operand(name, out, "out", shape, s.dtype, stream_handle)
            if _arrays.overlap(ob, yb):
                raise UbnextError(f"{name}: out overlaps y")
        wb = None if weights is None else self._operand(name, weights, "weights", rows, "float32", stream_handle)
        if side:
            _arrays.record_stream(stream_handle, owner, (yb, ob, wb))
        comm._order.follow(stream_handle, owner)
        return stream_handle, yb, ob, wb
