"""Where the host time of one eager ``all_reduce(x, out=y)`` goes, step by step.

    python bench/host_path.py

One process, one GPU, a communicator of one rank, 2 KiB of bfloat16 torch tensors. Each
step of ``Communicator.all_reduce`` (``ubnext/_api/collectives/all_reduce.py``, ``_dispatch.py``,
``_engine.py``) is called on its own with the arguments the call gives it, in
interleaved rounds (``launch_floor.measure``), the GPU drained between samples; the
whole call (out of place and in place), the planned fused call of one row, and the
launch floor (``bench/launch_floor.py``: an empty kernel of 11 parameters launched with
a prebuilt pack) are timed beside them, and so are the planned calls of a second
communicator made with ``pdl=False`` (rows ``..., pdl off``: CuPy's ``cuLaunchKernel``
binding instead of the dependent launch's ``cuLaunchKernelEx``). A repeated call takes its
call plan (``ubnext/_api/plans.py``): the rows ``plan: ...`` are the steps of that path, the
others those of a first call (the full path), which ``no plan`` times whole (the plans
dropped before each call, so that it also makes its plan). The table gives the median and the
minimum of host µs per call. Private names are used on purpose: this measures them.
"""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a script (python bench/host_path.py): bench/_standalone.py
    import _standalone  # noqa: F401

