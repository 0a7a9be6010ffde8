"""Communicator methods under torch.compile, on CPU: when dynamo traces
``Communicator.all_reduce`` (``all_reduce_add_rmsnorm``, ``reduce_scatter``,
``all_gather``, ``reduce_scatter_add_rmsnorm``) on torch tensors, the method's first
statement hands the call to ``ubnext.torch._traced``, which maps it to the
``torch.ops.ubnext`` op (``out=`` to the mutating op): no graph break, and the same bits
as the eager call. The communicator is ``torch_fakes.traced_communicator``: a
``ubnext.Communicator`` that carries a thread communicator's handle, so the traced ops
run on the thread communicator, whose methods (the same signatures) give the eager
reference. Dynamo is not thread-safe: only one rank compiles (the others run the same
calls eagerly on their threads)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from torch_fakes import rank_order, run_ranks, traced_communicator  # noqa: E402

import ubnext.torch as ut  # noqa: E402
from ubnext import ClosedError, UbnextError
from ubnext._interop import arrays as _arrays  # noqa: E402
from ubnext.torch import _traced  # noqa: E402


def ubnext_ops(gm) -> list[str]:
    """The ``torch.ops.ubnext`` ops an FX graph calls, in order (``"all_reduce_"``...)."""
    names = []
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op == "call_function" and target.startswith("ubnext."):
            names.append(target.removeprefix("ubnext.").removesuffix(".default"))
    return names


def recording(graphs: list):
    """A torch.compile backend that keeps dynamo's graphs and runs them as they are."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


# every collective method, with and without out=; size: the ranks; comm: a Communicator
# (compiled) or a ThreadComm (the eager reference), which take the same arguments
def all_reduce_scaled(comm, x, r, w, size):
    return comm.all_reduce(x * 2) + 1


def all_reduce_avg(comm, x, r, w, size):
    return comm.all_reduce(x, op="avg")


def all_reduce_max_in_place(comm, x, r, w, size):
    y = x * 2
    got = comm.all_reduce(y, out=y, op="max")
    return got, y


def all_reduce_into_out(comm, x, r, w, size):
    out = torch.full((x.numel(),), float("nan"))  # any shape of x's count
    got = comm.all_reduce(x, out=out, op="min")
    return got, out


def fused(comm, x, r, w, size):
    return comm.all_reduce_add_rmsnorm(x, r, w, eps=1e-5, bias=w * 0.5)


def fused_positional(comm, x, r, w, size):
    return comm.all_reduce_add_rmsnorm(x, None, w, 0.0)


def reduce_scatter(comm, x, r, w, size):
    return comm.reduce_scatter(x, op="avg")


