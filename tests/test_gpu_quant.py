"""The quantized two-shot all-reduce and reduce-scatter (opt-in) on GPUs: every output
element equals the host emulation (ubnext/_protocol/quant.py) bit for bit, in every format
(int8, fp8 where the device has it, int4), on every rank alike (the all-reduce), within the
stated error bound; odd sizes (partial groups, lanes and units; slices that start inside a
group of the message), unaligned and in-place arrays, groups built to hit rounding ties,
the clamp, zeros, -0.0 and non-finite values, several launches, CUDA-graph replay, the two
collectives back to back in changing sizes and formats; the opt-in rules (``auto``
quantizes only on a communicator that opted in, from the selector table's measured
threshold of the collective at 2 ranks or more: the shipped table's for this machine's own
entry (only H100 80GB HBM3 in graph mode has any: no other machine takes them), or a tune
file's; full precision otherwise, bit for bit as before); the overflow rule, alike in both
collectives.

Runs at any world size, ranks sharing a GPU included:
``mpirun --oversubscribe -n 4 python -m pytest -q tests/test_gpu_quant.py``.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from gpu_support import (
    Bordered,
    assert_same_bits_everywhere,
    check_all_reduce,
    collected,
    device,
    host,
    rank_inputs,
    recorded_launches,
    reference,
    require_gpu_and_torch,
)

from ubnext._protocol import quant as _quant

pytestmark = pytest.mark.gpu

SMALL = dict(pool_mb=160, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)


@pytest.fixture(scope="module")
def comm():
    """A communicator that opted in (int8 for ``auto``; any format per call)."""
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator(quantized="int8", **SMALL)
    yield c
    c.close()


@pytest.fixture(scope="module")
def plain():
    """A communicator that did not opt in."""
    require_gpu_and_torch()
    import ubnext

    c = ubnext.Communicator(**SMALL)
    yield c
    c.close()


def shipped_threshold(comm, collective: str) -> int | None:
    """The int8 bfloat16 threshold of ``collective`` that the shipped file (ubnext/tables/
    default.json, read as JSON) holds for this machine's own entry (its GPU, nvlink, plain
    arrays, the communicator's table mode) at this world size, or None: no machine takes
    another's (the nearest-entry fallback lends rows only)."""
    from pathlib import Path

    from ubnext._environment.devices import device_name

    key = (device_name(comm.device), "nvlink", "plain", comm.config.table_mode)
    for e in json.loads((Path(__file__).parents[1] / "ubnext" / "tables" / "default.json").read_text())["entries"]:
        if (e["gpu"], e["link"], e["placement"], e["mode"]) == key:
            q = e.get("quantized", {})
            tables = q.get("tables", {}) if collective == "all_reduce" else q.get("collectives", {}).get(
                collective, {}).get("tables", {})
            return None if comm.size < 2 else tables.get(str(comm.size), {}).get("bfloat16", {}).get("int8")
    return None


def _formats(comm):
    return [f for f in _quant.FORMATS if comm._arch >= _quant.FORMATS[f].min_arch]


