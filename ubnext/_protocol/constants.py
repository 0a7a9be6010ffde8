"""Constants of the protocol between the host and the kernels, defined here once.

The kernels see them through one generated header, ``protocol.h`` (:func:`header`):
``_kernels.source`` expands ``#include "protocol.h"`` into it, and CMakeLists.txt writes
it into its build tree by running this file as a script (which is why it imports
nothing of ubnext). The host reads the same names from this module. No kernel source
spells one of these values itself, so nothing is kept in sync by hand.
"""

from __future__ import annotations

#: ranks of one node the kernels serve
MAX_RANKS = 8
#: blocks per launch that have barrier flags of their own
MAX_BLOCKS = 256
#: bytes of the vectors the kernels move; arrays aligned to it take the direct path
VEC_BYTES = 16
#: the Lamport sentinel per element width in bytes: the bits of -0.0
SENTINEL_BITS = {2: 0x8000, 4: 0x80000000}
#: phases of the barrier flags: entry and exit
FLAG_PHASES = 2
#: Lamport two-shot slices and block parts are whole multiples of this many vectors, so
#: that a warp's 512-byte access covers whole 128-byte lines
TWOSHOT_ALIGN_VECS = 32
#: bytes of room for each rank's Lamport call-signature header (a vector): a 128-byte line
#: of its own, so that the ranks' header stores never share a line
HEADER_BYTES = 128
#: threads of a row group (kernels/rmsnorm.cuh) and of the separate add + RMSNorm kernel
NORM_THREADS = 1024
#: threads per block of the slot sum (kernels/slot_sum.cu: the overlapped reduce-scatter's reduction)
SLOT_SUM_THREADS = 512
#: threads per block of each kernel source's plain entry points (their launch bound)
THREADS = {"lamport.cu": 256, "lamport_twoshot.cu": 512, "twoshot.cu": 512, "quant_twoshot.cu": 512,
           "moe_dispatch.cu": 512, "moe_combine.cu": 512, "ll_move.cu": 512, "p2p.cu": 512,
           "moe_packed_dispatch.cu": 512, "moe_packed_combine.cu": 512}
#: the largest top-k of the expert-parallel dispatch (a routing record's ids and weights)
MOE_MAX_TOPK = 16
#: bits of the expert count in an expert-parallel call's signature (signature.MOE_BITS): the
#: experts, and so the local ones (the packed dispatch's offsets in shared memory), below 2 ** 12
MOE_EXPERT_BITS = 12
#: the largest capacity (rows per local expert) of the expert-parallel dispatch: its
#: scatter lists a part's rows in shared memory (kernels/moe_dispatch.cu), 4 bytes each
MOE_MAX_CAPACITY = 8192
#: a dispatch's route of a token's slot (kernels/moe.cuh), besides a row ``e * C + row`` of
#: this GPU: its expert is on another GPU (or the slot is dropped); past the capacity
MOE_ROUTE_ELSEWHERE, MOE_ROUTE_OVERFLOW = -1, -2
#: channels per fp32 scale of the expert-parallel FP8 dispatch (DeepEP's format; e4m3 codes
#: quantized as the quantized two-shot's, kernels/quant.cuh)
MOE_FP8_GROUP = 128
#: the low-latency data movers (kernels/ll_move.cu): the largest part one rank sends one
#: peer in one launch (an all-to-all's part, a broadcast's message); each 8 bytes travel
#: in a 16-byte line with the launch's flag
LL_MAX_BYTES = 64 << 10
#: entries (sends and receives) of one point-to-point launch (kernels/p2p.cu: its work is
#: two 64-bit words per entry, a kernel parameter)
P2P_MAX_ENTRIES = 32
#: the point-to-point kernel's bulk form (kernels/p2p.cu): a message of at least
#: P2P_BULK_MIN_BYTES moves in chunks of P2P_BULK_CHUNK bytes (16-byte vectors, one flag
#: line per chunk) through P2P_BULK_DEPTH chunk slots per source rank in the receiver's
#: area, up to P2P_BULK_BLOCKS blocks per pair and direction; smaller ones in LL lines
P2P_BULK_MIN_BYTES = 64 << 10
P2P_BULK_CHUNK = 32 << 10
P2P_BULK_DEPTH = 16
P2P_BULK_BLOCKS = 8
#: bits of a call signature's count field (ubnext/_protocol/signature.py), below its
#: collective, dtype and op fields
SIGNATURE_COUNT_BITS = 52
#: elements per group of the quantized two-shot (one fp32 scale each; ubnext/_protocol/quant.py)
QUANT_GROUP = 32
#: groups per unit of the quantized two-shot: what one warp quantizes at a time, stored as
#: one record of its codes then its fp32 scales (kernels/quant.cuh); 32, so that the scales
#: fill one 128-byte line, one per lane of the warp that stores them
QUANT_UNIT_GROUPS = 32
#: ErrorRecord.peer of a counting wait, which waits for no rank in particular
ANY_PEER = 0xFFFFFFFF

