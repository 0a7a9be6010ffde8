"""The first compiled call on a communicator that nothing has used yet, on CPU: the six
ways a user reaches a communicator from compiled code (tests/compile_forms.py: a module
global, a closure variable, an ``nn.Module`` attribute, a method of an object that holds
it, ``out=`` on the method, ``group=`` of ``ubnext.torch.functional``), and ``group=`` of
every ``ubnext.torch`` op and layer, under ``torch.compile`` by default and with
``fullgraph=True``.

Two halves:

* traced, not run: a ``Communicator`` made by ``Communicator.__init__`` itself (stopped at
  its CUDA context by fakes, as tests/test_tables.py does: nothing here has a GPU), never
  called. Every form traces into one graph, without a break, whose ubnext ops carry the
  communicator's handle as a constant. (Before the handle was assigned at construction,
  torch 2.11 failed here on every form and op: ``AsPythonConstantNotImplementedError:
  UserDefinedObjectVariable(Communicator) is not a constant``.)
* traced and run: a never-used stand-in ``Communicator`` that carries a thread
  communicator's handle (``torch_fakes.traced_communicator``), in the same forms at 2 ranks:
  the ops in the graph and eager's bits; rank 0 compiles (dynamo is not thread-safe), rank 1
  runs the same calls eagerly.

The CPU backends are the graph recorder and ``aot_eager`` (fake implementations,
functionalization); tests/test_gpu_torch_compile.py compiles with the default backend.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from compile_forms import FORMS, via_closure  # noqa: E402
from torch import nn  # noqa: E402
from torch_fakes import run_ranks, traced_communicator  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import UbnextError  # noqa: E402
from ubnext.torch import functional  # noqa: E402


def op_calls(comm, rank: int, size: int) -> dict:
    """``group=comm`` in every op of ubnext.torch: name -> (fn of one tensor, its input,
    its ubnext ops); the same operands for the same rank on every call."""
    g = torch.Generator().manual_seed(30 + rank)
    r, w, b = torch.randn(4, 16, generator=g), torch.randn(16, generator=g), torch.randn(16, generator=g)
    weight = torch.randn(16, 8, generator=g)
    norm = torch.randn(4 // size, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    x = torch.randn(4, 16, generator=g)

    def in_place(x):
        y = x * 2
        ut.all_reduce(y, op=ut.ReduceOp.SUM, group=comm)
        return y

    def into_shard(x):
        out = torch.empty(x.shape[0] // size, x.shape[1])
        ut.reduce_scatter_tensor(out, x, op=ut.ReduceOp.AVG, group=comm)
        return out

    def into_gathered(x):
        out = torch.empty(size * x.shape[0], x.shape[1])
        ut.all_gather_into_tensor(out, x, group=comm)
        return out

    calls = {
        "all_reduce": (in_place, ["all_reduce_"]),
        "reduce_scatter_tensor": (into_shard, ["reduce_scatter_"]),
        "all_gather_into_tensor": (into_gathered, ["all_gather_"]),
        "functional.all_reduce": (lambda x: functional.all_reduce(x, "max", group=comm), ["all_reduce"]),
        "functional.all_reduce_add_rmsnorm": (
            lambda x: functional.all_reduce_add_rmsnorm(x, r, w, b, 1e-5, group=comm), ["all_reduce_add_rmsnorm"]),
        "functional.reduce_scatter": (lambda x: functional.reduce_scatter(x, group=comm), ["reduce_scatter"]),
        "functional.all_gather": (lambda x: functional.all_gather(x, group=comm), ["all_gather"]),
        "functional.reduce_scatter_add_rmsnorm": (
            lambda x: functional.reduce_scatter_add_rmsnorm(x, r[:4 // size], w, b, 1e-5, group=comm),
            ["reduce_scatter_add_rmsnorm"]),
        "functional.copy_to_group": (lambda x: functional.copy_to_group(x, group=comm) * 2, []),
        "all_gather_matmul": (lambda x: ut.all_gather_matmul(x, weight, group=comm), ["all_gather_matmul"]),
        "matmul_reduce_scatter": (lambda x: ut.matmul_reduce_scatter(x, weight, group=comm),
                                  ["matmul_reduce_scatter"]),
        "matmul_reduce_scatter_add_rmsnorm": (
            lambda x: ut.matmul_reduce_scatter_add_rmsnorm(x, weight, *norm, group=comm),
            ["matmul_reduce_scatter_add_rmsnorm"]),
    }
    return {name: (fn, x, ops) for name, (fn, ops) in calls.items()}


def layers(comm, rank: int, size: int) -> dict:
    """Every layer of ubnext.torch.tp built on ``comm``: name -> (fn of one tensor, its
    input, its ubnext ops); the same weights and operands for the same rank on every call."""
    g = torch.Generator().manual_seed(40 + rank)

    def init(m):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return m

    def block(m):  # (x, residual) -> (normed, residual)
        residual = torch.randn(4, 16, generator=g)
        return lambda x: m(x, residual)

    built = {
        "ColumnParallelLinear": (init(ut.ColumnParallelLinear(16, 8, comm, bias=True)), (4, 16), []),
        "ColumnParallelLinear(sequence_parallel)": (
            init(ut.ColumnParallelLinear(16, 8, comm, sequence_parallel=True)), (4 // size, 16), ["all_gather_matmul"]),
        "RowParallelLinear": (init(ut.RowParallelLinear(16, 8, comm, bias=True)), (4, 16 // size), ["all_reduce"]),
        "AddRMSNormEpilogue": (block(init(ut.AddRMSNormEpilogue(16, comm))), (4, 16), ["all_reduce_add_rmsnorm"]),
        "TensorParallelMLP": (block(init(ut.TensorParallelMLP(16, 32, comm, bias=True))), (4, 16),
                              ["all_reduce_add_rmsnorm"]),
        "TensorParallelAttentionOutput": (block(init(ut.TensorParallelAttentionOutput(16, 16, comm, bias=True))),
                                          (4, 16 // size), ["all_reduce_add_rmsnorm"]),
    }
    return {name: (fn, torch.randn(shape, generator=g), ops) for name, (fn, shape, ops) in built.items()}


def ubnext_calls(graphs) -> list[tuple[str, int]]:
    """(op, handle) of every ``torch.ops.ubnext`` call in dynamo's graphs, in order."""
    calls = []
    for gm in graphs:
        for node in gm.graph.nodes:
            target = str(node.target)
            if node.op == "call_function" and target.startswith("ubnext."):
                calls.append((target.removeprefix("ubnext.").removesuffix(".default"), node.args[-1]))
    return calls


