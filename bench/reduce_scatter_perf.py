"""Reduce-scatter benchmark with nccl-tests' flags, table and JSON: ubnext next to NCCL.

    mpirun -n 4 python bench/reduce_scatter_perf.py -b 8 -e 256M -f 2
    mpirun -n 4 python bench/reduce_scatter_perf.py -b 8 -e 256M -f 2 --backend nccl
    mpirun -n 4 python bench/reduce_scatter_perf.py -b 1M -e 256M -f 2 -d bfloat16 -G 10 --precision int8

As nccl-tests' reduce_scatter_perf: a size is the whole input (size x k elements,
rounded down to a multiple of the world size), rank r gets the reduction of elements
[r*k, (r+1)*k); in place, its output is that slice of its input; busbw = algbw *
(n-1)/n (of the full-precision bytes, also for ``--precision int8|fp8|int4``: the quantized
reduce-scatter, checked bit for bit against its host emulation). Checking, timing and the
other flags: bench/all_reduce_perf.py, which runs it (bench/_sliced_perf.py).
"""

if __package__ in (None, ""):  # run as a script: bench/_standalone.py
    import _standalone  # noqa: F401

from bench._sliced_perf import REDUCE_SCATTER_PERF, script  # noqa: E402

if __name__ == "__main__":
    script(REDUCE_SCATTER_PERF)
