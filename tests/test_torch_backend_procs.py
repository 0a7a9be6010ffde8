"""The ubnext backend under init_process_group, in spawned processes on the CPU (fake
communicators over the group's FileStore, backend_procs.py): every dist.* op, functional
collectives eager and compiled, DDP, new_group, the Gloo route for CPU tensors, and a
2 x 2 device mesh with DTensor tensor parallelism and FSDP2."""

from __future__ import annotations

import functools
import multiprocessing
from pathlib import Path

import backend_procs
import pytest
import torch

JOIN_S = 300


def spawn(body, size: int, tmp_path: Path) -> list[dict]:
    """Each rank's dict from ``backend_procs.run(body, ...)``, the ranks spawned, joined with a timeout."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=backend_procs.run, args=(body, r, size, str(tmp_path))) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = {r: (tmp_path / f"{r}.err").read_text() for r in range(size) if (tmp_path / f"{r}.err").exists()}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert not hung, f"ranks {hung} hang"
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(size)]


@functools.cache
def _world2(tmp: str) -> list[dict]:
    return spawn(backend_procs.world2, 2, Path(tmp))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _world2(str(tmp_path_factory.mktemp("world2")))


TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

def test_identity(world2):
    assert [g["backend"] for g in world2] == ["ubnext_fake"] * 2
    assert world2[0]["name"] == world2[1]["name"]


@pytest.mark.parametrize("op,want0,want1", [
    ("all_reduce", [3.0] * 3, [3.0] * 3),
    ("async_future", [2.0, 2.0], [2.0, 2.0]),
    ("broadcast", [11.0, 11.0], [11.0, 11.0]),
    ("all_gather_into_tensor", [1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0]),
    ("all_gather", [5.0, 6.0], [5.0, 6.0]),
    ("reduce_scatter_tensor", [0.0, 3.0], [6.0, 9.0]),
    ("reduce_scatter", [3.0], [7.0]),
    ("all_to_all_single", [0.0, 100.0, 101.0, 102.0], [1.0, 2.0, 103.0]),
    ("batch_isend_irecv", [2.0, 2.0], [1.0, 1.0]),
    ("scatter", [20.0], [21.0]),
    ("coalescing_manager", [[3.0, 3.0], [30.0] * 3], [[3.0, 3.0], [30.0] * 3]),
    ("fc_all_reduce", [3.0, 3.0], [3.0, 3.0]),
    ("fc_all_gather", [1.0, 2.0], [1.0, 2.0]),
    ("fc_reduce_scatter", [1.0], [3.0]),
    ("fc_all_to_all", [0.0, 10.0], [1.0, 11.0]),
    ("compiled", [7.0, 7.0], [7.0, 7.0]),
])
def test_dist_op(world2, op, want0, want1):
    assert [world2[0][op], world2[1][op]] == [want0, want1]


def test_rooted_and_point_to_point(world2):
    assert world2[0]["reduce"] == [3.0, 3.0]
    assert world2[1]["recv"] == [42.0]
    assert world2[1]["gather"] == [7.0, 8.0] and world2[0]["gather"] is None


def test_ddp_averages_the_gradients(world2):
    # d(sum(W x + b))/dW = sum of x's rows: 3 * (rank + 1) per element; averaged: 4.5
    for g in world2:
        torch.testing.assert_close(g["ddp_grad"], torch.full((2, 4), 4.5))


def test_new_group_has_its_own_communicator(world2):
    for g in world2:
        assert g["subgroup"] == ([3.0], 1, True)


def test_cpu_tensors_take_the_gloo_route_and_make_no_communicator(world2):
    for g in world2:
        assert g["gloo_route"] == ([3.0, 3.0], [5.0, 6.0], [{"rank": 0}, {"rank": 1}], 0, "ProcessGroupGloo")


def test_every_op_went_to_the_communicator_and_destroy_closed_it(world2):
    calls = world2[0]["calls"][0]
    for name in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
                 "batch_isend_irecv", "send", "gather", "scatter", "barrier"):
        assert name in calls
    assert all(c == "close" for g in world2 for c in g["closed"])


def test_device_mesh_dtensor_tp_and_fsdp2(tmp_path):
    got = spawn(backend_procs.mesh4, 4, tmp_path)
    for rank, g in enumerate(got):
        assert g["dtensor_full"] == list(map(float, range(8))) == g["dtensor_replicate"]
        torch.testing.assert_close(g["tp_out"], g["tp_want"])
        torch.testing.assert_close(g["fsdp_grad"], g["fsdp_want"])  # FSDP2 averages over dp
        assert g["comms"] >= 2 and "all_gather" in g["calls"] and "reduce_scatter" in g["calls"]
        assert all(c == "close" for c in g["closed"])


def test_split_group_new_group_and_meshes_on_a_bound_world(tmp_path):
    got = spawn(backend_procs.split2, 2, tmp_path)
    for rank, g in enumerate(got):
        assert g["bound"] == "cuda:0"
        assert g["split"] == ([rank + 1.0] * 2, [3.0], [rank], "alone", True)
        assert g["new_group"] == (True if rank else [0])
        # torch 2.13's init_device_mesh makes a bound world's groups with split_group; 2.11's
        # with new_group (serial-number names): both serve the mesh
        assert g["mesh"][:2] == ([3.0], 1)
        assert g["mesh"][2] is (False if TORCH_VERSION >= (2, 13) else True)
    assert all(c == "close" for g in got for c in g["closed"])
