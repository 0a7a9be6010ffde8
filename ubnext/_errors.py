"""Exception types raised by ubnext.

Every message starts with the name of the operation that failed, so a user
reading a traceback from rank 3 of 8 knows what went wrong without the stack.
"""

from __future__ import annotations


class UbnextError(RuntimeError):
    """Base class of every error ubnext raises on purpose."""


class CudaError(UbnextError):
    """A CUDA driver, runtime or NVRTC call failed.

    Attributes:
        call: name of the failing API call (e.g. ``"cuMemCreate"``).
        code: the numeric error code, or None for compiler failures.
    """

    def __init__(self, call: str, code: int | None, message: str):
        super().__init__(f"{call}: {message}")
        self.call = call
        self.code = code


class CollectiveTimeoutError(UbnextError):
    """A kernel waited longer than ``UBNEXT_TIMEOUT_S`` for a peer.

    Attributes:
        rank: the rank that waited.
        peer: the rank that did not arrive, or None when the wait counts arrivals
            (the NVLS barrier) and cannot tell which rank is missing.
        where: which wait timed out (e.g. ``"lamport poll"``, ``"twoshot entry barrier"``).
    """

    def __init__(self, op: str, rank: int, peer: int | None, where: str, timeout_s: float):
        who = "another rank" if peer is None else f"rank {peer}"
        super().__init__(
            f"{op}: rank {rank} waited more than {timeout_s:g} s for {who} "
            f"({where}); {who} did not arrive (dead, hung, or called a different collective)"
        )
        self.rank = rank
        self.peer = peer
        self.where = where


class ClosedError(UbnextError):
    """An operation was attempted on a communicator or pool after ``close()``."""
