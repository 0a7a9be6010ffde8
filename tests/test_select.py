"""Selector tables (format, validation, the shipped defaults) and the selector's
choices and explanations: world size × dtype × size, limits, NCCL-only."""

from __future__ import annotations

import json

import pytest

from ubnext import UbnextError
from ubnext._protocol.algorithms import ALGORITHMS
from ubnext._protocol.algorithms import KERNEL_DTYPES as DTYPES
from ubnext._selection.select import Selector, bound
from ubnext._selection.table import ANY_WORLD
from ubnext._selection.table_format import agreed_table, default_table, load_table, parse_table

ALL = ["lamport", "lamport_twoshot", "twoshot", "nccl"]
KiB, MiB = 1 << 10, 1 << 20


def lim(lamport: int, lamport_twoshot: int = 16 * MiB) -> dict:
    """Selector limits as ``buffer_limits`` builds them from a Config."""
    return {"lamport": (lamport, f"UBNEXT_LAMPORT_MAX_KB={lamport >> 10}"),
            "lamport_twoshot": (lamport_twoshot, f"UBNEXT_LAMPORT_TWOSHOT_MAX_KB={lamport_twoshot >> 10}")}


def write(tmp_path, document, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return str(path)


def doc(tables, **extra):
    return {"format": 1, "machine": "test GPU", "tables": tables, **extra}


# --------------------------------------------------------------------------- the shipped table


def test_default_table_matches_the_measurements():
    t = default_table().entry(("NVIDIA H200", "nvlink", "plain", "graph"))
    assert t.source == "default table" and t.where == "default table: NVIDIA H200 nvlink plain graph"
    for world in ("2", "4", ANY_WORLD):
        assert set(t.rows[world]) == set(DTYPES)  # every dtype spelled out
        assert t.rows[world]["float16"] == t.rows[world]["bfloat16"] == t.rows[world]["float32"]
    # measured by python -m ubnext.tune (bench/results/tune_h200x*.txt; the 4-rank one-shot
    # up to 512 KiB as tune_h200x4_quant*.txt measured it); past 16 MiB the Lamport
    # two-shot runs in launches
    assert t.rows["4"]["bfloat16"] == ((512 * KiB, "lamport"), (32 * MiB, "lamport_twoshot"), (None, "nccl"))
    assert t.rows["2"]["bfloat16"] == ((1 * MiB, "lamport"), (None, "lamport_twoshot"))
    assert t.rows[ANY_WORLD]["bfloat16"] == ((256 * KiB, "lamport"), (32 * MiB, "twoshot"), (None, "nccl"))


def test_default_table_ships_in_the_wheel():
    """pyproject's package-data must list the file the loader opens."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    assert "ubnext.tables" in setuptools["packages"]
    assert "*.json" in setuptools["package-data"]["ubnext.tables"]


def test_selector_prefers_lamport_small_twoshot_large_and_respects_limits():
    sel = Selector(4, lim(1 * MiB), usable=ALL)
    assert sel.select(2048, "bfloat16") == "lamport"
    assert sel.select(512 * KiB, "bfloat16") == "lamport"
    assert sel.select(512 * KiB + 2, "bfloat16") == "lamport_twoshot"
    # buffers for less than the row: the sizes past them go to the next row
    assert Selector(4, lim(256 * KiB), usable=ALL).select(256 * KiB + 2, "bfloat16") == "lamport_twoshot"
    assert sel.select(16 * MiB, "bfloat16") == "lamport_twoshot"
    assert sel.select(32 * MiB, "bfloat16") == "lamport_twoshot"  # in 2 launches
    assert sel.select(32 * MiB + 2, "bfloat16") == "nccl"  # measured: NCCL wins there on plain arrays
    assert Selector(2, lim(1 * MiB), ALL).select(1 << 30, "bfloat16") == "lamport_twoshot"
    assert Selector(4, lim(1 * MiB), ["lamport", "twoshot", "nccl"]).select(1 * MiB, "bfloat16") == "nccl"
    # past the table (Lamport two-shot buffers below those it takes launches with)
    small = Selector(2, lim(1 * MiB, 4 * MiB), ALL)
    assert small.select(8 * MiB, "bfloat16") == "twoshot"
    assert small.select(8 * MiB + 2, "bfloat16") == "nccl"  # measured: NCCL ahead of the staged two-shot
    assert small.select(256 * MiB, "bfloat16") == "nccl"
    assert Selector(8, lim(1 * MiB), ALL).select(300 * KiB, "float32") == "twoshot"  # row "*"
    assert Selector(4, lim(1024), usable=ALL).select(4096, "float32") == "lamport_twoshot"
    nccl_only = Selector(8, lim(1 * MiB), usable=["nccl"])
    assert nccl_only.select(16, "float16") == "nccl"
    assert not nccl_only.fits("lamport", 16)


def test_fused_calls_past_the_lamport_twoshot_buffers_take_it_in_launches(tmp_path):
    """Where the table says NCCL only because the message is larger than the Lamport
    two-shot's buffers, a fused call takes the two-shot (in launches of whole rows)."""
    sel = Selector(4, lim(1 * MiB), usable=ALL)
    for nbytes, plain, fused in [(2048, "lamport", "lamport"), (32 * MiB, "lamport_twoshot", "lamport_twoshot"),
                                 (32 * MiB + 2, "nccl", "lamport_twoshot"), (1 << 30, "nccl", "lamport_twoshot")]:
        assert (sel.select(nbytes, "bfloat16"), sel.select_fused(nbytes, "bfloat16")) == (plain, fused), nbytes
    assert Selector(2, lim(1 * MiB), ALL).select_fused(1 << 30, "bfloat16") == "lamport_twoshot"
    # buffers smaller than the table's row: launches smaller than what it measured
    assert Selector(4, lim(1 * MiB, 2 * MiB), ALL).select_fused(8 * MiB, "bfloat16") == "nccl"
    assert Selector(4, lim(1 * MiB), ALL + ["nvls_lamport", "nvls"]).select_fused(64 * MiB, "bfloat16") == "nvls"
    # NCCL stays where the table prefers it at the buffers' size, or the two-shot is not usable
    table = load_table(write(tmp_path, doc({"4": {"bfloat16": [[8 * MiB, "lamport_twoshot"], [None, "nccl"]]}})))
    assert Selector(4, lim(1 * MiB), ALL, table).select_fused(32 * MiB, "bfloat16") == "nccl"
    assert Selector(4, lim(1 * MiB), ["lamport", "twoshot", "nccl"]).select_fused(32 * MiB, "bfloat16") == "nccl"
    assert Selector(8, lim(1 * MiB), ALL).select_fused(64 * MiB, "bfloat16") == "nccl"  # '*': two-shot at 16 MiB
    assert Selector(4, lim(1 * MiB), ["nccl"]).select_fused(32 * MiB, "bfloat16") == "nccl"


def test_a_row_past_the_lamport_twoshot_buffers_runs_it_in_launches(tmp_path):
    """A table row may give the Lamport two-shot more than its buffers hold: it then runs
    in launches of the buffers' size, if they are at least the default (what the tables
    measured); smaller buffers send those sizes to the next row, and say why."""
    table = load_table(write(tmp_path, doc({"4": {"bfloat16": [
        [256 * KiB, "lamport"], [32 * MiB, "lamport_twoshot"], [None, "nccl"]]}})))
    sel = Selector(4, lim(1 * MiB), ALL, table)
    assert [sel.select(n, "bfloat16") for n in (16 * MiB, 16 * MiB + 2, 32 * MiB, 32 * MiB + 2)] == [
        "lamport_twoshot", "lamport_twoshot", "lamport_twoshot", "nccl"]
    assert sel.explain(32 * MiB, "bfloat16")[1] == (
        f"table row ≤ 32 MiB for 4 ranks bfloat16 (tune file {tmp_path / 't.json'}: any machine); "
        "in launches of 16 MiB (UBNEXT_LAMPORT_TWOSHOT_MAX_KB=16384)")
    assert sel.capped() == []
    bigger = Selector(4, lim(1 * MiB, 64 * MiB), ALL, table)
    assert bigger.select(32 * MiB, "bfloat16") == "lamport_twoshot"
    assert "in launches" not in bigger.explain(32 * MiB, "bfloat16")[1]
    small = Selector(4, lim(1 * MiB, 8 * MiB), ALL, table)
    assert small.select(8 * MiB, "bfloat16") == "lamport_twoshot"
    name, why = small.explain(8 * MiB + 2, "bfloat16")
    assert name == "nccl"
    assert why.endswith("lamport_twoshot does not fit: > UBNEXT_LAMPORT_TWOSHOT_MAX_KB=8192 "
                        "(launches past its buffers need at least 16 MiB of them)")
    assert small.capped() == [("lamport_twoshot", 32 * MiB, "UBNEXT_LAMPORT_TWOSHOT_MAX_KB=8192")]
    # fused calls past the row still take it in launches of whole rows
    assert sel.select_fused(64 * MiB, "bfloat16") == "lamport_twoshot"
    assert small.select_fused(64 * MiB, "bfloat16") == "nccl"


def test_an_explicit_lamport_twoshot_takes_any_size_and_the_one_shot_its_buffers():
    sel = Selector(4, lim(1 * MiB, 2 * MiB), ALL)
    assert sel.fits("lamport_twoshot", 1 << 30)  # in launches, whatever the buffers
    assert sel.fits("lamport", 1 * MiB) and not sel.fits("lamport", 1 * MiB + 2)
    assert sel.fits("twoshot", 1 << 30) and sel.fits("nccl", 1 << 30)
    assert not Selector(4, lim(1 * MiB), ["lamport", "twoshot", "nccl"]).fits("lamport_twoshot", 16)


def test_bound_names_the_setting_that_keeps_an_algorithm_from_a_size():
    limits = lim(1 * MiB, 2 * MiB)
    assert bound("lamport", 1 * MiB, limits) is None
    assert bound("lamport", 1 * MiB + 2, limits) == "UBNEXT_LAMPORT_MAX_KB=1024"
    assert bound("lamport_twoshot", 1 << 30, limits) is None  # in launches of its buffers' size
    assert bound("twoshot", 1 << 30, limits) is None and bound("nccl", 1 << 30, limits) is None


# --------------------------------------------------------------------------- explain


def test_explain_names_the_row_and_the_table():
    sel = Selector(4, lim(1 * MiB), ALL)
    assert sel.explain(2048, "bfloat16") == (
        "lamport", "table row ≤ 512 KiB for 4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph)")
    assert sel.explain(2 * MiB, "float16") == (
        "lamport_twoshot", "table row ≤ 32 MiB for 4 ranks float16 (default table: NVIDIA H200 nvlink plain graph)")
    assert sel.explain(1 << 30, "float32") == (
        "nccl", "table row > 32 MiB for 4 ranks float32 (default table: NVIDIA H200 nvlink plain graph)")
    name, why = Selector(6, lim(1 * MiB), ALL).explain(1024, "bfloat16")
    assert (name, why) == ("lamport", "table row ≤ 256 KiB for 6 ranks (via '*') bfloat16 (default table: NVIDIA H200 nvlink plain graph)")


def test_explain_says_why_a_row_was_skipped():
    sel = Selector(4, lim(128 * KiB), ALL)
    assert sel.explain(200 * KiB, "bfloat16") == (
        "lamport_twoshot", "table row ≤ 32 MiB for 4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph); "
                           "lamport does not fit: > UBNEXT_LAMPORT_MAX_KB=128")
    assert sel.select(200 * KiB, "bfloat16") == "lamport_twoshot"


def test_explain_nccl_only_gives_the_reason():
    sel = Selector(4, lim(1 * MiB), ["nccl"], nccl_reason="ranks span several nodes (4 of 8 on this one)")
    assert sel.explain(1024, "bfloat16") == (
        "nccl", "only NCCL usable: ranks span several nodes (4 of 8 on this one)")
    assert Selector(4, lim(1 * MiB), ["nccl"]).explain(1024, "float32")[1].startswith("only NCCL usable: ")


def test_past_the_last_row_falls_back_by_size_in_preference_order(tmp_path):
    table = load_table(write(tmp_path, doc({"4": {"bfloat16": [[64 * KiB, "lamport"]]}})))
    sel = Selector(4, lim(1 * MiB), ALL, table)
    name, why = sel.explain(1 * MiB, "bfloat16")
    assert name == "twoshot"
    assert why.startswith("past the last table row (≤ 64 KiB) for 4 ranks bfloat16 (tune file ")
    assert why.endswith("first usable of twoshot ≤ 8 MiB, nccl")
    assert sel.select(8 * MiB, "bfloat16") == "twoshot"
    assert sel.select(8 * MiB + 2, "bfloat16") == "nccl"
    assert Selector(4, lim(1 * MiB), ["lamport", "nccl"], table).select(1 * MiB, "bfloat16") == "nccl"


# --------------------------------------------------------------------------- tune files


def test_tune_file_round_trip_and_fallback_to_the_default(tmp_path):
    path = write(tmp_path, doc({"4": {"bfloat16": [[64 * KiB, "lamport"], [None, "nccl"]],
                                      "float32": [[32 * KiB, "lamport"], [None, "twoshot"]]}}))
    table = load_table(path)
    assert table.source == f"tune file {path}" and table.format == 1
    assert "machine: test GPU" in table.entries[0].note and table.entries[0].key == ("*",) * 4
    sel = Selector(4, lim(1 * MiB), ALL, table)
    assert sel.select(1024, "bfloat16") == "lamport"
    assert sel.select(1 * MiB, "bfloat16") == "nccl"
    assert sel.select(48 * KiB, "float32") == "twoshot"  # the dtype dimension
    assert sel.select(1 * MiB, "float32") == "twoshot"
    name, why = sel.explain(1 * MiB, "float16")  # no float16 rows: bfloat16's (same width)
    assert name == "nccl" and f"4 ranks bfloat16 (no float16 rows) (tune file {path}: any machine)" in why
    # A world size the file lacks uses the shipped table.
    assert Selector(2, lim(1 * MiB), ALL, table).explain(1024, "bfloat16")[1].endswith("(default table: NVIDIA H200 nvlink plain graph)")


def test_tune_file_star_entry_covers_other_world_sizes(tmp_path):
    table = load_table(write(tmp_path, doc({"*": {"float32": [[None, "nccl"]]}})))
    name, why = Selector(2, lim(1 * MiB), ALL, table).explain(1024, "bfloat16")
    assert name == "nccl"
    assert why == f"table row (any size) for 2 ranks (via '*') float32 (no bfloat16 rows) ({table.source}: any machine)"


@pytest.mark.parametrize("document, message", [
    ("{not json", "cannot read tune file"),
    ([1, 2], "expected a JSON object"),
    ({"4": [[65536, "lamport"]]}, "missing key(s) format, entries"),
    ({"format": 1, "tables": {}}, "missing key(s) machine (a format-1 table has format, machine, tables"),
    (doc({"4": {"bfloat16": [[None, "nccl"]]}}, extra=1), "unknown key(s) extra"),
    ({"format": 3, "machine": "", "tables": {}}, "format 3 is not supported; this ubnext reads formats 2 and 1"),
    (doc({}), "tables must be a non-empty object"),
    (doc({"four": {"bfloat16": [[None, "nccl"]]}}), "tables key 'four' is not a world size"),
    (doc({"0": {"bfloat16": [[None, "nccl"]]}}), "tables key '0' is not a world size"),
    (doc({"4": []}), "tables['4'] must be a non-empty object"),
    (doc({"4": {"int8": [[None, "nccl"]]}}), "tables['4']: unknown dtype 'int8'"),
    (doc({"4": {"bfloat16": []}}), "tables['4']['bfloat16']: rows must be a non-empty list"),
    (doc({"4": {"bfloat16": [[10, "ring"]]}}), "row 1: unknown algorithm 'ring'"),
    (doc({"4": {"bfloat16": [[10]]}}), "row 1 is [10], not [max_bytes, algorithm]"),
    (doc({"4": {"bfloat16": [[None, "lamport"], [10, "nccl"]]}}), "row 1: null (no limit) is allowed on the last"),
    (doc({"4": {"bfloat16": [[-1, "lamport"]]}}), "row 1: max_bytes -1 is not a positive integer"),
    (doc({"4": {"bfloat16": [[1.5, "lamport"]]}}), "row 1: max_bytes 1.5 is not a positive integer"),
    (doc({"4": {"bfloat16": [[100, "lamport"], [100, "nccl"]]}}), "row 2: max_bytes 100 is not above"),
])
def test_bad_tune_files_are_refused_with_the_file_and_the_problem(tmp_path, document, message):
    path = write(tmp_path, document)
    with pytest.raises(UbnextError) as info:
        load_table(path)
    text = str(info.value)
    assert text.startswith("selector: ") and path in text
    assert message in text


def test_missing_tune_file(tmp_path):
    with pytest.raises(UbnextError, match=r"cannot read tune file .*nope\.json"):
        load_table(str(tmp_path / "nope.json"))


def test_parse_table_keeps_the_document():
    d = doc({"2": {"float16": [[None, "twoshot"]]}}, note="n", measured={})
    f = parse_table(d, "x")
    t = f.entries[0]
    assert t.entry["tables"] == d["tables"] and t.entry["measured"] == {} and "n" in t.note
    assert t.rows == {"2": {"float16": ((None, "twoshot"),)}}
    assert all(name in ALGORITHMS for rows in t.rows["2"].values() for _, name in rows)
    d2 = f.document
    assert parse_table(d2, "y").document is d2 and d2["format"] == 2  # format 2 kept as it is


class _Ranks:
    """``allgather_obj`` over pretend ranks: each one's value comes from ``values``."""

    def __init__(self, values):
        self.values = values

    def allgather_obj(self, obj):
        return [obj if v is None else v for v in self.values]


def test_agreed_table_raises_on_every_rank_when_one_rank_fails(tmp_path):
    path = write(tmp_path, doc({"4": {"bfloat16": [[None, "nccl"]]}}))
    assert agreed_table(path, _Ranks([None, None])).entries[0].rows["4"]
    with pytest.raises(UbnextError, match=r"UBNEXT_TUNE_FILE \(rank 1\): selector: cannot read"):
        agreed_table(path, _Ranks([None, ("selector: cannot read tune file x: gone", None)]))
    with pytest.raises(UbnextError, match="the ranks read different tables"):
        agreed_table(path, _Ranks([None, (None, "other digest")]))


def test_an_open_last_row_whose_buffers_are_too_small_falls_past_the_table():
    table = parse_table(doc({"4": {"bfloat16": [[256 * KiB, "lamport"], [None, "lamport_twoshot"]]}}), "tune file t")
    sel = Selector(4, lim(1 * MiB, lamport_twoshot=2 * MiB), ALL + ["lamport_twoshot"], table)
    assert sel.select(2 * MiB, "bfloat16") == "lamport_twoshot"
    name, why = sel.explain(4 * MiB, "bfloat16")
    assert name == "twoshot"
    assert why.startswith("no table row fits for 4 ranks bfloat16 (tune file t: any machine): first usable of twoshot ≤ 8 MiB, nccl")
    assert "lamport_twoshot does not fit: > UBNEXT_LAMPORT_TWOSHOT_MAX_KB=2048" in why


def test_capped_lists_rows_cut_short_by_the_buffers():
    one_shot = default_table().entry(("NVIDIA H200", "nvlink", "plain", "graph")).rows["4"]["bfloat16"][0]
    assert one_shot[1] == "lamport"  # the shipped 4-rank row the buffers cut short
    assert Selector(4, lim(1024), usable=ALL).capped() == [("lamport", one_shot[0], "UBNEXT_LAMPORT_MAX_KB=1")]
    # the tests' small buffers (lamport_max_kb=256) hold less than the 512 KiB row
    want = [("lamport", one_shot[0], "UBNEXT_LAMPORT_MAX_KB=256")] if one_shot[0] > 256 * KiB else []
    assert Selector(4, lim(256 * KiB), usable=ALL).capped() == want
    assert Selector(4, lim(1 * MiB), usable=ALL).capped() == []
    assert Selector(4, lim(1024), usable=["nccl"]).capped() == []


def test_multicast_instantiations_replace_their_unicast_rows():
    """The seed's preference: multicast kernels, then Lamport, two-shot, NCCL."""
    with_mc = ALL + ["nvls_lamport", "nvls"]
    sel = Selector(4, lim(1 * MiB), usable=with_mc)
    assert sel.select(2048, "bfloat16") == "nvls_lamport"
    assert sel.select(4 * MiB, "bfloat16") == "nvls"
    assert sel.select(256 * MiB, "bfloat16") == "nccl"
    assert sel.explain(4 * MiB, "bfloat16") == (
        "nvls", "table row ≤ 32 MiB for 4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph); "
                "NVLink multicast: nvls in place of lamport_twoshot")
    assert Selector(4, lim(1024), usable=with_mc).select(4096, "float32") == "nvls"


def test_deterministic_mode_takes_the_barrier_two_shot_where_a_row_gives_nccl():
    from ubnext._environment.config import Config
    from ubnext._selection.select import Selector, buffer_limits

    usable = ["lamport", "lamport_twoshot", "twoshot", "nccl"]
    plain = Selector(4, buffer_limits(Config()), usable)
    fixed = Selector(4, buffer_limits(Config()), usable, deterministic=True)
    big = 1 << 30
    assert plain.select(big, "bfloat16") == "nccl"
    assert fixed.select(big, "bfloat16") == "twoshot"
    assert fixed.select_fused(big, "bfloat16") != "nccl"
    name, why = fixed.explain(big, "bfloat16")
    assert name == "twoshot" and "deterministic mode: twoshot in place of nccl" in why
    for nbytes in (1 << 10, 1 << 20, 1 << 24):  # the kernels' rows are the same
        assert fixed.select(nbytes, "bfloat16") == plain.select(nbytes, "bfloat16")
    only_nccl = Selector(4, buffer_limits(Config()), ["nccl"], deterministic=True)
    assert only_nccl.select(big, "bfloat16") == "nccl"  # no kernels: NCCL all the same
