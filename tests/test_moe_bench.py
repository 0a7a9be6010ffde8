"""bench/moe_perf.py on the CPU: its flags, its routing (deterministic, distinct experts,
skewed onto the hot experts) and the link bytes it divides by the push rate."""

from __future__ import annotations

import numpy as np

from bench import moe_perf


def test_defaults_are_the_issue_shape():
    a = moe_perf.parse_args([])
    assert (a.hidden, a.top_k, a.experts, a.dtype, a.routing, a.graphs) == (7168, 8, 256, "bfloat16", "uniform", 1)
    assert moe_perf.parse_args(["-t", "1,128", "-G", "0"]).tokens == [1, 128]
    assert a.partials == "float32" and moe_perf.parse_args(["--partials", "bfloat16"]).partials == "bfloat16"
    assert not a.fp8 and moe_perf.parse_args(["--fp8", "1"]).fp8


def test_routing_is_deterministic_distinct_and_skewed_on_request():
    a = moe_perf.parse_args(["-k", "4", "-e", "32"])
    idx, w = moe_perf.routing(a, 1, 50)
    again, _ = moe_perf.routing(a, 1, 50)
    assert idx.dtype == np.int32 and w.dtype == np.float32 and (idx == again).all()
    assert all(len(set(row)) == 4 for row in idx) and idx.min() >= 0 and idx.max() < 32
    hot, _ = moe_perf.routing(moe_perf.parse_args(["-k", "4", "-e", "32", "--routing", "skewed"]), 1, 50)
    assert hot.max() < 8


def test_link_bytes_count_rows_to_other_gpus_once_each():
    a = moe_perf.parse_args(["-k", "2", "-e", "4", "--hidden", "8"])  # 2 ranks: experts 0, 1 | 2, 3
    idxs = [np.array([[0, 1], [0, 2], [3, 2]], np.int32),  # rank 0: token 1 -> GPU 1, token 2 -> GPU 1
            np.array([[2, 3], [0, -1]], np.int32)]         # rank 1: token 1 -> GPU 0
    rows, partials = moe_perf.link_bytes(a, 2, idxs)
    assert rows == 2 * 8 * 2        # rank 0 sends 2 rows of 8 bf16 (GPU 1 receives token 2 once)
    assert partials == 2 * 8 * 4    # GPU 1 returns 2 fp32 partials to rank 0
    half = moe_perf.parse_args(["-k", "2", "-e", "4", "--hidden", "8", "--partials", "bfloat16"])
    assert moe_perf.link_bytes(half, 2, idxs) == (rows, partials // 2)
    fp8 = moe_perf.parse_args(["-k", "2", "-e", "4", "--hidden", "512", "--fp8", "1"])
    assert moe_perf.link_bytes(fp8, 2, idxs)[0] == 2 * (512 + 512 // 32)  # e4m3 codes and fp32 scales per row


def test_the_capacity_is_the_busiest_experts_count():
    idxs = [np.array([[0, 3], [3, -1]], np.int32), np.array([[3, 1]], np.int32), np.zeros((0, 2), np.int32)]
    assert moe_perf.busiest_expert(4, idxs) == 3
    assert moe_perf.busiest_expert(4, [np.full((2, 2), -1, np.int32)]) == 1


def test_baselines_that_cannot_run_are_named_with_their_reason():
    from types import SimpleNamespace

    def comm(size, problem):
        return SimpleNamespace(size=size, _selector=SimpleNamespace(nccl_problem=problem))

    shared = moe_perf.baseline_problems(comm(4, "ranks share a GPU"))
    assert shared == {"nccl": "ranks share a GPU", "vdev": "ranks share a GPU"}
    alone = moe_perf.baseline_problems(comm(1, None))
    assert "nccl" not in alone and "one rank" in alone["vdev"]
