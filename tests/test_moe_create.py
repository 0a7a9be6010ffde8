"""Creation of both expert-parallel objects on the CPU (ubnext/_moe/base.py: MoeObject), over
stand-ins of the communicator, the device, the compiler and the launcher: the steps in order
(area, fill after a device wait and a barrier, arrays, compile, a last barrier), the area's
fill (the polled regions the sentinel, the rest zero), the arrays' slots with canary gaps,
and each launcher's constant arguments in the entry point's order (tests/test_moe_kernels.py:
NAMES) with its kernel's launch state."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_moe_kernels import NAMES

from ubnext._moe import base
from ubnext._moe.expert_parallel import ExpertParallel
from ubnext._moe.packed import PackedExpertParallel

POOL_BASE, STRIDE, RANK, MC, AREA_AT, RAW = 0x100000, 1 << 30, 1, 0x7700, 0x4000, 0x9000000


class Order:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def world(monkeypatch):
    """A communicator of 2 ranks (this one rank 1) whose steps are logged in ``world.log``."""
    import cupy

    log = []
    areas = {}

    def symmetric_area(key, nbytes):
        log.append(("area", key, nbytes))
        areas[key] = np.full(nbytes, 0x5A, np.uint8)  # what an earlier object left there
        return areas[key], [0, POOL_BASE + AREA_AT]

    class Device:
        def __init__(self, device):
            self.compute_capability, self.attributes = "90", {"MultiProcessorCount": 132}

        def synchronize(self):
            log.append(("device wait",))

    def full(nbytes, value, dtype):
        log.append(("buffer", nbytes, value))
        return SimpleNamespace(data=SimpleNamespace(ptr=RAW))

    def compile_module(source, defines, device):
        log.append(("compile", source, defines["UB_NRANKS"], defines["UB_T"]))
        return SimpleNamespace(get_function=lambda entry: entry)

    def launcher(function, params, prefix, suffix, dependent):
        log.append(("launcher", function))
        return SimpleNamespace(function=function, params=params, prefix=prefix, state=suffix)

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy, "full", full)
    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", lambda n: bytearray(n))
    monkeypatch.setattr(base, "compile_module", compile_module)
    monkeypatch.setattr(base, "Launcher", launcher)
    monkeypatch.setattr(base._arrays, "wrap", lambda ptr, dims, dtype, device, framework, owner: (ptr, dims, dtype))
    monkeypatch.setattr("ubnext._api.handles.assign", lambda obj: None)
    pool = SimpleNamespace(local_size=2, base=POOL_BASE, stride=STRIDE, local_rank=RANK,
                           contains=lambda ptr, nbytes: ptr - POOL_BASE, local_ptr=lambda offset: 0xE000 + offset)
    engine = SimpleNamespace(_blocks=64, _mc_base=MC, dependent=True,
                             plan=SimpleNamespace(offset=lambda name: {"moe_dispatch.state": 1, "moe_combine.state": 2,
                                                                       "moe_packed_dispatch.state": 3,
                                                                       "moe_packed_combine.state": 4}[name]))
    comm = SimpleNamespace(_order=Order(), _check_open=lambda name: log.append(("open", name)), _nccl_reason=None,
                           _node=SimpleNamespace(pool=pool, engine=engine), device=0,
                           _symmetric_area=symmetric_area, _local=SimpleNamespace(barrier=None),
                           _exchanges=SimpleNamespace(run=lambda name, fn: log.append(("barrier", name))))
    return SimpleNamespace(comm=comm, log=log, areas=areas)


def regions(sizes):
    """Offsets of the named regions laid one after the other from the area's offset."""
    out, at = {}, AREA_AT
    for name, nbytes in sizes:
        out[name] = at
        at += nbytes
    return out


