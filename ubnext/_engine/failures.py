"""Failure records: how a kernel that gave up tells the host what happened.

Kernels bound every spin-wait (``UBNEXT_TIMEOUT_S``) and never trap. A launch that fails
(a wait timed out, the ranks called different collectives, launches overlapped) marks
its family's ``LaunchState.broken``, writes poison where its results would have gone,
and its first failing thread fills the family's ``ErrorRecord`` (``_protocol``) in
host-mapped pinned memory. The host reads the records without synchronizing the device
(at the start of every ubnext call, in ``Communicator.synchronize`` and from the
watchdog), raises the matching :class:`~ubnext._protocol.errors.BrokenCommunicatorError`, and
passes the mark on to every family of every rank (``Node.announce``), so
that their waits give up within a round instead of timing out one after another.
"""

from __future__ import annotations

import ctypes

from ubnext._protocol.constants import (
    ANY_PEER,
    ERROR_RECORD,
    FAIL_KINDS,
    LAUNCH_STATE,
    MOE_INPUT_ERRORS,
    SPLIT_INPUT_ERRORS,
    WAIT_SITES,
    field_offset,
    struct_bytes,
)
from ubnext._protocol.errors import (
    BrokenCommunicatorError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConcurrentUseError,
    RoutingError,
    SplitError,
)

_RECORD_BYTES = 64
_CTYPES = {"u32": ctypes.c_uint32, "u64": ctypes.c_uint64}
_KIND = {name: code for code, (name, _) in FAIL_KINDS.items()}


class _Record(ctypes.Structure):
    _fields_ = [(field, _CTYPES[ctype]) for ctype, field, _ in ERROR_RECORD]


assert ctypes.sizeof(_Record) == struct_bytes(ERROR_RECORD) <= _RECORD_BYTES


def broken_word(kind: int, rank: int) -> int:
    """The value of ``LaunchState.broken`` that says rank ``rank`` failed with ``kind``."""
    return (kind << 8) | (rank + 1)


class FailureRecords:
    """Host-mapped pinned memory holding one ``ErrorRecord`` per kernel family state, after
    a word that any completed record sets (``LaunchState.tripped`` points the kernels to
    it), so that a call's check reads one word.

    Args:
        names: the LaunchState slots (their plan names), one record each.

    Attributes:
        device_ptr: ``{name: device address of its record}``, as kernels see it.
        tripped_ptr: device address of the word.
    """

    def __init__(self, names):
        from cuda.bindings import runtime as cudart
        from cupy.cuda import runtime

        from ubnext._environment.cuda import check

        self.names = tuple(names)
        nbytes = _RECORD_BYTES * (len(self.names) + 1)  # the word's line, then the records
        self._host = runtime.hostAlloc(nbytes, runtime.hostAllocMapped)
        ctypes.memset(self._host, 0, nbytes)
        self._word = ctypes.c_uint32.from_address(self._host)
        self._records = [_Record.from_address(self._host + _RECORD_BYTES * (i + 1)) for i in range(len(self.names))]
        base = int(check(cudart.cudaHostGetDevicePointer(self._host, 0), "cudaHostGetDevicePointer"))
        self.tripped_ptr = base
        self.device_ptr = {name: base + _RECORD_BYTES * (i + 1) for i, name in enumerate(self.names)}

    @property
    def tripped(self) -> bool:
        """Whether a kernel recorded a failure. Never blocks."""
        return self._host is not None and bool(self._word.value)

    def first(self) -> _Record | None:
        """A complete record, or None. Never blocks."""
        if not self.tripped:
            return None
        return next((rec for rec in self._records if rec.flag), None)

    def origin(self) -> tuple[int, int] | None:
        """(FailKind, rank) of the first failure a record tells of, or None. Never blocks."""
        rec = self.first()
        if rec is None:
            return None
        return (rec.site, rec.peer) if rec.kind == _KIND["kFailPeer"] else (rec.kind, rec.rank)

    def error(self, op: str, timeout_s: float) -> BrokenCommunicatorError | None:
        """The error a kernel recorded, or None. Never blocks.

        Returns:
            CollectiveTimeoutError, CollectiveMismatchError, ConcurrentUseError, or
            BrokenCommunicatorError (another rank failed first).
        """
        rec = self.first()
        if rec is None:
            return None
        return error_of(op, rec.kind, rec.rank, rec.peer, rec.site, rec.epoch, rec.mine, rec.theirs, timeout_s)

    def close(self) -> None:
        """Frees the pinned memory. Idempotent."""
        host, self._host, self._records, self._word = self._host, None, [], None
        if host is not None:
            from cupy.cuda import runtime

            runtime.freeHost(host)


def error_of(op: str, kind: int, rank: int, peer: int, site: int, epoch: int, mine: int, theirs: int,
             timeout_s: float) -> BrokenCommunicatorError:
    """The exception for one ErrorRecord's fields (pure)."""
    if kind == _KIND["kFailTimeout"]:
        where = WAIT_SITES[site][1] if site in WAIT_SITES else f"site {site}"
        return CollectiveTimeoutError(op, rank, None if peer == ANY_PEER else peer, f"{where}, launch {epoch}",
                                      timeout_s)
    if kind == _KIND["kFailMismatch"]:
        return CollectiveMismatchError(op, rank, peer, mine, theirs)
    if kind == _KIND["kFailConcurrent"]:
        return ConcurrentUseError(op, rank)
    if kind == _KIND["kFailInput"]:
        cls, table = (SplitError, SPLIT_INPUT_ERRORS) if site in SPLIT_INPUT_ERRORS else (RoutingError, MOE_INPUT_ERRORS)
        what = table[site][1] if site in table else f"invalid input {site}"
        return cls(op, rank, what, mine, theirs - (1 << 64) if theirs >> 63 else theirs)
    what = FAIL_KINDS[site][1] if site in FAIL_KINDS else f"failure {site}"
    return BrokenCommunicatorError(op, peer, f"rank {peer} failed first ({what}); rank {rank} gave up its launch")


def state_field(name: str) -> int:
    """Byte offset of field ``name`` in a LaunchState."""
    return field_offset(LAUNCH_STATE, name)
