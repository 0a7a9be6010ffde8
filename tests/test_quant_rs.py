"""The quantized reduce-scatter without a GPU: ``precision=`` on ``Communicator.reduce_scatter``
(the all-reduce's rules with the reduce-scatter's own thresholds), checked on stand-in
buffers with a recording dispatcher, and its launches (whole units of every slice, the
slices' pitch, the format's signature) through a recording engine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from stream_fakes import bare_communicator, fake_order

from ubnext._environment.config import Config
from ubnext._interop import arrays as _arrays
from ubnext._interop.arrays import Buffer
from ubnext._protocol import quant as _quant
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import ALGORITHMS
from ubnext._protocol.errors import UbnextError
from ubnext._selection.select import Selector, buffer_limits
from ubnext._selection.table import Machine
from ubnext._selection.table_format import parse_table

MIB = 1 << 20
RANKS = 4


class Recorder:
    """A Dispatcher stand-in that records the calls it would issue."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def buffer(count, dtype="bfloat16", ptr=1 << 20):
    width = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return Buffer(SimpleNamespace(count=count, ptr=ptr), "cupy", ptr, count, dtype, 0, (count,), count * width)


def tune_file(rs=None, ar=None):
    """A tune file's table for any machine: the reduce-scatter's thresholds ``rs`` and the
    all-reduce's ``ar`` ({dtype: {format: bytes}}) at every world size."""
    quantized = {}
    if ar:
        quantized["tables"] = {"*": ar}
    if rs:
        quantized["collectives"] = {"reduce_scatter": {"tables": {"*": rs}}}
    entry = {"gpu": "*", "link": "*", "placement": "*", "mode": "*", "tables": {"64": {"bfloat16": [[None, "nccl"]]}}}
    if quantized:
        entry["quantized"] = quantized
    return parse_table({"format": 2, "entries": [entry]}, "tune file t.json")


@pytest.fixture
def make(monkeypatch):
    """``make(quantized=..., table=..., kernels=True)``: a 4-rank Communicator (local rank 1)
    without devices, on sm_90; buffers are Buffer tuples."""
    monkeypatch.setattr(_arrays, "as_buffer", lambda x, op, stream: x)
    monkeypatch.setattr(_arrays, "launch_stream", lambda stream, x, device: (0, None, False))
    monkeypatch.setattr(_arrays, "empty_like", lambda x, s, o, side, shape=None: buffer(shape[0], x.dtype, 1 << 30))

    def make(quantized="int8", table=None, kernels=True, arch=90, machine=None):
        cfg = Config(quantized=quantized)
        local = type("Local", (), {"rank": 1, "size": RANKS})()
        node = SimpleNamespace(pool=None, failure=lambda name, timeout: None, hold=lambda stream: None) if kernels else None
        usable = [n for n, a in ALGORITHMS.items() if not a.multicast] if kernels else ["nccl"]
        return bare_communicator(fake_order(), config=cfg, _dispatch=Recorder(), rank=1, size=RANKS, _local=local,
                                 _node=node, _arch=arch, _nccl_reason=None if kernels else "test",
                                 _selector=Selector(RANKS, buffer_limits(cfg), usable, table, "", machine=machine))

    return make


def quantized_calls(comm):
    return [c for c in comm._dispatch.calls if c[0] == "quantized_reduce_scatter"]


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
@pytest.mark.parametrize("dtype", list(_quant.DTYPES))
@pytest.mark.parametrize("op", list(_quant.OPS))
def test_a_format_per_call_runs_the_quantized_reduce_scatter(make, fmt, dtype, op):
    """At any size, whatever the tables say; the signature is the reduce-scatter's with the
    format's tag, so ranks calling another format or the all-reduce fail as mismatched."""
    comm = make(quantized="int4")  # any opt-in takes any format per call
    x = buffer(RANKS * 33, dtype)
    out = comm.reduce_scatter(x, op=op, precision=fmt)
    ((name, got_fmt, xb, ob, k, got_op, _, _, sig),) = comm._dispatch.calls
    assert (name, got_fmt, xb, k, got_op, ob.obj) == ("quantized_reduce_scatter", fmt, x, 33, op, out)
    plain = _signature.encode("reduce_scatter", dtype, op, RANKS * 33)
    assert sig == _quant.signature(plain, fmt) != _quant.signature(_signature.encode("all_reduce", dtype, op,
                                                                                    RANKS * 33), fmt)


def test_in_place_is_this_ranks_slice(make):
    comm = make()
    x = buffer(RANKS * 64)
    out = buffer(64, ptr=x.ptr + 1 * 64 * 2)  # local rank 1's slice
    assert comm.reduce_scatter(x, out=out, precision="int8") is out.obj
    assert quantized_calls(comm)[0][3] is out


