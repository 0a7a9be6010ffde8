"""Selector tables keyed by machine (format 2): validation that names the entry and the
key, the choice of the entry (exact, the fallbacks, alike on every rank), format-1 files,
``python -m ubnext.tune`` writing and merging format 2, and what describe()/info say.
The H200 rows carried over from format 1 choose as before, checked over a grid, but for
one deliberate change (ONE_SHOT_4: at 4 ranks the Lamport one-shot up to 512 KiB)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ubnext import UbnextError, tune
from ubnext._environment.config import Config
from ubnext._protocol.algorithms import COLLECTIVES, DTYPES, KERNEL_DTYPES
from ubnext._selection.select import Selector, buffer_limits
from ubnext._selection.table import FORMAT, Machine, agreed_machine, family
from ubnext._selection.table_format import agreed_table, default_table, load_table, parse_table
from ubnext._tools import tune_table

KiB, MiB = 1 << 10, 1 << 20
#: The shipped table as it was in format 1 (ubnext/tables/h200.json before format 2), verbatim.
OLD_H200 = Path(__file__).with_name("selector_h200_format1.json")
#: python -m ubnext.tune --quantized on 2x H200 (2026-11-29; bench/results/README.md): a graph
#: and a dependent entry, whose 2-rank reduce-scatter/all-gather rows and (graph) quantized
#: thresholds the shipped H200 entry took.
TUNE_H200X2 = Path(__file__).resolve().parents[1] / "bench" / "results" / "tune_h200x2_1129.json"
H200 = ("NVIDIA H200", "nvlink", "plain", "graph")
#: What a reason adds where the H200 entry serves a machine other than its own (another GPU,
#: link, placement or mode): it holds thresholds measured on 2x H200 in graph mode.
H200_THRESHOLDS_NOT_TAKEN = "; its quantized thresholds not taken (measured on NVIDIA H200 nvlink plain graph only)"
H100 = ("NVIDIA H100 80GB HBM3", "nvlink", "plain", "graph")
H100_DEPENDENT = (*H100[:3], "dependent")
#: The one deliberate change to the H200 rows since format 1: at 4 ranks the Lamport
#: one-shot all-reduce takes messages up to 512 KiB (was 256 KiB), every dtype, where two
#: later tunes on 4x H200 and a 4x H100 run measured the crossover (bench/NOTES.md,
#: eighteenth session). The '*' rows (not measured) and the other collectives keep 256 KiB.
ONE_SHOT_4 = {"was": 256 * KiB, "now": 512 * KiB}


def format_1_rows_changed():
    """The format-1 document with that one change made (and nothing else)."""
    old = json.loads(OLD_H200.read_text())
    for rows in old["tables"]["4"].values():
        assert rows[0] == [ONE_SHOT_4["was"], "lamport"]
        rows[0][0] = ONE_SHOT_4["now"]
    return old


def tune_h200x2(mode):
    """The entry of TUNE_H200X2 measured in ``mode`` (``graph`` or ``dependent``)."""
    (measured,) = [e for e in json.loads(TUNE_H200X2.read_text())["entries"] if e["mode"] == mode]
    assert (measured["gpu"], measured["link"], measured["placement"]) == H200[:3]
    return measured


def format_1_rows_measured():
    """format_1_rows_changed() with the 2-rank reduce-scatter's and all-gather's rows
    measured on 2x H200 (graph mode), float16 taking bfloat16's: what the shipped H200
    entry should hold."""
    doc = format_1_rows_changed()
    measured = tune_h200x2("graph")["collectives"]
    for collective, place in doc["collectives"].items():
        rows = measured[collective]["tables"]["2"]
        place["tables"]["2"] = {**rows, "float16": rows["bfloat16"]}
    return doc


def as_rows(collectives):
    """A JSON document's ``collectives`` as a parsed entry's ``by_collective`` holds them:
    collective -> world key -> dtype -> ((max_bytes, algorithm), ...)."""
    return {c: {w: {d: tuple((m, a) for m, a in rows) for d, rows in by_dtype.items()}
                for w, by_dtype in place["tables"].items()} for c, place in collectives.items()}


def entry(gpu="NVIDIA H200", link="nvlink", placement="plain", mode="graph", rows=None, **extra):
    return {"gpu": gpu, "link": link, "placement": placement, "mode": mode,
            "tables": {"*": {"bfloat16": rows or [[None, "nccl"]]}}, **extra}


def document(*entries, **extra):
    return {"format": FORMAT, "entries": list(entries), **extra}


def write(tmp_path, doc, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


# --------------------------------------------------------------------------- the format


def test_default_table_is_format_2_with_the_h200_rows_unchanged_but_the_4_rank_one_shot():
    old = json.loads(OLD_H200.read_text())
    shipped = default_table()
    assert shipped.format == 2 and [t.key for t in shipped.entries] == [H200, H100, H100_DEPENDENT]
    h200 = shipped.entry(H200)
    assert h200.entry["tables"] == format_1_rows_changed()["tables"]
    # the reduce-scatter's and all-gather's rows: format 1's defaults, but at 2 ranks those
    # measured on 2x H200 (float16 takes bfloat16's rows)
    measured = format_1_rows_measured()["collectives"]
    assert {c: h200.entry["collectives"][c]["tables"] for c in old["collectives"]} == {
        c: measured[c]["tables"] for c in old["collectives"]}
    for collective, place in old["collectives"].items():
        assert {w for w in place["tables"] if place["tables"][w] != measured[collective]["tables"][w]} == {"2"}
    # the change is exactly that: the first row of each 4-rank dtype, nothing else
    changed = {(world, dtype, i) for world, by_dtype in old["tables"].items() for dtype, rows in by_dtype.items()
               for i, row in enumerate(rows) if h200.entry["tables"][world][dtype][i] != row}
    assert changed == {("4", dtype, 0) for dtype in ("bfloat16", "float16", "float32")}
    assert "NVIDIA H200 (2 and 4 GPUs, NVLink" in h200.note  # the format-1 machine text, kept
    assert "tune_h200x4_quant.txt and tune_h200x4_quant_repeat.txt" in h200.note  # where the change comes from


def test_default_table_file_is_the_one_packaged():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"ubnext.tables" = ["*.json"]' in text
    assert (Path(__file__).resolve().parents[1] / "ubnext" / "tables" / "default.json").is_file()
    assert not (Path(__file__).resolve().parents[1] / "ubnext" / "tables" / "h200.json").exists()


@pytest.mark.parametrize("doc, message", [
    (document(), "entries must be a non-empty list"),
    (document(entry(), extra=1), "unknown key(s) extra"),
    ({"format": 2, "tables": {}}, "missing key(s) entries"),
    (document([1]), "entries[0]: must be an object with gpu, link, placement, mode, tables, got list"),
    (document({k: v for k, v in entry().items() if k != "link"}), "entries[0]: missing key(s) link"),
    (document(entry(link="infiniband")),
     "entries[0] (NVIDIA H200 infiniband plain graph): link 'infiniband' is not one of nvlink, pcie (or \"*\")"),
    (document(entry(placement="pinned")),
     "entries[0] (NVIDIA H200 nvlink pinned graph): placement 'pinned' is not one of plain, pool"),
    (document(entry(mode="stream")),
     "entries[0] (NVIDIA H200 nvlink plain stream): mode 'stream' is not one of graph, dependent, eager"),
    (document(entry(gpu="")), "entries[0] ( nvlink plain graph): gpu must be a non-empty string"),
    (document(entry(), entry(gpu=7)), "entries[1]: gpu must be a non-empty string"),
    (document(entry(), entry(rows=[[10, "ring"]], gpu="NVIDIA H100")),
     "entries[1] (NVIDIA H100 nvlink plain graph): tables['*']['bfloat16']: row 1: unknown algorithm 'ring'"),
    (document(entry(), entry(note=3)), "entries[1] (NVIDIA H200 nvlink plain graph): note must be a string"),
    (document(entry(), entry(mode="eager"), entry()),
     "entries[2] (NVIDIA H200 nvlink plain graph): the same machine key as entries[0]"),
    (document(entry(collectives={"all_gather": {"tables": {"4": {"bfloat16": [[None, "lamport"]]}}}})),
     "entries[0] (NVIDIA H200 nvlink plain graph): collectives['all_gather'].tables['4']['bfloat16']: "
     "row 1: lamport has no all_gather kernel"),
    (document(entry(collectives={"broadcast": {"tables": {"4": {"bfloat16": [[None, "lamport"]]}}}})),
     "collectives['broadcast'].tables['4']['bfloat16']: row 1: 'lamport' is not an algorithm of broadcast; use ll, "
     "copy, scatter_allgather, nccl"),
    (document(entry(collectives={"all_to_all": {"tables": {"2": {"float32": [[None, "scatter_allgather"]]}}}})),
     "row 1: 'scatter_allgather' is not an algorithm of all_to_all; use ll, copy, nccl"),
    (document(entry(collectives={"gather": {"tables": {"2": {"float32": [[None, "copy"]]}}}})),
     "collectives must be an object whose keys are among reduce_scatter, all_gather, broadcast, all_to_all, "
     "send_recv"),
    (document(entry(), note=["x"]), "note must be a string"),
])
def test_format_2_errors_name_the_entry_and_the_key(tmp_path, doc, message):
    path = write(tmp_path, doc)
    with pytest.raises(UbnextError) as info:
        load_table(path)
    text = str(info.value)
    assert text.startswith(f"selector: tune file {path}: ")
    assert message in text


# --------------------------------------------------------------------------- choosing the entry


def several_machines():
    """A document with several machines: H200 NVLink (plain and pool), H100 PCIe, and a '*'
    entry, which the shipped table lacks (the shipped table's own fallbacks: the tests of
    the shipped table below)."""
    return parse_table(document(
        entry(rows=[[None, "lamport_twoshot"]]),
        entry(placement="pool", rows=[[None, "lamport"]]),
        entry(gpu="NVIDIA H100 80GB HBM3", link="pcie", rows=[[None, "twoshot"]]),
        entry(gpu="*", rows=[[1024, "lamport"], [None, "nccl"]]),
    ), "t")


def test_choose_takes_the_exact_machine():
    t = several_machines().choose(Machine("NVIDIA H200"))
    assert t.key == H200 and t.why == "exact match"
    pool = several_machines().choose(Machine("NVIDIA H200", placement="pool"))
    assert pool.key == ("NVIDIA H200", "nvlink", "pool", "graph") and pool.why == "exact match"
    pcie = several_machines().choose(Machine("NVIDIA H100 80GB HBM3", link="pcie"))
    assert pcie.gpu == "NVIDIA H100 80GB HBM3" and pcie.why == "exact match"


def test_an_unmeasured_gpu_takes_the_same_family_then_star_then_the_first_entry():
    # H100 on NVLink: the only H100 entry is PCIe, so the same link wins: H200 (family H)
    # before the '*' entry
    t = several_machines().choose(Machine("NVIDIA H100 80GB HBM3"))
    assert t.key == H200
    assert t.why == "no entry for NVIDIA H100 80GB HBM3: NVIDIA H200, nearest measured of the same family (H)"
    # B200: no family entry on NVLink: the '*' entry
    b = several_machines().choose(Machine("NVIDIA B200"))
    assert b.gpu == "*" and b.why == "no entry for NVIDIA B200: the entry for any GPU"
    # no '*' entry either: the first entry of the file with the same link
    only = parse_table(document(entry(gpu="NVIDIA A100-SXM4-80GB"), entry()), "t")
    first = only.choose(Machine("NVIDIA B200"))
    assert first.gpu == "NVIDIA A100-SXM4-80GB"
    assert first.why == "no entry for NVIDIA B200: NVIDIA A100-SXM4-80GB, nearest measured (first such entry)"
    unknown = only.choose(Machine())
    assert unknown.gpu == "NVIDIA A100-SXM4-80GB" and unknown.why.startswith("GPU not known: ")


def test_another_link_only_as_a_last_resort_and_missing_placement_or_mode_fall_back():
    pcie_only = parse_table(document(entry(link="pcie")), "t").choose(Machine("NVIDIA H200"))
    assert pcie_only.link == "pcie" and pcie_only.why == "no nvlink entry: pcie's"
    # the same GPU on another link loses to an entry for any GPU on this one
    other_link = parse_table(document(entry(link="pcie"), entry(gpu="*", link="*")), "t")
    assert other_link.choose(Machine("NVIDIA H200")).gpu == "*"
    assert other_link.choose(Machine("NVIDIA H200", link="pcie")).gpu == "NVIDIA H200"
    eager = several_machines().choose(Machine("NVIDIA H200", mode="eager"))
    assert eager.key == H200 and eager.why == "no eager mode entry for NVIDIA H200 nvlink plain: graph's"
    # placement: the plain entry is listed first, yet pool asks for the pool entry
    assert several_machines().choose(Machine("NVIDIA H200", placement="pool")).placement == "pool"


def test_the_dependent_mode_takes_its_entry_and_falls_back_to_the_graph_entry():
    """UBNEXT_TABLE_MODE=dependent: the dependent entry where the table has one for the
    machine, else the graph entry, and the reason names what is missing. The GPU ranks
    before the mode: this GPU's graph entry wins over another GPU's dependent entry."""
    both = parse_table(document(entry(rows=[[None, "lamport_twoshot"]]),
                                entry(mode="dependent", rows=[[None, "lamport"]])), "t")
    dependent = both.choose(Machine("NVIDIA H200", mode="dependent"))
    assert dependent.mode == "dependent" and dependent.why == "exact match"
    assert both.choose(Machine("NVIDIA H200")).mode == "graph"  # graph still takes the graph entry
    assert both.choose(Machine("NVIDIA H100 80GB HBM3", mode="dependent")).mode == "dependent"  # family, mode
    fallback = default_table().choose(Machine("NVIDIA H200", mode="dependent"))
    assert fallback.key == H200 and fallback.why == (
        "no dependent mode entry for NVIDIA H200 nvlink plain: graph's" + H200_THRESHOLDS_NOT_TAKEN)
    other_gpu = parse_table(document(entry(), entry(gpu="NVIDIA H100 80GB HBM3", mode="dependent")), "t")
    chosen = other_gpu.choose(Machine("NVIDIA H200", mode="dependent"))
    assert chosen.key == H200 and chosen.why == "no dependent mode entry for NVIDIA H200 nvlink plain: graph's"
    # a placement and a mode both missing: each named with the key before it
    pool = several_machines().choose(Machine("NVIDIA H100 80GB HBM3", placement="pool", mode="dependent"))
    assert pool.key == ("NVIDIA H200", "nvlink", "pool", "graph")
    assert pool.why.endswith("(H); no dependent mode entry for NVIDIA H200 nvlink pool: graph's")
    star = parse_table(document(entry(gpu="*")), "t").choose(Machine("NVIDIA B200", placement="pool"))
    assert star.why == ("no entry for NVIDIA B200: the entry for any GPU; "
                        "no pool placement entry for any GPU nvlink: plain's")


def test_the_selector_follows_the_dependent_entry_where_asked(tmp_path):
    """The rows of a tune file's dependent entry serve a communicator asking for the
    dependent mode; one asking for graph keeps the graph entry; the shipped table (graph
    only) serves what the tune file lacks, whichever the mode."""
    table = parse_table(document(entry(rows=[[None, "twoshot"]]), entry(
        mode="dependent", tables={"4": {"bfloat16": [[4096, "lamport"], [None, "nccl"]]}})), "t")
    limits, usable = buffer_limits(Config.from_env({})), ["lamport", "lamport_twoshot", "twoshot", "nccl"]
    dependent = Selector(4, limits, usable, table, machine=Machine("NVIDIA H200", mode="dependent"))
    graph = Selector(4, limits, usable, table, machine=Machine("NVIDIA H200"))
    assert [dependent.select(n, "bfloat16") for n in (1024, 1 << 20)] == ["lamport", "nccl"]
    assert [graph.select(n, "bfloat16") for n in (1024, 1 << 20)] == ["twoshot", "twoshot"]
    assert [t.where for t in dependent.tables] == ["t: NVIDIA H200 nvlink plain dependent",
                                                   "default table: NVIDIA H200 nvlink plain graph"]
    assert dependent.tables[1].why == "no dependent mode entry for NVIDIA H200 nvlink plain: graph's" + (
        H200_THRESHOLDS_NOT_TAKEN)
    assert dependent.explain(1024, "bfloat16")[1] == ("table row ≤ 4 KiB for 4 ranks bfloat16 "
                                                     "(t: NVIDIA H200 nvlink plain dependent)")
    # a world size the tune file lacks: the shipped table's graph entry
    assert "(default table: NVIDIA H200 nvlink plain graph)" in Selector(
        2, limits, usable, table, machine=Machine("NVIDIA H200", mode="dependent")).explain(1024, "bfloat16")[1]


def test_family_of_gpu_names():
    assert family("NVIDIA H100 80GB HBM3") == family("NVIDIA H200") == family("NVIDIA H800") == "H"
    assert family("NVIDIA A100-SXM4-80GB") == "A" and family("NVIDIA GB200") == "GB"
    assert family("NVIDIA L40S") == "L" and family("NVIDIA GeForce RTX 4090") is None and family(None) is None


class _Local:
    """``allgather_obj`` over pretend local ranks: rank r contributes ``values[r]``."""

    def __init__(self, values):
        self.values = values

    def allgather_obj(self, obj):
        return list(self.values)


def test_every_rank_chooses_the_same_entry_with_mixed_gpus():
    names = ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    chosen = []
    for _ in names:  # each rank of the node
        machine, note = agreed_machine(_Local(names), "whatever this rank sees")
        assert machine == Machine("NVIDIA H200") and "different GPUs" in note and "NVIDIA H200" in note
        chosen.append(several_machines().choose(machine).digest())
    assert len(set(chosen)) == 1
    assert agreed_machine(_Local(["NVIDIA H200"] * 2), "NVIDIA H200") == (Machine("NVIDIA H200"), "")
    assert agreed_machine(_Local(["NVIDIA H200"] * 2), "NVIDIA H200", "dependent") == (
        Machine("NVIDIA H200", mode="dependent"), "")
    # different entries have different digests (so a disagreement would show)
    table = several_machines()
    assert len({t.digest() for t in table.entries}) == len(table.entries)


def test_a_rank_that_cannot_read_its_gpu_name_still_joins_the_allgather():
    """The name is read inside agreed_machine: a read that fails contributes None (a GPU not
    known) instead of leaving the other ranks waiting in the allgather."""
    class Recording:
        def __init__(self, others):
            self.others, self.sent = others, []

        def allgather_obj(self, obj):
            self.sent.append(obj)
            return [obj, *self.others]

    def broken():
        raise RuntimeError("cudaErrorUnknown")

    local = Recording(["NVIDIA H200"])
    machine, note = agreed_machine(local, broken)  # local rank 0 cannot read its name
    assert local.sent == [None] and machine == Machine() and "could not be read" in note
    assert agreed_machine(Recording(["NVIDIA H200"]), lambda: "NVIDIA H200") == (Machine("NVIDIA H200"), "")


class _Stop(Exception):
    pass


def _communicator_until_its_context(monkeypatch):
    """Communicator() on a CPU up to its CUDA context, where a fake Context stops it (_Stop):
    no preflight, each rank its own device, cupy's Device a stand-in. Returns the module."""
    import cupy

    from ubnext._api import communicator as _comm

    def context(device):
        raise _Stop("past agreed_machine")

    monkeypatch.setattr(_comm._preflight, "check", lambda op, config: None)
    monkeypatch.setattr(_comm, "map_devices", lambda local, device, current: local.rank)
    monkeypatch.setattr(_comm, "caller_device", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: SimpleNamespace(use=lambda: None))
    monkeypatch.setattr(_comm, "Context", context)
    return _comm


