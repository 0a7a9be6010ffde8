"""The six ways a user reaches a communicator from compiled code (issue 49), shared by the
CPU test (tests/test_torch_compile_forms.py) and the GPU one (test_gpu_torch_compile.py):
each ``form(comm)`` returns a function of one tensor that computes ``all_reduce(x * 2) + 1``
through the communicator held as a module global, a closure variable, an ``nn.Module``
attribute, a method of an object that holds it, ``comm.all_reduce(y, out=y)``, and
``ubnext.torch.functional.all_reduce(x, group=comm)``."""

from __future__ import annotations

from torch import nn

from ubnext.torch import functional

#: the communicator of the module-global form (set by ``via_global``)
COMM = None


class Block(nn.Module):
    """The communicator as a module's attribute."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, x):
        return self.comm.all_reduce(x * 2) + 1


class Holder:
    """The communicator held by an object whose method is compiled."""

    def __init__(self, comm):
        self.comm = comm

    def step(self, x):
        return self.comm.all_reduce(x * 2) + 1


def via_global(comm):
    global COMM
    COMM = comm

    def fn(x):
        return COMM.all_reduce(x * 2) + 1

    return fn


def via_closure(comm):
    return lambda x: comm.all_reduce(x * 2) + 1


def via_module(comm):
    return Block(comm)


def via_method(comm):
    return Holder(comm).step


def via_out(comm):
    def fn(x):
        y = x * 2
        comm.all_reduce(y, out=y)
        return y + 1

    return fn


def via_functional(comm):
    return lambda x: functional.all_reduce(x * 2, group=comm) + 1


#: form -> the ubnext ops its graph calls
FORMS = {via_global: ["all_reduce"], via_closure: ["all_reduce"], via_module: ["all_reduce"],
         via_method: ["all_reduce"], via_out: ["all_reduce_"], via_functional: ["all_reduce"]}
