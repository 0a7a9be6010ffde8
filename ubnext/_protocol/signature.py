"""Call signatures: what a rank says it is calling, carried in band by the kernels.

Every launch carries a 64-bit signature of its call — the collective, dtype, op and
element count (the whole message's: size x k for the reduce-scatter and all-gather; for
the fused calls, rows and hidden size) — next to the data or flags the
kernels already exchange. A kernel that receives a signature other than its own fails
the communicator with ``kFailMismatch`` and both signatures, so ranks that call with
different arguments get ``CollectiveMismatchError`` instead of a result, with no host
round trip added.

Layout (bits): 63..60 collective, 59..56 dtype, 55..52 op, 51..0 count; the rooted
movers (broadcast, gather, scatter: ``encode_rooted``) carry their root in the op field, so
that ranks naming different roots mismatch; the fused call's count is ``rows << HIDDEN_BITS | hidden``; the expert-parallel calls' (``encode_moe``) is
``experts << 40 | top_k << 35 | max_tokens << 20 | hidden``, their op field the format that crosses the link
(``MOE_WIRES``), so that ranks whose formats differ mismatch.
"""

from __future__ import annotations

from ubnext._protocol.algorithms import DTYPES, OPS
from ubnext._protocol.constants import MOE_EXPERT_BITS, SIGNATURE_COUNT_BITS

#: collectives that carry a signature, in code order (code 0 is never used)
COLLECTIVES = ("all_reduce", "all_reduce_add_rmsnorm", "reduce_scatter", "all_gather", "reduce_scatter_add_rmsnorm",
               "moe_dispatch", "moe_combine", "broadcast", "all_to_all", "gather", "scatter", "send_recv",
               "moe_packed_dispatch", "moe_packed_combine")
#: the expert-parallel calls, whose count is their object's sizes (encode_moe)
_MOE = ("moe_dispatch", "moe_combine", "moe_packed_dispatch", "moe_packed_combine")
#: the expert-parallel calls' formats on the link, by their code in the op field (0: the payload's own)
MOE_WIRES = ("", "bfloat16 partials", "e4m3 rows with fp32 scales")
#: bits of the expert-parallel sizes in the count: experts, top-k, max tokens (hidden: HIDDEN_BITS)
MOE_BITS = {"experts": MOE_EXPERT_BITS, "top_k": 5, "max_tokens": 15}
#: the collectives that reduce nothing (their op field is "sum", and says nothing)
_MOVERS = ("all_gather", "broadcast", "all_to_all", "gather", "scatter", "send_recv")
#: the movers that name a root, carried in their op field (encode_rooted)
_ROOTED = ("broadcast", "gather", "scatter")
#: bits of the op field (a root must fit them)
OP_BITS = 4
#: the fused calls, whose count is rows and hidden size
_FUSED = ("all_reduce_add_rmsnorm", "reduce_scatter_add_rmsnorm")
COUNT_BITS = SIGNATURE_COUNT_BITS
HIDDEN_BITS = 20
_DTYPES = tuple(DTYPES)
_OPS = tuple(OPS)
#: (collective, dtype, op) -> the signature's bits above the count
_HEAD = {(c, d, o): (ci + 1) << 60 | di << 56 | oi << 52
         for ci, c in enumerate(COLLECTIVES) for di, d in enumerate(_DTYPES) for oi, o in enumerate(_OPS)}


def encode(collective: str, dtype: str, op: str, count: int) -> int:
    """The signature of a call of ``collective`` on ``count`` elements of ``dtype`` with ``op``.

    Raises:
        ValueError: a count that does not fit its field.
    """
    if not 0 <= count < 1 << COUNT_BITS:
        raise ValueError(f"signature: count {count} does not fit {COUNT_BITS} bits")
    return _HEAD[collective, dtype, op] | count


