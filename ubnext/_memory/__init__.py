"""The symmetric memory pool and what lives in it.

Owns: the pool (``pool``: every local rank's device memory in one VA range), the plan of
its bytes (``heap``: the library's slots at fixed offsets, and user buffers), the NVLink
multicast range (``multicast``), the exchange of file descriptors between the node's
ranks (``descriptors``), and transactional setup with undo steps (``transaction``).
Imports: ``_protocol``, ``_environment``, ``ubnext.bootstrap``.
"""
