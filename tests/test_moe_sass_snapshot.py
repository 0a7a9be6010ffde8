"""tools/sass_snapshot.py, the check that a refactor of the MoE kernels kept their instruction
streams: its normalization forgets register numbers, addresses, encodings and labels only,
and its comparison names the kept instructions (memory, fences, barriers, shuffles,
floating point) whose counts or order differ."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import sass_snapshot as snap  # noqa: E402

SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                           /* 0x0000000000007919 */
        /*0020*/              @!P0 BRA `(.L_x_3) ;                              /* 0x0000000000008947 */
        /*0030*/                   STG.E.STRONG.SYS desc[UR4][R2.64], R5 ;      /* 0x0000000502007986 */
        /*0040*/                   FADD R7, R7, R9 ;                            /* 0x0000000907077221 */
.L_x_3:
        /*0050*/                   BSSY B0, 0x90 ;                              /* 0x0000003000007945 */
        /*0060*/                   EXIT ;                                       /* 0x000000000000794d */
"""


def renumbered(text: str) -> str:
    """The same instructions with other registers, labels, addresses and encodings."""
    for a, b in (("R1,", "R11,"), ("R0,", "R4,"), ("R2.64", "R12.64"), ("R5 ;", "R6 ;"), ("R7, R7, R9", "R3, R3, R8"),
                 ("P0", "P2"), ("UR4", "UR6"), (".L_x_3", ".L_x_17"), ("B0, 0x90", "B1, 0x1a0"),
                 ("0x0000000502007986", "0x0000000602007986"), ("/*0040*/", "/*0050*/")):
        text = text.replace(a, b)
    return text


def test_normalization_forgets_registers_labels_addresses_and_encodings():
    assert snap.normalize(SASS, snap._SASS_RULES) == snap.normalize(renumbered(SASS), snap._SASS_RULES)
    assert "STG.E.STRONG.SYS desc[UR][R.64], R ;" in snap.normalize(SASS, snap._SASS_RULES)


def test_normalization_keeps_what_the_instructions_do():
    base = snap.normalize(SASS, snap._SASS_RULES)
    for a, b in (("STRONG.SYS", "STRONG.GPU"), ("FADD", "FMUL"), ("c[0x0][0x28]", "c[0x0][0x30]")):
        assert snap.normalize(SASS.replace(a, b), snap._SASS_RULES) != base


def test_compare_names_the_kept_instructions_that_differ(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    norm = snap.normalize(SASS, snap._SASS_RULES)
    (a / "k-same.norm").write_text(norm)
    (b / "k-same.norm").write_text(norm)
    (a / "k-moved.norm").write_text(norm)
    (b / "k-moved.norm").write_text(norm.replace("S2R R, SR_TID.X ;\n", "") + "S2R R, SR_TID.X ;\n")
    (a / "k-fewer.norm").write_text(norm)
    (b / "k-fewer.norm").write_text(norm.replace("STG.E.STRONG.SYS desc[UR][R.64], R ;\n", ""))
    (a / "k-swapped.norm").write_text(norm)
    lines = norm.splitlines()
    i, j = lines.index("STG.E.STRONG.SYS desc[UR][R.64], R ;"), lines.index("FADD R, R, R ;")
    lines[i], lines[j] = lines[j], lines[i]
    (b / "k-swapped.norm").write_text("\n".join(lines) + "\n")
    assert snap.compare(a, b) == 1
    out = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert out["k-same"] == "same"
    assert out["k-moved"].endswith("kept opcodes that differ: none, in the same order")
    assert out["k-fewer"].endswith("kept opcodes that differ: STG.E.STRONG.SYS 1->0")
    assert out["k-swapped"].endswith("kept opcodes that differ: none, reordered")


def test_ptx_loads_of_either_signedness_count_alike_and_parameter_reads_not_at_all():
    ptx = "ld.param.u64 %rd1, [p];\nld.global.u32 %r1, [%rd1];\nadd.s64 %rd2, %rd1, 4;\nadd.rn.f32 %f1, %f1, %f2;\n"
    other = "ld.global.s32 %rd3, [%rd1];\nld.param.u64 %rd1, [p];\nld.param.u64 %rd1, [p];\nadd.rn.f32 %f3, %f3, %f4;\n"
    assert snap.kept_counts(ptx) == snap.kept_counts(other) == {"ld.global.b32": 1, "add.rn.f32": 1}
