"""Which algorithm a call takes.

Owns: the selector for ``algorithm="auto"`` (``select``) and the selector tables, shipped
and tuned: their entries and the choice of one for a machine, with byte counts as people
read them (``table``), and their JSON format read, validated and agreed on (``table_format``).
Imports: ``_protocol``, ``_environment``.
"""