def encode_rooted(collective: str, dtype: str, count: int, root: int) -> int:
    """The signature of a rooted mover ``collective`` (broadcast, gather or scatter) of
    ``count`` elements of ``dtype`` from or to rank ``root``: the root in the op field.

    Raises:
        ValueError: not a rooted mover, or a count or root that does not fit its field.
    """
    if collective not in _ROOTED or not 0 <= root < 1 << OP_BITS:
        raise ValueError(f"signature: {collective} with root {root} is not a rooted mover's call")
    return encode(collective, dtype, "sum", count) & ~(((1 << OP_BITS) - 1) << COUNT_BITS) | root << COUNT_BITS


def encode_fused(dtype: str, rows: int, hidden: int, collective: str = "all_reduce_add_rmsnorm") -> int:
    """The signature of a fused ``collective`` (``all_reduce_add_rmsnorm`` or
    ``reduce_scatter_add_rmsnorm``) of ``rows`` x ``hidden`` elements."""
    if hidden >= 1 << HIDDEN_BITS or rows >= 1 << (COUNT_BITS - HIDDEN_BITS):
        raise ValueError(f"signature: {rows} x {hidden} does not fit")
    return encode(collective, dtype, "sum", rows << HIDDEN_BITS | hidden)


def encode_moe(collective: str, dtype: str, experts: int, top_k: int, max_tokens: int, hidden: int,
               wire: int = 0) -> int:
    """The signature of an expert-parallel ``collective`` (``moe_dispatch`` or
    ``moe_combine``) of an object of these sizes (``ubnext._moe.layout.Shape``), whose data
    crosses the link as ``MOE_WIRES[wire]`` (in the op field).

    Raises:
        ValueError: a size that does not fit its field (MOE_BITS, HIDDEN_BITS), an unknown wire.
    """
    sizes = {"experts": experts, "top_k": top_k, "max_tokens": max_tokens}
    if hidden >= 1 << HIDDEN_BITS or any(value >= 1 << MOE_BITS[name] for name, value in sizes.items()):
        raise ValueError(f"signature: {sizes} x hidden {hidden} does not fit")
    if not 0 <= wire < len(MOE_WIRES):
        raise ValueError(f"signature: no expert-parallel format {wire}")
    count = experts << 40 | top_k << 35 | max_tokens << HIDDEN_BITS | hidden
    return encode(collective, dtype, "sum", count) | wire << COUNT_BITS


def text(signature: int) -> str:
    """Words for a signature, e.g. ``"all_reduce of 4096 bfloat16 (sum)"``."""
    code, dtype, op = signature >> 60, signature >> 56 & 0xF, signature >> COUNT_BITS & 0xF
    count = signature & ((1 << COUNT_BITS) - 1)
    collective = COLLECTIVES[code - 1] if 1 <= code <= len(COLLECTIVES) else None
    if collective is None or dtype >= len(_DTYPES) or (op >= len(_OPS) and collective not in _ROOTED):
        return f"an unknown call (signature {signature:#018x})"
    if collective in _ROOTED:
        return f"{collective} of {count} {_DTYPES[dtype]} (root {op})"
    if collective in _MOE:
        wire = f", {MOE_WIRES[op]}" if 0 < op < len(MOE_WIRES) else ""
        return (f"{collective} of {count >> 40} experts, top-{count >> 35 & 31}, {count >> HIDDEN_BITS & 0x7FFF} "
                f"tokens of {count & ((1 << HIDDEN_BITS) - 1)} {_DTYPES[dtype]}{wire}")
    if collective in _FUSED:
        rows, hidden = count >> HIDDEN_BITS, count & ((1 << HIDDEN_BITS) - 1)
        return f"{collective} of {rows} x {hidden} {_DTYPES[dtype]}"
    if collective in _MOVERS:
        return f"{collective} of {count} {_DTYPES[dtype]}"
    return f"{collective} of {count} {_DTYPES[dtype]} ({_OPS[op]})"
