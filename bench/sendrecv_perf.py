"""Send/recv benchmark with nccl-tests' flags, table and JSON: ubnext next to NCCL.

    mpirun -n 4 python bench/sendrecv_perf.py -b 8 -e 256M -f 2
    mpirun -n 4 python bench/sendrecv_perf.py -b 8 -e 256M -f 2 --backend nccl
    mpirun -n 4 python bench/sendrecv_perf.py -b 8 -e 1M -f 2 --algo ll   # the pool's point-to-point kernel

As nccl-tests' sendrecv_perf: each rank sends size bytes to the next rank and receives
the previous rank's, in one group (at one rank: to and from itself); out of place only
(the in-place columns read N/A); redop "none"; busbw = algbw. Checking, timing and the
other flags: bench/all_reduce_perf.py, which runs it (bench/_moves_perf.py).
"""

if __package__ in (None, ""):  # run as a script: bench/_standalone.py
    import _standalone  # noqa: F401

from bench._moves_perf import SENDRECV_PERF, script  # noqa: E402

if __name__ == "__main__":
    script(SENDRECV_PERF)
