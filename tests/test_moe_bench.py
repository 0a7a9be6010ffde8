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
    assert shared == {"nccl": "ranks share a GPU", "vdev": "ranks share a GPU", "nccl_ep": "ranks share a GPU"}
    alone = moe_perf.baseline_problems(comm(1, None))
    assert "nccl" not in alone and "one rank" in alone["vdev"]


def test_the_nccl_ep_baseline_is_named_where_it_cannot_run(monkeypatch):
    import sys
    from types import ModuleType, SimpleNamespace

    from bench import _moe_baselines as mb

    monkeypatch.setattr(mb, "nccl_ep_problem", lambda: None)
    shared = moe_perf.baseline_problems(SimpleNamespace(size=4, _selector=SimpleNamespace(nccl_problem="shared")))
    assert shared["nccl_ep"] == "shared"
    monkeypatch.undo()

    monkeypatch.setitem(sys.modules, "nccl.ep", None)  # not importable
    assert "nccl.ep does not import (ModuleNotFoundError" in mb.nccl_ep_problem()
    nccl = ModuleType("nccl")
    nccl.core = SimpleNamespace(get_version=lambda: None)
    monkeypatch.setitem(sys.modules, "nccl", nccl)
    monkeypatch.setitem(sys.modules, "nccl.core", nccl.core)
    monkeypatch.setitem(sys.modules, "nccl.ep", ModuleType("nccl.ep"))
    one = lambda: {"/t/nvidia/nccl/lib/libnccl.so.2"}  # noqa: E731
    old = mb.nccl_ep_problem(loaded=lambda: (2, 28, 9), files=one)
    assert "loaded here is 2.28.9; nccl_ep needs 2.30.7 or newer" in old
    assert "loaded here is 2.30.5;" in mb.nccl_ep_problem(loaded=lambda: (2, 30, 5), files=one)  # the patch counts
    assert "two libnccl loaded (/a/libnccl.so.2, /b/libnccl.so.2)" in mb.nccl_ep_problem(
        loaded=lambda: (2, 30, 7), files=lambda: {"/a/libnccl.so.2", "/b/libnccl.so.2"})
    assert "no libnccl.so.2 loaded" in mb.nccl_ep_problem(loaded=lambda: None, files=set)
    assert mb.nccl_ep_problem(loaded=lambda: (2, 30, 7), files=one) is None
    assert mb.nccl_ep_problem(loaded=lambda: (2, 31, 0), files=one) is None


class _FakeEp:
    """nccl.ep and nccl.core as NcclEpBaseline calls them: records every call, keeps the
    tensors each descriptor names."""

    class Algorithm:
        LOW_LATENCY = "LL"

    class Layout:
        EXPERT_MAJOR = "EM"

    def __init__(self):
        from types import SimpleNamespace

        self.calls, self.tensors = [], 0
        fake = self

        class Bundle(SimpleNamespace):
            pass

        for name in ("GroupConfig", "DispatchInputs", "DispatchOutputs", "LayoutInfo", "CombineInputs",
                     "CombineOutputs"):
            setattr(self, name, type(name, (Bundle,), {}))

        class Tensor:
            def __init__(self, t):
                fake.tensors += 1
                self.t = t

        class Handle:
            def dispatch(self, inputs, outputs, *, layout_info, stream):
                fake.calls.append(("dispatch", inputs, outputs, layout_info, stream))

            def combine(self, inputs, outputs, *, stream):
                fake.calls.append(("combine", inputs, outputs, stream))

        class Group:
            @staticmethod
            def create(comm, config):
                fake.calls.append(("group", comm, config))
                return Group()

            def create_handle(self, layout, topk_idx, *, stream):
                fake.calls.append(("handle", layout, topk_idx, stream))
                return Handle()

        class Communicator:
            @staticmethod
            def init(n, rank, uid):
                fake.calls.append(("comm", n, rank, uid))
                return "comm"

        self.Tensor, self.Group = Tensor, Group
        self.core = SimpleNamespace(get_unique_id=lambda: SimpleNamespace(as_bytes=b"uid0"), Communicator=Communicator,
                                    UniqueId=SimpleNamespace(from_bytes=lambda b: ("uid", b)))