def test_auto_quantizes_from_the_reduce_scatters_own_threshold(make):
    """auto: the communicator's format from the reduce-scatter's threshold (bytes of the
    whole input); the all-reduce's threshold does not apply to it, nor its to the all-reduce."""
    comm = make(table=tune_file(rs={"bfloat16": {"int8": 8 * MIB}}, ar={"bfloat16": {"int8": 64 * MIB}}))
    comm.reduce_scatter(buffer(4 * MIB))  # 8 MiB of bfloat16: quantized
    comm.reduce_scatter(buffer(4 * MIB - RANKS))  # just below: full precision
    comm.reduce_scatter(buffer(4 * MIB, "float16"))  # float16 takes bfloat16's threshold (same width)
    comm.reduce_scatter(buffer(4 * MIB), precision="exact")
    comm.reduce_scatter(buffer(4 * MIB), op="max")  # not an op it takes: full precision
    comm.reduce_scatter(buffer(2 * MIB, "float32"))  # not a dtype it takes: full precision
    comm.reduce_scatter(buffer(4 * MIB), algorithm="twoshot")  # a named algorithm: itself
    calls = comm._dispatch.calls
    assert [c[0] for c in calls] == ["quantized_reduce_scatter", "reduce_scatter", "quantized_reduce_scatter",
                                     *["reduce_scatter"] * 4]
    assert calls[0][1] == calls[2][1] == "int8" and calls[-1][1] == "twoshot"
    assert comm._quantized_format("all_reduce", "auto", "auto", buffer(4 * MIB), "sum") is None  # 8 MiB < 64 MiB


H100 = "NVIDIA H100 80GB HBM3"


def shipped_rs_threshold(machine: Machine) -> int | None:
    """The int8 bfloat16 reduce-scatter threshold at RANKS ranks that the shipped file
    (ubnext/tables/default.json, read as JSON) holds for ``machine``'s exact key, or None."""
    path = Path(__file__).parents[1] / "ubnext" / "tables" / "default.json"
    for e in json.loads(path.read_text())["entries"]:
        if (e["gpu"], e["link"], e["placement"], e["mode"]) == (machine.gpu, machine.link, machine.placement,
                                                                machine.mode):
            tables = e.get("quantized", {}).get("collectives", {}).get("reduce_scatter", {}).get("tables", {})
            return tables.get(str(RANKS), {}).get("bfloat16", {}).get("int8")
    return None


@pytest.mark.parametrize("machine", [Machine("NVIDIA H200"), Machine(H100), Machine("NVIDIA B200"), Machine(None),
                                     Machine(H100, mode="dependent"), Machine(H100, mode="eager"),
                                     Machine(H100, link="pcie")], ids=lambda m: m.label())
def test_auto_quantizes_a_reduce_scatter_only_where_the_shipped_table_measured_it(make, machine):
    """The shipped table itself: its H100 graph entry's threshold on that machine (measured
    at 4 ranks), and on every other machine none, its nearest entry's included: full
    precision at every size, and describe() says why."""
    want = shipped_rs_threshold(machine)
    assert (want is not None) == (machine == Machine(H100))
    comm = make(machine=machine)
    comm.reduce_scatter(buffer(256 * MIB))
    assert bool(quantized_calls(comm)) == (want is not None)
    threshold, why = comm.selector.quantized("int8", "bfloat16", "reduce_scatter")
    assert threshold == want, why
    if want is None:
        assert why.startswith(f"never: not measured for {RANKS} ranks on {machine.label()} (no selector table has "
                              "quantized reduce_scatter thresholds"), why


def test_a_tune_file_with_the_all_reduces_thresholds_only_has_none_for_the_reduce_scatter(make):
    comm = make(table=tune_file(ar={"bfloat16": {"int8": 1024}}), machine=Machine("NVIDIA H200"))
    comm.reduce_scatter(buffer(256 * MIB))
    assert not quantized_calls(comm) and comm._dispatch.calls[0][0] == "reduce_scatter"
    threshold, why = comm.selector.quantized("int8", "bfloat16", "reduce_scatter")
    assert threshold is None and "no selector table has quantized reduce_scatter thresholds" in why


def test_without_the_opt_in_auto_is_exact_and_a_format_raises(make):
    comm = make(quantized="off", table=tune_file(rs={"bfloat16": {"int8": 1024}}))
    comm.reduce_scatter(buffer(RANKS * MIB))
    assert not quantized_calls(comm)
    with pytest.raises(UbnextError, match="^reduce_scatter: precision='int8' runs the quantized two-shot, but the "
                                          "communicator opted out: set UBNEXT_QUANTIZED"):
        comm.reduce_scatter(buffer(64), precision="int8")