def reduce_scatter_into_out(comm, x, r, w, size):
    out = torch.full((x.shape[0] // size, x.shape[1]), float("nan"))
    got = comm.reduce_scatter(x, out=out, op="max")
    return got, out


def all_gather(comm, x, r, w, size):
    return comm.all_gather(x[:2])


def all_gather_into_out(comm, x, r, w, size):
    out = torch.full((size * 2 * x.shape[1],), float("nan"))
    got = comm.all_gather(x[:2], out=out)
    return got, out


def sequence_parallel_fused(comm, x, r, w, size):
    return comm.reduce_scatter_add_rmsnorm(x, r[:x.shape[0] // size], w, eps=1e-5, bias=None)


CALLS = {all_reduce_scaled: ["all_reduce"], all_reduce_avg: ["all_reduce"],
         all_reduce_max_in_place: ["all_reduce_"], all_reduce_into_out: ["all_reduce_"],
         fused: ["all_reduce_add_rmsnorm"], fused_positional: ["all_reduce_add_rmsnorm"],
         reduce_scatter: ["reduce_scatter"], reduce_scatter_into_out: ["reduce_scatter_"],
         all_gather: ["all_gather"], all_gather_into_out: ["all_gather_"],
         sequence_parallel_fused: ["reduce_scatter_add_rmsnorm"]}


def data(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, generator=g)


class Mapped:
    """A communicator whose methods are ``_traced.call``'s mappings, called eagerly."""

    def __init__(self, comm):
        self.comm = traced_communicator(comm)

    def __getattr__(self, name):
        return lambda *args, **kwargs: _traced.call(self.comm, name, *args, **kwargs)


def results(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def test_traced_is_false_in_eager_code():
    assert not _arrays.traced(torch.ones(2))
    assert not _arrays.traced(None)


def test_traced_needs_no_torch():
    """ubnext core does not import torch for the predicate (nor at all)."""
    code = ("import sys, ubnext, ubnext._interop.arrays as a\n"
            "assert not a.traced(object()) and not a.traced(None)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_traced_first_asked_under_dynamo():
    """The predicate's first call (which looks torch up) may be under tracing: it answers
    True there without rebinding itself (the rebinding waits for eager code)."""
    code = ("import torch\n"
            "from ubnext._interop import arrays as _arrays\n"
            "assert _arrays._compiling is _arrays._compiling_before_torch\n"
            "fn = torch.compile(lambda x: x + 1 if _arrays.traced(x) else x - 1, fullgraph=True, backend='eager')\n"
            "assert torch.equal(fn(torch.zeros(2)), torch.ones(2))\n"
            "assert _arrays._compiling is _arrays._compiling_before_torch\n"
            "assert not _arrays.traced(torch.zeros(2))\n"
            "assert _arrays._compiling is torch.compiler.is_dynamo_compiling\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ubnext_torch_first_imported_under_tracing():
    """A program that never imported ubnext.torch: the hook imports it while dynamo traces,
    and the graph holds the op (the communicator's handle is the one its construction
    assigned)."""
    code = ("import sys, torch, ubnext\n"
            "assert 'ubnext.torch' not in sys.modules\n"
            "from ubnext._api import handles\n"
            "comm = object.__new__(ubnext.Communicator)\n"
            "comm._closed, comm.rank, comm.size = True, 0, 1\n"
            "handles.assign(comm)  # as Communicator.__init__ does\n"
            "graphs = []\n"
            "def backend(gm, example_inputs):\n"
            "    graphs.append(gm)\n"
            "    return lambda *args: (args[0],)  # records, runs nothing\n"
            "torch.compile(lambda x: comm.all_reduce(x * 2) + 1, fullgraph=True, backend=backend)(torch.ones(2))\n"
            "targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == 'call_function']\n"
            "assert any(t.startswith('ubnext.all_reduce') for t in targets), targets\n"
            "assert 'ubnext.torch' in sys.modules and comm._handle\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_traced_is_true_under_dynamo_without_a_graph_break():
    torch._dynamo.reset()

    def fn(x):
        return (x + 1 if _arrays.traced(x) else x - 1), _arrays.traced(3)

    explained = torch._dynamo.explain(fn)(torch.zeros(2))
    assert explained.graph_break_count == 0, explained.break_reasons
    y, other = torch.compile(fn, fullgraph=True, backend="eager")(torch.zeros(2))
    assert torch.equal(y, torch.ones(2)) and other is False  # only torch tensors


def test_the_lambda_of_the_issue_compiles_to_the_op():
    """``lambda x: comm.all_reduce(x * 2) + 1`` with fullgraph=True: one graph, no break,
    torch.ops.ubnext.all_reduce in it, eager's bits."""
    torch._dynamo.reset()

    def body(tc):
        comm = traced_communicator(tc)
        fn = lambda x: comm.all_reduce(x * 2) + 1  # noqa: E731
        x = torch.randn(4, 16)
        explained = torch._dynamo.explain(fn)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
        graphs = []
        got = torch.compile(fn, fullgraph=True, backend=recording(graphs))(x)
        assert [ubnext_ops(g) for g in graphs] == [["all_reduce"]]
        got_aot = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
        want = tc.all_reduce(x * 2) + 1
        return torch.equal(got, want) and torch.equal(got_aot, want)

    assert run_ranks(1, body) == [True]


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("fn", list(CALLS), ids=lambda f: f.__name__)
def test_every_method_compiles_to_its_op_with_eager_bits(fn, size):
    """Each method (out= too) compiled with fullgraph=True on rank 0 (the other ranks run it
    eagerly): the ops of ``CALLS`` in the graph, and the bits of the eager call, which
    every rank made first."""
    torch._dynamo.reset()

    def body(tc):
        x, r, w = data(tc.rank)
        want = results(fn(tc, x, r, w, tc.size))
        if tc.rank:
            got = results(fn(tc, x, r, w, tc.size))
            return want, got, None
        graphs = []
        compiled = torch.compile(fn, fullgraph=True, backend=recording(graphs))
        got = results(compiled(traced_communicator(tc), x, r, w, tc.size))
        return want, got, [ubnext_ops(g) for g in graphs]

    for rank, (want, got, ops) in enumerate(run_ranks(size, body)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b), f"rank {rank}: {fn.__name__} differs from eager"
        if rank == 0:
            assert ops == [CALLS[fn]]


def test_out_is_what_the_call_returns_and_the_input_is_kept():
    torch._dynamo.reset()

    def fn(comm, x):
        out = torch.empty(8)
        y = x.clone()
        same = comm.all_reduce(x, out=out) is out and comm.all_reduce(y, out=y) is y
        return same, x

    def body(tc):
        x = torch.randn(2, 4)
        same, kept = torch.compile(fn, fullgraph=True, backend="aot_eager")(traced_communicator(tc), x.clone())
        return same and torch.equal(kept, x)

    assert run_ranks(1, body) == [True]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_in_place_on_a_graph_input_and_no_gradient_as_eager(backend):
    """``out=x`` on the compiled function's own input writes the input (aot_eager
    functionalizes the write and copies it back); an input that requires grad gives a
    result without one, as the eager method's (it is not differentiable). Rank 0 compiled,
    rank 1 eager."""
    torch._dynamo.reset()

    def fn(comm, x, w):
        comm.all_reduce(x, out=x, op="max")
        return comm.all_reduce(w * 2)

    def body(tc):
        x, _, w = data(tc.rank)
        w.requires_grad_()
        want_x = x.clone()
        want = fn(tc, want_x, w)
        if tc.rank:
            return fn(tc, x, w), None, None
        got = torch.compile(fn, fullgraph=True, backend=backend)(traced_communicator(tc), x, w)
        return got, torch.equal(x, want_x) and torch.equal(got, want), (want.requires_grad, got.requires_grad)

    _, same, grads = run_ranks(2, body)[0]
    assert same and grads == (False, False)


@pytest.mark.parametrize("size", [2, 4])
def test_the_mapping_equals_the_methods_at_several_ranks(size):
    """``_traced.call`` run eagerly (its ops run the thread communicators' collectives)
    against the methods themselves, every call of ``CALLS``: shapes, ops and out=
    mapped alike (at one rank, max, avg and slices look alike)."""
    def body(tc):
        x, r, w = data(tc.rank)
        out = []
        for fn in CALLS:
            out.append((results(fn(tc, x, r, w, tc.size)), results(fn(Mapped(tc), x, r, w, tc.size))))
        return out

    for rank, pairs in enumerate(run_ranks(size, body)):
        for fn, (want, got) in zip(CALLS, pairs):
            assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want)), (rank, fn.__name__)


def test_reduction_at_two_ranks_is_the_rank_order_sum():
    torch._dynamo.reset()

    def body(tc):
        x = torch.full((3,), float(tc.rank + 1))
        if tc.rank:
            return tc.all_reduce(x)
        return torch.compile(lambda c, t: c.all_reduce(t), fullgraph=True, backend="eager")(
            traced_communicator(tc), x)

    got = run_ranks(2, body)
    assert all(torch.equal(g, rank_order([torch.full((3,), 1.0), torch.full((3,), 2.0)])) for g in got)


def test_a_compiled_call_keeps_its_precision():
    """The all-reduce and reduce-scatter ops take the call's precision as it is: a compiled
    ``comm.all_reduce(x, precision="exact")`` is exact on an opted-in communicator, and a
    format asked for reaches the communicator."""
    torch._dynamo.reset()

    def calls(c, t):
        return c.all_reduce(t, precision="exact"), c.reduce_scatter(t, precision="int8")

    def body(tc):  # one thread compiles (torch 2.11 crashes where a second thread compiles)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(tc.rank)).to(torch.bfloat16)
        if tc.rank:
            calls(tc, x)
        else:
            torch.compile(calls, fullgraph=True, backend="eager")(traced_communicator(tc), x)
        return tc.precisions

    for precisions in run_ranks(2, body, quantized="int8"):
        assert precisions == ["exact", "int8"]


@pytest.mark.parametrize("call,message", [
    (lambda c, x: c.all_reduce(x, stream=object()), "all_reduce: stream="),
    (lambda c, x: c.all_reduce(x, algorithm="twoshot"), "all_reduce: algorithm='twoshot'"),
    (lambda c, x: c.all_reduce(x, precision="bf16"), "all_reduce: precision must be one of"),
    (lambda c, x: c.all_reduce(x, op="prod"), "all_reduce: unsupported op 'prod'"),
    (lambda c, x: c.all_reduce_add_rmsnorm(x, x, x[0], out=torch.empty_like(x)), "all_reduce_add_rmsnorm: out="),
    (lambda c, x: c.all_reduce_add_rmsnorm(x, x, x[0], residual_out=x.clone()),
     "all_reduce_add_rmsnorm: residual_out="),
    (lambda c, x: c.all_reduce_add_rmsnorm(x, x, x[0], eps=-1.0), "all_reduce_add_rmsnorm: eps must be"),
    (lambda c, x: c.all_reduce_add_rmsnorm(x, x, x[0], stream=object()), "all_reduce_add_rmsnorm: stream="),
    (lambda c, x: c.reduce_scatter(x, algorithm="nvls"), "reduce_scatter: algorithm='nvls'"),
    (lambda c, x: c.reduce_scatter(x, precision=8), "reduce_scatter: precision must be one of"),
    (lambda c, x: c.all_gather(x, stream=object()), "all_gather: stream="),
    (lambda c, x: c.reduce_scatter_add_rmsnorm(x, None, x[0], algorithm="twoshot"),
     "reduce_scatter_add_rmsnorm: algorithm='twoshot'"),
    (lambda c, x: c.all_reduce(x, out=torch.empty(3)), "all_reduce: out has 3 float32 elements, input has 64 float32"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_the_ops_cannot_express_raises_under_tracing(call, message):
    """An argument the ops cannot take (a stream, an algorithm, a precision, a fused call's
    outputs) raises UbnextError naming it, never ignored: the mapping raises it, a
    compiled function's call raises it, and fullgraph=True reports it as dynamo's error."""
    torch._dynamo.reset()

    def body(tc):
        x = torch.randn(4, 16)
        with pytest.raises(UbnextError, match=re.escape(message)):
            call(Mapped(tc), x)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=re.escape(message)):
            torch.compile(call, fullgraph=True, backend="eager")(traced_communicator(tc), x)
        torch._dynamo.reset()
        with pytest.raises(UbnextError, match=re.escape(message)):  # not a graph break into eager code
            torch.compile(call, backend="eager")(traced_communicator(tc), x)

    run_ranks(1, body)


def test_eager_calls_take_the_communicators_own_path():
    """Outside tracing the hook does nothing: an eager call of the stand-in (closed, no
    GPU) raises its own ClosedError, not an op's."""
    def body(tc):
        with pytest.raises(ClosedError):
            traced_communicator(tc).all_reduce(torch.ones(2))

    run_ranks(1, body)


def test_unknown_method():
    with pytest.raises(UbnextError, match="no traced form"):
        run_ranks(1, lambda tc: _traced.call(traced_communicator(tc), "empty", 4))


def graphs_of_three_compiled_calls() -> int:
    """The graphs dynamo made for three calls of one compiled all-reduce (one rank, after
    a reset): 1 where every call after the first reuses the first one's."""
    torch._dynamo.reset()

    def body(tc):
        comm = traced_communicator(tc)
        graphs = []
        fn = torch.compile(lambda t: comm.all_reduce(t), fullgraph=True, backend=recording(graphs))
        for _ in range(3):
            fn(torch.randn(4))
        return len(graphs)

    return run_ranks(1, body)[0]


def test_handles_are_stable_across_compiled_calls():
    """The op takes the communicator's handle as a constant: a second call reuses the graph."""
    assert graphs_of_three_compiled_calls() == 1


def test_functional_ops_are_unchanged():
    def body(tc):
        x = torch.randn(4)
        return torch.equal(ut.functional.all_reduce(x, group=tc), tc.all_reduce(x))

    assert run_ranks(1, body) == [True]


def test_a_first_collective_under_compile_is_compiled_once(monkeypatch):
    """Where no eager collective ran before (``_compiling`` not yet bound to torch's), the
    first compiled call does not rebind it from inside its trace: a second call reuses
    the graph instead of recompiling on the changed global."""
    from ubnext._interop import arrays

    monkeypatch.setattr(arrays, "_compiling", arrays._compiling_before_torch)
    assert graphs_of_three_compiled_calls() == 1
