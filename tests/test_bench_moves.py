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
