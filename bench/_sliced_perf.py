"""The reduce-scatter and all-gather benchmarks (bench/reduce_scatter_perf.py,
bench/all_gather_perf.py): nccl-tests' layouts (``common.sliced``) run by the
machinery of bench/all_reduce_perf.py."""

from __future__ import annotations

import sys

from bench import _common as common
from bench.all_reduce_perf import Program, main

#: the ubnext algorithms with a reduce-scatter and an all-gather (``--algo``)
_ALGORITHMS = ("auto", "lamport_twoshot", "twoshot", "nccl")

def _quantized_reduce_scatter(inputs, fmt: str, op: str, rank: int):
    """What ubnext's quantized reduce-scatter stores on ``rank`` (the host emulation)."""
    from ubnext._tools import reference

    return reference.quantized_reduce_scatter(inputs, fmt, op)[rank]


#: The reduce-scatter, as nccl-tests' reduce_scatter.cu describes it.
REDUCE_SCATTER = common.sliced("ReduceScatter", lambda engine, send, recv, dtype, op, stream: engine.reduce_scatter(
    send, recv, dtype, op, stream), common.reduce_scatter_data, gathers=False, quantized=_quantized_reduce_scatter)
#: The all-gather, as nccl-tests' all_gather.cu describes it.
ALL_GATHER = common.sliced("AllGather", lambda engine, send, recv, dtype, op, stream: engine.all_gather(
    send, recv, dtype, op, stream), common.all_gather_data, gathers=True)

REDUCE_SCATTER_PERF = Program("reduce_scatter_perf", REDUCE_SCATTER, _ALGORITHMS)
ALL_GATHER_PERF = Program("all_gather_perf", ALL_GATHER, _ALGORITHMS)


def script(program: Program) -> None:
    """Runs ``program`` on ``sys.argv`` and exits with its status (aborting the MPI job on
    an exception)."""
    sys.exit(common.run_or_abort(lambda: main(program=program)))
