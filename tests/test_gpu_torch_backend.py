"""The ubnext torch.distributed backend on GPUs: init_process_group(backend="ubnext")
over a TCPStore, every dist.* op on CUDA tensors against a host reference (inputs whose
sums are exact in any order, gpu_support.make_exact_input, so ubnext's kernels and its
NCCL rung must both match bit for bit), the ops the Communicator does not have yet
raising instead (they pass either way), CPU tensors on the Gloo route beside them,
async work (wait on another stream, is_completed, a DDP-hook-style future), CUDA-graph
capture and replay of dist.all_reduce, functional collectives under
torch.compile(fullgraph=True), DDP, new_group subgroups each on its own communicator,
and destroy_process_group closing them.

Run at 1 rank (plain pytest), at N ranks one per GPU and with ranks sharing a GPU:
``mpirun -n N python -m pytest -q tests/test_gpu_torch_backend.py``; skipped without a GPU.
"""

from __future__ import annotations

import pytest
from gpu_support import make_exact_input, require_gpu_and_torch

pytestmark = pytest.mark.gpu

COUNT = 4096 + 3  # elements per rank: odd, beyond one vector


@pytest.fixture(scope="module")
def world():
    """(rank, size) of the default group, initialized with backend "ubnext" over a TCPStore
    rank 0 hosts (its port sent through ubnext's bootstrap: MPI under mpirun)."""
    require_gpu_and_torch()
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ubnext.torch  # noqa: F401 (registers "ubnext")
    from ubnext.bootstrap import default

    boot = default()
    rank, size = boot.rank, boot.size
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = (dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=120), wait_for_workers=False)
             if rank == 0 else None)
    port = int(boot.allgather(str(store.port if store else 0).encode())[0])
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=120))
    from ubnext.torch.backend import Options

    dist.init_process_group("ubnext", store=store, rank=rank, world_size=size, device_id=device,
                            pg_options=Options(pool_mb=512))  # subgroups: UBNEXT_POOL_MB's default
    yield rank, size
    if dist.is_initialized():
        dist.destroy_process_group()
    boot.barrier()  # rank 0 hosts the store: it stays until every rank has left the groups
    boot.close()


def inputs(size: int, seed: int, dtype="float32", count: int = COUNT):
    """Every rank's input of a test (each rank regenerates the others')."""
    return [make_exact_input(count, dtype, r, seed) for r in range(size)]


def bits(t):
    import torch

    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert bool((bits(got) == bits(want)).all()), (got - want).abs().max()


def comm_has(name: str) -> bool:
    """Whether ubnext's Communicator has the collective ``name`` (the rest of NCCL's set
    comes with the collectives branch)."""
    from ubnext import Communicator

    return hasattr(Communicator, name)


def served(name: str, fn) -> bool:
    """Whether ``fn()`` ran: where the Communicator has ``name``, it runs, unless the op
    needs NCCL where NCCL cannot run (ranks sharing a GPU): then the UbnextError says so;
    where the Communicator lacks it, it must raise naming it."""
    from ubnext import UbnextError

    if not comm_has(name):
        with pytest.raises(UbnextError, match=name):
            fn()
        return False
    try:
        fn()
    except UbnextError as exc:
        if "NCCL, which runs it, cannot run here" not in str(exc):
            raise
        return False
    return True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "MIN", "PREMUL_SUM"])
def test_all_reduce(world, op, dtype):
    import torch
    import torch.distributed as dist

    rank, size = world
    xs = inputs(size, 1, dtype)
    wide = torch.stack([x.double() for x in xs])
    want = {"SUM": wide.sum(0), "AVG": wide.sum(0) / size, "MAX": wide.max(0).values, "MIN": wide.min(0).values,
            "PREMUL_SUM": (wide * 0.5).sum(0)}[op].to(xs[0].dtype)
    redop = dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
    t = xs[rank].clone()
    dist.all_reduce(t, op=redop)
    if op == "AVG" and size & (size - 1):  # a division by 3: within one rounding
        torch.testing.assert_close(t, want)
    else:
        assert_bits(t, want)
    comm = dist.group.WORLD.communicator
    assert comm is not None and comm.config.pool_mb == 512 and comm.size == size


def test_product_and_bitwise_raise(world):
    import torch
    import torch.distributed as dist

    from ubnext import UbnextError

    t = torch.ones(8, device="cuda")
    for op, name in ((dist.ReduceOp.PRODUCT, "PRODUCT"), (dist.ReduceOp.BOR, "BOR")):
        with pytest.raises(UbnextError, match=f"ReduceOp.{name}"):
            dist.all_reduce(t, op=op)


