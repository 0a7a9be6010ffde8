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


class BrokenCommunicatorError(UbnextError):
    """A collective failed; the communicator's buffers no longer hold a known state.

    Every later call on it raises this error again (or a subclass); ``close()`` is then
    local. Create a new communicator to go on. Subclasses say what failed on this rank;
    this class itself is raised where another rank failed first.

    Attributes:
        rank: the rank that failed first, where known, else None.
    """

    def __init__(self, op: str, rank: int | None, what: str):
        super().__init__(f"{op}: {what}; the communicator is broken: close it (or abort()) and create a new one")
        self.rank = rank


class CollectiveTimeoutError(BrokenCommunicatorError):
    """A kernel waited longer than ``UBNEXT_TIMEOUT_S`` for a peer.

    Attributes:
        rank: the rank that waited.
        peer: the rank that did not arrive, or None when the wait counts arrivals
            (the NVLS barrier) and cannot tell which rank is missing.
        where: which wait timed out (e.g. ``"Lamport poll"``, ``"two-shot entry barrier"``).
    """

    def __init__(self, op: str, rank: int, peer: int | None, where: str, timeout_s: float):
        who = "another rank" if peer is None else f"rank {peer}"
        super().__init__(op, rank, f"rank {rank} waited more than {timeout_s:g} s for {who} ({where}); {who} "
                                   "did not arrive (dead, hung, or called a different collective)")
        self.peer = peer
        self.where = where


class CollectiveMismatchError(BrokenCommunicatorError):
    """Ranks called one collective with different arguments (count, dtype, op, ...).

    Attributes:
        rank: the rank that saw the difference.
        peer: the rank whose call differed from it.
        mine, theirs: the two call signatures (``_signature.text`` reads them).
    """

    def __init__(self, op: str, rank: int, peer: int, mine: int, theirs: int):
        from ubnext._protocol.signature import text

        super().__init__(op, rank, f"rank {rank} called {text(mine)} but rank {peer} called "
                                   f"{text(theirs)}; every rank must make the same calls in the same order")
        self.peer = peer
        self.mine = mine
        self.theirs = theirs


class ConcurrentUseError(BrokenCommunicatorError):
    """Two launches of one communicator ran at the same time on a rank (e.g. a CUDA graph
    replayed on one stream while eager calls ran on another): its buffers are shared."""

    def __init__(self, op: str, rank: int):
        super().__init__(op, rank, f"two launches of this communicator overlapped on rank {rank} (a CUDA graph "
                                   "replayed while other calls ran on another stream?); order them on one stream")


class RoutingError(BrokenCommunicatorError):
    """An expert-parallel call's routing was invalid where only the device could see it (an
    expert id out of range, one expert twice in a token's top-k, more tokens for a local
    expert than its capacity); the kernel wrote nothing out of bounds.

    Attributes:
        rank: the rank whose kernel found it.
        what: the words for what was wrong.
        where, value: the token slot (token * top_k + k) or expert, and the value found.
    """

    def __init__(self, op: str, rank: int, what: str, where: int, value: int):
        super().__init__(op, rank, f"rank {rank} found {what} (at {where}: {value})")
        self.what, self.where, self.value = what, where, value


class SplitError(RoutingError):
    """An all-to-all's split counts in device memory were invalid where only the device
    could see them (a negative count, counts summing past the rows of x or out, a count of
    rows from a rank other than the receiver's out_splits expect); the kernel wrote nothing
    out of bounds, nor any part whose counts disagree. Attributes as RoutingError's (where,
    value: the rank sending, and the rows it sent, for a disagreement; the first rank whose
    count is negative or takes the sum past the rows, and that count, otherwise)."""


class ClosedError(UbnextError):
    """An operation was attempted on a communicator or pool after ``close()``."""
