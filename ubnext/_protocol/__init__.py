"""The contract between the host and the kernels, and the errors it raises.

Owns: the constants both sides use (``constants``: the one source of the generated
``protocol.h``), the algorithm table (``algorithms``: one record per kernel source and
what it supports), call signatures carried in band (``signature``), the quantized formats
and their exact arithmetic (``quant``), and ubnext's exception types (``errors``).
Imports: nothing of ubnext beyond itself (and ``_version``); pure Python, no CUDA.
"""
