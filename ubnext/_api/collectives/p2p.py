"""Point-to-point on the symmetric pool (kernels/p2p.cu): the choice between it and NCCL
for ``send``, ``recv``, ``batch_isend_irecv`` and the all-to-all with uneven splits
(``_p2p_algorithm``), and their launches.

The kernel moves each message through its pair's own slots in the receiver's segment,
with the pair's own counters: only the two ranks of a pair take part, no barrier, no launch
state shared with the other ranks' calls. Two forms, chosen by both ends from the
message's bytes alone: below ``P2P_BULK_MIN_BYTES`` (64 KiB) LL lines (8 bytes and a flag
per pushed 16-byte line, polled: no sentinel, so every byte pattern travels; one block per
pair and direction where the launch holds only LL messages, as many as a bulk message's
where it holds one); from there the bulk form, chunks of ``P2P_BULK_CHUNK`` (32 KiB) stored
as 16-byte vectors into ``P2P_BULK_DEPTH`` (16) chunk slots per pair, one fenced flag line
and one credit per chunk, the chunks shared by up to ``P2P_BULK_BLOCKS`` (8) blocks per pair
and direction (``Engine.p2p``: every block of a launch within the SMs). Matching rule, per
ordered pair (NCCL's): the k-th message rank a sends rank b is the k-th message b receives
from a, whatever its form, counting single calls, a batch's entries in issue order and an
all-to-all's one message per pair. Each message's header carries the call's signature and
its bytes, and the receiver compares them with its own before it writes (a difference:
CollectiveMismatchError). Up to two messages of a pair may be in flight before their
receive is posted, a bulk one as far as its chunks fit the pair's free chunk slots (512
KiB); a send past that waits, bounded, for the receiver.

Failures: every wait is bounded (``timeout_s``). A receive whose send never comes times
out on the receiving rank, which raises CollectiveTimeoutError naming the peer at its next
call or ``synchronize()``; the failure is passed on to every rank of the communicator as
for the collectives, whose later calls raise BrokenCommunicatorError ("rank r failed
first"). The other ranks' queued work is not waited for: a rank that takes no part in the
pair sees the failure only at its next call. Where a receive fails, ``out`` holds all-ones
bytes where a wait gave up (the bulk form: the chunks of the blocks that gave up) and is
otherwise not written.

:class:`P2P` is a base of the Communicator, under ``SendRecv`` and ``AllToAll``.
"""

from __future__ import annotations

import logging

from ubnext._api.collectives.rung import Rung
from ubnext._engine.launch import issue
from ubnext._environment.log import log_once
from ubnext._protocol import signature as _signature
from ubnext._protocol.algorithms import DTYPES, P2P_ALGORITHMS
from ubnext._protocol.constants import P2P_MAX_ENTRIES
from ubnext._protocol.errors import UbnextError


def groups(items: list) -> list:
    """``items`` (``(kind, address, bytes, peer)`` in issue order) as the kernel's groups:
    ``(kind, peer, [(address, bytes), ...])``, one per kind and peer in order of first
    appearance, each group's entries in issue order (the order of a pair's messages)."""
    by_key: dict = {}
    for kind, ptr, nbytes, peer in items:
        by_key.setdefault((kind, peer), []).append((ptr, nbytes))
    return [(kind, peer, entries) for (kind, peer), entries in by_key.items()]


def head(collective: str) -> int:
    """The signature a message of ``collective`` carries, without its count (the message's
    bytes, which the kernel adds)."""
    return _signature.encode(collective, "uint8", "sum", 0)


class P2P(Rung):
    """The pool's point-to-point form: choice and launches (module docstring)."""

    def _p2p_algorithm(self, name: str, algorithm: str, entries: int = 0, why_nccl: str | None = None) -> str:
        """``"ll"`` (this module's kernel, both its forms) or ``"nccl"`` for a call of ``name`` of
        ``entries`` messages on this rank (``algorithm``: ``"auto"`` or one of
        ``P2P_ALGORITHMS``). ``auto`` takes NCCL where it runs (the kernel's speed against
        NCCL is not measured yet) and the kernel where it does not (ranks sharing a GPU).
        The same on every rank but for ``entries``: it reads only what they agreed at
        construction. Where NCCL runs, the rung's check (``why_nccl``: its reason)."""
        if algorithm != "auto" and algorithm not in P2P_ALGORITHMS:
            raise UbnextError(f"{name}: unknown algorithm {algorithm!r}; use auto or one of "
                              f"{', '.join(P2P_ALGORITHMS)}")
        pooled = self._node is not None
        if algorithm == "ll" and not pooled:
            raise UbnextError(f"{name}: algorithm 'll' needs the symmetric pool ({self.path})")
        algo = algorithm
        if algorithm == "auto":
            algo = "ll" if pooled and self._selector.nccl_problem else "nccl"
            if algo == "ll":
                log_once(f"p2p:{name}:ll", f"{name}: NCCL cannot run here ({self._selector.nccl_problem}); the "
                         f"pool's point-to-point kernel serves it", logging.INFO)
        if algo == "ll" and entries > P2P_MAX_ENTRIES:
            raise UbnextError(f"{name}: the pool's point-to-point kernel takes at most {P2P_MAX_ENTRIES} sends and "
                              f"receives per call, not {entries}" + ("" if algorithm == "ll" else
                                                                     f" (and NCCL cannot run here: "
                                                                     f"{self._selector.nccl_problem})"))
        if algo == "nccl":
            self._rung(name, "algorithm 'nccl' was named" if algorithm == "nccl" else why_nccl or
                       ("the pool's point-to-point kernel is not measured against NCCL yet" if pooled else
                        f"this communicator has no symmetric pool ({self.path})"))
        return algo

    def _run_p2p(self, collective: str, items: list, handle: int, owner) -> tuple:
        """The kernel's launch on ``handle`` for ``items`` (``(kind, address, bytes, peer)``;
        a rank is the pool's index of its segment: the pool serves a communicator of one
        node) as messages of ``collective``; returns it (``issue``'s form), for a call plan."""
        self._order.follow(handle, owner)
        launch = self._node.engine.p2p(groups(items), head(collective))
        issue(launch, handle)
        return launch

    def _run_alltoallv(self, xb, ob, rows: int, out_rows: int, row_bytes: int, ins, outs, handle: int,
                       owner) -> tuple:
        """The kernel's all-to-all with split counts in device memory (Buffers ``ins`` and
        ``outs``, int32 or int64, each its own) on ``handle``: rows of ``row_bytes`` of
        ``xb`` (``rows``) into ``ob`` (``out_rows``); returns the launch, as ``_run_p2p``."""
        self._order.follow(handle, owner)
        launch = self._node.engine.p2p_alltoallv(xb.ptr, ob.ptr, rows, out_rows, row_bytes, ins.ptr,
                                                 DTYPES[ins.dtype][1], outs.ptr, DTYPES[outs.dtype][1],
                                                 head("all_to_all"))
        issue(launch, handle)
        return launch
