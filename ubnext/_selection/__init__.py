"""Which algorithm a call takes.

Owns: the selector for ``algorithm="auto"`` (``select``) and the selector tables, shipped
and tuned, with byte counts as people read them (``table``).
Imports: ``_protocol``, ``_environment``.
"""
