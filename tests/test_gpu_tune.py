"""GPU: comm.describe() agrees with comm.select(), and short python -m ubnext.tune runs
(back to back, and --mode dependent: each call after a GEMM) measure, write and merge a
table that a communicator then loads (the dependent entry where UBNEXT_TABLE_MODE asks),
the all-reduce's rows and the reduce-scatter's and all-gather's alike, and the data
movers' (--movers), which auto then follows.

Runs at any world size (``mpirun -n N python -m pytest tests/test_gpu_tune.py``).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def comm():
    import ubnext

    c = ubnext.Communicator(pool_mb=64, staging_mb=8, lamport_max_kb=256, lamport_twoshot_max_kb=2048)
    yield c
    c.close()


def test_describe_matches_select_and_is_the_same_on_every_rank(comm):
    d = comm.describe()
    json.dumps(d)
    assert d["ranks"] == comm.size and d["device"] == comm.device
    for dtype, rows in d["selection"].items():
        for nbytes, name, why in rows:
            assert name == comm.select(nbytes, dtype), (nbytes, dtype, why)
    text = str(d)
    assert text.startswith(f"ubnext communicator: rank {comm.rank} of {comm.size}")
    selections = comm.bootstrap.allgather_obj(d["selection"])
    assert all(s == selections[0] for s in selections)


def test_the_default_table_entry_is_chosen_for_this_gpu_alike_on_every_rank(comm):
    """The entry of the shipped table chosen for local rank 0's GPU, the same on every rank.
    The expectation is read from ubnext/tables/default.json as plain JSON, not through the
    selection code: where the file has an entry of this GPU's name for NVLink, plain arrays
    and the communicator's table mode, that one ("exact match"); else this GPU's entry of
    another mode where there is one; else one of the file's entries, with a reason that
    names this GPU as missing."""
    from importlib import resources

    d = comm.describe()
    (chosen,) = d["tables"]
    gpu = comm.bootstrap.allgather_obj(d["device_name"])[0]
    raw = json.loads(resources.files("ubnext").joinpath("tables", "default.json").read_text(encoding="utf-8"))
    keys = [(e["gpu"], e["link"], e["placement"], e["mode"]) for e in raw["entries"]]
    mine = (gpu, "nvlink", "plain", comm.config.table_mode)
    if mine in keys:
        assert chosen == f"default table: {' '.join(mine)} (exact match)"
    elif any(k[0] == gpu for k in keys):  # this GPU's entry of another mode
        assert chosen.startswith(f"default table: {gpu} nvlink plain ") and "no entry for" not in chosen, chosen
    else:
        labels = [" ".join(("any GPU" if k[0] == "*" else k[0], *k[1:])) for k in keys]
        assert any(chosen.startswith(f"default table: {label} (") for label in labels), (chosen, labels)
        assert f"no entry for {gpu}: " in chosen
    digests = comm.bootstrap.allgather_obj([t.digest() for t in comm._selector.tables])
    assert all(x == digests[0] for x in digests)


def test_tune_writes_a_table_that_a_communicator_loads(comm, tmp_path, capsys):
    import ubnext
    from ubnext import tune
    from ubnext._selection.table_format import load_table

    path = comm.bootstrap.bcast_obj(str(tmp_path / "tune.json") if comm.rank == 0 else None)
    argv = ["-o", path, "-b", "4K", "-e", "1M", "-f", "16", "-n", "4", "-G", "2", "--repeats", "3",
            "--dtype", "bfloat16,float32"]
    assert tune.run(comm, tune.parse_args(argv), argv) == 0
    if comm.rank == 0:
        assert f"export UBNEXT_TUNE_FILE={path}" in capsys.readouterr().out
    comm.bootstrap.barrier()
    (table,) = load_table(path).entries  # a new file: the entry of the GPU tune ran on
    assert table.gpu == comm.describe()["device_name"] and table.key[1:] == ("nvlink", "plain", "graph")
    assert set(table.rows[str(comm.size)]) == {"bfloat16", "float32"}
    record = table.entry["measured"][str(comm.size)]["bfloat16"]
    assert record["sizes"] == [4 << 10, 64 << 10, 1 << 20]
    assert all(t is None or t > 0 for times in record["us"].values() for t in times)
    with ubnext.Communicator(pool_mb=64, staging_mb=8, lamport_twoshot_max_kb=2048, tune_file=path) as tuned:
        assert tuned.describe()["tables"][0] == f"tune file {path}: {table.label} (exact match)"
        winners = dict(zip(record["sizes"], record["winners"]))
        for nbytes, name in winners.items():
            if tuned._selector.fits(name, nbytes):
                assert tuned.select(nbytes, "bfloat16") == name
        for collective in ("reduce_scatter", "all_gather"):  # a size: the whole message
            assert set(table.by_collective[collective][str(comm.size)]) == {"bfloat16", "float32"}
            kept = record[collective]
            assert kept["sizes"] == record["sizes"] and all(t is None or t > 0 for ts in kept["us"].values()
                                                            for t in ts)
            for nbytes, name in zip(kept["sizes"], kept["winners"]):
                if tuned.selector.fits(name, nbytes):
                    assert tuned.select(nbytes, "bfloat16", collective=collective) == name, (collective, nbytes)
                why = tuned.selector.explain(nbytes, "bfloat16", collective)[1]
                assert f"({collective}, tune file {path}: {table.label})" in why, why


def test_tune_in_the_dependent_mode_writes_the_entry_a_communicator_asking_for_it_takes(comm, tmp_path, capsys):
    """--mode dependent: each call after a GEMM (torch's) writing its input, in CUDA graphs; the
    entry keyed dependent, its record with the GEMM's shape and the raw and GEMM-alone
    times; UBNEXT_TABLE_MODE=dependent takes it, graph falls back to it (the file has no
    graph entry) and describe() says so."""
    import math

    import ubnext
    from ubnext import tune
    from ubnext._selection.table_format import load_table

    path = comm.bootstrap.bcast_obj(str(tmp_path / "tune_dependent.json") if comm.rank == 0 else None)
    argv = ["-o", path, "--mode", "dependent", "--gemm", "16,512,256", "-b", "4K", "-e", "1M", "-f", "16",
            "-n", "4", "-G", "2", "--repeats", "3", "--dtype", "bfloat16,float32"]
    assert tune.run(comm, tune.parse_args(argv), argv) == 0
    if comm.rank == 0:
        out = capsys.readouterr().out
        assert "dependent mode: CUDA graphs of 4 (GEMM 16x512x256 writing the call's input, call) pairs" in out
        assert out.rstrip().endswith("export UBNEXT_TABLE_MODE=dependent")
    comm.bootstrap.barrier()
    (table,) = load_table(path).entries
    assert table.gpu == comm.describe()["device_name"] and table.key[1:] == ("nvlink", "plain", "dependent")
    assert set(table.rows[str(comm.size)]) == {"bfloat16", "float32"}
    record = table.entry["measured"][str(comm.size)]["bfloat16"]
    assert record["gemm_mnk"] == [16, 512, 256] and record["sizes"] == [4 << 10, 64 << 10, 1 << 20]
    assert set(record["raw_us"]) == set(record["gemm_us"]) == set(record["us"])
    for kept in (record, record["reduce_scatter"], record["all_gather"]):
        for name, ranked in kept["us"].items():
            for us, raw, gemm in zip(ranked, kept["raw_us"][name], kept["gemm_us"][name]):
                assert (us is None) == (raw is None) == (gemm is None), name
                assert us is None or (raw > 0 and gemm > 0 and math.isfinite(us)), name
    assert set(table.by_collective) == {"reduce_scatter", "all_gather"}
    settings = dict(pool_mb=64, staging_mb=8, lamport_twoshot_max_kb=2048, tune_file=path)
    with ubnext.Communicator(table_mode="dependent", **settings) as tuned:
        assert tuned.describe()["tables"][0] == f"tune file {path}: {table.label} (exact match)"
        for nbytes, name in zip(record["sizes"], record["winners"]):
            if tuned._selector.fits(name, nbytes):
                assert tuned.select(nbytes, "bfloat16") == name
    with ubnext.Communicator(**settings) as graph:
        assert graph.describe()["tables"][0] == (f"tune file {path}: {table.label} (no graph mode entry for "
                                                 f"{table.gpu} nvlink plain: dependent's)")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_tune_times_calls_on_values_not_zeros(comm, dtype):
    """The quantized kernels skip a group of zeros' arithmetic: tune's input must hold no
    such group (nor infinities or NaNs), so that it times what a model's data costs."""
    import cupy
    import ml_dtypes
    import numpy as np

    from ubnext import tune
    from ubnext._tools import tune_measure
    from ubnext._protocol import quant as _quant

    host_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    stream = cupy.cuda.Stream(non_blocking=True)
    args = tune.parse_args(["-b", "4K", "-e", "1M", "--dtype", dtype])
    send, out = tune_measure.buffers(dtype, args, stream)
    stream.synchronize()
    assert send.size == out.size == (1 << 20) // np.dtype(host_dtype).itemsize
    values = cupy.asnumpy(send.view(cupy.uint32 if dtype == "float32" else cupy.uint16)).view(host_dtype)
    values = values.astype(np.float32)
    assert np.isfinite(values).all() and np.abs(values).max() <= 0.5
    whole = values[: values.size // _quant.GROUP * _quant.GROUP].reshape(-1, _quant.GROUP)
    assert (np.abs(whole).max(axis=1) > 0).all()


def test_tune_movers_writes_their_rows_and_auto_follows_them(comm, tmp_path, capsys):
    """--movers: the broadcast's and the all-to-all's forms and NCCL timed in one run (NCCL
    refused, a dash, where ranks share a GPU), their rows under the entry's collectives; a
    communicator loading the file hands each measured size to the row's algorithm, and its
    auto broadcast and all-to-all move the bytes exactly at each size."""
    import cupy
    import numpy as np

    import ubnext
    from ubnext import tune
    from ubnext._selection.table_format import load_table

    path = comm.bootstrap.bcast_obj(str(tmp_path / "tune_movers.json") if comm.rank == 0 else None)
    argv = ["-o", path, "--movers", "--collectives", "all_reduce", "-b", "4K", "-e", "4M", "-f", "32", "-n", "4",
            "-G", "2", "--repeats", "3"]
    assert tune.run(comm, tune.parse_args(argv), argv) == 0
    if comm.rank == 0:
        out = capsys.readouterr().out
        assert "# µs per broadcast (size: the message, root 0)" in out and "# broadcast rows for " in out
        assert "# send_recv: only NCCL serves it" in out or "# send_recv rows for " in out
    comm.bootstrap.barrier()
    (table,) = load_table(path).entries
    world = str(comm.size)
    for mover in ("broadcast", "all_to_all"):
        kept = table.entry["measured"][world]["bfloat16"][mover]
        assert kept["sizes"] == [4 << 10, 128 << 10, 4 << 20]
        assert "nccl" in kept["us"] and "copy" in kept["us"]
        assert all(t is None or t > 0 for ts in kept["us"].values() for t in ts)
        assert set(table.by_collective[mover][world]) == {"bfloat16"}
    assert set(table.entry["measured"][world]["bfloat16"]["broadcast"]["us"]) >= {"ll", "scatter_allgather"}
    with ubnext.Communicator(pool_mb=64, staging_mb=8, lamport_twoshot_max_kb=2048, tune_file=path) as tuned:
        n, me = tuned.size, tuned.rank
        for mover in ("broadcast", "all_to_all"):
            kept = table.entry["measured"][world]["bfloat16"][mover]
            for nbytes, name in zip(kept["sizes"], kept["winners"]):
                assert tuned._sized(mover, tuned._mover(mover, "auto"), nbytes, "bfloat16") == name, (mover, nbytes)
                count = nbytes // 4 // n * n
                x = cupy.arange(count, dtype=cupy.int32) + 1000000 * me
                got = tuned.broadcast(x, 0) if mover == "broadcast" else tuned.all_to_all(x)
                k = count // n
                want = (np.arange(count, dtype=np.int32) if mover == "broadcast" else np.concatenate(
                    [np.arange(me * k, (me + 1) * k, dtype=np.int32) + 1000000 * j for j in range(n)]))
                assert (cupy.asnumpy(got) == want).all(), (mover, nbytes, name)
        tuned.synchronize()
