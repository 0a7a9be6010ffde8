"""CPU tests of the data-movement benchmarks (bench/broadcast_perf.py, alltoall_perf.py,
sendrecv_perf.py, built in bench/_moves_perf.py): nccl-tests' layouts and bus factors,
the exact data, the engines' calls, and whole runs on the numpy stand-in for the GPU
(tests/bench_fakes.py) with every result checked bit for bit."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # bench/ is not part of the installed package

import bench_fakes as fakes  # noqa: E402

from bench import _common as common  # noqa: E402
from bench import _moves_perf as moves  # noqa: E402
from bench import all_reduce_perf as arp  # noqa: E402

PROGRAMS = {"broadcast_perf": moves.BROADCAST_PERF, "alltoall_perf": moves.ALLTOALL_PERF,
            "sendrecv_perf": moves.SENDRECV_PERF}


class MoveEngine(fakes.ReduceEngine):
    """The fake engine with the three movers, computed on the host over the bootstrap;
    ``faults`` corrupts the last element received."""

    def _enqueue(self, recv, stream, result):
        def work():
            got = result()
            if self.faults and got.size:
                got[-1] += 1
            recv.host[...] = got

        stream.enqueue(work)

    def broadcast(self, send, recv, dtype, root, stream):
        self._enqueue(recv, stream, lambda: self.bootstrap.allgather_obj(send.host.copy())[root])

    def all_to_all(self, send, recv, dtype, op, stream):
        rank, n = self.bootstrap.rank, self.bootstrap.size
        k = send.size // n
        self._enqueue(recv, stream, lambda: np.concatenate(
            [s[rank * k:(rank + 1) * k] for s in self.bootstrap.allgather_obj(send.host.copy())]))

    def sendrecv(self, send, recv, dtype, op, stream):
        rank, n = self.bootstrap.rank, self.bootstrap.size
        self._enqueue(recv, stream, lambda: self.bootstrap.allgather_obj(send.host.copy())[(rank - 1) % n])


def world(program, faults=False):
    import cupy  # the fake, installed by the caller

    boot = fakes.Bootstrap()
    return arp.World(fakes.Comm(boot), MoveEngine(boot, faults), cupy.cuda.Stream(),
                     lambda count, dtype: cupy.empty((count,), dtype.numpy), ["# Buffers: fake"],
                     collective=program.collective)


@pytest.mark.parametrize("graph", ["0", "2"])
@pytest.mark.parametrize("script", list(PROGRAMS))
def test_runs_on_fake_gpu_checked_bit_for_bit(monkeypatch, capsys, script, graph):
    fakes.install(monkeypatch)
    importlib.import_module(f"bench.{script}")  # the script imports
    program = PROGRAMS[script]
    argv = ["-b", "8", "-e", "64K", "-f", "8", "-d", "all", "-n", "2", "-w", "1", "-G", graph]
    args = arp.parse_args(argv, program)
    assert arp.run(args, world(program), argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert len(rows) == 3 * len(args.sizes)
    assert {r[3] for r in rows} == {"none"}
    assert {r[4] for r in rows} == ({"0"} if script == "broadcast_perf" else {"-1"})
    assert all(r[8] == "0" for r in rows)
    if program.collective.has_in_place:
        assert all(r[12] == "0" for r in rows)
    else:
        assert all(r[9:13] == ["N/A"] * 4 for r in rows)
    assert f"# Collective test starting: {script}" in out and "# Out of bounds values : 0 OK" in out


@pytest.mark.parametrize("script", list(PROGRAMS))
def test_wrong_results_are_counted(monkeypatch, capsys, script):
    fakes.install(monkeypatch)
    program = PROGRAMS[script]
    argv = ["-b", "1K", "-e", "1K", "-n", "1"]
    args = arp.parse_args(argv, program)
    assert arp.run(args, world(program, faults=True), argv) == 1
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert rows[0][8] == "1"


def test_layouts_and_bus_factors_at_four_ranks():
    b, a, s = moves.BROADCAST, moves.ALL_TO_ALL, moves.SENDRECV
    assert (b.count(100, 2, 4), a.count(100, 2, 4), s.count(100, 2, 4)) == (50, 48, 50)
    assert (b.bus_factor(4), a.bus_factor(4), s.bus_factor(4)) == (1.0, 0.75, 1.0)
    assert a.buffers(48, 4) == (48, 48) and (b.root, a.root) == (0, -1)
    values, want = b.data(4, 2, 50, 7, "none")
    assert (want == common.make_input(0, 4, 50, 7)).all() and not (values == common.make_input(0, 4, 50, 7)).all()
    values, want = a.data(4, 2, 48, 7, "none")
    assert values.size == 48 and (want[12:24] == common.make_input(1, 4, 48, 7)[24:36]).all()
    values, want = s.data(4, 0, 50, 7, "none")
    assert (want == common.make_input(3, 4, 50, 7)).all()


def test_flags_are_nccl_tests_and_algo_the_movers(capsys):
    args = arp.parse_args(["-b", "8", "-e", "1M", "-f", "2", "-n", "5", "-w", "2", "-d", "bfloat16", "-G", "10",
                           "--backend", "nccl"], moves.ALLTOALL_PERF)
    assert (args.ops, args.backend, args.cudagraph, args.symmetric) == (["none"], "nccl", 10, 0)
    assert arp.parse_args(["--algo", "copy"], moves.BROADCAST_PERF).algo == "copy"
    assert arp.parse_args(["--algo", "scatter_allgather"], moves.BROADCAST_PERF).algo == "scatter_allgather"
    with pytest.raises(SystemExit):
        arp.parse_args(["--algo", "scatter_allgather"], moves.ALLTOALL_PERF)
    with pytest.raises(SystemExit):
        arp.parse_args(["--algo", "lamport"], moves.BROADCAST_PERF)
    with pytest.raises(SystemExit):
        arp.parse_args(["--algo", "copy"], moves.SENDRECV_PERF)
    assert arp.parse_args(["--algo", "ll"], moves.SENDRECV_PERF).algo == "ll"
    assert arp.parse_args(["--algo", "p2p"], moves.ALLTOALL_PERF).algo == "p2p"


def test_engines_call_the_communicator_and_nccl_alike():
    calls = []
    record = lambda name: lambda *a, **k: calls.append((name, a, k))  # noqa: E731
    comm = SimpleNamespace(rank=1, size=4, broadcast=record("broadcast"), all_to_all=record("all_to_all"),
                           batch_isend_irecv=record("batch"))
    ub = arp.UbnextEngine(comm, "auto")
    x, y = SimpleNamespace(size=8, data=SimpleNamespace(ptr=0x1000)), SimpleNamespace(size=8, data=SimpleNamespace(ptr=0x2000))
    f32, stream = common.DTYPES["float"], SimpleNamespace(ptr=0x99)
    ub.broadcast(x, y, f32, 0, stream)
    ub.all_to_all(x, y, f32, "none", stream)
    ub.sendrecv(x, y, f32, "none", stream)
    assert calls == [("broadcast", (x, 0), {"out": y, "stream": stream, "algorithm": "auto"}),
                     ("all_to_all", (x,), {"out": y, "stream": stream, "algorithm": "auto"}),
                     ("batch", ([("send", x, 2), ("recv", y, 0)],), {"stream": stream, "algorithm": "auto"})]
    calls.clear()
    arp.UbnextEngine(comm, "p2p").all_to_all(x, y, f32, "none", stream)
    assert calls == [("all_to_all", (x,), {"out": y, "in_splits": [2] * 4, "out_splits": [2] * 4, "stream": stream,
                                           "algorithm": "ll"})]
    calls.clear()
    nccl = SimpleNamespace(rank=1, size=4, broadcast=record("broadcast"), exchange=record("exchange"))
    eng = arp.NcclEngine(nccl)
    eng.broadcast(x, y, f32, 0, stream)
    eng.all_to_all(x, y, f32, "none", stream)
    eng.sendrecv(x, y, f32, "none", stream)
    assert calls == [("broadcast", (0x1000, 0x2000, 8, "float32", 0, 0x99), {}),
                     ("exchange", ([(0x1000 + 8 * j, 8, j) for j in range(4)], [(0x2000 + 8 * j, 8, j) for j in range(4)],
                                   0x99, "nccl.all_to_all"), {}),
                     ("exchange", ([(0x1000, 32, 2)], [(0x2000, 32, 0)], 0x99, "nccl.sendrecv"), {})]


# ---- the movers in bench/compare.py ---------------------------------------------------------------
def test_compare_parses_the_collectives_of_one_run(capsys):
    from bench import compare

    assert compare.parse_args([]).collective_list == ["all_reduce"]
    args = compare.parse_args(["--collectives", "sendrecv,broadcast,all_reduce,all_to_all"])
    assert args.collective_list == ["all_reduce", "broadcast", "all_to_all", "sendrecv"]
    for bad in ("gather", "", "broadcast,reduce"):
        with pytest.raises(SystemExit):
            compare.parse_args(["--collectives", bad])
        assert "--collectives takes a comma-separated subset of all_reduce, broadcast, all_to_all, sendrecv" in \
            capsys.readouterr().err


def test_compare_mover_candidates_are_each_algorithm_and_nccl_out_of_place(monkeypatch):
    fakes.install(monkeypatch)
    from bench import _compare_moves as cm
    from bench import compare

    comm = SimpleNamespace(size=4, rank=0)
    f32 = common.DTYPES["float"]
    for label, algos in (("broadcast", ["auto", "ll", "copy", "scatter_allgather", "nccl"]),
                         ("all_to_all", ["auto", "ll", "copy", "nccl"]), ("sendrecv", ["auto"])):
        cands = cm.ubnext_candidates(comm, label, f32, 48, compare.Candidate, compare.ubnext_refuses)
        assert [c.name for c in cands] == [f"ubnext-{a}" for a in algos]
        assert all(c.placement == "out-of-place" and c.send is not c.recv and c.send.size == c.recv.size == 48
                   and c.engine.algorithm == a for c, a in zip(cands, algos))
        nccl = cm.nccl_candidate(SimpleNamespace(size=4), label, f32, 48, compare.Candidate)
        assert nccl.name == "nccl" and isinstance(nccl.engine, arp.NcclEngine) and nccl.send is not nccl.recv


def _mover_sessions(args, faults=False):
    """compare's sessions of the movers on the fake GPU: ubnext-auto, ubnext-ll (refusing
    more than 4 KiB, as ubnext refuses: UbnextError), nccl; one engine computing each on the
    host."""
    import cupy

    from bench import compare
    from ubnext._protocol.errors import UbnextError

    boot = fakes.Bootstrap()
    engine = MoveEngine(boot, faults)

    class Limited:
        def __init__(self, limit):
            self.limit = limit

        def __getattr__(self, name):
            def run(send, recv, dtype, *rest):
                if self.limit and send.size * dtype.itemsize > self.limit:
                    raise UbnextError(f"{name}: algorithm 'll' takes at most {self.limit} bytes")
                getattr(engine, name)(send, recv, dtype, *rest)
            return run

    class Nccl:
        def close(self):
            pass

    sessions = []
    for label in args.collective_list:
        count = compare.COLLECTIVES[label].count(args.maxbytes, args.dtype.itemsize, 1)

        def cand(name, limit=None):
            send, recv = cupy.empty((count,), args.dtype.numpy), cupy.empty((count,), args.dtype.numpy)
            return compare.Candidate(name, "out-of-place", send, recv, Limited(limit), compare.ubnext_refuses)

        sessions.append(compare.Session(fakes.Comm(boot), Nccl(), cupy.cuda.Stream(),
                                        [cand("ubnext-auto"), cand("ubnext-ll", 4096), cand("nccl")], False,
                                        left_out={"dependent mode": "all_reduce only"}, label=label,
                                        collective=compare.COLLECTIVES[label]))
    return sessions


def test_compare_runs_the_movers_beside_nccl_bit_for_bit(monkeypatch, tmp_path, capsys):
    """Each mover's candidates checked bit for bit and timed in the eager and graph modes
    (the dependent mode is the all-reduce's), a table per mode with the ratio to NCCL, a
    JSON of its own; a refused size is a dash; an engine that corrupts an element is WRONG."""
    import json

    from bench import compare

    fakes.install(monkeypatch)
    argv = ["-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "--repeats", "2", "-G", "2", "--outdir", str(tmp_path),
            "--name", "t", "--collectives", "broadcast,all_to_all,sendrecv", "--modes", "eager,graph,dependent"]
    args = compare.parse_args(argv)
    for s in _mover_sessions(args):
        compare.sweep(s, args, lambda text: None)
        assert {r["mode"] for r in s.records} == {"eager", "graph"}
        assert all(r["wrong"] == 0 for r in s.records if r["status"] == "ok")
        assert {(r["candidate"], r["bytes"]) for r in s.records if r["status"] == "skipped"} == {("ubnext-ll", 16384)}
        compare.report(s, args, argv)
        doc = json.loads((tmp_path / f"t_{s.label}.json").read_text())
        assert doc["collective"] == s.label and doc["left_out"] == {"dependent mode": "all_reduce only"}
        busbw = {r["busbw_GBps"] > 0 for r in doc["results"] if r["status"] == "ok"}
        assert busbw == {s.label != "all_to_all"}  # one rank: the all-to-all's (n - 1) / n is 0
    out = capsys.readouterr().out
    for name in ("Broadcast", "AlltoAll", "SendRecv"):
        assert f"# graph: median us per {name}; (x) = faster NCCL's time" in out
        assert f"# eager: median us per {name};" in out
    assert "# dependent:" not in out and "# dependent mode left out: all_reduce only" in out
    sixteen = [line for line in out.splitlines() if line.strip().startswith("16 KiB")]
    assert len(sixteen) == 6 and all("—" in line and "nccl" in line.split()[2] for line in sixteen)
    assert "WRONG" not in out
    for s in _mover_sessions(args, faults=True):
        compare.sweep(s, args, lambda text: None)
        assert all(r["wrong"] for r in s.records if r["status"] == "ok")
        assert all("WRONG" in line for line in compare.table(s.records, "graph", ["nccl"])[2:])


@pytest.mark.parametrize("label", ["broadcast", "all_to_all", "sendrecv"])
def test_compare_checks_each_mover_against_nccl_tests_layout(monkeypatch, label):
    """compare's check of a mover, as rank 2 of 4: right for the layout of nccl-tests
    (root 0's input; part 2 of every rank's, in rank order; the previous rank's), computed
    here from the inputs, and wrong for this rank's own input."""
    from bench import compare

    fakes.install(monkeypatch)
    import cupy  # the fake

    class FourRanks(fakes.Bootstrap):
        rank, size = 2, 4

        def allgather_obj(self, obj):
            return [obj] * 4

        def allgather(self, data):
            return [data] * 4

    count, seed, f32 = 48, 5, common.DTYPES["float"]
    inputs = [common.make_input(r, 4, count, seed) for r in range(4)]
    want = {"broadcast": inputs[0], "sendrecv": inputs[1],
            "all_to_all": np.concatenate([inputs[j][24:36] for j in range(4)])}[label]

    class Writes:
        def __init__(self, values):
            self.values = values

        def __getattr__(self, name):
            return lambda send, recv, dtype, *rest: rest[-1].enqueue(
                lambda: recv.host.__setitem__(slice(None), self.values.astype(recv.host.dtype)))

    s = compare.Session(fakes.Comm(FourRanks()), None, cupy.cuda.Stream(), [], False, label=label,
                        collective=compare.COLLECTIVES[label])
    for values, wrong in ((want, 0), (inputs[2], 4 * int((inputs[2] != want).sum()))):
        send, recv = cupy.empty((count,), np.float32), cupy.empty((count,), np.float32)
        cand = compare.Candidate("x", "out-of-place", send, recv, Writes(values), compare.ubnext_refuses)
        assert compare.trial(s, cand, f32, "sum", count, seed) == ("ok", wrong)
    assert (inputs[2] != want).any()


def test_compare_torch_movers_call_torch_distributed_as_nccl_tests_lays_them_out(monkeypatch):
    """torch-nccl's movers: dist.broadcast in place from root 0, all_to_all_single(out, in),
    and the ring as one batch_isend_irecv (to the next rank, from the previous), each work
    waited on the stream."""
    dist = pytest.importorskip("torch.distributed")
    from bench import _compare_torch as ct

    calls, waited = [], []
    monkeypatch.setattr(dist, "broadcast", lambda t, src: calls.append(("broadcast", t, src)))
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, x: calls.append(("all_to_all_single", out, x)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer: (op.__name__, t, peer))
    monkeypatch.setattr(dist, "batch_isend_irecv",
                        lambda ops: calls.append(("batch", ops)) or [SimpleNamespace(wait=lambda: waited.append(1))] * 2)
    engine, f32 = ct.TorchMover(), common.DTYPES["float"]
    moves.BROADCAST.run(engine, "x", "y", f32, "none", None)
    moves.ALL_TO_ALL.run(engine, "x", "y", f32, "none", None)
    moves.SENDRECV.run(engine, "x", "y", f32, "none", None)
    assert calls == [("broadcast", "y", 0), ("all_to_all_single", "y", "x"),
                     ("batch", [("isend", "x", 1), ("irecv", "y", 3)])]
    assert waited == [1, 1]
