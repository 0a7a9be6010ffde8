"""Broadcast benchmark with nccl-tests' flags, table and JSON: ubnext next to NCCL.

    mpirun -n 4 python bench/broadcast_perf.py -b 8 -e 256M -f 2
    mpirun -n 4 python bench/broadcast_perf.py -b 8 -e 256M -f 2 --backend nccl

As nccl-tests' broadcast_perf: root 0's size bytes on every rank; in place, the input is
the output; no reduction (redop "none"); busbw = algbw. Checking, timing and the other
flags: bench/all_reduce_perf.py, which runs it (bench/_moves_perf.py).
"""

if __package__ in (None, ""):  # run as a script: bench/_standalone.py
    import _standalone  # noqa: F401

from bench._moves_perf import BROADCAST_PERF, script  # noqa: E402

if __name__ == "__main__":
    script(BROADCAST_PERF)
