"""The layout of every rank's pool segment: the library slots at fixed offsets.

The same on every rank (the kernels address one offset in every segment) and fixed for
the communicator's life, so that captured CUDA graphs stay valid. The slots: a
LaunchState per kernel family state, the barrier flags and signatures of the barrier
two-shot, a set of three receive buffers per Lamport family and element width, and the
staging slot; user buffers (``Communicator.empty``) follow.
"""

from __future__ import annotations

from ._heap import SlotPlan
from ._protocol import (FLAG_PHASES, HEADER_BYTES, LAUNCH_STATE_BYTES, MAX_BLOCKS, MAX_RANKS, TWOSHOT_ALIGN_VECS,
                        VEC_BYTES)

#: the LaunchState slots of the plan: one per Lamport family and element width (the
#: sentinel's bit pattern depends on the width), one per barrier two-shot transport
STATES = tuple([f"{family}{width}.state" for width in (2, 4) for family in ("lamport", "lamport_twoshot")]
               + [f"twoshot.{transport}.state" for transport in ("unicast", "multicast")] + ["quant.state"])
#: bytes of the barrier flags and signatures of one transport (kernels/sync.cuh:
#: flag_offset, signature_offset)
FLAG_BYTES = (4 * FLAG_PHASES + 8) * MAX_BLOCKS * MAX_RANKS
#: the fused Lamport two-shot's all-gather area also holds a 16-byte scale per row: room
#: for them at the full message for rows of at least this many vectors (1 KiB)
SCALE_ROW_VECS = 64


def plan_layout(nranks: int, lamport_bytes: int, lamport_twoshot_bytes: int, staging_bytes: int,
                quant_bytes: int = 0) -> SlotPlan:
    """The library slots of every segment, identical on every rank.

    Each Lamport family has one set of 3 receive buffers and a launch state per element
    width; a set is shared by a family's unicast and multicast kernels and by its fused
    kernel (same protocol, same rotation). A one-shot buffer holds nranks slots of
    ``lamport_bytes`` and a signature header per rank; a two-shot buffer holds a
    reduce-scatter and an all-gather area of ``area(lamport_twoshot_bytes)``. The barrier
    two-shot kernels have a launch state and barrier flags per transport: the unicast
    barrier stores epochs per source rank, the multicast one counts arrivals. The
    quantized two-shot (opt-in) has a launch state, barrier flags and ``quant_bytes`` of
    receive areas of its own (``_quant.area_bytes``; 0 where the communicator did not opt in).
    """
    plan = SlotPlan()
    for name in STATES:
        plan.add(name, LAUNCH_STATE_BYTES)
    for transport in ("unicast", "multicast"):
        plan.add(f"flags.{transport}", FLAG_BYTES)
    for width in (2, 4):
        plan.add(f"lamport{width}", set_bytes("lamport", nranks, lamport_bytes))
        plan.add(f"lamport_twoshot{width}", set_bytes("lamport_twoshot", nranks, area(lamport_twoshot_bytes)))
    plan.add("flags.quant", FLAG_BYTES)
    plan.add("quant", quant_bytes)
    plan.add("staging", staging_bytes)
    return plan


def set_bytes(family: str, nranks: int, unit: int) -> int:
    """Bytes of a Lamport family's set of 3 receive buffers whose kernels take ``unit``:
    one-shot, nranks slots of ``unit`` bytes and HEADER_BYTES per rank for its signature
    header (kernels/lamport.cu); two-shot, a reduce-scatter and an all-gather area of
    ``unit`` bytes (kernels/lamport_twoshot.cu)."""
    return 3 * (nranks * (unit + HEADER_BYTES) if family == "lamport" else 2 * unit)


def set_unit(family: str, nranks: int, nbytes: int) -> int:
    """The ``unit`` of a set of ``nbytes`` (the inverse of set_bytes)."""
    return nbytes // (3 * nranks) - HEADER_BYTES if family == "lamport" else nbytes // 6


def area(max_bytes: int) -> int:
    """Bytes of a Lamport two-shot area for messages up to ``max_bytes``: the slots of the
    reduce-scatter area are whole slices of whole TWOSHOT_ALIGN_VECS-vector units, up to
    that many vectors per rank more than the message, followed by HEADER_BYTES per rank
    for its signature header, starting at a multiple of HEADER_BYTES; the all-gather area
    of the fused kernel also holds a 16-byte scale per row of at least SCALE_ROW_VECS
    vectors."""
    vecs = -(-max_bytes // VEC_BYTES)
    data = VEC_BYTES * (vecs + vecs // SCALE_ROW_VECS + TWOSHOT_ALIGN_VECS * MAX_RANKS)
    return -(-data // HEADER_BYTES) * HEADER_BYTES + MAX_RANKS * HEADER_BYTES


def twoshot_norm_rows(area_bytes: int, row_bytes: int, nranks: int) -> int:
    """Rows of ``row_bytes`` one fused Lamport two-shot launch takes with areas of
    ``area_bytes`` (kernels/lamport_twoshot.cu): every rank's slot holds ceil(rows / nranks)
    rows before the signature headers (reduce-scatter area), the all-gather area also a
    16-byte scale per row."""
    rows = min(area_bytes // (row_bytes + VEC_BYTES), (area_bytes - nranks * HEADER_BYTES) // row_bytes)
    return rows // nranks * nranks