@pytest.mark.parametrize("kwargs, words", [
    (dict(x=buffer(64, "float32")), "it takes bfloat16 and float16, not float32"),
    (dict(op="max"), "it takes op sum or avg, not 'max'"),
    (dict(algorithm="lamport_twoshot"), "pass algorithm='auto', not 'lamport_twoshot'"),
    (dict(precision="int2"), "reduce_scatter: unknown precision 'int2'"),
])
def test_what_a_format_cannot_take_raises_before_any_launch(make, kwargs, words):
    comm = make()
    call = {"x": buffer(64), "precision": "int8", **kwargs}
    with pytest.raises(UbnextError, match=words):
        comm.reduce_scatter(**call)
    assert comm._dispatch.calls == []


def test_nccl_only_and_fp8_before_sm89_raise(make):
    with pytest.raises(UbnextError, match="this communicator runs NCCL only"):
        make(kernels=False).reduce_scatter(buffer(64), precision="int8")
    with pytest.raises(UbnextError, match="needs compute capability 8.9"):
        make(arch=80).reduce_scatter(buffer(64), precision="fp8")
    comm = make(arch=80)
    comm.reduce_scatter(buffer(64), precision="int4")
    assert quantized_calls(comm)


def test_counts_and_outputs_are_checked_as_in_full_precision(make):
    comm = make()
    with pytest.raises(UbnextError, match="^reduce_scatter: x has 10 elements, which 4 ranks do not divide"):
        comm.reduce_scatter(buffer(10), precision="int8")
    with pytest.raises(UbnextError, match="^reduce_scatter: out has 5 bfloat16 elements; it must have 4 bfloat16"):
        comm.reduce_scatter(buffer(16), out=buffer(5, ptr=1 << 25), precision="int8")
    assert comm._dispatch.calls == []


def test_an_empty_reduce_scatter_launches_nothing(make):
    comm = make()
    comm.reduce_scatter(buffer(0), precision="int8")
    assert comm._dispatch.calls == []


def test_select_and_describe_say_the_reduce_scatters_format(make, monkeypatch):
    """select() gives the full-precision algorithm (as for the all-reduce); describe() says
    from which size reduce-scatters run quantized, and why."""
    from ubnext._api.report import report

    monkeypatch.setattr("ubnext._environment.devices.device_name", lambda device: "fake")
    comm = make(table=tune_file(rs={"bfloat16": {"int8": 16 * MIB}}))
    assert comm.select(64 * MIB, "bfloat16", collective="reduce_scatter") in ALGORITHMS
    d = report(SimpleNamespace(config=comm.config, rank=1, size=RANKS, local_rank=1, local_size=RANKS, device=0,
                               path="kernels on the symmetric pool", pool=None, nvls=None, selector=comm.selector,
                               algorithms=comm.algorithms))
    rows = d["collectives"]["reduce_scatter"]["bfloat16"]
    for nbytes, _, why in rows:
        assert ("run the quantized reduce-scatter in int8 instead" in why) == (nbytes >= 16 * MIB), why
    assert "reduce-scatters where it says so for them: bfloat16 from 16 MiB" in d["quantized"]


# ---- launches ---------------------------------------------------------------------------------
class FakeEngine:
    nranks = RANKS

    def quantized_rs(self, *args):
        return ("quantized_rs", *args)


def dispatcher(monkeypatch):
    from ubnext._engine import dispatch as _dispatch

    issued = []
    monkeypatch.setattr(_dispatch, "issue", lambda launch, stream: issued.append((*launch, stream)))
    order = SimpleNamespace(follow=lambda stream, owner: None)
    return _dispatch.Dispatcher(SimpleNamespace(engine=FakeEngine()), {}, order, None, 0), issued


def test_a_call_runs_in_launches_of_whole_units_of_every_slice(monkeypatch):
    d, issued = dispatcher(monkeypatch)
    chunk = _quant.slice_launch_elems(RANKS)
    k = 2 * chunk + 5
    x, out = 1 << 30, 1 << 40
    d.quantized_reduce_scatter("int4", buffer(RANKS * k, ptr=x), buffer(k, ptr=out), k, "avg", 7, None, 99)
    assert issued == [("quantized_rs", "int4", "bfloat16", "avg", x + c0 * 2, out + c0 * 2, n, k * 2, 99, 7)
                      for c0, n in ((0, chunk), (chunk, chunk), (2 * chunk, 5))]


def test_a_small_call_is_one_launch(monkeypatch):
    d, issued = dispatcher(monkeypatch)
    d.quantized_reduce_scatter("int8", buffer(RANKS * 3, "float16", ptr=10), buffer(3, "float16", ptr=20), 3, "sum",
                               7, None, 5)
    assert issued == [("quantized_rs", "int8", "float16", "sum", 10, 20, 3, 6, 5, 7)]