def test_all_gather_and_reduce_scatter_tensor(world):
    import torch
    import torch.distributed as dist

    rank, size = world
    xs = inputs(size, 2, "bfloat16", 512)
    out = torch.full((size * 512,), float("nan"), dtype=torch.bfloat16, device="cuda")
    dist.all_gather_into_tensor(out, xs[rank])
    assert_bits(out, torch.cat(xs))
    lst = [torch.full((512,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(size)]
    dist.all_gather(lst, xs[rank])
    for got, want in zip(lst, xs):
        assert_bits(got, want)
    big = inputs(size, 3, "bfloat16", 512 * size)
    total = torch.stack([b.double() for b in big]).sum(0).bfloat16()
    shard = torch.full((512,), float("nan"), dtype=torch.bfloat16, device="cuda")
    dist.reduce_scatter_tensor(shard, big[rank])
    assert_bits(shard, total[rank * 512:(rank + 1) * 512])
    shard.fill_(float("nan"))
    dist.reduce_scatter(shard, list(big[rank].split(512)))
    assert_bits(shard, total[rank * 512:(rank + 1) * 512])


def test_rest_of_the_set_served_or_raising(world):
    """broadcast, reduce, all_to_all_single, gather, scatter, send/recv, barrier: equal to
    the reference where the Communicator has them; a UbnextError naming them where not."""
    import torch
    import torch.distributed as dist

    rank, size = world
    dist.all_reduce(torch.ones(1, device="cuda"))  # the communicator exists
    xs = inputs(size, 4, "float32", 256)
    t = xs[rank].clone()
    if served("broadcast", lambda: dist.broadcast(t, src=size - 1)):
        assert_bits(t, xs[size - 1])
    t = xs[rank].clone()
    if served("reduce", lambda: dist.reduce(t, dst=0)) and rank == 0:
        assert_bits(t, torch.stack([x.double() for x in xs]).sum(0).float())
    out = torch.full((256,), float("nan"), device="cuda")
    if served("all_to_all", lambda: dist.all_to_all_single(out, xs[rank])):
        k = 256 // size
        assert_bits(out, torch.cat([x[rank * k:(rank + 1) * k] for x in xs]))
    if comm_has("gather"):
        parts = [torch.full((256,), float("nan"), device="cuda") for _ in range(size)] if rank == 0 else None
        if served("gather", lambda: dist.gather(xs[rank], parts, dst=0)) and rank == 0:
            for got, want in zip(parts, xs):
                assert_bits(got, want)
        mine = torch.full((256,), float("nan"), device="cuda")
        if served("scatter", lambda: dist.scatter(mine, list(xs) if rank == 0 else None, src=0)):
            assert_bits(mine, xs[rank])
    served("barrier", lambda: dist.barrier())
    if size > 1:
        got = torch.full((256,), float("nan"), device="cuda")
        peer_to, peer_from = (rank + 1) % size, (rank - 1) % size

        def exchange():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, xs[rank], peer_to),
                                             dist.P2POp(dist.irecv, got, peer_from)]):
                w.wait()

        if served("batch_isend_irecv", exchange):
            assert_bits(got, xs[peer_from])
    torch.cuda.synchronize()


def test_cpu_tensors_take_the_gloo_route(world):
    import torch
    import torch.distributed as dist

    rank, size = world
    t = torch.full((5,), rank + 1.0)
    dist.all_reduce(t)
    assert t.tolist() == [size * (size + 1) / 2] * 5
    assert dist.group.WORLD._cpu.backend is not None


def test_async_work_and_future(world):
    import torch
    import torch.distributed as dist

    rank, size = world
    xs = inputs(size, 5)
    want = torch.stack([x.double() for x in xs]).sum(0).float()
    t = xs[rank].clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)  # a DDP communication hook's shape
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        work.wait()  # the other stream waits for the all-reduce, the host does not
        doubled = t * 2
    other.synchronize()
    assert_bits(t, want)
    assert_bits(doubled, want * 2)
    assert_bits(fut.wait(), want * 2)
    torch.cuda.synchronize()
    assert work.is_completed()


def test_cuda_graph_capture_and_replay(world):
    import torch
    import torch.distributed as dist

    rank, size = world
    xs = inputs(size, 6, "bfloat16", 1024)
    t = xs[rank].clone()
    dist.all_reduce(t)  # eager first: the kernel is compiled, the plan made
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(t)
    want = torch.stack([x.double() for x in xs]).sum(0).bfloat16()
    for _ in range(3):
        t.copy_(xs[rank])
        graph.replay()
        torch.cuda.synchronize()
        assert_bits(t, want)


def test_functional_collectives_compiled(world):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    rank, size = world
    xs = inputs(size, 7, "float32", 1024)
    group = dist.group.WORLD

    def step(x):
        y = fc.all_reduce(x, "sum", group)
        return fc.all_gather_tensor(fc.reduce_scatter_tensor(y, "sum", 0, group), 0, group)

    want = torch.stack([x.double() for x in xs]).sum(0).float() * size
    assert_bits(step(xs[rank]), want)
    assert_bits(torch.compile(step, fullgraph=True)(xs[rank]), want)


def test_ddp_gradients_are_averaged(world):
    import torch

    rank, size = world
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).cuda()
    ref = torch.nn.Linear(64, 32).cuda()
    ref.load_state_dict(model.state_dict())
    # DDP's first step broadcasts rank 0's parameters: the Communicator's broadcast where it has one
    ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=comm_has("broadcast"))
    batch = [make_exact_input(8 * 64, "float32", r, 8).view(8, 64) for r in range(size)]
    ddp(batch[rank]).sum().backward()
    for x in batch:
        (ref(x).sum() / size).backward()
    torch.testing.assert_close(model.weight.grad, ref.weight.grad)


