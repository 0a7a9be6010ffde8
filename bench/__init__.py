"""ubnext benchmarks: ``all_reduce_perf`` (nccl-tests flags and table), ``compare``, ``plot``."""