def test_the_communicator_reads_the_gpu_name_inside_the_allgather(monkeypatch):
    """Communicator(): a rank whose GPU name cannot be read does not leave the node's other
    ranks waiting in agreed_machine's allgather: every rank gets past it (to the next step,
    stopped here by a fake Context)."""
    from thread_ranks import run_ranks

    import ubnext

    def device_name(device):
        import threading

        if threading.current_thread().name == "rank1":
            raise RuntimeError("cudaErrorUnknown: cannot describe the device")
        return "NVIDIA H200"

    monkeypatch.setattr(_communicator_until_its_context(monkeypatch), "device_name", device_name)
    results = run_ranks(2, lambda boot: ubnext.Communicator(bootstrap=boot))
    assert all(isinstance(r, _Stop) for r in results), results


@pytest.mark.parametrize("overrides, mode", [({}, "graph"), ({"table_mode": "dependent"}, "dependent")])
def test_the_communicator_asks_for_the_mode_of_ubnext_table_mode(monkeypatch, overrides, mode):
    from thread_ranks import run_ranks

    import ubnext

    _comm = _communicator_until_its_context(monkeypatch)
    machines = []
    real = _comm.agreed_machine

    def agreed(local, gpu, *rest):
        machines.append(real(local, gpu, *rest)[0])
        return machines[-1], ""

    monkeypatch.setattr(_comm, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(_comm, "agreed_machine", agreed)
    results = run_ranks(2, lambda boot: ubnext.Communicator(bootstrap=boot, **overrides))
    assert all(isinstance(r, _Stop) for r in results), results
    assert machines == [Machine("NVIDIA H200", mode=mode)] * 2


def test_agreed_table_compares_every_entry(tmp_path):
    path = write(tmp_path, document(entry(), entry(gpu="NVIDIA H100")))
    here = load_table(path)

    class Ranks:
        def __init__(self, other):
            self.other = other

        def allgather_obj(self, obj):
            return [obj, self.other]

    assert agreed_table(path, Ranks((None, here.digest()))).digest() == here.digest()
    changed = parse_table(document(entry(), entry(gpu="NVIDIA H100", rows=[[None, "twoshot"]])), "x")
    with pytest.raises(UbnextError, match="the ranks read different tables"):
        agreed_table(path, Ranks((None, changed.digest())))


# --------------------------------------------------------------------------- format 1


def test_a_format_1_file_loads_as_one_entry_for_any_machine(tmp_path):
    old = json.loads(OLD_H200.read_text())
    path = write(tmp_path, old)
    table = load_table(path)
    assert table.format == 1 and len(table.entries) == 1
    (only,) = table.entries
    assert only.key == ("*",) * 4 and only.label == "any machine"
    assert only.note.startswith("format-1 table (machine: NVIDIA H200 (2 and 4 GPUs")
    # the other collectives' rows come along (else they would fall through to the default table)
    assert set(only.by_collective) == set(old["collectives"]) == {"reduce_scatter", "all_gather"}
    assert only.by_collective == as_rows(old["collectives"])
    for machine in (Machine("NVIDIA H200"), Machine("NVIDIA B200", link="pcie", mode="eager"), Machine()):
        chosen = table.choose(machine)
        assert chosen.rows == only.rows and chosen.by_collective == only.by_collective
    assert table.choose(Machine("NVIDIA B200")).why == "format-1 file: one entry for any machine"
    assert table.document["format"] == 2 and table.document["entries"][0]["tables"] == old["tables"]


# --------------------------------------------------------------------------- quantized thresholds


def quantized(tables, note=None):
    return {"tables": tables, **({"note": note} if note else {})}


def test_quantized_thresholds_choose_by_machine_and_world_size(tmp_path):
    """The size from which auto quantizes: the chosen entry's threshold for the world size
    (its own, then "*"), a float16 without thresholds taking bfloat16's; "never"; what is
    not there (the key, the world size, the format) is not measured: never; one rank never."""
    doc = document(
        entry(quantized=quantized({"2": {"bfloat16": {"int8": 64 * MiB, "int4": 16 * MiB, "fp8": "never"}},
                                   "*": {"bfloat16": {"int8": 32 * MiB}, "float16": {"int8": 128 * MiB}}},
                                  note="measured")),
        entry(gpu="NVIDIA H100"),  # no quantized key: an entry written before it existed
    )
    table = load_table(write(tmp_path, doc))
    where = f"tune file {tmp_path / 't.json'}: NVIDIA H200 nvlink plain graph"
    two = Selector(2, {}, ["nccl"], table, machine=Machine("NVIDIA H200"))
    assert two.quantized("int8", "bfloat16") == (64 * MiB, f"from 64 MiB (2 ranks bfloat16 (quantized, {where}))")
    assert two.quantized("int4", "float16") == (
        16 * MiB, f"from 16 MiB (2 ranks bfloat16 (no float16 rows) (quantized, {where}))")
    assert two.quantized("fp8", "bfloat16") == (None, f"never (measured not to pay: 2 ranks bfloat16 (quantized, "
                                                       f"{where}))")
    four = Selector(4, {}, ["nccl"], table, machine=Machine("NVIDIA H200"))
    assert four.quantized("int8", "bfloat16") == (
        32 * MiB, f"from 32 MiB (4 ranks (via '*') bfloat16 (quantized, {where}))")
    assert four.quantized("int8", "float16")[0] == 128 * MiB
    assert four.quantized("int4", "bfloat16") == (
        None, f"never: int4 not measured (4 ranks (via '*') bfloat16 (quantized, {where}))")
    assert four.quantized("int8", "float32") == (None, "")  # not a dtype the quantized two-shot takes
    assert Selector(1, {}, ["nccl"], table, machine=Machine("NVIDIA H200")).quantized("int8", "bfloat16") == (
        None, "never: one rank moves nothing over links")
    # the H100 takes its own entry, which has none, then the shipped table's entry for it
    h100 = Selector(2, {}, ["nccl"], table, machine=Machine(H100[0]))
    assert h100.quantized("int8", "bfloat16")[0] == shipped_thresholds(H100)["2"]["bfloat16"]["int8"]
    assert h100.quantized("int8", "bfloat16")[1].endswith(f"(quantized, default table: {' '.join(H100)}))")
    h100_8 = Selector(8, {}, ["nccl"], table, machine=Machine(H100[0]))  # measured nowhere
    assert h100_8.quantized("int8", "bfloat16") == (
        None, f"never: not measured for 8 ranks on {' '.join(H100)} (no selector table has quantized thresholds "
              "for them; python -m ubnext.tune --quantized measures them)")
    # a world size missing from the entry: not measured
    doc["entries"][0]["quantized"] = quantized({"2": {"bfloat16": {"int8": 64 * MiB}}})
    eight = Selector(8, {}, ["nccl"], parse_table(doc, "t"), machine=Machine("NVIDIA H200"))
    assert eight.quantized("int8", "bfloat16")[1].startswith("never: not measured for 8 ranks")
    # a GPU nobody measured takes the nearest measured entry's rows, never its thresholds
    a100 = Selector(2, {}, ["nccl"], parse_table(document(doc["entries"][0]), "t"), machine=Machine("NVIDIA A100"))
    assert a100.tables[0].gpu == "NVIDIA H200" and a100.quantized("int8", "bfloat16")[0] is None


def test_quantized_thresholds_change_the_digest():
    plain = parse_table(document(entry()), "t")
    with_q = parse_table(document(entry(quantized=quantized({"2": {"bfloat16": {"int8": 64 * MiB}}}))), "t")
    never = parse_table(document(entry(quantized=quantized({"2": {"bfloat16": {"int8": "never"}}}))), "t")
    assert len({plain.digest(), with_q.digest(), never.digest()}) == 3


def test_files_without_quantized_thresholds_still_load_and_leave_them_to_the_default_table(tmp_path):
    """An older format-2 file and a format-1 file have no thresholds: an opted-in
    communicator quantizes where the shipped table measured it pays (its H100 graph entry:
    2 and 4 ranks), as without a file, and at world sizes nobody measured never."""
    old2 = write(tmp_path, document(entry(gpu=H100[0], rows=[[1 * MiB, "lamport"], [None, "nccl"]])), "old2.json")
    old1 = write(tmp_path, json.loads(OLD_H200.read_text()), "old1.json")
    measured = shipped_thresholds(H100)
    for table in (None, load_table(old2), load_table(old1)):
        for nranks in (2, 4, 8):
            sel = Selector(nranks, {}, ["lamport", "nccl"], table, machine=Machine(H100[0]))
            for fmt in ("int8", "fp8", "int4"):
                threshold, why = sel.quantized(fmt, "bfloat16")
                if nranks == 8:
                    assert threshold is None and why.startswith("never: not measured for 8 ranks")
                else:
                    assert threshold == measured[str(nranks)]["bfloat16"][fmt], (table, nranks, fmt)
                    assert why.endswith(f"(quantized, default table: {' '.join(H100)}))"), why


@pytest.mark.parametrize("q, message", [
    ([1], "quantized must be an object {\"note\": ..., \"tables\""),
    ({"note": "x"}, "quantized must be an object"),
    ({"tables": {}}, "quantized.tables must be a non-empty object"),
    (quantized({"two": {"bfloat16": {"int8": 1}}}), "quantized.tables key 'two' is not a world size"),
    (quantized({"2": {"float32": {"int8": 1}}}), "dtype 'float32' is not quantized; use bfloat16, float16"),
    (quantized({"2": {"bfloat16": {"int2": 1}}}), "quantized.tables['2']['bfloat16']: unknown format 'int2'"),
    (quantized({"2": {"bfloat16": {"int8": 0}}}), "['int8']: 0 is not a positive byte count or \"never\""),
    (quantized({"2": {"bfloat16": {"int8": None}}}), "['int8']: None is not a positive byte count"),
    (quantized({"2": {"bfloat16": {}}}), "quantized.tables['2']['bfloat16'] must be a non-empty object"),
])
def test_quantized_threshold_errors_name_the_entry_and_the_key(q, message):
    with pytest.raises(UbnextError) as info:
        parse_table(document(entry(quantized=q)), "t")
    assert str(info.value).startswith("selector: t: entries[0] (NVIDIA H200 nvlink plain graph): ")
    assert message in str(info.value)


def rs_thresholds(tables):
    return {"collectives": {"reduce_scatter": {"tables": tables}}}


def test_reduce_scatter_thresholds_are_their_own(tmp_path):
    """The reduce-scatter's thresholds (``quantized.collectives.reduce_scatter``) are looked
    up as the all-reduce's, apart from them: an entry with only the all-reduce's leaves the
    reduce-scatter not measured (never), whatever the next table says for the all-reduce,
    and the next table's own reduce-scatter thresholds then serve; an entry may hold the
    reduce-scatter's alone."""
    both = document(entry(quantized={**quantized({"2": {"bfloat16": {"int8": 64 * MiB}}}),
                                     **rs_thresholds({"*": {"bfloat16": {"int8": 8 * MiB, "int4": "never"}}})}))
    table = load_table(write(tmp_path, both))
    where = f"tune file {tmp_path / 't.json'}: NVIDIA H200 nvlink plain graph"
    two = Selector(2, {}, ["nccl"], table, machine=Machine("NVIDIA H200"))
    assert two.quantized("int8", "bfloat16") == (64 * MiB, f"from 64 MiB (2 ranks bfloat16 (quantized, {where}))")
    assert two.quantized("int8", "float16", "reduce_scatter") == (
        8 * MiB, f"from 8 MiB (2 ranks (via '*') bfloat16 (no float16 rows) (quantized reduce_scatter, {where}))")
    assert two.quantized("int4", "bfloat16", "reduce_scatter")[1].startswith("never (measured not to pay: ")
    assert two.quantized("fp8", "bfloat16", "reduce_scatter")[1].startswith("never: fp8 not measured")
    assert two.quantized("int8", "bfloat16", "all_gather") == (None, "")  # the all-gather never quantizes
    # the all-reduce's only (this file's; the shipped H200 entry has none at 4 ranks): the
    # reduce-scatter was not measured
    only_ar = load_table(write(tmp_path, document(entry(quantized=quantized(
        {"2": {"bfloat16": {"int8": 1}}, "4": {"bfloat16": {"int8": 1}}}))), "ar.json"))
    assert not shipped_thresholds(H200, "reduce_scatter").get("4")
    for table_ in (only_ar, None):
        threshold, why = Selector(4, {}, ["nccl"], table_, machine=Machine("NVIDIA H200")).quantized(
            "int8", "bfloat16", "reduce_scatter")
        assert threshold is None and why == (
            "never: not measured for 4 ranks on NVIDIA H200 nvlink plain graph (no selector table has quantized "
            "reduce_scatter thresholds for them; python -m ubnext.tune --quantized measures them)")
    # at 2 ranks the shipped H200 entry has the reduce-scatter's own (measured on 2x H200):
    # those, not the file's all-reduce threshold
    measured = tune_h200x2("graph")["quantized"]["collectives"]["reduce_scatter"]["tables"]["2"]["bfloat16"]["int8"]
    assert measured == 16 * MiB
    assert Selector(2, {}, ["nccl"], only_ar, machine=Machine("NVIDIA H200")).quantized(
        "int8", "bfloat16", "reduce_scatter") == (
        measured, "from 16 MiB (2 ranks bfloat16 (quantized reduce_scatter, default table: NVIDIA H200 nvlink plain "
                  "graph))")
    only_rs = parse_table(document(entry(gpu=H100[0], quantized=rs_thresholds(
        {"2": {"bfloat16": {"int8": 4 * MiB}}}))), "t")
    sel = Selector(2, {}, ["nccl"], only_rs, machine=Machine(H100[0]))
    assert sel.quantized("int8", "bfloat16", "reduce_scatter")[0] == 4 * MiB
    assert sel.quantized("int8", "bfloat16")[1].endswith(f"(quantized, default table: {' '.join(H100)}))")
    assert Selector(1, {}, ["nccl"], only_rs, machine=Machine("NVIDIA H200")).quantized(
        "int8", "bfloat16", "reduce_scatter") == (None, "never: one rank moves nothing over links")


# ---- the shipped table itself (ubnext/tables/default.json, read as JSON here)
SHIPPED = Path(__file__).parents[1] / "ubnext" / "tables" / "default.json"


def shipped_thresholds(key, collective="all_reduce"):
    """The thresholds that the shipped file holds for the entry keyed ``key`` exactly, world
    key -> dtype -> format -> bytes, read from the JSON ({} where it has none)."""
    for e in json.loads(SHIPPED.read_text())["entries"]:
        if (e["gpu"], e["link"], e["placement"], e["mode"]) == tuple(key):
            q = e.get("quantized", {})
            return q.get("tables", {}) if collective == "all_reduce" else q.get("collectives", {}).get(
                collective, {}).get("tables", {})
    return {}


#: The shipped entries with quantized thresholds measured by python -m ubnext.tune --quantized
#: with today's kernel on nonzero inputs, and their world sizes (both collectives): H100 graph
#: mode (bench/results/tune_h100x{4,2}_quant.txt, 2026-11-27); H200 graph mode at 2 ranks
#: (TUNE_H200X2, 2026-11-29; its 4-rank thresholds, timed on zeros with the kernel before, stay
#: removed until measured again). An entry re-measured is added here with its evidence;
#: nothing else may hold thresholds.
MEASURED_THRESHOLDS = {H100: {"2", "4"}, H200: {"2"}}


def test_the_shipped_table_has_thresholds_only_for_the_machines_measured_with_todays_kernel():
    """No '*' in a key or world size; the H100 dependent entry has none (they were the graph
    entry's, not measured in that mode)."""
    entries = json.loads(SHIPPED.read_text())["entries"]
    assert {(e["gpu"], e["link"], e["placement"], e["mode"]) for e in entries if "quantized" in e} == set(
        MEASURED_THRESHOLDS)
    for key, worlds in MEASURED_THRESHOLDS.items():
        assert "*" not in key
        for collective in ("all_reduce", "reduce_scatter"):
            assert set(shipped_thresholds(key, collective)) == worlds, (key, collective)
    assert H100_DEPENDENT not in MEASURED_THRESHOLDS


def test_the_h200_thresholds_are_those_measured_on_2x_h200_in_graph_mode():
    """The shipped H200 entry's thresholds (2 ranks, both collectives) are the graph run's of
    TUNE_H200X2 (int8 and fp8 from 16 MiB, int4 from 8 MiB). The dependent run's (its
    reduce-scatter's int8 and fp8 from 8 MiB) are not shipped: the table has no dependent
    H200 entry, and a dependent communicator takes the graph entry's rows, not its thresholds."""
    (shipped,) = [e["quantized"] for e in json.loads(SHIPPED.read_text())["entries"]
                  if (e["gpu"], e["link"], e["placement"], e["mode"]) == H200]
    graph, dependent = tune_h200x2("graph")["quantized"], tune_h200x2("dependent")["quantized"]
    assert shipped["tables"] == graph["tables"] == {"2": {"bfloat16": {"int8": 16 * MiB, "fp8": 16 * MiB,
                                                                       "int4": 8 * MiB}}}
    assert shipped["collectives"]["reduce_scatter"]["tables"] == graph["collectives"]["reduce_scatter"]["tables"] == (
        graph["tables"])
    assert dependent["collectives"]["reduce_scatter"]["tables"] != graph["collectives"]["reduce_scatter"]["tables"]
    assert not any(e["mode"] == "dependent" and e["gpu"] == H200[0] for e in json.loads(SHIPPED.read_text())["entries"])


#: machines the shipped table is asked for: those measured (H100 and H200 graph) and machines
#: whose nearest entry is another's (the fallbacks), or that have an entry without thresholds
MACHINES = [Machine(H100[0]), Machine("NVIDIA A100-SXM4-80GB"), Machine("NVIDIA B200"), Machine("NVIDIA L40S"),
            Machine(None), Machine("NVIDIA H200"), Machine("NVIDIA H800"), Machine("NVIDIA H100 PCIe"),
            Machine(H100[0], link="pcie"), Machine(H100[0], mode="dependent"), Machine(H100[0], mode="eager"),
            Machine(H100[0], placement="pool"), Machine("NVIDIA H200", mode="dependent"),
            Machine("NVIDIA H200", link="pcie")]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.label())
