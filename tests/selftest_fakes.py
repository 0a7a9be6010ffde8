"""A stand-in for ``ubnext.Communicator`` with what ``python -m ubnext selftest`` uses of
it, on the numpy stand-in for CuPy (``bench_fakes.install``), with faults to inject.
"""

from __future__ import annotations

import bench_fakes
import numpy as np
from stream_fakes import fake_context

from ubnext._environment import nvls_gate as _gate
from ubnext._environment.config import Config
from ubnext._protocol.errors import BrokenCommunicatorError
from ubnext._tools import reference as _reference
from ubnext._tools import selfcheck as _selfcheck

KERNELS = ["lamport", "lamport_twoshot", "twoshot"]
ALL = KERNELS + ["nccl"]


class FakeComm:
    """What the selftest uses of ``ubnext.Communicator``, on the numpy stand-in for CuPy.

    ``all_reduce`` stores the reference's result (every rank's input gathered over the
    bootstrap); ``fault(rank, algorithm, dtype, count)`` returns how this rank's call
    goes wrong: ``"element"`` (one bit of the last element flipped), ``"unwritten"``
    (out left as it was), ``"input"`` (the input changed too), ``"raise"``, or None.
    """

    def __init__(self, bootstrap, algorithms=tuple(ALL), fault=None, nvls="auto", **config):
        self._context = fake_context(0)  # the device guard, on a fake driver
        self.bootstrap, self.rank, self.size, self.device = bootstrap, bootstrap.rank, bootstrap.size, 0
        self.config = Config(**config)
        self.nvls = _gate.NvlsDecision(nvls == "1", "fake")
        self._algorithms, self._fault = list(algorithms), fault or (lambda *a: None)
        self.path = "kernels on the symmetric pool (fake)"
        self.calls, self.closed = 0, False
        self._results = {}

    def algorithms(self):
        return list(self._algorithms)

    def empty(self, shape, dtype):
        from ubnext._interop.arrays import _cupy_dtype

        return bench_fakes.ndarray(None, _host=np.zeros(shape, _reference.ALL_DTYPES[dtype])).view(_cupy_dtype(dtype))

    def all_reduce(self, x, out=None, op="sum", algorithm="auto", stream=None):
        self.calls += 1
        dtype, count = x.dtype.name, x.size
        parts = self.bootstrap.allgather_obj(x.host.copy())
        key = (algorithm, dtype, count)
        if key not in self._results:  # the timed calls repeat the checked one
            self._results[key] = _selfcheck.expected(algorithm, parts)
        fault = self._fault(self.rank, algorithm, dtype, count)
        if fault == "raise":
            raise BrokenCommunicatorError("all_reduce", 1, "a fake failure")
        if fault != "unwritten":
            out.host[...] = self._results[key]
        if fault == "element":
            bits = _reference.bits(out.host)
            bits[-1] ^= 1
        if fault == "input":
            x.host[0] = 3
        return out

    def synchronize(self, stream=None):
        pass

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
