"""This machine and process, read and checked before any setup.

Owns: the one error gate for CUDA driver calls and the NVRTC helper (``cuda``), the
installed CUDA major and NCCL library (``install``), the checks a communicator makes
first (``preflight``), the configuration read once (``config``), the ``ubnext`` logger
(``log``), which GPU each rank uses (``devices``), and whether NVLink multicast may be
used (``nvls_gate``).
Imports: ``_protocol``.
"""
