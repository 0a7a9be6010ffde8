"""Call plans: the validated launch of an eager all-reduce or fused all-reduce + add +
RMSNorm (and of the point-to-point kernel's calls: ``send_recv.p2p_key``), kept for the
next call with the same arguments (a call's host time goes mostly
to validating its arrays and packing its arguments, not to the launch).

The first call with a key runs the full path: it validates, resolves the algorithm and
launches. Where that was one kernel launch, the communicator keeps a :class:`Plan`: the
launch with its argument pack written once (``_launch.Packed``). A later call with the
same key (``all_reduce_key``, ``add_rmsnorm_key``: everything the validation and the
launch read, the collective's name first, so that the two never share a key) checks
that the communicator is open and not broken, enters the launch order, records its
tensors on a side stream, and launches the plan. Everything else takes the full path
every time: an output to allocate, arrays of other frameworks (viewing them orders their
producer's stream), NCCL, launches in chunks or through the staging slot, the
quantized all-reduce, the fused call's separate add + RMSNorm kernel and an ``eps`` other
than a float > 0, empty arrays, and debug mode (which compares the ranks' calls).

The key holds what may differ between calls; everything else the full path reads is
fixed for the communicator's life: its configuration (frozen; debug mode plans nothing),
the selector's tables, the pool, the engine's launchers (one per kernel, never
replaced) and launch shapes, and the checks are pure functions of the key (``_resolve``
caches them too). What can change, whether the communicator is open and whether a kernel recorded a
failure, is checked on every call as before; the plans are dropped on ``close``,
``abort`` and when a failure is seen. Plans hold addresses and the communicator's own
launchers, never the caller's arrays.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from ubnext._engine.launch import Packed
from ubnext._interop import arrays as _arrays

#: plans a communicator keeps (the oldest is dropped for a new one). A loop that cycles
#: through more keys than this misses every time, paying the key and a new plan on top of
#: the full path: 256 takes a call per row-parallel layer of the largest tensor-parallel
#: models (2 x 126 layers) without dropping any
MAX_PLANS = 256


class Plan(NamedTuple):
    """What a planned call does besides the communicator's checks and the launch order.

    Attributes:
        launch: its one kernel launch, all arguments packed.
        buffers: the Buffers of the call's arrays but for their first field (``obj``, the
            array), None for an array not given, in the order the call passes them to
            ``_arrays.record_stream`` on a side stream: ``Buffer(x, *buffers[0])`` is x's.
        written: the places, in that order, of the torch tensors the launch writes (the
            caller's outputs), whose versions a planned call increments as the full path
            does (``_arrays.mark_written``).
    """

    launch: Packed
    buffers: tuple
    written: tuple = ()


def all_reduce_key(x, out, op, algorithm, precision, stream: int, side: bool) -> tuple | None:
    """The plan key of ``all_reduce(x, out=out, op=op, algorithm=algorithm, precision=precision)``
    on the launch stream ``stream`` (``side``: another than the current one), or None where
    the call is never planned (no ``out``: one is allocated; arrays that ``_arrays.identity``
    does not name). Whether ``out`` is ``x`` is a field of its own."""
    if out is None:
        return None
    xi = _arrays.identity(x)
    oi = True if out is x else _arrays.identity(out)
    if xi is None or oi is None:
        return None
    return "all_reduce", xi, oi, op, algorithm, precision, stream, side


def add_rmsnorm_key(x, residual, weight, bias, out, residual_out, eps, algorithm, stream: int,
                    side: bool) -> tuple | None:
    """The plan key of ``all_reduce_add_rmsnorm(x, residual, weight, eps, bias, out,
    residual_out, algorithm)`` on the launch stream ``stream`` (``side`` as for
    ``all_reduce_key``), or None where the call is never planned: no ``out`` or no
    ``residual_out`` (allocated), an ``eps`` other than a float > 0 (the launch packs it as
    float32: -0.0 equals 0.0 but packs other bits, and other types convert on the full
    path), arrays that ``_arrays.identity`` does not name. A residual or bias not given is
    None; whether ``residual_out`` is ``residual`` (in place) is a field of its own."""
    if out is None or residual_out is None or type(eps) is not float or not eps > 0:
        return None
    identity = _arrays.identity
    xi, wi, oi = identity(x), identity(weight), identity(out)
    ri = None if residual is None else identity(residual)
    bi = None if bias is None else identity(bias)
    roi = True if residual_out is residual else identity(residual_out)
    if (xi is None or wi is None or oi is None or roi is None or (ri is None and residual is not None)
            or (bi is None and bias is not None)):
        return None
    return "all_reduce_add_rmsnorm", xi, ri, wi, bi, oi, roi, eps, algorithm, stream, side


class Plans:
    """At most ``capacity`` plans by key, the oldest dropped first. Lookups (``get``) take
    no lock, one dict read under the GIL; changes take one, so calls from several
    threads may look up, add and clear at once."""

    def __init__(self, capacity: int = MAX_PLANS):
        self._plans: dict[tuple, Plan] = {}
        self._capacity = capacity
        self._lock = threading.Lock()
        self.get = self._plans.get  # the dict is never replaced, only cleared

    def put(self, key: tuple, plan: Plan) -> None:
        with self._lock:
            if key not in self._plans and len(self._plans) >= self._capacity:
                del self._plans[next(iter(self._plans))]  # insertion order: the oldest
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