#: where a kernel waited: code -> (name in the kernels, words for the host's message)
WAIT_SITES = {
    1: ("kSiteLamportPoll", "Lamport poll"),
    2: ("kSiteEntryBarrier", "two-shot entry barrier"),
    3: ("kSiteExitBarrier", "two-shot exit barrier"),
    4: ("kSiteClusterMail", "row sum of a thread-block cluster"),
    5: ("kSiteMoePoll", "expert-parallel poll"),
    6: ("kSiteLinePoll", "low-latency line poll"),
    7: ("kSiteP2PCredit", "point-to-point credit (the receiver freeing a buffer of the pair)"),
}

#: how a communicator failed: code -> (name in the kernels, words for the host's message)
FAIL_KINDS = {
    1: ("kFailTimeout", "a wait timed out"),
    2: ("kFailMismatch", "the ranks called different collectives"),
    3: ("kFailConcurrent", "two launches of the communicator overlapped"),
    4: ("kFailPeer", "another rank failed first"),
    5: ("kFailAborted", "the communicator was aborted"),
    6: ("kFailInput", "a call's input was invalid where only the device could see it"),
}

#: what a kFailInput of the expert-parallel kernels found (ErrorRecord.site): code -> (name
#: in the kernels, words for the host's message)
MOE_INPUT_ERRORS = {
    1: ("kMoeBadExpert", "an expert id out of range"),
    2: ("kMoeRepeatedExpert", "one expert twice in a token's top-k"),
    3: ("kMoeOverCapacity", "more tokens for one local expert than its capacity"),
    4: ("kMoeOverRows", "more rows than the packed layout's max_rows"),
}
#: what a kFailInput of the all-to-all with device splits found (kernels/p2p.cu; codes
#: apart from MOE_INPUT_ERRORS'): code -> (name in the kernels, words for the host's message)
SPLIT_INPUT_ERRORS = {
    17: ("kSplitBadIn", "in_splits with a negative count or summing past x's rows"),
    18: ("kSplitBadOut", "out_splits with a negative count or summing past out's rows"),
    19: ("kSplitDisagree", "a count of rows from a rank other than its out_splits expect"),
}

#: Per rank and kernel family, in the rank's own segment: (type, field, meaning). Every
#: block reads it at entry; the last block to finish advances it. Once the communicator
#: failed (``broken``), the family's waits give up and its outputs are poison.
LAUNCH_STATE = (
    ("u32", "epoch", "launches completed"),
    ("u32", "blocks", "blocks of the running launches that started (high 16 bits) and finished (low 16 bits)"),
    ("u32", "prev_vecs", "vectors moved by the previous launch (Lamport: what to re-poison)"),
    ("u32", "slot", "Lamport: the receive buffer (0, 1, 2) of the next launch"),
    ("u32", "broken", "0, or (FailKind << 8) | (rank + 1) of the rank that failed; set by the kernels "
                      "of this rank and by the host of any rank"),
    ("u32", "claim", "0 until a thread of this rank claimed the family's ErrorRecord (atomic)"),
    ("u64", "record", "device address of the family's ErrorRecord (set by the host)"),
    ("u64", "tripped", "device address of the word that any completed ErrorRecord sets (set by the host)"),
    ("u64", "timeout_ns", "bound on every wait of the family (set by the host)"),
    ("u64", "entered_ns", "global timer (ns) when block 0 of the latest launch entered, before its "
                          "grid-dependency wait (written there only; read by the host)"),
)
#: One per LaunchState, in host-mapped pinned memory, written by the thread that claimed
#: it: (type, field, meaning). ``flag`` is written last.
ERROR_RECORD = (
    ("u32", "flag", "0: no error; 1: the record is complete"),
    ("u32", "kind", "a FailKind"),
    ("u32", "rank", "the rank that recorded it"),
    ("u32", "peer", "the rank waited for (ANY_PEER: a counting wait); kFailPeer: the rank that failed"),
    ("u32", "site", "a WaitSite; kFailPeer: the FailKind of the rank that failed; kFailInput: what was wrong"),
    ("u32", "epoch", "launch epoch of the recording kernel"),
    ("u64", "mine", "kFailMismatch: this rank's call signature; kFailInput: where (a token, an expert)"),
    ("u64", "theirs", "kFailMismatch: the peer's call signature; kFailInput: the value found"),
)

_TYPE_BYTES = {"u32": 4, "u64": 8}


