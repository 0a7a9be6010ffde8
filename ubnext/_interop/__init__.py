"""The caller's side of a call: arrays, streams and the CUDA context.

Owns: views of the caller's CuPy, PyTorch, DLPack and CUDA-array-interface arrays and the
one device check of every array a call takes or returns (``arrays``), the order of a
communicator's launches across the caller's streams and its launch section (``streams``),
and the communicator's CUDA context, current while ubnext works (``context``).
Imports: ``_protocol``, ``_environment``.
"""