def check_quantized(comm, count: int, dtype: str, fmt: str, seed: int, *, op: str = "sum", place: str = "out",
                    offset: int = 0, specials: bool = True, precision: str | None = None, inputs=None):
    """One quantized all_reduce checked element by element against the emulation: poisoned,
    bordered output (or in place), the input unchanged, the same bits on every rank, the
    error within the bound (outside groups holding a NaN or infinity). ``inputs``: every
    rank's input of ``count`` elements (default ``rank_inputs``). Returns the launches."""
    import torch

    if inputs is None:
        inputs = rank_inputs(count, dtype, comm.size, seed, specials)
    x = Bordered(count, dtype, seed + 1, offset)
    x.view.copy_(device(inputs[comm.rank]))
    out = x
    if place == "out":
        out = Bordered(count, dtype, seed + 2, offset)
        out.view.fill_(float("nan"))
    with recorded_launches(comm) as launches:
        result = comm.all_reduce(x.view, out=out.view, op=op, precision=precision or fmt)
    assert result is out.view
    torch.cuda.synchronize()
    assert_same_bits_everywhere(comm, result)
    assert {launch.kernel for launch in launches} == {f"quantized:{fmt}"}
    want = reference.quantized(inputs, fmt, op)
    got = host(result)
    reference.assert_same_bits(got, want, f"quantized {fmt} {dtype} {op} of {count}")
    out.assert_intact("quantized all_reduce (output)")
    if place == "out":
        x.assert_intact("quantized all_reduce (input)")
        reference.assert_same_bits(host(x.view), inputs[comm.rank], "the call modified its input")
    errors = _quant.group_errors(inputs, got, op)[bounded_groups(inputs)]
    limit = _quant.bound(fmt, dtype, comm.size) + 1e-12
    assert errors.size == 0 or errors.max() <= limit, f"error {errors.max()} over the bound {limit}"
    return launches


def bounded_groups(inputs) -> np.ndarray:
    """The groups the error bound covers: finite inputs whose sum cannot overflow (the
    overflow rule makes the others NaN or inf)."""
    groups = np.stack([_quant._grouped(a).astype(np.float64) for a in inputs])
    largest = np.abs(groups).max(axis=2).sum(axis=0)
    return np.isfinite(groups).all(axis=(0, 2)) & (largest < float(ml_dtypes.finfo(inputs[0].dtype).max) / 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("count", [1, 31, 33, 4099, 8 * 1024 * 9 + 1000, (1 << 20) + 3])
def test_bit_for_bit_with_the_emulation(comm, dtype, count):
    failures = []
    for k, fmt in enumerate(_formats(comm)):
        with collected(failures):
            check_quantized(comm, count, dtype, fmt, seed=count + 10 * k)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
def test_avg_unaligned_in_place_and_plain_data(comm, fmt):
    if fmt not in _formats(comm):
        pytest.skip(f"{fmt} needs compute capability {_quant.FORMATS[fmt].min_arch}")
    failures = []
    for case in (dict(op="avg"), dict(offset=1), dict(place="in"), dict(specials=False, op="avg", offset=3)):
        with collected(failures):
            check_quantized(comm, 50_001, "bfloat16", fmt, seed=7, **case)
    assert not failures, "\n".join(failures[:5])


def special_groups(rank: int) -> np.ndarray:
    """Rank ``rank``'s bfloat16 input of groups built for the codecs, times rank + 1 (so the
    owner's sum requantizes them too): rounding ties of int4 (scale 1: codes k + 0.5),
    of int8 (127) and of fp8 (448: halfway between e4m3 neighbours), every int4 code, a
    group of -0.0, one with a NaN, one with an infinity, one so small that its fp32 scale
    is subnormal and rounds down (the clamp), a random one, two whose scales lie just below
    2^-126 (rank 0's: divided, not multiplied by the reciprocal; the codes differ: int8
    64, int4 -4); then a partial group."""
    import ml_dtypes

    groups = np.zeros((11, _quant.GROUP), np.float32)
    groups[0, :12] = [7, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5, 5.5, 6.5, -7]
    groups[1, :6] = [127, 0.5, 1.5, -2.5, 126.5, -125.5]
    groups[2, :5] = [448, 1.0625, 1.1875, -3, 2.0**-9]
    groups[3, :15] = np.arange(-7, 8)
    groups[4] = -0.0
    groups[5, :3] = [1, np.nan, -2]
    groups[6, :3] = [1, -np.inf, 2]
    groups[7, :2] = [10 * 2.0**-133, -3 * 2.0**-133]  # bfloat16 subnormals; amax / 7 ~ 2^-130
    groups[8] = np.random.default_rng(rank).standard_normal(_quant.GROUP)
    groups[9, :2] = [float.fromhex("0x1.6ep-120"), float.fromhex("0x1.6ep-121")]
    groups[10, :2] = [float.fromhex("0x1.08p-124"), -float.fromhex("0x1.08p-125")]
    flat = np.concatenate([groups.reshape(-1), np.arange(1, 6, dtype=np.float32)])
    return (flat * (rank + 1)).astype(ml_dtypes.bfloat16)


def test_special_groups_in_every_format(comm):
    """The codecs' edge cases, bit for bit against the emulation (ties, the clamp, zeros of
    either sign, non-finite values), as whole units and as a unit's part."""
    failures = []
    inputs = [special_groups(r) for r in range(comm.size)]
    for k, fmt in enumerate(_formats(comm)):
        for repeat in (1, 40):  # one partial unit; then whole units and a partial one
            data = [np.tile(x, repeat) for x in inputs]
            with collected(failures):
                check_quantized(comm, data[0].size, "bfloat16", fmt, seed=90 + k, inputs=data, op="sum")
    assert not failures, "\n".join(failures[:5])


#: a bfloat16 value whose fp32 sum over two ranks overflows; float16's: 40000, whose fp32
#: sum is finite and past float16's 65504
BIG = {"bfloat16": 1.5 * 2.0**127, "float16": 40000.0}


def overflow_inputs(groups: int, dtype: str, rank: int) -> np.ndarray:
    """Rank ``rank``'s input of ``groups`` groups of random values where element g % 32 of
    every 5th group g is +BIG (g % 10 == 0) or -BIG: its sum overflows from two ranks on."""
    x = np.random.default_rng(rank).standard_normal((groups, _quant.GROUP)).astype(np.float32)
    for g in range(0, groups, 5):
        x[g, g % _quant.GROUP] = BIG[dtype] if g % 10 == 0 else -BIG[dtype]
    return x.reshape(-1).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)