@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_each_machine_gets_the_shipped_thresholds_of_its_own_entry_only(machine, nranks):
    """What the shipped file holds for the machine's exact key and world size (read from
    the JSON), and nothing from the nearest-entry fallback: every format, both collectives,
    both dtypes (float16 takes bfloat16's); where there is none auto keeps full precision
    and describe() says why."""
    sel = Selector(nranks, {}, ["nccl"], None, machine=machine)
    key = (machine.gpu, machine.link, machine.placement, machine.mode)
    for collective in ("all_reduce", "reduce_scatter"):
        want = shipped_thresholds(key, collective).get(str(nranks), {}).get("bfloat16", {})
        for fmt in ("int8", "fp8", "int4"):
            for dtype in ("bfloat16", "float16"):
                threshold, why = sel.quantized(fmt, dtype, collective)
                assert threshold == want.get(fmt), (collective, fmt, why)
                if fmt not in want:
                    assert why.startswith(f"never: not measured for {nranks} ranks on {machine.label()}"), why
    assert (key in MEASURED_THRESHOLDS and str(nranks) in MEASURED_THRESHOLDS[key]) == bool(
        shipped_thresholds(key).get(str(nranks)))


def test_a_fallback_entry_says_its_thresholds_are_not_taken():
    """Another link, mode or GPU of the family: the rows of the measured entry, its
    thresholds dropped, and the reason says so; an entry whose key says '*' keeps them."""
    doc = document(entry(quantized=quantized({"2": {"bfloat16": {"int8": 64 * MiB}}})))
    table = parse_table(doc, "t")
    for machine in (Machine("NVIDIA H200", link="pcie"), Machine("NVIDIA H200", mode="dependent"),
                    Machine("NVIDIA H100 80GB HBM3")):
        chosen = table.choose(machine)
        assert chosen.key == H200 and not chosen.quantized, machine
        assert chosen.why.endswith("; its quantized thresholds not taken (measured on NVIDIA H200 nvlink plain "
                                   "graph only)"), chosen.why
    assert table.choose(Machine("NVIDIA H200")).quantized and table.choose(Machine("NVIDIA H200")).why == "exact match"
    star = parse_table(document(entry(gpu="*", mode="*", quantized=quantized({"2": {"bfloat16": {"int8": 1}}}))), "t")
    assert star.choose(Machine("NVIDIA B200", mode="dependent")).quantized  # '*' says any: kept