import ubnext  # noqa: E402
from bench.launch_floor import launch_candidates, measure  # noqa: E402
from ubnext._api.plans import add_rmsnorm_key, all_reduce_key  # noqa: E402
from ubnext._engine.engine import lamport_shape  # noqa: E402
from ubnext._engine.launch import issue  # noqa: E402
from ubnext._interop import arrays as _arrays  # noqa: E402
from ubnext._protocol import signature as _signature  # noqa: E402
from ubnext._protocol.algorithms import ALGORITHMS  # noqa: E402
from ubnext._protocol.constants import VEC_BYTES  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(prog="host_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=2048)
    p.add_argument("-n", "--iters", type=int, default=300, help="calls per sample")
    p.add_argument("--rounds", type=int, default=9)
    return p.parse_args(argv)


def steps(comm, nbytes: int, plain) -> dict:
    """name -> a callable making one call of that step, as ``all_reduce(x, out=y)`` does;
    ``plain``: the communicator made with ``pdl=False``."""
    import torch

    x = torch.randn(nbytes // 2, device="cuda").bfloat16()
    y = torch.empty_like(x)
    name = "all_reduce"
    handle, owner, _ = _arrays.launch_stream(None, x, comm.device)
    xb = _arrays.as_buffer(x, name, handle)
    algo = comm._resolve(name, "auto", xb.nbytes, xb.dtype, "sum")
    ob = _arrays.check_out(xb, y, name, handle)
    sig = _signature.encode(name, xb.dtype, "sum", xb.count)
    dispatch = comm._dispatch
    engine = dispatch._node.engine
    nvec = -(-xb.nbytes // VEC_BYTES)
    comm.all_reduce(x, out=y)  # planned
    key = all_reduce_key(x, y, "sum", "auto", "auto", handle, False)
    plan = comm._plans.get(key)
    assert plan is not None, "all_reduce(x, out=y) made no plan"
    found = {
        "all_reduce(x, out=y)": lambda: comm.all_reduce(x, out=y),
        "all_reduce(x, out=x)": lambda: comm.all_reduce(x, out=x),
        "all_reduce(x, out=y), no plan": lambda: (comm._plans.clear(), comm.all_reduce(x, out=y)),
        "_check_open": lambda: comm._check_open(name),
        "_arrays.launch_stream": lambda: _arrays.launch_stream(None, x, comm.device),
        "_arrays.as_buffer(x)": lambda: _arrays.as_buffer(x, name, handle),
        "_resolve (cached)": lambda: comm._resolve(name, "auto", xb.nbytes, xb.dtype, "sum"),
        "_arrays.check_out": lambda: _arrays.check_out(xb, y, name, handle),
        "_signature.encode": lambda: _signature.encode(name, xb.dtype, "sum", xb.count),
        "_dispatch.all_reduce": lambda: dispatch.all_reduce(algo, xb, ob, "sum", handle, owner, sig),
        "engine.lamport": lambda: issue(engine.lamport(algo, xb.dtype, "sum", xb.ptr, ob.ptr, xb.count, sig), handle),
        "engine._kernel (lookup)": lambda: engine._kernel(algo, xb.dtype, "sum"),
        "lamport_shape": lambda: lamport_shape(ALGORITHMS[algo], nvec, engine.nranks, engine._blocks),
        "Launcher()": (lambda launch, shape: lambda: launch(*shape, handle, xb.ptr, ob.ptr, xb.count, sig))(
            engine._kernel(algo, xb.dtype, "sum"), lamport_shape(ALGORITHMS[algo], nvec, engine.nranks, engine._blocks)),
        "torch attributes of x": lambda: (x.data_ptr(), x.dtype, x.shape, x.is_contiguous(), x.get_device()),
        "plan: _arrays.identity(x)": lambda: _arrays.identity(x),
        "plan: key + lookup": lambda: comm._plans.get(all_reduce_key(x, y, "sum", "auto", "auto", handle, False)),
        "plan: _dispatch.launch": lambda: dispatch.launch(plan.launch, handle, owner),
        "plan: Packed launch": lambda: plan.launch(handle),
    }
    # the fused call of one row of the same bytes, planned, and the launch floor's rows, in
    # the same rounds: ratios to the floor are taken within one phase of the host
    row, residual = x.view(1, -1), torch.randn_like(x).view(1, -1)
    weight, normed, res_out = torch.randn_like(x), torch.empty_like(row), torch.empty_like(row)
    comm.all_reduce_add_rmsnorm(row, residual, weight, out=normed, residual_out=res_out)
    fused_key = add_rmsnorm_key(row, residual, weight, None, normed, res_out, 1e-6, "auto", handle, False)
    assert comm._plans.get(fused_key) is not None, "all_reduce_add_rmsnorm made no plan"
    found["all_reduce_add_rmsnorm, planned"] = lambda: comm.all_reduce_add_rmsnorm(
        row, residual, weight, out=normed, residual_out=res_out)
    order = comm._order
    found["section: with comm._order"] = lambda: (order.__enter__(), order.__exit__(None, None, None))
    # a call made while another context is current: the section switches to the
    # communicator's and back (``foreign``: another GPU's primary context, or with one GPU
    # a second context made on it); the two switches that put the foreign one current
    # around the call are timed alone beside it
    from cupy_backends.cuda.api import driver

    mine, foreign = driver.ctxGetCurrent(), _foreign_context(comm.device)
    found["all_reduce(x, out=y), foreign context"] = lambda: (
        driver.ctxSetCurrent(foreign), comm.all_reduce(x, out=y), driver.ctxSetCurrent(mine))
    found["two context switches"] = lambda: (driver.ctxSetCurrent(foreign), driver.ctxSetCurrent(mine))
    for _ in range(2):  # a repeated call has its plan
        for other in (x, y):
            plain.all_reduce(x, out=other)
    plain_plan = plain._plans.get(all_reduce_key(x, y, "sum", "auto", "auto", handle, False))
    found["all_reduce(x, out=y), pdl off"] = lambda: plain.all_reduce(x, out=y)
    found["all_reduce(x, out=x), pdl off"] = lambda: plain.all_reduce(x, out=x)
    found["plan: Packed launch, pdl off"] = lambda: plain_plan.launch(handle)
    floor = launch_candidates()
    found["floor: cuda.bindings, prebuilt pack"] = floor["cuda.bindings cuLaunchKernel"]
    found["CuPy launchKernel, prebuilt pack"] = floor["cupy launchKernel"]
    found["floor: Packed, dependent"] = floor["ubnext Packed, dependent"]
    return algo, found


def _foreign_context(device: int) -> int:
    """A context other than ``device``'s primary one: another GPU's primary context, or a
    new context on ``device`` where it is the only GPU (left to the process's end)."""
    from ubnext._environment.cuda import drv

    count = drv("cuDeviceGetCount")
    if count > 1:
        return int(drv("cuDevicePrimaryCtxRetain", drv("cuDeviceGet", (device + 1) % count)))
    mine = drv("cuCtxGetCurrent")
    made = drv("cuCtxCreate", None, 0, drv("cuDeviceGet", device))  # makes itself current
    drv("cuCtxSetCurrent", mine)
    return int(made)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    comm, plain = ubnext.Communicator(), ubnext.Communicator(pdl=False, pool_mb=512)
    try:
        assert comm._node.engine.dependent, "pdl is off: the device is older than sm_90, or UBNEXT_PDL=0"
        algo, found = steps(comm, args.bytes, plain)
        samples = measure(found, args.iters, args.rounds, torch.cuda.synchronize)
        print(f"# {args.bytes} B bfloat16, algorithm {algo}, {comm.size} rank(s): host µs per call, "
              f"median (min) of {args.rounds} interleaved rounds of {args.iters}")
        for k, v in samples.items():
            v.sort()
            print(f"  {k:<36} {v[len(v) // 2]:7.2f} ({v[0]:.2f})")
    finally:
        plain.close()
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
