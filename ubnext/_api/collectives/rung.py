"""What the collectives of this package share: the NCCL rung that runs them where no
ubnext kernel does (logged once with the reason; refused before any launch where NCCL
cannot run), the checks of their root and peer ranks, and the side-stream record of
the calls that are not the same on every rank.

:class:`Rung` is a base of the Communicator, under each collective's class."""

from __future__ import annotations

import logging
import numbers

from ubnext._environment.log import log_once
from ubnext._interop import arrays as _arrays
from ubnext._protocol.errors import UbnextError


class Rung:
    """The shared steps of the collectives of ``_api.collectives`` (module docstring)."""

    def _rung(self, name: str, why: str | None = None):
        """The NCCL rung's check for a call of ``name`` that NCCL runs (``why``: the reason,
        by default that ubnext has no kernel for it): raises, before anything is launched,
        where NCCL cannot run here (ranks sharing a GPU, a rank without the library: known
        alike on every rank since construction); else logs once that NCCL runs it."""
        why = why or f"ubnext has no {name} kernel"
        problem = self._selector.nccl_problem
        if problem:
            raise UbnextError(f"{name}: {why}, and NCCL, which runs it, cannot run here ({problem})")
        log_once(f"rung:{name}:{why}", f"{name}: runs on NCCL ({why})", logging.INFO)

    def _rank_arg(self, name: str, value, what: str) -> int:
        """``value`` (a root or peer) as an int that is a rank of this communicator (a
        global rank, NCCL's); else raises."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise UbnextError(f"{name}: {what} must be an int rank, got {value!r}")
        if not 0 <= value < self.size:
            raise UbnextError(f"{name}: {what} {value} is not a rank of this communicator (0..{self.size - 1})")
        return int(value)

    def _open_rooted(self, name: str, x, stream, root, rung: bool = True) -> tuple:
        """The start of a call with a root: ``_open_call``'s ``(handle, owner, side, xb)``
        and the root checked, then with ``rung`` the rung's check (the data movers' choice,
        ``_mover``, makes it itself)."""
        handle, owner, side, xb = self._open_call(name, x, stream)
        root = self._rank_arg(name, root, "root")
        if rung:
            self._rung(name)
        return handle, owner, side, xb, root

    @staticmethod
    def _record(handle: int, owner, side: bool, buffers) -> None:
        """The call's ``buffers`` recorded on a side stream (``_arrays.record_stream``), for the
        calls that ``CallSteps._prepare`` does not take (their counts differ between ranks)."""
        if side:
            _arrays.record_stream(handle, owner, buffers)