def test_reduce_scatter_thresholds_change_the_digest():
    ar = quantized({"2": {"bfloat16": {"int8": 64 * MiB}}})
    digests = {parse_table(document(entry(quantized=q)), "t").digest() for q in (
        ar, {**ar, **rs_thresholds({"2": {"bfloat16": {"int8": 64 * MiB}}})},
        {**ar, **rs_thresholds({"2": {"bfloat16": {"int8": 32 * MiB}}})})}
    assert len(digests) == 3


@pytest.mark.parametrize("q, message", [
    ({"note": "x"}, "(tables or collectives, or both)"),
    ({"collectives": {}}, "quantized.collectives must be a non-empty object whose keys are among reduce_scatter"),
    ({"collectives": {"all_gather": {"tables": {"2": {"bfloat16": {"int8": 1}}}}}}, "the all-gather stays exact"),
    ({"collectives": {"reduce_scatter": {"2": {}}}}, "quantized.collectives['reduce_scatter'] must be an object"),
    (rs_thresholds({"2": {"float32": {"int8": 1}}}), "quantized.collectives['reduce_scatter'].tables['2']: dtype "
                                                     "'float32' is not quantized"),
    (rs_thresholds({"2": {"bfloat16": {"int8": -1}}}), "quantized.collectives['reduce_scatter'].tables['2']"
                                                       "['bfloat16']['int8']: -1 is not a positive byte count"),
])
def test_reduce_scatter_threshold_errors_name_the_key(q, message):
    with pytest.raises(UbnextError) as info:
        parse_table(document(entry(quantized=q)), "t")
    assert message in str(info.value), str(info.value)