def assert_the_overflow_rule(result: np.ndarray, first: int, dtype: str, op: str, nranks: int) -> None:
    """``result``: groups ``first``, ``first + 1``, ... of an overflow_inputs message. From two
    ranks on, bfloat16: the groups holding BIG are NaN throughout (the fp32 sum overflowed,
    avg's too); float16 sums: that element is +-inf (the sum rounded past 65504), the
    group's others finite; every other group finite. At one rank, and float16 averages
    (40000): everything finite."""
    got = result.astype(np.float32).reshape(-1, _quant.GROUP)
    for i, group in enumerate(got):
        g = first + i
        if g % 5 or nranks < 2 or (dtype, op) == ("float16", "avg"):
            assert np.isfinite(group).all(), (g, group)
        elif dtype == "bfloat16":
            assert np.isnan(group).all(), (g, group)
        else:
            assert group[g % _quant.GROUP] == (np.inf if g % 10 == 0 else -np.inf), (g, group)
            assert np.isfinite(np.delete(group, g % _quant.GROUP)).all(), (g, group)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("groups", [45, 2 * 1031])
def test_an_overflowing_sum_follows_one_rule_in_both_collectives(comm, dtype, groups):
    """The overflow rule of docs/quantized.md, bit for bit against the emulation in every
    format, sum and avg, in the all-reduce and the reduce-scatter alike (``groups`` per
    slice: a partial unit, and several units and a partial one)."""
    n, r = comm.size, comm.rank
    inputs = [overflow_inputs(n * groups, dtype, rank) for rank in range(n)]
    failures = []
    for j, fmt in enumerate(_formats(comm)):
        for op in ("sum", "avg"):
            with collected(failures):
                check_quantized(comm, inputs[0].size, dtype, fmt, seed=300 + j, op=op, inputs=inputs)
                assert_the_overflow_rule(reference.quantized(inputs, fmt, op), 0, dtype, op, n)
            with collected(failures):
                check_quantized_rs(comm, groups * _quant.GROUP, dtype, fmt, seed=400 + j, op=op, inputs=inputs)
                mine = reference.quantized_reduce_scatter(inputs, fmt, op)[r]
                assert_the_overflow_rule(mine, r * groups, dtype, op, n)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_messages_past_one_launch(comm, fmt):
    """A message of several launches (_quant.LAUNCH_BYTES each) reduces like one."""
    count = _quant.LAUNCH_BYTES // 2 + 37
    launches = check_quantized(comm, count, "bfloat16", fmt, seed=3, specials=False)
    assert len(launches) == 2


