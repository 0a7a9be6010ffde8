"""All-to-all benchmark with nccl-tests' flags, table and JSON: ubnext next to NCCL.

    mpirun -n 4 python bench/alltoall_perf.py -b 8 -e 256M -f 2
    mpirun -n 4 python bench/alltoall_perf.py -b 8 -e 256M -f 2 --backend nccl
    mpirun -n 4 python bench/alltoall_perf.py -b 8 -e 1M -f 2 --algo p2p  # parts as splits: the point-to-point kernel

As nccl-tests' alltoall_perf: a size is one rank's whole input (rounded down to a
multiple of the world size), part j of it to rank j, the parts received in rank order;
out of place only (the in-place columns read N/A); redop "none"; busbw = algbw *
(n-1)/n. NCCL runs it as grouped sends and receives (CuPy's binding has no
ncclAlltoAll). Checking, timing and the other flags: bench/all_reduce_perf.py, which runs
it (bench/_moves_perf.py).
"""

if __package__ in (None, ""):  # run as a script: bench/_standalone.py
    import _standalone  # noqa: F401

from bench._moves_perf import ALLTOALL_PERF, script  # noqa: E402

if __name__ == "__main__":
    script(ALLTOALL_PERF)