# --------------------------------------------------------------------------- the same choices as before


def _selections(selector):
    sizes = [1 << s for s in range(4, 31)] + [(1 << s) + 16 for s in range(4, 31)]
    return {(c, dtype, n): (selector.select(n, dtype, c), selector.explain(n, dtype, c)[0])
            for c in COLLECTIVES for dtype in KERNEL_DTYPES for n in sizes} | {
        ("fused", dtype, n): selector.select_fused(n, dtype) for dtype in KERNEL_DTYPES for n in sizes}


@pytest.mark.parametrize("usable", [
    ["lamport", "lamport_twoshot", "twoshot", "nccl"],
    ["lamport", "twoshot", "nccl"],
    ["lamport", "lamport_twoshot", "twoshot", "nccl", "nvls_lamport", "nvls"],
])
@pytest.mark.parametrize("config", [{}, {"lamport_max_kb": 128}, {"lamport_twoshot_max_kb": 2048}])
def test_the_h200_rows_choose_as_the_format_1_table_did(usable, config):
    """Old: the format-1 file's rows (consulted first, and covering every world size and
    collective, they decide everything). New: the shipped format-2 table on an H200, on a
    GPU nobody measured, and with no GPU known. Same algorithm everywhere but for the one
    deliberate change (ONE_SHOT_4): at 4 ranks, all-reduces (plain and fused) of more
    than 256 KiB up to 512 KiB now take the Lamport one-shot (its multicast instantiation
    where multicast is usable) where its buffers hold them; and for the 2-rank
    reduce-scatters and all-gathers, which follow the rows measured on 2x H200
    (format_1_rows_measured) instead of format 1's unmeasured ones. The format-1 rows with
    those changes choose exactly as the shipped table."""
    old_table = parse_table(json.loads(OLD_H200.read_text()), "old")
    changed_table = parse_table(format_1_rows_changed(), "old, changed")
    measured_table = parse_table(format_1_rows_measured(), "old, changed, measured")
    limits = buffer_limits(Config.from_env({}, **config))
    one_shot = "nvls_lamport" if "nvls_lamport" in usable else "lamport"
    for nranks in (1, 2, 3, 4, 8):
        old = _selections(Selector(nranks, limits, usable, old_table))
        changed = _selections(Selector(nranks, limits, usable, changed_table))
        fits = limits["lamport"][0] >= ONE_SHOT_4["now"]
        want = {key for key in old if nranks == 4 and fits and key[0] in ("all_reduce", "fused")
                and ONE_SHOT_4["was"] < key[2] <= ONE_SHOT_4["now"]}
        assert bool(want) == (nranks == 4 and fits)  # the grid has sizes in between
        assert {key for key in old if old[key] != changed[key]} == want, (nranks, config)
        assert all(changed[key] in (one_shot, (one_shot, one_shot)) for key in want)
        assert all(old[key] not in (one_shot, (one_shot, one_shot)) for key in want)
        # the measured rows: only 2-rank reduce-scatters and all-gathers choose otherwise
        measured = _selections(Selector(nranks, limits, usable, measured_table))
        moved = {key for key in changed if changed[key] != measured[key]}
        assert {key[0] for key in moved} == ({"reduce_scatter", "all_gather"} if nranks == 2 else set()), nranks
        for machine in (Machine("NVIDIA H200"), Machine("NVIDIA H800"), Machine("NVIDIA A100-SXM4-80GB"), None):
            new = Selector(nranks, limits, usable, machine=machine)
            assert new.tables[0].key == H200
            assert _selections(new) == measured, (nranks, machine)