def recording(graphs: list, run: bool = True):
    """A torch.compile backend that keeps dynamo's graphs and runs them as they are (or,
    ``run=False``, returns zeros of the outputs' shapes without running them)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        if run:
            return gm.forward
        outputs = [n.meta["example_value"] for n in next(iter(reversed(gm.graph.nodes))).args[0]]
        return lambda *args: [torch.zeros(t.shape, dtype=t.dtype) for t in outputs]

    return backend


# ---- traced, not run: a Communicator as Communicator() makes it ----------------------------
class _Stop(Exception):
    pass


@pytest.fixture
def constructed(monkeypatch):
    """``make(size)``: rank 0's ``Communicator`` of ``size`` thread ranks made by
    ``Communicator.__init__``, which fakes stop at its CUDA context (no preflight, each rank
    its own device, cupy's Device a stand-in); it is left closed, never called."""
    import cupy
    from thread_ranks import run_ranks as run_boots

    from ubnext import Communicator
    from ubnext._api import communicator as _comm

    def context(device):
        raise _Stop("at the CUDA context")

    monkeypatch.setattr(_comm._preflight, "check", lambda op, config: None)
    monkeypatch.setattr(_comm, "map_devices", lambda local, device, current: local.rank)
    monkeypatch.setattr(_comm, "caller_device", lambda: 0)
    monkeypatch.setattr(_comm, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: type("Device", (), {"use": lambda self: None})())
    monkeypatch.setattr(_comm, "Context", context)

    def rank(boot):
        comm = Communicator.__new__(Communicator)
        with pytest.raises(_Stop):
            comm.__init__(bootstrap=boot)
        return comm

    def make(size: int):
        comms = run_boots(size, rank)
        assert all(isinstance(c, Communicator) and c._closed for c in comms), comms
        return comms[0]

    return make


def _traces(fn, x, fullgraph: bool) -> list:
    """Dynamo's graphs of ``fn(x)`` compiled (not run), after a reset."""
    torch._dynamo.reset()
    graphs = []
    torch.compile(fn, fullgraph=fullgraph, backend=recording(graphs, run=False))(x)
    return graphs


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda f: f.__name__)
def test_a_constructed_communicator_traces_in_every_form(constructed, form, fullgraph):
    comm = constructed(2)
    graphs = _traces(form(comm), torch.randn(4, 16), fullgraph)
    assert ubnext_calls(graphs) == [(op, ut.handle(comm)) for op in FORMS[form]]
    assert len(graphs) == 1  # no break


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("calls", [op_calls, layers], ids=["ops", "layers"])
def test_a_constructed_communicator_traces_as_group_of_every_op_and_layer(constructed, calls, fullgraph):
    comm = constructed(2)
    for name, (fn, x, ops) in calls(comm, comm.rank, comm.size).items():
        graphs = _traces(fn, x, fullgraph)
        assert ubnext_calls(graphs) == [(op, ut.handle(comm)) for op in ops], name
        assert len(graphs) == 1, name