def test_auto_quantizes_from_the_measured_threshold_and_exact_keeps_full_precision(comm, tmp_path):
    """On an opted-in communicator auto quantizes from the selector table's threshold at 2
    ranks or more: a tune file's (``"*"`` world sizes, bfloat16, int8 from 2 MiB); with the
    shipped table, its threshold for this machine and world size (read from the file: none
    but on H100 at 2 and 4 ranks, above 2 MiB), and one rank never. Smaller messages, one rank, float32, max and
    precision="exact" keep full precision, bit for bit as the plain path."""
    import torch

    import ubnext

    big = 1 << 20  # elements: 2 MiB of bfloat16, the threshold
    path = tmp_path / "tune.json"  # each rank its own copy; the ranks check that they agree
    path.write_text(json.dumps({"format": 2, "entries": [
        {"gpu": "*", "link": "*", "placement": "*", "mode": "*",
         "tables": {"1024": {"bfloat16": [[None, "nccl"]]}},  # rows for no world size here: the shipped ones
         "quantized": {"tables": {"*": {"bfloat16": {"int8": 2 * big}}}}}]}))
    failures = []
    with ubnext.Communicator(quantized="int8", tune_file=str(path), **SMALL) as tuned:
        if tuned.size > 1:
            with collected(failures):  # auto: the communicator's format, from the threshold
                check_quantized(tuned, big, "bfloat16", "int8", seed=11, precision="auto", specials=False)
        for count in (4099, big - 1):  # below the threshold, and precision="exact": full precision
            inputs = rank_inputs(count, "bfloat16", tuned.size, 12)
            x = device(inputs[tuned.rank])
            for precision in ("exact", "auto"):
                with recorded_launches(tuned) as launches:
                    got = tuned.all_reduce(x, precision=precision)
                torch.cuda.synchronize()
                assert_same_bits_everywhere(tuned, got)
                with collected(failures):
                    name = {launch.kernel for launch in launches}
                    assert name == {tuned.select(count * 2, "bfloat16")}, (precision, name)
                    reference.assert_same_bits(host(got), reference.all_reduce(name.pop(), inputs, "sum", [count]),
                                               precision)
        with recorded_launches(tuned) as launches:  # float32 and max: auto keeps full precision
            tuned.all_reduce(torch.ones(big, device="cuda"))
            tuned.all_reduce(torch.ones(big, device="cuda", dtype=torch.bfloat16), op="max")
            if tuned.size == 1:  # one rank: auto keeps full precision at any size
                tuned.all_reduce(torch.ones(big, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        assert not any(launch.kernel.startswith("quantized") for launch in launches)
        text = str(tuned.describe())
        assert ("bfloat16 from 2 MiB" in text) == (tuned.size > 1), text
    with recorded_launches(comm) as launches:  # the shipped table: no threshold measured, never
        comm.all_reduce(torch.ones(big, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert not any(launch.kernel.startswith("quantized") for launch in launches)
    start, why = comm.selector.quantized("int8", "bfloat16")  # the shipped table's, for this machine only
    assert start == shipped_threshold(comm, "all_reduce"), why
    text = comm.describe()["quantized"]
    assert "int8: auto reduces" in text and why in text, text
    assert start is None or start > 2 * big  # so the 2 MiB call above stayed exact
    assert not failures, "\n".join(failures[:5])


def test_without_the_opt_in_every_call_is_exact(plain):
    import torch

    import ubnext

    _, launches = check_all_reduce(plain, 4099, "bfloat16", seed=21)
    assert not any(launch.kernel.startswith("quantized") for launch in launches)
    x = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ubnext.UbnextError, match="UBNEXT_QUANTIZED"):
        plain.all_reduce(x, precision="int8")
    assert plain._node.engine._quant[-1] == 0  # no receive areas reserved
    assert "auto never quantizes" in str(plain.describe())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_cuda_graph_replay(comm, collective, fmt):
    """A captured quantized all-reduce or reduce-scatter replayed with new inputs into
    poisoned outputs."""
    import torch

    n = comm.size
    rs = collective == "reduce_scatter"
    k = 25_001 if rs else 100_003  # this rank's output elements
    x = torch.empty(n * k if rs else k, device="cuda", dtype=torch.bfloat16)
    y = Bordered(k, "bfloat16", seed=6 if rs else 5)
    call = getattr(comm, collective)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm up: compiles the kernel outside capture
        call(x.fill_(1), out=y.view, precision=fmt)
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        call(x, out=y.view, precision=fmt)
    failures = []
    for it in range(5):
        inputs = rank_inputs(x.numel(), "bfloat16", n, (600 if rs else 500) + it)
        x.copy_(device(inputs[comm.rank]))
        y.view.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        with collected(failures):
            want = (reference.quantized_reduce_scatter(inputs, fmt)[comm.rank] if rs
                    else reference.quantized(inputs, fmt))
            reference.assert_same_bits(host(y.view), want, f"replay {it}")
            y.assert_intact(f"replay {it}")
    if not rs:
        assert_same_bits_everywhere(comm, y.view)
    assert not failures, "\n".join(failures[:5])


# ---- the reduce-scatter ------------------------------------------------------------------------
def check_quantized_rs(comm, k: int, dtype: str, fmt: str, seed: int, *, op: str = "sum", place: str = "out",
                       offset: int = 0, specials: bool = True, precision: str | None = None, inputs=None):
    """One quantized reduce_scatter of size x ``k`` elements checked element by element
    against the emulation: this rank's k elements into a poisoned, bordered output (or in
    place: its slice of x, the other slices untouched), the input unchanged, the error
    within the reduce-scatter's bound (outside groups holding a NaN or infinity or whose
    sum may overflow, which the bound leaves out).
    ``inputs``: every rank's input of size x k elements (default ``rank_inputs``).
    Returns the launches."""
    import torch

    n, r = comm.size, comm.rank
    if inputs is None:
        inputs = rank_inputs(n * k, dtype, n, seed, specials)
    x = Bordered(n * k, dtype, seed + 1, offset)
    x.view.copy_(device(inputs[r]))
    if place == "out":
        out = Bordered(k, dtype, seed + 2, offset)
        out.view.fill_(float("nan"))
        target = out.view
    else:
        target = x.view[r * k:(r + 1) * k]
    with recorded_launches(comm) as launches:
        result = comm.reduce_scatter(x.view, out=target, op=op, precision=precision or fmt)
    assert result is target
    torch.cuda.synchronize()
    assert {(launch.kernel, launch.collective) for launch in launches} == {(f"quantized:{fmt}", "reduce_scatter")}
    got = host(result)
    reference.assert_same_bits(got, reference.quantized_reduce_scatter(inputs, fmt, op)[r],
                               f"quantized reduce_scatter {fmt} {dtype} {op} of {n} x {k}")
    x.assert_intact("quantized reduce_scatter (input)")
    whole = host(x.view)
    if place == "out":
        out.assert_intact("quantized reduce_scatter (output)")
        reference.assert_same_bits(whole, inputs[r], "the call modified its input")
    else:  # the other ranks' slices of x are as they were
        mine = np.zeros(n * k, bool)
        mine[r * k:(r + 1) * k] = True
        reference.assert_same_bits(whole[~mine], inputs[r][~mine], "the call modified x outside its slice")
    # the bound's groups (a slice may start at make_input's largest finite value, apart
    # from its infinity and NaN)
    slices = [a[r * k:(r + 1) * k] for a in inputs]
    errors = _quant.group_errors(slices, got, op)[bounded_groups(slices)]
    limit = _quant.bound(fmt, dtype, n, "reduce_scatter") + 1e-12
    assert errors.size == 0 or errors.max() <= limit, f"error {errors.max()} over the bound {limit}"
    return launches


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("k", [1, 31, 33, 1029, 4099, 8 * 1024 * 9 + 1000, (1 << 18) + 3])
def test_reduce_scatter_bit_for_bit_with_the_emulation(comm, dtype, k):
    """Every format, with -0.0, infinities, NaN and the largest finite value among random
    data (gpu_support.make_input), and without: slices of partial groups, lanes and units."""
    failures = []
    for j, fmt in enumerate(_formats(comm)):
        for specials in (True, False):
            with collected(failures):
                check_quantized_rs(comm, k, dtype, fmt, seed=k + 10 * j + specials, specials=specials)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("fmt", list(_quant.FORMATS))
def test_reduce_scatter_avg_unaligned_in_place_and_plain_data(comm, fmt):
    if fmt not in _formats(comm):
        pytest.skip(f"{fmt} needs compute capability {_quant.FORMATS[fmt].min_arch}")
    failures = []
    for case in (dict(op="avg"), dict(offset=1), dict(place="in"), dict(place="in", offset=1, op="avg"),
                 dict(specials=False, op="avg", offset=3)):
        with collected(failures):
            check_quantized_rs(comm, 12_501, "bfloat16", fmt, seed=17, **case)
    assert not failures, "\n".join(failures[:5])


def test_reduce_scatter_special_groups_in_every_format(comm):
    """The codecs' edge cases (special_groups: ties, the clamp, zeros of either sign,
    non-finite values) in every rank's slice, as a partial unit and as whole units and a
    partial one."""
    failures = []
    for j, fmt in enumerate(_formats(comm)):
        for repeat in (1, 40):
            data = [np.tile(special_groups(r), repeat * comm.size) for r in range(comm.size)]
            with collected(failures):
                check_quantized_rs(comm, data[0].size // comm.size, "bfloat16", fmt, seed=190 + j, inputs=data)
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_reduce_scatter_past_one_launch(comm, fmt):
    """Slices longer than one launch takes (_quant.slice_launch_elems) reduce like one launch."""
    k = _quant.slice_launch_elems(comm.size) + 37
    launches = check_quantized_rs(comm, k, "bfloat16", fmt, seed=23, specials=False)
    assert len(launches) == 2


def test_reduce_scatter_auto_quantizes_from_its_own_threshold(comm, tmp_path):
    """auto: a tune file's reduce-scatter threshold (``"*"`` world sizes, bfloat16, int4 from
    2 MiB of input) at 2 ranks or more, full precision below it, with precision="exact", and
    at one rank; the all-reduce keeps its own (none in the file). With the shipped table
    auto quantizes a reduce-scatter only from this machine's own entry's threshold (H100: 2
    and 4 ranks)."""
    import torch

    import ubnext

    big = 1 << 20  # elements of the whole input: 2 MiB of bfloat16, the threshold
    path = tmp_path / "tune.json"  # each rank its own copy; the ranks check that they agree
    path.write_text(json.dumps({"format": 2, "entries": [
        {"gpu": "*", "link": "*", "placement": "*", "mode": "*",
         "tables": {"1024": {"bfloat16": [[None, "nccl"]]}},
         "quantized": {"collectives": {"reduce_scatter": {"tables": {"*": {"bfloat16": {"int4": 2 * big}}}}}}}]}))
    n = comm.size
    failures = []
    with ubnext.Communicator(quantized="int4", tune_file=str(path), **SMALL) as tuned:
        k = -(-big // n)  # at least the threshold
        if n > 1:
            with collected(failures):
                check_quantized_rs(tuned, k, "bfloat16", "int4", seed=31, precision="auto", specials=False)
        for precision, count in (("auto", n * (k - 64)), ("exact", n * k)):  # below; exact: full precision
            x = device(rank_inputs(count, "bfloat16", n, 32)[tuned.rank])
            with recorded_launches(tuned) as launches:
                tuned.reduce_scatter(x, precision=precision)
            torch.cuda.synchronize()
            with collected(failures):
                assert not any(launch.kernel.startswith("quantized") for launch in launches), (precision, count)
        with recorded_launches(tuned) as launches:  # one rank: never; the all-reduce: its own (the shipped table)
            tuned.all_reduce(torch.ones(4099, device="cuda", dtype=torch.bfloat16))
            if n == 1:
                tuned.reduce_scatter(torch.ones(big, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        assert not any(launch.kernel.startswith("quantized") for launch in launches)
        text = tuned.describe()["quantized"]
        assert ("reduce-scatters where it says so for them: bfloat16 from 2 MiB" in text) == (n > 1), text
    # the shipped table: thresholds for this machine's own entry only (H100 graph: 2 and 4 ranks)
    whole = n * (8 << 20)  # elements: n x 16 MiB of bfloat16
    start, why = comm.selector.quantized("int8", "bfloat16", "reduce_scatter")
    assert start == shipped_threshold(comm, "reduce_scatter"), why
    with recorded_launches(comm) as launches:
        comm.reduce_scatter(torch.ones(whole, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert any(launch.kernel.startswith("quantized") for launch in launches) == (
        start is not None and 2 * whole >= start), (start, why)
    assert not failures, "\n".join(failures[:5])


def test_reduce_scatter_without_the_opt_in_raises(plain):
    import torch

    import ubnext

    x = torch.ones(64 * plain.size, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ubnext.UbnextError, match="UBNEXT_QUANTIZED"):
        plain.reduce_scatter(x, precision="int4")
    with recorded_launches(plain) as launches:
        plain.reduce_scatter(x)
    torch.cuda.synchronize()
    assert not any(launch.kernel.startswith("quantized") for launch in launches)


def test_all_reduces_and_reduce_scatters_back_to_back_in_changing_sizes_and_formats(comm):
    """Launches of both entry points, one after another without a host sync, growing and
    shrinking, in every format: each result bit for bit. A peer's next launch stores its
    slots while this rank may still dequantize its all-gather area; the area lies apart from
    the slots of any launch, so no result may change."""
    import torch

    n, r = comm.size, comm.rank
    rng = np.random.default_rng(77)  # the same sequence on every rank
    fmts = _formats(comm)
    plan = []  # (collective, format, every rank's input, this rank's on the device)
    for i in range(40):
        collective = ("all_reduce", "reduce_scatter")[int(rng.integers(2))]
        fmt = fmts[int(rng.integers(len(fmts)))]
        k = int(rng.choice([33, 1024 * 5 + 7, 1 << 16, (1 << 19) + 5]))
        inputs = rank_inputs(n * k, "bfloat16", n, 700 + i, specials=False)
        plan.append((collective, fmt, inputs, device(inputs[r])))
    torch.cuda.synchronize()
    calls = [(collective, fmt, inputs, comm.all_reduce(x, precision=fmt) if collective == "all_reduce" else
              comm.reduce_scatter(x, precision=fmt)) for collective, fmt, inputs, x in plan]
    torch.cuda.synchronize()
    failures = []
    for i, (collective, fmt, inputs, out) in enumerate(calls):
        want = (reference.quantized(inputs, fmt) if collective == "all_reduce" else
                reference.quantized_reduce_scatter(inputs, fmt)[r])
        with collected(failures):
            reference.assert_same_bits(host(out), want, f"call {i}: {collective} {fmt} of {inputs[0].size}")
    assert not failures, "\n".join(failures[:5])