# --------------------------------------------------------------------------- tune


def test_tune_merges_into_a_format_1_file_as_format_2():
    old = json.loads(OLD_H200.read_text())
    doc = tune_table.merged_document(old, "NVIDIA H100 80GB HBM3", 2, {"bfloat16": [[None, "nccl"]]}, {"bfloat16": {}})
    table = parse_table(doc, "t")
    assert doc["format"] == 2 and [t.key for t in table.entries] == [
        ("*",) * 4, ("NVIDIA H100 80GB HBM3", "nvlink", "plain", "graph")]
    assert table.entries[0].entry["tables"] == old["tables"]
    assert table.entries[0].entry["collectives"] == old["collectives"]
    assert table.entries[0].by_collective == as_rows(old["collectives"])
    # the new entry starts from the format-1 rows that served this GPU: only 2 ranks bfloat16 changed
    h100 = table.choose(Machine("NVIDIA H100 80GB HBM3"))
    assert h100.rows == {**table.entries[0].rows, "2": {**table.entries[0].rows["2"], "bfloat16": ((None, "nccl"),)}}
    assert h100.by_collective == table.entries[0].by_collective
    assert table.choose(Machine("NVIDIA B200")).gpu == "*"  # the old rows serve other GPUs
    assert table.choose(Machine("NVIDIA H200")).gpu == "NVIDIA H100 80GB HBM3"  # but the family first
    assert old == json.loads(OLD_H200.read_text())  # not mutated


def test_tune_replaces_only_its_machines_rows():
    base = document(entry(), entry(gpu="NVIDIA H100", rows=[[None, "twoshot"]]))
    doc = tune_table.merged_document(copy.deepcopy(base), "NVIDIA H100", 4, {"bfloat16": [[None, "nccl"]]},
                               {"bfloat16": {"winners": ["nccl"]}})
    assert doc["entries"][0] == base["entries"][0]
    h100 = doc["entries"][1]
    assert h100["tables"] == {"*": {"bfloat16": [[None, "twoshot"]]}, "4": {"bfloat16": [[None, "nccl"]]}}
    assert h100["measured"] == {"4": {"bfloat16": {"winners": ["nccl"]}}}
    pool = tune_table.merged_document(doc, "NVIDIA H100", 4, {"bfloat16": [[None, "lamport"]]}, {}, placement="pool")
    assert [(e["gpu"], e["placement"]) for e in pool["entries"]] == [
        ("NVIDIA H200", "plain"), ("NVIDIA H100", "plain"), ("NVIDIA H100", "pool")]


def test_tune_run_writes_an_entry_for_the_gpu_it_ran_on(monkeypatch, tmp_path, capsys):
    import bench_fakes as fakes
    from test_tune import ALL, FakeComm, fake_measure

    cupy = fakes.install(monkeypatch)
    cupy.zeros = lambda shape, dtype: fakes.empty(shape, dtype)
    cupy.empty_like = lambda a: fakes.empty(a.host.shape, a.host.dtype)
    monkeypatch.setattr(tune, "measure", fake_measure())
    out = tmp_path / "tune.json"
    out.write_text(OLD_H200.read_text())  # an older tune file: merged into, as format 2
    argv = ["-o", str(out), "-e", "64M"]
    assert tune.run(FakeComm(4, usable=ALL), tune.parse_args(argv), argv) == 0
    # the new entry starts from the format-1 rows (2, 4, '*'), 4 ranks bfloat16 measured
    assert "# wrote " + str(out) + " (entry Fake GPU nvlink plain graph: world sizes 2, 4, *)" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["format"] == 2
    assert [(e["gpu"], e["link"], e["placement"], e["mode"]) for e in written["entries"]] == [
        ("*", "*", "*", "*"), ("Fake GPU", "nvlink", "plain", "graph")]
    chosen = load_table(str(out)).choose(Machine("Fake GPU"))
    assert chosen.why == "exact match" and set(chosen.rows) == {"2", "4", "*"}
    assert set(chosen.entry["measured"]) == {"4"}
    # the reduce-scatter's and all-gather's 4-rank bfloat16 rows measured; the format-1 file's others kept
    old = load_table(str(OLD_H200)).entries[0].by_collective
    for collective, crossover in (("reduce_scatter", 32 << 20), ("all_gather", 8 << 20)):
        got = chosen.by_collective[collective]
        assert got["4"]["bfloat16"] == ((crossover, "twoshot"), (None, "nccl"))
        assert {**got, "4": {**got["4"], "bfloat16": old[collective]["4"]["bfloat16"]}} == old[collective]


def test_tune_rerun_over_a_format_1_file_changes_only_what_it_measured(tmp_path):
    """A format-1 file tuned at 2 and 4 ranks on this GPU, tuned again at 4 ranks (as run()
    merges: into load_table(...).document): 2 ranks, the other dtypes and the other
    collectives keep the file's rows on this GPU, as format 1's merge kept them; other GPUs
    keep the rows for any machine."""
    old = {"format": 1, "machine": "NVIDIA H200",
           "tables": {"2": {"bfloat16": [[None, "twoshot"]]}, "4": {"bfloat16": [[None, "twoshot"]],
                                                                    "float32": [[None, "twoshot"]]}},
           "collectives": {"reduce_scatter": {"tables": {"*": {"bfloat16": [[None, "twoshot"]]}}}}}
    path = write(tmp_path, old)
    doc = tune_table.merged_document(load_table(path).document, "NVIDIA H200", 4, {"bfloat16": [[None, "nccl"]]},
                               {"bfloat16": {}})
    table = parse_table(doc, "t")
    limits, usable = buffer_limits(Config.from_env({})), ["lamport", "lamport_twoshot", "twoshot", "nccl"]
    for gpu, four in (("NVIDIA H200", "nccl"), ("NVIDIA B200", "twoshot")):
        two = Selector(2, limits, usable, table, machine=Machine(gpu))
        assert two.select(1 << 20, "bfloat16") == "twoshot", gpu  # not the default table's lamport
        assert two.select(1 << 10, "bfloat16", "reduce_scatter") == "twoshot", gpu
        four_ranks = Selector(4, limits, usable, table, machine=Machine(gpu))
        assert four_ranks.select(1 << 10, "bfloat16") == four and four_ranks.select(1 << 10, "float32") == "twoshot"
    assert "NVIDIA H200" in table.entry(H200).note and set(table.entry(H200).entry["measured"]) == {"4"}


# --------------------------------------------------------------------------- describe and info


def _fake_comm(selector):
    cfg = Config.from_env({})
    return SimpleNamespace(rank=0, size=4, device=0, config=cfg, pool=None, path="kernels on the symmetric pool",
                           local_rank=0, local_size=4, selector=selector, algorithms=lambda: ["lamport", "nccl"])


def test_describe_says_which_entry_and_why(monkeypatch):
    from ubnext._api import report as _report

    monkeypatch.setattr("ubnext._environment.devices.device_name", lambda device: "NVIDIA H100 80GB HBM3")
    limits = buffer_limits(Config.from_env({}))
    d = _report.report(_fake_comm(Selector(4, limits, ["lamport", "nccl"], machine=Machine("NVIDIA H200"))))
    assert d["tables"] == ["default table: NVIDIA H200 nvlink plain graph (exact match)"]
    h800 = Selector(4, limits, ["lamport", "nccl"], machine=Machine("NVIDIA H800"))
    d = _report.report(_fake_comm(h800))
    assert d["tables"] == ["default table: NVIDIA H200 nvlink plain graph (no entry for NVIDIA H800: "
                           f"NVIDIA H200, nearest measured of the same family (H){H200_THRESHOLDS_NOT_TAKEN})"]
    text = str(d)
    assert "selector tables: default table: NVIDIA H200 nvlink plain graph (no entry for NVIDIA H800" in text
    assert "table row ≤ 512 KiB for 4 ranks bfloat16 (default table: NVIDIA H200 nvlink plain graph)" in text
    assert set(d["selection"]) == set(DTYPES)


