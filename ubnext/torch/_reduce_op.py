"""torch.distributed's ReduceOp (or a name) to ubnext's op names."""

from __future__ import annotations

from ubnext._protocol.algorithms import OPS
from ubnext._protocol.errors import UbnextError


def op_name(op) -> str:
    """ubnext's name of a reduce op.

    Collective: no.
    Graph-capturable: yes (host only).

    Args:
        op: ``torch.distributed.ReduceOp.SUM``, ``AVG``, ``MAX`` or ``MIN``, or those names (any case).

    Returns:
        ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    Raises:
        UbnextError: any other op (PRODUCT, BAND, BOR, BXOR, PREMUL_SUM).
    """
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if isinstance(name, str) and name.lower() in OPS:
        return name.lower()
    raise UbnextError(f"ubnext.torch: unsupported reduce op {op!r}; ubnext reduces with "
                      f"ReduceOp.SUM, AVG, MAX and MIN ({', '.join(OPS)})")
