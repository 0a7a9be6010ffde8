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
#: threads of a row group (kernels/rmsnorm.cuh) and of the separate add + RMSNorm kernel
NORM_THREADS = 1024
#: threads per block of each all-reduce source's plain entry point (its launch bound)
THREADS = {"lamport.cu": 256, "lamport_twoshot.cu": 512, "twoshot.cu": 512}
#: ErrorRecord.peer of a counting wait, which waits for no rank in particular
ANY_PEER = 0xFFFFFFFF

#: where a kernel waited: code -> (name in the kernels, words for the host's message)
WAIT_SITES = {
    1: ("kSiteLamportPoll", "Lamport poll"),
    2: ("kSiteEntryBarrier", "two-shot entry barrier"),
    3: ("kSiteExitBarrier", "two-shot exit barrier"),
}

#: Per rank and kernel family, in the rank's own segment: (type, field, meaning). Every
#: block reads it at entry; the last block to finish advances it.
LAUNCH_STATE = (
    ("u32", "epoch", "launches completed"),
    ("u32", "done", "blocks of the running launch that finished"),
    ("u32", "prev_vecs", "vectors moved by the previous launch (Lamport: what to re-poison)"),
    ("u32", "slot", "Lamport: the receive buffer (0, 1, 2) of the next launch"),
)
#: One per communicator, in host-mapped pinned memory: (type, field, meaning). ``flag``
#: is written last.
ERROR_RECORD = (
    ("u32", "flag", "0: no error; 1: a wait timed out"),
    ("u32", "rank", "the rank that waited"),
    ("u32", "peer", "the rank it waited for (ANY_PEER: a counting wait)"),
    ("u32", "site", "a WaitSite"),
    ("u64", "epoch", "launch epoch of the waiting kernel"),
)

_TYPE_BYTES = {"u32": 4, "u64": 8}


def struct_bytes(fields) -> int:
    """Size of a struct of ``fields`` (naturally aligned, as the compiler lays it out)."""
    size, align = 0, 1
    for ctype, _, _ in fields:
        width = _TYPE_BYTES[ctype]
        size = -(-size // width) * width + width
        align = max(align, width)
    return -(-size // align) * align


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
    """The text of ``protocol.h``: macros, the WaitSite enum, LaunchState and ErrorRecord.

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
        "UB_NORM_THREADS": NORM_THREADS,
        "UB_ANY_PEER": f"{ANY_PEER:#x}u",
        **{f"UB_{source.removesuffix('.cu').upper()}_THREADS": n for source, n in THREADS.items()},
    }
    lines = ["// Generated from ubnext/_protocol.py: the constants the kernels share with the host.",
             "#pragma once"]
    lines += [f"#define {name} {value}" for name, value in macros.items()]
    lines += ["enum WaitSite : u32 {"]
    lines += [f"  {name} = {code},  // {words}" for code, (name, words) in WAIT_SITES.items()]
    lines += ["};"]
    lines += _struct("LaunchState", LAUNCH_STATE) + _struct("ErrorRecord", ERROR_RECORD)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # CMakeLists.txt: python3 ubnext/_protocol.py > <build>/protocol.h
    print(header(), end="")