def test_the_low_latency_object_is_created_in_order_with_its_kernels_constant_arguments(world):
    ep = ExpertParallel(world.comm, num_experts=8, hidden=64, max_tokens=5, top_k=2, dtype="bfloat16")
    # 2 ranks, E 8, H 64, M 5, K 2: records of 1 vector, bf16 rows of 128 bytes, C = 10
    at = regions([("rotation", 128), ("dispatch_headers", 3 * 2 * 128), ("records", 3 * 2 * 5 * 16),
                  ("rows", 2 * 2 * 5 * 128), ("combine_headers", 3 * 2 * 128), ("partials", 2 * 2 * 5 * 256)])
    nbytes = at["partials"] + 2 * 2 * 5 * 256 - AREA_AT
    assert [step[0] for step in world.log] == ["open", "area", "device wait", "barrier", "buffer", "device wait",
                                              "compile", "launcher", "compile", "launcher", "barrier"]
    assert world.log[1] == ("area", "moe:8x64x5x2x10:bfloat16", nbytes)
    assert world.log[6] == ("compile", "moe_dispatch.cu", "2", "bf16")
    words = world.areas["moe:8x64x5x2x10:bfloat16"].view(np.uint32)
    for name, end in (("rotation", "dispatch_headers"), ("rows", "combine_headers")):
        assert not words[(at[name] - AREA_AT) // 4:(at[end] - AREA_AT) // 4].any(), name
    for name, end in (("dispatch_headers", "rows"), ("combine_headers", None)):
        polled = words[(at[name] - AREA_AT) // 4:None if end is None else (at[end] - AREA_AT) // 4]
        assert (polled == 0x80000000).all(), name
    sizes = (8, 4, 2, 64, 5, 10)
    pool = (POOL_BASE, STRIDE, RANK, MC)
    want = {"dispatch": pool + (at["rotation"], at["dispatch_headers"], at["records"], at["rows"]) + sizes,
            "combine": pool + (at["rotation"], at["combine_headers"], at["partials"]) + sizes}
    for kind, source, state in (("dispatch", "moe_dispatch.cu", 1), ("combine", "moe_combine.cu", 2)):
        launcher = ep._launchers[kind]
        assert launcher.prefix == want[kind] and launcher.state == (0xE000 + state,)
        assert len(launcher.prefix) == NAMES[source].split().index("y" if kind == "combine" else "x")
    assert ep._blocks == 64 and ep._generation == 0 and ep._comm is world.comm
    slots = list(ep._slots.values())
    assert slots[0] == (256, 4 * 10 * 64 * 2) and all(b[0] >= a[0] + a[1] + 256 for a, b in zip(slots, slots[1:]))
    assert ep._ptr["recv_x"] == RAW + 256 and ep._views["counts"] == (RAW + ep._slots["counts"][0], (4,), "int32")


def test_the_packed_object_is_created_in_order_with_its_kernels_constant_arguments(world):
    ep = PackedExpertParallel(world.comm, num_experts=8, hidden=64, max_tokens=5, top_k=2, dtype="float32")
    at = regions([("rotation", 128), ("dispatch_headers", 3 * 2 * 128), ("combine_headers", 3 * 2 * 128),
                  ("progress", 128), ("records", 2 * 5 * 16), ("data", 2 * 5 * 256)])
    assert [step[0] for step in world.log] == ["open", "area", "device wait", "barrier", "buffer", "device wait",
                                              "compile", "launcher", "compile", "launcher", "barrier"]
    assert world.log[1] == ("area", "moe_packed:8x64x5x2:float32", at["data"] + 2 * 5 * 256 - AREA_AT)
    words = world.areas["moe_packed:8x64x5x2:float32"].view(np.uint32)
    assert not words[:128 // 4].any() and not words[(at["progress"] - AREA_AT) // 4:].any()
    assert (words[(at["dispatch_headers"] - AREA_AT) // 4:(at["progress"] - AREA_AT) // 4] == 0x80000000).all()
    sizes = (8, 4, 2, 64, 5, 2 * 5 * 2)
    pool = (POOL_BASE, STRIDE, RANK, MC)
    want = {"dispatch": pool + (at["rotation"], at["dispatch_headers"], at["progress"], at["records"], at["data"])
            + sizes + (64 // 3,),
            "combine": pool + (at["rotation"], at["combine_headers"], at["data"]) + sizes}
    for kind, source, state in (("dispatch", "moe_packed_dispatch.cu", 3), ("combine", "moe_packed_combine.cu", 4)):
        launcher = ep._launchers[kind]
        assert launcher.prefix == want[kind] and launcher.state == (0xE000 + state,)
        assert len(launcher.prefix) == NAMES[source].split().index("y" if kind == "combine" else "x")
    assert (ep._blocks, ep._senders) == (64, 21)
    assert list(ep._slots) == ["recv_x", "offsets", "src", "weights", "route", "tokens", "dest", "counts"]
    assert ep._slots["recv_x"] == (256, 20 * 64 * 4)


@pytest.mark.parametrize("cls", [ExpertParallel, PackedExpertParallel])
def test_creation_refuses_an_unknown_framework_and_a_communicator_without_a_pool(world, cls):
    with pytest.raises(Exception, match=f"^{cls.__name__}: framework must be 'cupy' or 'torch', got 'jax'"):
        cls(world.comm, 8, 64, 5, 2, framework="jax")
    world.comm._node, world.comm._nccl_reason = None, "one rank per node"
    with pytest.raises(Exception, match=f"^{cls.__name__}: this communicator has no symmetric memory pool "
                                        f"\\(it uses NCCL: one rank per node\\)"):
        cls(world.comm, 8, 64, 5, 2)
    assert [step for step in world.log if step[0] == "area"] == []