def _layout(fields) -> tuple[dict[str, int], int]:
    """Offsets of ``fields`` and the struct's size, naturally aligned as the compiler lays
    them out."""
    offsets, size, align = {}, 0, 1
    for ctype, field, _ in fields:
        width = _TYPE_BYTES[ctype]
        offsets[field] = -(-size // width) * width
        size = offsets[field] + width
        align = max(align, width)
    return offsets, -(-size // align) * align


def struct_bytes(fields) -> int:
    """Size of a struct of ``fields``."""
    return _layout(fields)[1]


def field_offset(fields, name: str) -> int:
    """Byte offset of field ``name`` in a struct of ``fields``."""
    return _layout(fields)[0][name]


#: bytes of one LaunchState
LAUNCH_STATE_BYTES = struct_bytes(LAUNCH_STATE)



def sentinel_word(width: int) -> int:
    """A 32-bit word whose every element of ``width`` bytes is the sentinel."""
    bits = SENTINEL_BITS[width]
    return bits * 0x00010001 if width == 2 else bits


def _struct(name: str, fields) -> list[str]:
    lines = [f"struct {name} {{"]
    lines += [f"  {ctype} {field};  // {meaning}" for ctype, field, meaning in fields]
    lines += ["};", f"static_assert(sizeof({name}) == {struct_bytes(fields)}, \"{name} layout\");"]
    return lines


def header() -> str:
    """The text of ``protocol.h``: macros, the WaitSite and FailKind enums, and the
    LaunchState and ErrorRecord structs.

    It expects ``u32`` and ``u64`` to be defined (kernels/common.cuh includes it after them).
    """
    macros = {
        "UB_MAX_RANKS": MAX_RANKS,
        "UB_MAX_BLOCKS": MAX_BLOCKS,
        "UB_VEC_BYTES": VEC_BYTES,
        "UB_SENTINEL16": f"{SENTINEL_BITS[2]:#x}u",
        "UB_SENTINEL32": f"{SENTINEL_BITS[4]:#x}u",
        "UB_FLAG_PHASES": FLAG_PHASES,
        "UB_TWOSHOT_ALIGN_VECS": TWOSHOT_ALIGN_VECS,
        "UB_HEADER_BYTES": HEADER_BYTES,
        "UB_NORM_THREADS": NORM_THREADS,
        "UB_SLOT_SUM_THREADS": SLOT_SUM_THREADS,
        "UB_ANY_PEER": f"{ANY_PEER:#x}u",
        "UB_QUANT_GROUP": QUANT_GROUP,
        "UB_QUANT_UNIT_GROUPS": QUANT_UNIT_GROUPS,
        "UB_MOE_MAX_TOPK": MOE_MAX_TOPK,
        "UB_MOE_EXPERT_BITS": MOE_EXPERT_BITS,
        "UB_MOE_MAX_CAPACITY": MOE_MAX_CAPACITY,
        "UB_MOE_ROUTE_ELSEWHERE": f"({MOE_ROUTE_ELSEWHERE})",
        "UB_MOE_ROUTE_OVERFLOW": f"({MOE_ROUTE_OVERFLOW})",
        "UB_LL_MAX_BYTES": LL_MAX_BYTES,
        "UB_P2P_MAX_ENTRIES": P2P_MAX_ENTRIES,
        "UB_P2P_BULK_MIN_BYTES": f"{P2P_BULK_MIN_BYTES}ull",
        "UB_P2P_BULK_CHUNK": f"{P2P_BULK_CHUNK}ull",
        "UB_P2P_BULK_DEPTH": f"{P2P_BULK_DEPTH}u",
        "UB_SIG_COUNT_BITS": SIGNATURE_COUNT_BITS,
        "UB_MOE_FP8_GROUP": MOE_FP8_GROUP,
        **{f"UB_{source.removesuffix('.cu').upper()}_THREADS": n for source, n in THREADS.items()},
    }
    lines = ["// Generated from ubnext/_protocol/constants.py: the constants the kernels share with the host.",
             "#pragma once"]
    lines += [f"#define {name} {value}" for name, value in macros.items()]
    for enum, table in (("WaitSite", WAIT_SITES), ("FailKind", FAIL_KINDS), ("MoeInputError", MOE_INPUT_ERRORS),
                         ("SplitInputError", SPLIT_INPUT_ERRORS)):
        lines += [f"enum {enum} : u32 {{"]
        lines += [f"  {name} = {code},  // {words}" for code, (name, words) in table.items()]
        lines += ["};"]
    lines += _struct("LaunchState", LAUNCH_STATE) + _struct("ErrorRecord", ERROR_RECORD)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # CMakeLists.txt: python3 ubnext/_protocol/constants.py > <build>/protocol.h
    print(header(), end="")