def test_describe_says_when_the_dependent_mode_falls_back_to_a_graph_entry(monkeypatch, tmp_path):
    from ubnext._api import report as _report

    monkeypatch.setattr("ubnext._environment.devices.device_name", lambda device: "NVIDIA H200")
    limits = buffer_limits(Config.from_env({}))
    tuned = load_table(write(tmp_path, document(entry(mode="dependent", rows=[[None, "lamport"]]))))
    dependent = Machine("NVIDIA H200", mode="dependent")
    comm = _fake_comm(Selector(4, limits, ["lamport", "nccl"], tuned, machine=dependent))
    comm.config = Config.from_env({"UBNEXT_TABLE_MODE": "dependent"})
    d = _report.report(comm)
    assert d["config"]["UBNEXT_TABLE_MODE"] == "dependent"
    where = f"{tuned.source}: NVIDIA H200 nvlink plain dependent"
    assert d["tables"] == [f"{where} (exact match)",
                           "default table: NVIDIA H200 nvlink plain graph (no dependent mode entry for "
                           f"NVIDIA H200 nvlink plain: graph's{H200_THRESHOLDS_NOT_TAKEN})"]
    text = str(d)
    assert "  UBNEXT_TABLE_MODE      dependent" in text
    assert ("selector tables: " + ", then ".join(d["tables"])) in text
    assert f"lamport  table row (any size) for 4 ranks (via '*') bfloat16 ({where})" in text


def test_info_lists_the_entries_and_the_choice_for_gpu_0(tmp_path):
    from ubnext._tools import info as _info

    lines = _info.table_lines({}, "NVIDIA H800")
    assert lines[0] == "default table:"
    assert lines[1].startswith("  entry NVIDIA H200 nvlink plain graph: world sizes 2 (bfloat16/float16/float32), 4")
    assert lines[2].startswith("  entry NVIDIA H100 80GB HBM3 nvlink plain graph: world sizes 4 (bfloat16/float32), 2")
    assert lines[3].startswith("  entry NVIDIA H100 80GB HBM3 nvlink plain dependent: world sizes 4 (bfloat16)")
    assert lines[4] == ("  for NVIDIA H800 nvlink plain graph: entry NVIDIA H200 nvlink plain graph "
                        f"(no entry for NVIDIA H800: NVIDIA H200, nearest measured of the same family (H)"
                        f"{H200_THRESHOLDS_NOT_TAKEN})")
    assert _info.table_lines({}, "NVIDIA H200")[4].endswith("entry NVIDIA H200 nvlink plain graph (exact match)")
    assert _info.table_lines({}, "NVIDIA H100 80GB HBM3")[4].endswith(
        "entry NVIDIA H100 80GB HBM3 nvlink plain graph (exact match)")
    path = write(tmp_path, json.loads(OLD_H200.read_text()))
    lines = _info.table_lines({"UBNEXT_TUNE_FILE": path}, "NVIDIA H200")
    assert f"tune file {path} (UBNEXT_TUNE_FILE) (format 1: one entry for any machine): consulted first" in lines
    assert "  for NVIDIA H200 nvlink plain graph: entry any machine (format-1 file: one entry for any machine)" \
        in lines


def test_info_chooses_for_the_mode_of_ubnext_table_mode(tmp_path):
    from ubnext._tools import info as _info

    lines = _info.table_lines({"UBNEXT_TABLE_MODE": "dependent"}, "NVIDIA H200")
    assert lines[4] == ("  for NVIDIA H200 nvlink plain dependent: entry NVIDIA H200 nvlink plain graph "
                        f"(no dependent mode entry for NVIDIA H200 nvlink plain: graph's{H200_THRESHOLDS_NOT_TAKEN})")
    assert _info.table_lines({"UBNEXT_TABLE_MODE": "dependent"}, "NVIDIA H100 80GB HBM3")[4].endswith(
        "entry NVIDIA H100 80GB HBM3 nvlink plain dependent (exact match)")
    path = write(tmp_path, document(entry(), entry(mode="dependent")))
    lines = _info.table_lines({"UBNEXT_TABLE_MODE": "Dependent", "UBNEXT_TUNE_FILE": path}, "NVIDIA H200")
    assert lines[-1] == ("  for NVIDIA H200 nvlink plain dependent: entry NVIDIA H200 nvlink plain dependent "
                         "(exact match)")
    # an invalid mode: the configuration section reports it; the entries are chosen for the default
    assert _info.table_lines({"UBNEXT_TABLE_MODE": "eager"}, "NVIDIA H200")[4].endswith("(exact match)")
    assert "UBNEXT_TABLE_MODE" in _info.config_lines({"UBNEXT_TABLE_MODE": "eager"})[0]


def test_an_h100_takes_its_measured_rows():
    """The H100 entries (python -m ubnext.tune with every collective, bench/results/
    tune_h100x*_all.txt; the sweeps rsag_h100x* agree): the all-reduce's 2-rank Lamport two-shot
    up to 64 MiB, float32's own 4-rank rows, and NCCL for reduce-scatters and all-gathers
    past 16 MiB, where the H200 entry's unmeasured 4-rank rows keep the Lamport two-shot."""
    limits = buffer_limits(Config.from_env({}))
    usable = ["lamport", "lamport_twoshot", "twoshot", "nccl"]
    h100 = {n: Selector(n, limits, usable, machine=Machine("NVIDIA H100 80GB HBM3")) for n in (2, 4)}
    h200 = {n: Selector(n, limits, usable, machine=Machine("NVIDIA H200")) for n in (2, 4)}
    assert h100[2].tables[0].key == H100 and h100[4].tables[0].key == H100
    assert [h100[2].select(n, "bfloat16") for n in (1 * MiB, 1 * MiB + 2, 64 * MiB, 64 * MiB + 2)] == [
        "lamport", "lamport_twoshot", "lamport_twoshot", "nccl"]
    assert [h100[4].select(n, "float32") for n in (64 * MiB, 64 * MiB + 4)] == ["lamport_twoshot", "nccl"]
    assert [h100[4].select(n, "bfloat16") for n in (32 * MiB, 32 * MiB + 2)] == ["lamport_twoshot", "nccl"]
    for collective in ("reduce_scatter", "all_gather"):
        for n in (2, 4):
            assert [h100[n].select(s, "bfloat16", collective) for s in (16 * MiB, 16 * MiB + 2 * n)] == [
                "lamport_twoshot", "nccl"], (collective, n)
        assert h200[4].select(16 * MiB + 8, "bfloat16", collective) == "lamport_twoshot"  # not measured there
    dependent = Selector(4, limits, usable, machine=Machine("NVIDIA H100 80GB HBM3", mode="dependent"))
    assert dependent.tables[0].key == H100_DEPENDENT and dependent.tables[0].why == "exact match"


@pytest.mark.parametrize("mode", ["graph", "dependent"])
def test_an_h200_takes_the_2_rank_reduce_scatter_and_all_gather_rows_measured_on_2x_h200(mode):
    """bench/results/tune_h200x2_1129_graph.txt (2x H200, 2026-11-29): bfloat16's reduce-scatter
    and all-gather take the Lamport two-shot up to 16 MiB, the barrier two-shot up to 64 MiB,
    NCCL above (128 MiB: 303.98 µs against the two-shot's 352.49); float16 takes bfloat16's
    rows; float32's all-gather as bfloat16's, its reduce-scatter NCCL past 16 MiB (32 MiB:
    the two-shot 86.71 against 89.10, under the 3 % margin). The dependent run chose the same
    bfloat16 rows; no dependent H200 entry is shipped, so that mode takes the graph entry's.
    4 ranks keep the unmeasured rows (the Lamport two-shot up to 32 MiB)."""
    assert {c: tune_h200x2("dependent")["collectives"][c]["tables"]["2"]["bfloat16"]
            for c in ("reduce_scatter", "all_gather")} == {
        c: tune_h200x2("graph")["collectives"][c]["tables"]["2"]["bfloat16"] for c in ("reduce_scatter", "all_gather")}
    limits = buffer_limits(Config.from_env({}))
    usable = ["lamport", "lamport_twoshot", "twoshot", "nccl"]
    two = Selector(2, limits, usable, machine=Machine("NVIDIA H200", mode=mode))
    assert two.tables[0].key == H200
    sizes = (1 * KiB, 16 * MiB, 16 * MiB + 8, 64 * MiB, 64 * MiB + 8, 256 * MiB)
    rows = ["lamport_twoshot", "lamport_twoshot", "twoshot", "twoshot", "nccl", "nccl"]
    want = {("reduce_scatter", "bfloat16"): rows, ("reduce_scatter", "float16"): rows,
            ("reduce_scatter", "float32"): ["lamport_twoshot", "lamport_twoshot", "nccl", "nccl", "nccl", "nccl"],
            ("all_gather", "bfloat16"): rows, ("all_gather", "float16"): rows, ("all_gather", "float32"): rows}
    assert {(c, dtype): [two.select(n, dtype, c) for n in sizes] for c, dtype in want} == want
    four = Selector(4, limits, usable, machine=Machine("NVIDIA H200", mode=mode))
    for collective in ("reduce_scatter", "all_gather"):
        assert [four.select(n, "bfloat16", collective) for n in (32 * MiB, 32 * MiB + 8)] == [
            "lamport_twoshot", "nccl"], collective