def test_new_group_subgroups_have_their_own_communicators(world):
    import torch
    import torch.distributed as dist

    rank, size = world
    halves = [list(range(0, size, 2)), list(range(1, size, 2))] if size > 1 else [[0]]
    groups = [dist.new_group(r) for r in halves]  # collective: every rank creates every group
    mine = next(g for g, r in zip(groups, halves) if rank in r)
    members = next(r for r in halves if rank in r)
    t = torch.full((1000,), rank + 1.0, device="cuda")
    dist.all_reduce(t, group=mine)
    assert t.tolist() == [float(sum(m + 1 for m in members))] * 1000
    assert mine.communicator is not None and mine.communicator is not dist.group.WORLD.communicator
    assert mine.communicator.size == len(members)
    dist.destroy_process_group(mine)
    assert mine.communicator is None


@pytest.mark.parametrize("example", ["ddp", "fsdp2", "dtensor_tp", "compiled_functional"])
def test_example_losses_equal_gloos(world, example):
    """At 1 rank (plain pytest): the example program on a GPU prints, step for step, the
    losses of the same program on backend "gloo" on the CPU, within float tolerance (ranks
    sharing a GPU: run the examples under mpirun with both backends, docs/pytorch.md)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    if world[1] != 1:
        pytest.skip("the examples are launched as programs of their own at 1 rank")
    if example == "ddp" and not comm_has("broadcast"):
        pytest.skip("DDP's first step broadcasts rank 0's parameters: needs Communicator.broadcast")
    if example == "dtensor_tp" and not comm_has("scatter"):
        pytest.skip("parallelize_module distributes rank 0's weights: needs Communicator.scatter and broadcast")
    root = Path(__file__).resolve().parents[1]

    def losses(backend, device):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "RANK", "WORLD_"))}
        env["PYTHONPATH"] = str(root)
        out = subprocess.run([sys.executable, str(root / "examples" / f"{example}.py"), "--steps", "10",
                              "--backend", backend, "--device", device], capture_output=True, text=True, env=env,
                             timeout=600, cwd=root / "examples")
        assert out.returncode == 0, out.stderr[-3000:]
        return [float(m) for m in re.findall(r"loss ([-0-9.e]+)", out.stdout)]

    got, want = losses("ubnext", "cuda"), losses("gloo", "cpu")
    assert len(got) == 10
    assert got == pytest.approx(want, rel=1e-3)


def test_split_group_and_a_two_dimensional_mesh(world):
    """The world is bound to its device (the fixture's device_id): split_group, and
    init_device_mesh's groups through it, each a communicator of its own."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, size = world
    assert dist.group.WORLD.bound_device_id is not None
    halves = [list(range(0, size, 2)), list(range(1, size, 2))] if size > 1 else [[0]]
    mine = dist.split_group(split_ranks=halves)
    members = next(r for r in halves if rank in r)
    t = torch.full((300,), rank + 1.0, device="cuda")
    dist.all_reduce(t, group=mine)
    assert t.tolist() == [float(sum(m + 1 for m in members))] * 300
    assert mine.communicator is not None and mine.communicator.size == len(members)
    dp = 2 if size % 2 == 0 else 1
    mesh = init_device_mesh("cuda", (dp, size // dp), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        ranks = dist.get_process_group_ranks(group)
        u = torch.full((8,), rank + 1.0, device="cuda")
        dist.all_reduce(u, group=group)
        assert u.tolist() == [float(sum(r + 1 for r in ranks))] * 8


def test_dtensor_redistributions(world):
    """DTensor's redistributions (functional collectives from C++) on a mesh of every rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rank, size = world
    mesh = init_device_mesh("cuda", (size,))
    sharded = DTensor.from_local(torch.full((2, 3), rank + 1.0, device="cuda"), mesh, [Shard(0)])
    want = torch.cat([torch.full((2, 3), r + 1.0) for r in range(size)])
    assert torch.equal(sharded.full_tensor().cpu(), want)
    assert torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local().cpu(), want)
    total = size * (size + 1) / 2
    partial = DTensor.from_local(torch.full((4 * size,), rank + 1.0, device="cuda"), mesh, [Partial()])
    assert partial.full_tensor().tolist() == [total] * 4 * size  # an all-reduce
    assert partial.redistribute(mesh, [Shard(0)]).to_local().tolist() == [total] * 4  # a reduce-scatter


def test_fsdp2_gradients_equal_a_single_process_reference(world):
    import copy

    import torch
    from torch.distributed.fsdp import fully_shard

    rank, size = world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).cuda()
    ref = copy.deepcopy(model)
    batch = [make_exact_input(8 * 64, "float32", r, 9).view(8, 64) for r in range(size)]
    for x in batch:
        (ref(x).sum() / size).backward()  # FSDP2 averages the ranks' gradients
    fully_shard(model)
    model(batch[rank]).sum().backward()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad)
