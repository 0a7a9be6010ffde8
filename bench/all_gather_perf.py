"""All-gather benchmark with nccl-tests' flags, table and JSON: ubnext next to NCCL.

    mpirun -n 4 python bench/all_gather_perf.py -b 8 -e 256M -f 2
    mpirun -n 4 python bench/all_gather_perf.py -b 8 -e 256M -f 2 --backend nccl

As nccl-tests' all_gather_perf: a size is the whole output (size x k elements, rounded
down to a multiple of the world size), rank r's k elements land at [r*k, (r+1)*k); in
place, its input is that slice of its output; no reduction (redop "none"); busbw =
algbw * (n-1)/n. Checking, timing and the other flags: bench/all_reduce_perf.py, which
runs it (bench/_sliced_perf.py).
"""

if __package__ in (None, ""):  # run as a script: bench/_standalone.py
    import _standalone  # noqa: F401

from bench._sliced_perf import ALL_GATHER_PERF, script  # noqa: E402

if __name__ == "__main__":
    script(ALL_GATHER_PERF)
