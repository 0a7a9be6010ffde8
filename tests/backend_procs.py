"""Rank bodies of test_torch_backend_procs.py: processes (spawned) that run programs
on the ubnext backend with fake communicators (backend_fakes.StoreComm over the group's
store), each writing what it saw to ``{out}/{rank}.pt`` (or its traceback to
``{out}/{rank}.err``)."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

RANK_TIMEOUT_S = 120


def run(body, rank: int, size: int, out: str) -> None:
    """Spawn target: ``body(rank, size, out)``'s dict saved, or the traceback."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        import backend_fakes

        import ubnext.torch.backend as ub

        log: list = []
        ub.register("ubnext_fake", backend_fakes.factory(log), device_type="cpu")
        from datetime import timedelta

        dist.init_process_group("ubnext_fake", store=dist.FileStore(f"{out}/store", size), rank=rank,
                                world_size=size, timeout=timedelta(seconds=RANK_TIMEOUT_S))
        result = body(rank, size, log)
        dist.destroy_process_group()
        result["closed"] = [c.closed for c in log]
        torch.save(result, f"{out}/{rank}.pt")
    except BaseException:
        with open(f"{out}/{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise


def world2(rank: int, size: int, log: list) -> dict:
    """Every dist.* op, functional collectives eager and compiled, DDP, new_group, the Gloo route."""
    import torch.distributed._functional_collectives as fc

    import backend_fakes
    import ubnext.torch.backend as ub

    r, peer = rank, 1 - rank
    got: dict = {"backend": dist.get_backend(), "name": dist.group.WORLD.group_name}
    t = torch.full((3,), r + 1.0)
    dist.all_reduce(t)
    got["all_reduce"] = t.tolist()
    w = dist.all_reduce(torch.full((2,), r + 1.0), op=dist.ReduceOp.MAX, async_op=True)
    got["async_future"] = w.get_future().wait()[0].tolist()
    t = torch.full((2,), 10.0 + r)
    dist.broadcast(t, src=1)
    got["broadcast"] = t.tolist()
    t = torch.full((2,), r + 1.0)
    dist.reduce(t, dst=0)
    got["reduce"] = t.tolist()
    ag = torch.zeros(4)
    dist.all_gather_into_tensor(ag, torch.full((2,), r + 1.0))
    got["all_gather_into_tensor"] = ag.tolist()
    ag_list = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(ag_list, torch.full((1,), 5.0 + r))
    got["all_gather"] = [x.item() for x in ag_list]
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(4.0) * (r + 1))
    got["reduce_scatter_tensor"] = rs.tolist()
    rs = torch.zeros(1)
    dist.reduce_scatter(rs, [torch.full((1,), 1.0 + r), torch.full((1,), 3.0 + r)])
    got["reduce_scatter"] = rs.tolist()
    ins, outs = ([1, 2], [1, 3]) if r == 0 else ([3, 1], [2, 1])
    y = torch.zeros(sum(outs))
    dist.all_to_all_single(y, torch.arange(float(sum(ins))) + 100 * r, outs, ins)
    got["all_to_all_single"] = y.tolist()
    recv = torch.zeros(2)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), r + 1.0), peer),
                                        dist.P2POp(dist.irecv, recv, peer)]):
        work.wait()
    got["batch_isend_irecv"] = recv.tolist()
    if r == 0:
        dist.send(torch.tensor([42.0]), 1)
    else:
        x = torch.zeros(1)
        dist.recv(x, 0)
        got["recv"] = x.tolist()
    gl = [torch.zeros(1), torch.zeros(1)] if r == 1 else None
    dist.gather(torch.full((1,), 7.0 + r), gl, dst=1)
    got["gather"] = [x.item() for x in gl] if gl else None
    sc = torch.zeros(1)
    dist.scatter(sc, [torch.full((1,), 20.0), torch.full((1,), 21.0)] if r == 0 else None, src=0)
    got["scatter"] = sc.tolist()
    dist.barrier()
    from torch.distributed.distributed_c10d import _coalescing_manager

    coalesced = [torch.full((2,), r + 1.0), torch.full((3,), 10.0 * (r + 1))]
    with _coalescing_manager(async_ops=True) as cm:  # issued at its end as one allreduce_coalesced
        for t in coalesced:
            dist.all_reduce(t)
    cm.wait()
    got["coalescing_manager"] = [t.tolist() for t in coalesced]
    # functional collectives: eager, then compiled with fullgraph
    got["fc_all_reduce"] = fc.all_reduce(torch.full((2,), r + 1.0), "sum", dist.group.WORLD).tolist()
    got["fc_all_gather"] = fc.all_gather_tensor(torch.full((1,), r + 1.0), 0, dist.group.WORLD).tolist()
    got["fc_reduce_scatter"] = fc.reduce_scatter_tensor(torch.arange(2.0) + r, "sum", 0, dist.group.WORLD).tolist()
    got["fc_all_to_all"] = fc.all_to_all_single(torch.arange(2.0) + 10 * r, [1, 1], [1, 1], dist.group.WORLD).tolist()
    compiled = torch.compile(lambda x: fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1, fullgraph=True)
    got["compiled"] = compiled(torch.full((2,), r + 1.0)).tolist()
    # DDP: its reducer all-reduces the gradient buckets from C++
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.full((3, 4), r + 1.0)).sum().backward()
    got["ddp_grad"] = model.weight.grad.clone()
    # a subgroup is its own communicator
    before = len(log)
    sub = dist.new_group([0, 1])
    t = torch.full((1,), r + 1.0)
    dist.all_reduce(t, group=sub)
    got["subgroup"] = (t.tolist(), len(log) - before, sub.group_name != dist.group.WORLD.group_name)
    # the CPU route: a group whose communicator serves CUDA sends CPU tensors to Gloo
    cuda_log: list = []
    ub.register("ubnext_cuda_fake", backend_fakes.factory(cuda_log), device_type="cuda")
    g = dist.new_group([0, 1], backend="ubnext_cuda_fake")
    t = torch.full((2,), r + 1.0)
    dist.all_reduce(t, group=g)
    y = torch.zeros(2)
    dist.all_gather_into_tensor(y, torch.full((1,), r + 5.0), group=g)
    objects: list = [None, None]
    dist.all_gather_object(objects, {"rank": r}, group=g)  # object collectives: CPU tensors, so Gloo
    got["gloo_route"] = (t.tolist(), y.tolist(), objects, len(cuda_log), type(g._cpu.backend).__name__)
    got["calls"] = [[name for name, _ in c.calls] for c in log]
    return got