def test_the_nccl_ep_baseline_lays_out_its_buffers_and_calls(monkeypatch):
    """Its low-latency group, its expert-major handle made once at creation from int64
    routing, its own buffers of the layout the header gives ([L, N x M, H], counts [L]
    int32, out [T, H], weights [T, K] float32), every call on torch's current stream, one
    combine descriptor per y buffer."""
    import torch
    from types import SimpleNamespace

    from bench import _moe_baselines as mb

    monkeypatch.setattr(mb, "_stream", lambda: 1234)
    fake = _FakeEp()
    a = moe_perf.parse_args(["-k", "2", "-e", "8", "--hidden", "16"])
    boot = SimpleNamespace(rank=1, size=2, bcast_obj=lambda obj: ("from rank 0", obj) and b"uid0")
    x = torch.randn(3, 16).to(torch.bfloat16)
    idx, w = torch.tensor([[0, 5], [7, 6], [1, 2]], dtype=torch.int32), torch.rand(3, 2)
    b = mb.NcclEpBaseline(a, boot, x, idx, w, ep=fake, core=fake.core)
    (_, n, rank, uid), (_, comm, config), (_, layout, topk, stream) = fake.calls
    assert (n, rank, uid, comm) == (2, 1, ("uid", b"uid0"), "comm")
    assert (config.algorithm, config.num_experts, config.max_dispatch_tokens_per_rank, config.max_token_bytes) == \
        ("LL", 8, 3, 32)
    assert layout == "EM" and stream == 1234 and topk.t.dtype == torch.int64 and torch.equal(topk.t, idx.long())
    assert b.dispatch() is b.recv and (b.recv.shape, b.recv.dtype) == ((4, 6, 16), torch.bfloat16)
    _, inputs, outputs, info, stream = fake.calls[3]
    assert inputs.tokens.t is x and outputs.tokens.t is b.recv and stream == 1234
    assert info.expert_counters.t.shape == (4,) and info.expert_counters.t.dtype == torch.int32
    made = fake.tensors
    for _ in range(2):
        assert b.combine(b.recv) is b.out
    assert fake.tensors == made + 1  # the descriptor of y made once
    _, inputs, outputs, stream = fake.calls[-1]
    assert inputs.tokens.t is b.recv and outputs.tokens.t is b.out and b.out.shape == (3, 16) and stream == 1234
    assert outputs.topk_weights.t.dtype == torch.float32 and torch.equal(outputs.topk_weights.t, w)
    assert [c[0] for c in fake.calls] == ["comm", "group", "handle", "dispatch", "combine", "combine"]

    empty = mb.NcclEpBaseline(a, boot, x[:0], idx[:0], w[:0], ep=fake, core=fake.core)
    assert empty.max_tokens == 1 and empty.recv.shape == (4, 2, 16)  # T = 0: the group takes at least 1


def test_an_nccl_ep_baseline_that_fails_to_start_is_dropped_on_every_rank(monkeypatch):
    from types import SimpleNamespace

    def fails(*args):
        raise RuntimeError("NCCL EP requires NCCL Device API support\nmore")

    monkeypatch.setattr(moe_perf, "NcclEpBaseline", fails)
    comm = SimpleNamespace(bootstrap=SimpleNamespace(allgather_obj=lambda why: [None, why]))
    notes = {}
    assert moe_perf.nccl_ep_calls(comm, moe_perf.parse_args([]), None, None, None, "graph", notes) == {}
    assert notes == {"nccl_ep": "creation failed (RuntimeError: NCCL EP requires NCCL Device API support)"}
