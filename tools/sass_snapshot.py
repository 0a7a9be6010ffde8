"""Writes the SASS of kernel variants, normalized, one file per variant: the evidence that a
refactor of kernels/ changed no instruction (compare two snapshots with ``diff -r``).

Usage (from a source tree's root; the kernels compiled are that tree's)::

    PYTHONPATH=$PWD python tools/sass_snapshot.py OUT [--sources moe_dispatch.cu ...]
        [--ranks 1,2,4,8] [--dtypes bfloat16,float32] [--arch sm_90a] [--cuobjdump PATH] [--ptx]

Each source is compiled as the library compiles it (``_engine.kernels.compile_cubin`` with
``compile_defines(dtype, "sum", nranks)``, full optimization) and disassembled with
``cuobjdump -sass``; ``--ptx`` writes the PTX (``compute_`` of the arch) instead. For each
variant OUT holds ``<source>-<dtype>-<n>.raw`` (the disassembly) and ``.norm``: addresses,
encodings, register numbers, labels and branch targets replaced by placeholders, so that two
snapshots agree where the instruction streams agree modulo register allocation and layout.
A variant that fails to compile writes its error to ``.err``.

``--compare A B`` compares two snapshots: per variant, "same" where the normalized streams
agree, else the lines that differ and the counts, per opcode, of the instructions whose
semantics a refactor must keep (memory, fences, atomics, barriers, warp votes and
shuffles, floating-point arithmetic) that differ between A and B; where none do, whether
those instructions come in the same order in both (then the streams differ only in integer
arithmetic, moves, predicates and branches between them).
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ubnext._engine import kernels as _kernels
from ubnext._protocol.algorithms import compile_defines

#: the MoE kernels of ExpertParallel and PackedExpertParallel
MOE_SOURCES = ("moe_dispatch.cu", "moe_combine.cu", "moe_packed_dispatch.cu", "moe_packed_combine.cu")

_SASS_RULES = (
    (re.compile(r"/\*[0-9a-f]{4,}\*/"), ""),             # instruction addresses
    (re.compile(r"/\* 0x[0-9a-f]+ \*/"), ""),             # encodings
    (re.compile(r"\bUR\d+\b"), "UR"),
    (re.compile(r"\bR\d+\b"), "R"),
    (re.compile(r"\bUP\d\b"), "UP"),
    (re.compile(r"\bP\d\b"), "P"),
    (re.compile(r"\bB\d+\b"), "B"),                       # convergence barriers
    (re.compile(r"`\(\.L_x_\d+\)"), "`(L)"),             # branch targets, by label
    (re.compile(r"\b((?:BRA|BSSY|CALL\.REL|CALL\.ABS|BREAK|JMP|SSY|PBK)\b[^;]*?)0x[0-9a-f]+(\s*;)"), r"\1ADDR\2"),  # by address
    (re.compile(r"\.L_x_\d+:"), "L:"),
)
_PTX_RULES = (
    (re.compile(r"%(r|rd|f|fd|p|rs|h|hh)\d+"), r"%\1"),
    (re.compile(r"\$L__\w+"), "$L"),
    (re.compile(r"^\s*//.*$", re.M), ""),
)


def normalize(text: str, rules) -> str:
    """``text`` with the rules applied line by line, blank lines dropped."""
    lines = []
    for line in text.splitlines():
        for pattern, repl in rules:
            line = pattern.sub(repl, line)
        line = " ".join(line.split())
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


#: opcodes (their first dotted word, PTX or SASS) whose counts --compare reports
_KEPT = re.compile(r"^(ld|st|atom|red|fence|membar|bar|barrier|shfl|vote|redux|mul|add|sub|fma|div|rcp|cvt|"
                   r"griddepcontrol|LDG|STG|LD|ST|LDS|STS|ATOM|ATOMG|ATOMS|RED|MEMBAR|FENCE|BAR|SHFL|VOTE|REDUX|"
                   r"FMUL|FADD|FFMA|F2F|F2FP|I2F|F2I|MUFU|ACQBULK|CCTL|ERRBAR)$")


def kept_sequence(norm: str) -> list[str]:
    """The kept instructions of a normalized stream, in order, by full opcode (``ld.global.b32``)."""
    out = []
    for line in norm.splitlines():
        words = line.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words and _KEPT.match(words[0].split(".")[0]):
            if words[0].split(".")[0] in ("mul", "add", "sub", "cvt") and ".f" not in words[0] and ".rn" not in words[0]:
                continue  # integer arithmetic and conversions: addressing
            op = words[0]
            if op.startswith("ld.param"):
                continue  # a parameter read again: no memory the kernel shares
            if op.split(".")[0] in ("ld", "st"):
                op = re.sub(r"\.[sub](\d+)$", r".b\1", op)  # a load's signedness: the same bits
            out.append(op)
    return out


def kept_counts(norm: str) -> dict[str, int]:
    """Counts of the kept instructions of a normalized stream, by full opcode."""
    counts: dict[str, int] = {}
    for op in kept_sequence(norm):
        counts[op] = counts.get(op, 0) + 1
    return counts


def compare(a: Path, b: Path) -> int:
    """Prints the comparison of two snapshots; 0 if every variant's normalized stream agrees."""
    differ = 0
    for fa in sorted(a.glob("*.norm")):
        fb = b / fa.name
        if not fb.exists():
            print(f"{fa.stem}: missing in {b}")
            differ += 1
            continue
        ta, tb = fa.read_text(), fb.read_text()
        if ta == tb:
            print(f"{fa.stem}: same")
            continue
        differ += 1
        lines = sum(1 for d in difflib.ndiff(ta.splitlines(), tb.splitlines()) if d[:1] in "+-")
        ca, cb = kept_counts(ta), kept_counts(tb)
        delta = {k: (ca.get(k, 0), cb.get(k, 0)) for k in sorted(set(ca) | set(cb)) if ca.get(k, 0) != cb.get(k, 0)}
        order = "in the same order" if kept_sequence(ta) == kept_sequence(tb) else "reordered"
        print(f"{fa.stem}: {lines} lines differ; kept opcodes that differ: "
              + (", ".join(f"{k} {x}->{y}" for k, (x, y) in delta.items()) or f"none, {order}"))
    return 1 if differ else 0


def sass(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sources", nargs="+", default=list(MOE_SOURCES))
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--ptx", action="store_true", help="PTX (compute_ arch) instead of SASS")
    ap.add_argument("--compare", type=Path, metavar="B", help="compare snapshot OUT with snapshot B; compile nothing")
    a = ap.parse_args(argv)
    if a.compare is not None:
        return compare(a.out, a.compare)
    a.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for src in a.sources:
        for dtype in a.dtypes.split(","):
            for n in map(int, a.ranks.split(",")):
                stem = a.out / f"{src[:-3]}-{dtype}-{n}"
                arch = a.arch.replace("sm_", "compute_") if a.ptx else a.arch
                try:
                    image = _kernels.compile_cubin(src, compile_defines(dtype, "sum", n), arch=arch)
                except Exception as e:  # noqa: BLE001 - a variant's failure is recorded, the rest still run
                    stem.with_suffix(".err").write_text(str(e))
                    failed += 1
                    continue
                raw = image.decode(errors="replace").rstrip("\0") if a.ptx else sass(image, a.cuobjdump)
                stem.with_suffix(".raw").write_text(raw)
                stem.with_suffix(".norm").write_text(normalize(raw, _PTX_RULES if a.ptx else _SASS_RULES))
                print(stem.name, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
