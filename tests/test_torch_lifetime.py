"""Layers and buffer plans hold their communicator (CPU, thread communicators): a model
built in a function works once the function's reference is gone; ``copy.deepcopy`` of a
layer shares its communicator and plan, pickling refuses with a clear error."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest

torch = pytest.importorskip("torch")

import tp_support as tp  # noqa: E402
from torch_fakes import ThreadComm, _Group, run_ranks  # noqa: E402

from ubnext.torch import BufferPlan  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS_FEATURES, TOKENS = 64, 128, 64, 12


def build(w, dtype, planned: bool):
    """What a user writes: the communicator and the plan made in a function, only the model
    returned."""
    comm = ThreadComm(_Group(1), 0)
    plan = BufferPlan(comm, TOKENS, {"mlp": HIDDEN}, dtype) if planned else None
    return tp.mlp(comm, w, dtype, "cpu", plan), weakref.ref(comm)


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_a_model_built_in_a_function_keeps_its_communicator(planned, grad):
    dtype = torch.float32
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cpu")
    model, comm = build(w, dtype, planned)
    gc.collect()
    assert comm() is not None and model.down.comm is comm() and model.norm.comm is comm()
    with torch.set_grad_enabled(grad):
        got = tp.run_block("mlp", model, 0, 1, data, backward=grad)
    reference = tp.run_block("mlp", tp.mlp(ThreadComm(_Group(1), 0), w, dtype, "cpu"), 0, 1, data, backward=grad)
    tp.assert_equal_bits(got, reference)
    del model, got
    gc.collect()
    assert comm() is None  # and nothing else held it


def test_deepcopy_shares_the_communicator_and_the_plan_and_pickling_refuses():
    dtype = torch.float32
    w = tp.weights(HIDDEN, INTERMEDIATE, HEADS_FEATURES, dtype, "cpu")
    data = tp.inputs(TOKENS, HIDDEN, HEADS_FEATURES, dtype, "cpu")

    def rank(comm):
        plan = BufferPlan(comm, TOKENS, {"mlp": HIDDEN}, dtype)
        model = tp.mlp(comm, w, dtype, "cpu", plan)
        twin = copy.deepcopy(model)
        assert twin.down.weight is not model.down.weight and torch.equal(twin.down.weight, model.down.weight)
        assert twin.down.plan is plan and twin.gate_up.comm is model.gate_up.comm
        with torch.no_grad():
            return [tp.run_block("mlp", m, comm.rank, comm.size, data, backward=False) for m in (model, twin)]

    for got, twin in run_ranks(2, rank):
        tp.assert_equal_bits(got, twin)


def test_pickling_a_layer_a_plan_or_a_communicator_refuses():
    from stream_fakes import bare_communicator, fake_order

    from ubnext.torch import RowParallelLinear

    plan = BufferPlan(ThreadComm(_Group(1), 0), TOKENS, {"mlp": HIDDEN}, torch.float32)
    with pytest.raises(TypeError, match="^BufferPlan cannot be pickled"):
        pickle.dumps(plan)
    real = bare_communicator(fake_order())
    layer = RowParallelLinear(INTERMEDIATE, HIDDEN, real)
    assert layer.comm is real
    for thing in (real, layer):
        with pytest.raises(TypeError, match="^Communicator cannot be pickled"):
            pickle.dumps(thing)
    assert copy.deepcopy(real) is real and copy.copy(real) is real
    assert copy.deepcopy(layer).comm is real


def test_a_functional_call_holds_its_communicator_until_backward():
    from ubnext.torch import functional

    def forward():
        comm = ThreadComm(_Group(1), 0)
        x = torch.arange(8, dtype=torch.float32, requires_grad=True)
        return x, functional.all_reduce(functional.copy_to_group(x, comm) * 3, "sum", comm), weakref.ref(comm)

    x, y, comm = forward()
    gc.collect()
    assert comm() is not None  # held by y's graph
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((8,), 3.0))
    del y
    gc.collect()
    assert comm() is None