@pytest.mark.parametrize("mode", ["graph", "dependent"])
def test_thresholds_tune_writes_serve_exactly_the_machine_world_size_and_mode_it_ran_on(tmp_path, mode):
    """python -m ubnext.tune --quantized on 2x H200 (tune_table.merged_document, as run() calls it):
    a communicator of that GPU, mode and world size takes the thresholds written; another
    world size, mode or GPU (the same family) takes the rows at most, never the thresholds."""
    rows = {"bfloat16": [[1 * MiB, "lamport"], [None, "lamport_twoshot"]]}
    doc = tune_table.merged_document(None, "NVIDIA H200", 2, rows, {"bfloat16": {}}, mode=mode,
                               quantized={"bfloat16": {"int8": 16 * MiB, "fp8": "never", "int4": 8 * MiB}},
                               quantized_rs={"bfloat16": {"int8": 32 * MiB}})
    table = load_table(write(tmp_path, doc))
    here = Selector(2, {}, ["nccl"], table, machine=Machine("NVIDIA H200", mode=mode))
    assert [here.quantized(f, "bfloat16")[0] for f in ("int8", "fp8", "int4")] == [16 * MiB, None, 8 * MiB]
    assert here.quantized("int8", "bfloat16", "reduce_scatter")[0] == 32 * MiB
    other_mode = "graph" if mode == "dependent" else "dependent"
    for nranks, machine in ((4, Machine("NVIDIA H200", mode=mode)), (2, Machine("NVIDIA H200", mode=other_mode)),
                            (2, Machine("NVIDIA H100 80GB HBM3" if mode == "dependent" else "NVIDIA H800", mode=mode))):
        sel = Selector(nranks, {}, ["nccl"], table, machine=machine)
        for collective in ("all_reduce", "reduce_scatter"):
            # the tune file's thresholds never; the shipped table's only for its measured machine
            want = (shipped_thresholds((machine.gpu, machine.link, machine.placement, machine.mode), collective)
                    .get(str(nranks), {}).get("bfloat16", {}))
            assert {f: sel.quantized(f, "bfloat16", collective)[0] for f in ("int8", "fp8", "int4")} == {
                f: want.get(f) for f in ("int8", "fp8", "int4")}, (nranks, machine, collective)


@pytest.mark.parametrize("setting, archs, refused", [
    ("fp8", (90, 80), "local rank 1's: 8.0); use int8 or int4"), ("fp8", (86, 90), "local rank 0's: 8.6); use int8 or int4"),
    ("fp8", (89, 90), None), ("int8", (80, 70), None), ("int4", (80, 80), None), ("off", (80, 80), None)])
def test_the_communicator_refuses_an_opt_in_to_a_format_a_gpu_of_the_node_cannot_run(monkeypatch, setting, archs,
                                                                                       refused):
    """UBNEXT_QUANTIZED=fp8 on a node with a GPU before sm_89: one line at construction, on
    every rank alike (the ranks gather their compute capabilities), so auto never chooses a
    format that would raise on a call; the integer formats and no opt-in pass (to the next
    step, stopped here by a fake Context)."""
    import threading

    import cupy
    from thread_ranks import run_ranks

    import ubnext

    _comm = _communicator_until_its_context(monkeypatch)
    monkeypatch.setattr(_comm, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    arch = {f"rank{r}": a for r, a in enumerate(archs)}
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: SimpleNamespace(
        use=lambda: None, compute_capability=str(arch[threading.current_thread().name])))
    results = run_ranks(2, lambda boot: ubnext.Communicator(bootstrap=boot, quantized=setting))
    if refused is None:
        assert all(isinstance(r, _Stop) for r in results), results
    else:
        for r in results:
            assert isinstance(r, UbnextError) and str(r).startswith(
                f"Communicator: UBNEXT_QUANTIZED=fp8 needs compute capability 8.9 or newer on every GPU of the node "
                f"(") and str(r).endswith(refused) and "\n" not in str(r), r


# --------------------------------------------------------------------------- the data movers' rows


MOVER_ROWS = {"broadcast": {"note": "x", "tables": {"4": {"float32": [[4 * KiB, "ll"], [MiB, "nccl"],
                                                                     [None, "scatter_allgather"]]}}},
              "all_to_all": {"tables": {"*": {"bfloat16": [[64 * KiB, "ll"], [None, "copy"]]}}},
              "send_recv": {"tables": {"2": {"bfloat16": [[None, "nccl"]]}}}}


def test_mover_rows_choose_by_bytes_for_any_dtype_and_only_where_measured(tmp_path):
    """A data mover's rows (an entry's collectives, algorithms of MOVER_SERVES) choose by the
    bytes moved, for every dtype (a dtype without rows takes another's); a world size
    without rows, or a table without them (the shipped one), gives None: today's rule."""
    table = load_table(write(tmp_path, document(entry(collectives=MOVER_ROWS))))
    assert table.entries[0].by_collective["broadcast"]["4"]["float32"][2] == (None, "scatter_allgather")
    sel = Selector(4, buffer_limits(Config()), ["nccl"], table, machine=Machine("NVIDIA H200"))
    every = lambda name: True  # noqa: E731
    for dtype in DTYPES:
        assert sel.mover("broadcast", 4 * KiB, dtype, every)[0] == "ll"
        assert sel.mover("broadcast", 4 * KiB + 1, dtype, every)[0] == "nccl"
        assert sel.mover("broadcast", MiB + 1, dtype, every)[0] == "scatter_allgather"
    algo, why = sel.mover("broadcast", 100, "int8", lambda name: name != "ll")
    assert algo == "nccl" and why.startswith("table row ≤ 1 MiB for 4 ranks float32 (no int8 rows) (broadcast, tune file")
    assert sel.mover("all_to_all", 1 << 30, "float16", every)[0] == "copy"
    assert sel.mover("all_to_all", 1, "float16", lambda name: name == "nccl") is None
    assert sel.mover("send_recv", 1, "bfloat16", every) is None  # rows for 2 ranks only
    assert sel.mover_algorithms("broadcast") == {"ll", "nccl", "scatter_allgather"}
    assert sel.mover_algorithms("send_recv") == set()
    shipped = Selector(4, buffer_limits(Config()), ["nccl"], None, machine=Machine("NVIDIA H200"))
    assert all(shipped.mover_algorithms(c) == set() for c in ("broadcast", "all_to_all", "send_recv"))
    assert shipped.mover("broadcast", 1, "bfloat16", every) is None


def test_mover_rows_serve_only_the_machine_they_were_measured_on(tmp_path):
    """An H200 entry's mover rows: an H200 takes them; an H100 (the same family's entry),
    the dependent mode (graph's entry) and another link do not (auto's rule of today),
    and the reason says so; the entry's other rows still serve them; an entry for any GPU
    ("*") serves every GPU."""
    rows = {"broadcast": MOVER_ROWS["broadcast"], "reduce_scatter": {"tables": {"4": {"bfloat16": [[None, "nccl"]]}}}}
    path = write(tmp_path, document(entry(collectives=rows, quantized=quantized({"4": {"bfloat16": {"int8": MiB}}}))))
    table = load_table(path)
    every = lambda name: True  # noqa: E731
    for machine, taken in ((Machine("NVIDIA H200"), True), (Machine("NVIDIA H100 80GB HBM3"), False),
                           (Machine("NVIDIA H200", mode="dependent"), False), (Machine("NVIDIA H200", "pcie"), False)):
        sel = Selector(4, buffer_limits(Config()), ["nccl"], table, machine=machine)
        assert (sel.mover("broadcast", KiB, "float32", every) is not None) == taken, machine
        chosen = table.choose(machine)
        assert ("data movers' rows" in chosen.why) == (not taken)
        assert chosen.by_collective["reduce_scatter"] == {"4": {"bfloat16": ((None, "nccl"),)}}
    why = table.choose(Machine("NVIDIA H100 80GB HBM3")).why
    assert why.endswith("; its quantized thresholds and data movers' rows not taken (measured on NVIDIA H200 "
                        "nvlink plain graph only)")
    star = load_table(write(tmp_path, document(entry(gpu="*", collectives=rows)), "star.json"))
    sel = Selector(4, buffer_limits(Config()), ["nccl"], star, machine=Machine("NVIDIA B200"))
    assert sel.mover("broadcast", MiB + 1, "bfloat16", every)[0] == "scatter_allgather"