def mesh4(rank: int, size: int, log: list) -> dict:
    """A 2 x 2 device mesh (dp x tp): one communicator per mesh group; DTensor tensor
    parallelism (parallelize_module) and FSDP2 (fully_shard) on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    got: dict = {"tp_ranks": mesh["tp"].mesh.tolist(), "dp_ranks": mesh["dp"].mesh.tolist()}
    d = distribute_tensor(torch.arange(8.0), mesh["tp"], [Shard(0)])
    got["dtensor_full"] = d.full_tensor().tolist()
    got["dtensor_replicate"] = d.redistribute(mesh["tp"], [Replicate()]).to_local().tolist()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 4, bias=False))
    ref = torch.nn.Sequential(*[m for m in torch.nn.Sequential(*mlp)])  # the same weights, before sharding
    x = torch.arange(8.0).view(2, 4) / 8
    want = ref(x).detach().clone()
    parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    got["tp_out"], got["tp_want"] = mlp(x).detach(), want
    import copy

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    inputs = [torch.full((2, 4), dp + 1.0) for dp in range(2)]
    for x in inputs:  # the reference: each dp rank's loss, averaged, in one process
        (ref(x).sum() / 2).backward()
    fully_shard(model, mesh=mesh["dp"])
    model(inputs[mesh["dp"].get_local_rank()]).sum().backward()
    got["fsdp_grad"], got["fsdp_want"] = model[0].weight.grad.full_tensor(), ref[0].weight.grad
    got["comms"] = len(log)
    got["calls"] = sorted({name for c in log for name, _ in c.calls})
    return got


def split2(rank: int, size: int, log: list) -> dict:
    """torch's split_group, and new_group and init_device_mesh on a world bound to a device
    (as init_process_group(device_id=...) binds it on a GPU machine; emulated here: the
    accelerator answers as CUDA's, the tensors stay on the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    world = dist.group.WORLD
    world._get_backend(torch.device("cuda", 0)).eager_connect_single_device(torch.device("cuda", 0))
    got: dict = {"bound": str(world.bound_device_id)}
    alone = dist.split_group(split_ranks=[[0], [1]], group_desc="alone")
    pair = dist.split_group(split_ranks=[[0, 1]])
    t, u = torch.full((2,), rank + 1.0), torch.full((1,), rank + 1.0)
    dist.all_reduce(t, group=alone)
    dist.all_reduce(u, group=pair)
    got["split"] = (t.tolist(), u.tolist(), dist.get_process_group_ranks(alone), alone.group_desc,
                    pair.group_name != world.group_name)
    first = dist.new_group([0])  # rank 1 is outside: torch asks the world's backend to split nothing
    got["new_group"] = first == dist.GroupMember.NON_GROUP_MEMBER if rank else dist.get_process_group_ranks(first)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    v = torch.full((1,), rank + 1.0)
    dist.all_reduce(v, group=mesh.get_group("dp"))
    tp = mesh.get_group("tp")
    got["mesh"] = (v.tolist(), tp.size(), tp.group_name.isdigit())  # new_group's names are serial numbers
    got["comms"] = len(log)
    return got
