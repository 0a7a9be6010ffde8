"""What the command-line tools and benchmarks share.

Owns: ``python -m ubnext selftest`` (``selftest``, its checks in ``selfcheck``), the host
reference of the kernels' arithmetic, bit for bit (``reference``), ``python -m ubnext
info`` (``info``), timing calls on the GPU (``timing``; after a GEMM that writes their
input: ``dependent``), byte sizes on command lines as nccl-tests writes them (``cli``),
and the body of ``python -m ubnext.tune``: how it measures (``tune_measure``) and what
its times make of a selector table (``tune_table``).
Imports: every layer, the Communicator included; nothing imports it but the entry points,
``ubnext.tune`` and the benchmarks.
"""