# ---- traced and run: eager's bits ----------------------------------------------------------
def _compiled_and_eager(make, fullgraph: bool, size: int = 2) -> dict:
    """Every entry of ``make(comm, rank, size)`` (name -> (fn of one tensor, that tensor,
    its ubnext ops)) compiled on rank 0 with a never-used stand-in communicator, by the
    graph recorder and by aot_eager, then called eagerly on the thread communicator (the
    other ranks make the same calls eagerly). Returns rank 0's name -> (eager result,
    recorded result, aot_eager result, the graphs' ubnext calls, the calls expected with
    the stand-in's handle, the number of graphs)."""
    def body(tc):
        out = {}
        for name, (fn, x, ops) in make(tc, tc.rank, size).items():
            if tc.rank:
                fn(x), fn(x), fn(x)
                continue
            stand = traced_communicator(tc)  # never called before the compiled calls
            compiled = make(stand, 0, size)[name][0]
            graphs = []
            torch._dynamo.reset()
            got = torch.compile(compiled, fullgraph=fullgraph, backend=recording(graphs))(x)
            torch._dynamo.reset()
            got_aot = torch.compile(compiled, fullgraph=fullgraph, backend="aot_eager")(x)
            out[name] = fn(x), got, got_aot, ubnext_calls(graphs), [(op, ut.handle(stand)) for op in ops], len(graphs)
        return out

    return run_ranks(size, body)[0]


def _equal(a, b) -> bool:
    a, b = (list(t) if isinstance(t, tuple) else [t] for t in (a, b))
    return len(a) == len(b) and all(p.shape == q.shape and torch.equal(p, q) for p, q in zip(a, b))


def _forms(comm, rank: int, size: int) -> dict:
    """The six forms on ``comm``; on a thread communicator (the eager calls) its own
    all_reduce(x * 2) + 1 for each (a module global cannot hold each rank's)."""
    from ubnext import Communicator

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(20 + rank))
    own = not isinstance(comm, Communicator)
    return {form.__name__: ((via_closure if own else form)(comm), x, ops) for form, ops in FORMS.items()}


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("make", [_forms, op_calls, layers], ids=["forms", "ops", "layers"])
def test_every_form_op_and_layer_runs_with_eager_bits(make, fullgraph):
    for name, (want, got, got_aot, calls, expected, count) in _compiled_and_eager(make, fullgraph).items():
        assert calls == expected and count == 1, name
        assert _equal(got, want) and _equal(got_aot, want), name


# ---- what has no handle --------------------------------------------------------------------
def test_a_group_without_a_handle_under_compile_raises_naming_the_fix():
    """A group that is not a Communicator gets its handle on its first eager use; met first
    under torch.compile, it raises (never runs the registry inside the trace)."""
    class Group:
        size = 2

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="group= is a Group without a handle under torch.compile"):
        torch.compile(lambda x: functional.all_reduce(x, group=Group()), fullgraph=True, backend="eager")(
            torch.ones(2))
    eager = Group()
    assert ut.handle(eager) == eager._handle and ut.handle(eager) & 0xFFFF == 2


def test_a_communicator_too_large_for_a_handle_raises():
    class Group:
        size = 1 << 16

    with pytest.raises(UbnextError, match="a communicator of 65536 ranks has no handle"):
        ut.handle(Group())
