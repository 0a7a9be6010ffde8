"""GPU: a communicator's first use compiled (issue 49). Each of the six ways a user reaches
a communicator from compiled code (tests/compile_forms.py: a module global, a closure
variable, an ``nn.Module`` attribute, a method of an object that holds it,
``comm.all_reduce(y, out=y)``, ``ubnext.torch.functional.all_reduce(x, group=comm)``),
with torch.compile's default backend, by default and with ``fullgraph=True``, on a
Communicator that no call has used (one made for each case): the compiled function's
first call compiles and runs, without a graph break, and gives the bits of the same
function run eagerly afterwards. (Before communicators had their handle from
construction, every case failed on torch 2.11 at the first call:
``AsPythonConstantNotImplementedError: UserDefinedObjectVariable(Communicator) is not a
constant``.) tests/test_torch_compile_forms.py checks the same forms and every op and
layer on CPU.

Run at N ranks with ``mpirun -n N python -m pytest -q tests/test_gpu_torch_compile.py``
(ranks may share a GPU); skipped without a GPU.
"""

from __future__ import annotations

import pytest
from gpu_support import SMALL, require_gpu_and_torch, skip_where_nccl_cannot_run

torch = pytest.importorskip("torch")

from compile_forms import FORMS  # noqa: E402

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN = 8, 256


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda f: f.__name__)
def test_the_first_compiled_call_on_a_new_communicator(form, fullgraph):
    require_gpu_and_torch()
    import ubnext

    comm = ubnext.Communicator(**SMALL)
    try:
        torch.cuda.set_device(comm.device)
        if comm.select(TOKENS * HIDDEN * 2, "bfloat16") == "nccl":
            skip_where_nccl_cannot_run(comm)
        g = torch.Generator(device="cuda").manual_seed(1000 + comm.rank)
        x = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").bfloat16()
        torch._dynamo.reset()
        got = torch.compile(form(comm), fullgraph=fullgraph)(x)  # the communicator's first call
        want = form(comm)(x)
        assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert not torch.equal(want, x * 2 + 1) or comm.size == 1  # the other ranks' data is in it
        explained = torch._dynamo.explain(form(comm))(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        comm.synchronize()
    finally:
        comm.close()
