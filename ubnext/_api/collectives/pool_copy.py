"""The pool's forms of the data movers: the choice between them and NCCL (``_mover``,
and by the call's size ``_sized``: the selector table's mover rows), the launch of the
low-latency kernel (``_run_ll``: kernels/ll_move.cu, broadcast and all-to-all), and the
copy form of ``broadcast`` (and its bandwidth form, scatter + all-gather), ``all_to_all``
with even splits, ``gather`` and ``scatter``: copy engines move the bytes between the ranks' segments of a
symmetric area, and ubnext's one-shot all-reduce of one flag vector is the barrier that
says when a peer's bytes have landed or a peer has read them (the pattern of the
overlapped GEMMs, ``ubnext.torch._overlap``). No kernel of its own, so every dtype moves
exactly and the form runs wherever the pool does, ranks sharing a GPU included.

Plans (:func:`broadcast_plan` ...) are pure lists of steps, so the layouts are tested
without a GPU; a copy stays within one rank's memory and the caller's array (the 2-D
copies read one segment); :meth:`PoolCopy._run_copies` issues them on the caller's stream. Each
plan opens with a barrier (every rank's reads of the area by earlier calls are done
before anyone writes it) and moves the message in rounds of at most a half of the area
(scatter + all-gather: a half per rank), round j in half j % 2: a rank writes a half at round j + 2 only after the barrier of
round j + 1, which every rank passes only after its reads of round j. The barrier
carries the call's signature, so ranks calling different movers or counts raise
CollectiveMismatchError.

:class:`PoolCopy` is a base of the Communicator, under the movers' classes.
"""

from __future__ import annotations

import logging

from ubnext._api.collectives.rung import Rung
from ubnext._engine.copies import copy as _copy
from ubnext._engine.copies import copy_rows as _copy_rows
from ubnext._engine.launch import issue
from ubnext._environment.log import log_once
from ubnext._interop import arrays as _arrays
from ubnext._interop.streams import refuse_capture
from ubnext._protocol.algorithms import LL_ENTRIES, MOVER_SERVES, MOVER_TABLES
from ubnext._protocol.constants import LL_MAX_BYTES, VEC_BYTES
from ubnext._protocol.errors import UbnextError

#: bytes of the movers' symmetric area per rank (two halves; allocated at the first call
#: of the copy form)
AREA_BYTES = 8 << 20
AREA_KEY = "ubnext.collectives"
#: the barrier's algorithm: the one-shot all-reduce (pushes into every peer, polled)
BARRIER = "lamport"
#: a step that waits for every rank (the barrier)
WAIT = ("barrier",)
#: the algorithms that run on the area: the copy form and broadcast's bandwidth form
COPY_FORMS = {"copy", "scatter_allgather"}


def _rounds(nbytes: int, unit: int):
    """``(j, offset, bytes)`` of the rounds of a message of ``nbytes`` in pieces of ``unit``."""
    for j, off in enumerate(range(0, nbytes, unit)):
        yield j, off, min(unit, nbytes - off)


def _slot(half: int, nranks: int) -> int:
    """Bytes of one rank's slot in a half shared by ``nranks`` slots (whole vectors)."""
    return half // nranks // VEC_BYTES * VEC_BYTES


def broadcast_plan(me: int, root: int, area: tuple, x: int, out: int, nbytes: int, half: int) -> list:
    """The root stages each round in its own half; every other rank pulls it into ``out``.
    ``area``: the area's address in every rank's segment."""
    steps = [WAIT]
    for j, off, n in _rounds(nbytes, half):
        h = (j % 2) * half
        if me == root:
            steps.append(("copy", area[me] + h, x + off, n))
        steps.append(WAIT)
        if me != root:
            steps.append(("copy", out + off, area[root] + h, n))
    if me == root and out != x:
        steps.append(("copy", out, x, nbytes))
    return steps


def scatter_allgather_plan(me: int, root: int, area: tuple, x: int, out: int, nbytes: int, half: int) -> list:
    """Broadcast's bandwidth form: a round takes up to ``half`` bytes per rank of the
    message, cut in one part per rank (whole vectors, the last parts shorter or empty); the
    root pushes part d into rank d's half (the scatter), then every other rank pulls every
    part into ``out`` (the all-gather). The root's links carry about twice the message, where
    the copy form's (:func:`broadcast_plan`) carry it once per peer."""
    nranks = len(area)
    steps = [WAIT]
    for j, off, n in _rounds(nbytes, half * nranks):
        h = (j % 2) * half
        part = -(-n // (nranks * VEC_BYTES)) * VEC_BYTES
        parts = [(d, d * part, min(part, n - d * part)) for d in range(nranks) if d * part < n]
        if me == root:
            steps += [("copy", area[d] + h, x + off + start, k) for d, start, k in parts]
        steps.append(WAIT)
        if me != root:
            steps += [("copy", out + off + start, area[d] + h, k) for d, start, k in parts]
    if me == root and out != x:
        steps.append(("copy", out, x, nbytes))
    return steps


def all_to_all_plan(me: int, area: tuple, x: int, out: int, part: int, half: int) -> list:
    """Each rank pushes part d of ``x`` (``part`` bytes each) into slot ``me`` of rank d's
    half (a copy per rank: a copy stays within one rank's memory), then copies its slots,
    in rank order, into ``out`` (one 2-D copy)."""
    nranks, slot = len(area), _slot(half, len(area))
    steps = [WAIT]
    for j, off, n in _rounds(part, slot):
        h = (j % 2) * half
        steps += [("copy", area[d] + h + me * slot, x + d * part + off, n) for d in range(nranks)]
        steps.append(WAIT)
        steps.append(("rows", out + off, part, area[me] + h, slot, n, nranks))
    return steps


def gather_plan(me: int, root: int, area: tuple, x: int, out: int, nbytes: int, half: int) -> list:
    """Each rank pushes ``x`` into slot ``me`` of the root's half; the root copies the
    slots, in rank order, into ``out``."""
    nranks, slot = len(area), _slot(half, len(area))
    steps = [WAIT]
    for j, off, n in _rounds(nbytes, slot):
        h = (j % 2) * half
        steps.append(("copy", area[root] + h + me * slot, x + off, n))
        steps.append(WAIT)
        if me == root:
            steps.append(("rows", out + off, nbytes, area[me] + h, slot, n, nranks))
    return steps


def scatter_plan(me: int, root: int, area: tuple, x: int, out: int, nbytes: int, half: int) -> list:
    """The root pushes part d of ``x`` (``nbytes`` each) into rank d's half (a copy per
    rank); every rank copies its half into ``out``."""
    steps = [WAIT]
    for j, off, n in _rounds(nbytes, half):
        h = (j % 2) * half
        if me == root:
            steps += [("copy", area[d] + h, x + d * nbytes + off, n) for d in range(len(area))]
        steps.append(WAIT)
        steps.append(("copy", out + off, area[me] + h, n))
    return steps


class PoolCopy(Rung):
    """The copy form's choice, area, barrier and issue (module docstring)."""

    def _mover(self, name: str, algorithm: str, even: bool = True) -> str:
        """The algorithm of a data mover's call, before its section: ``algorithm`` checked
        (``"auto"`` or one of ``MOVER_SERVES[name]``; ``even``: an all-to-all's splits are
        even, which the pool's forms need), or ``"auto"`` where the call resolves it by size
        (:meth:`_sized`). Where the call runs on NCCL, the rung's check (``_rung``: it raises
        where NCCL cannot run); where a form on the copy form's area may run (named, or
        ``auto`` where a selector table row names one or NCCL cannot run), the area is
        allocated at the first call (collectively, in the section of its own: call it before
        the call's section). The same on every rank: it reads only what they agreed at
        construction."""
        served = MOVER_SERVES[name]
        if algorithm != "auto" and algorithm not in served:
            raise UbnextError(f"{name}: unknown algorithm {algorithm!r}; use auto or one of {', '.join(served)}")
        pooled = self._node is not None and even
        if algorithm not in ("auto", "nccl") and not self._pool_takes(algorithm, pooled):
            why = "even splits" if self._node is not None and not even else "the symmetric pool"
            raise UbnextError(f"{name}: algorithm {algorithm!r} needs {why} ({self.path})")
        if algorithm == "nccl" or (algorithm == "auto" and not pooled):  # refused here where NCCL cannot run
            self._rung(name, "algorithm 'nccl' was named" if algorithm == "nccl" else
                       "ubnext's forms of it take even splits only" if self._node is not None else
                       f"this communicator has no symmetric pool ({self.path})")
            return "nccl"
        if algorithm in COPY_FORMS or (algorithm == "auto" and self._pool_takes("copy", pooled) and (
                self._selector.nccl_problem or COPY_FORMS & self._selector.mover_algorithms(name))):
            self._symmetric_area(AREA_KEY, AREA_BYTES)
        if algorithm == "auto" and not (name in MOVER_TABLES and self._selector.mover_algorithms(name)):
            return self._auto(name)  # no rows: a choice that does not depend on the size
        return algorithm

    def _sized(self, name: str, algorithm: str, nbytes: int, dtype: str) -> str:
        """``algorithm`` as :meth:`_mover` returned it, ``"auto"`` resolved for a call of
        ``nbytes`` of ``dtype`` (the message; an all-to-all's whole input), inside the call's
        section and before anything is launched (:meth:`_auto`)."""
        return self._auto(name, nbytes, dtype) if algorithm == "auto" else algorithm

    def _auto(self, name: str, nbytes: int | None = None, dtype: str = "") -> str:
        """``auto``'s algorithm for a pooled call of ``name`` (even splits): with ``nbytes``,
        the first selector table row of ``name`` (``MOVER_TABLES``, as ``python -m ubnext.tune``
        measures them, NCCL included) that covers ``nbytes`` and whose algorithm runs here;
        where no row does, NCCL where it runs, the copy form where it cannot. NCCL's choice
        makes the rung's check; each choice is logged once. The same on every rank."""
        found = None
        if nbytes is not None:
            found = self._selector.mover(name, nbytes, dtype, lambda a: self._pool_takes(a, True, name, nbytes)
                                         if a != "nccl" else not self._selector.nccl_problem)
        if found is not None:
            algo, why = found
            if algo == "nccl":
                self._rung(name, f"the selector's choice: {why}")
            else:
                log_once(f"mover:{name}:{algo}:{why}", f"{name}: {algo} ({why})", logging.INFO)
            return algo
        if self._pool_takes("copy", True) and self._selector.nccl_problem:
            log_once(f"mover:{name}:copy", f"{name}: NCCL cannot run here ({self._selector.nccl_problem}); "
                     f"the pool's copy form serves it", logging.INFO)
            return "copy"
        self._rung(name, "the pool's forms are not measured against NCCL on this machine (no selector table rows)"
                   if self._pool_takes("copy", True) else f"this communicator has no symmetric pool ({self.path})")
        return "nccl"

    def _pool_takes(self, algorithm: str, pooled: bool, name: str = "", nbytes: int = 0) -> bool:
        """Whether a pool form runs here: ``pooled`` (a pool and, for an all-to-all, even
        splits); the copy form's area and barrier for ``COPY_FORMS``; with ``nbytes`` given
        (``auto``'s choice), the low-latency kernel's bound (per part for an all-to-all)."""
        if not pooled:
            return False
        if algorithm in COPY_FORMS:
            return self._selector.fits(BARRIER, VEC_BYTES)
        if algorithm == "ll" and nbytes:
            return (nbytes // self.size if name == "all_to_all" else nbytes) <= LL_MAX_BYTES
        return True

    def _run_ll(self, name: str, x: int, out: int, nbytes: int, sig: int, handle: int, owner,
                root: int | None = None) -> None:
        """The low-latency kernel of ``name`` (``LL_ENTRIES``) on ``handle``: ``nbytes`` per
        part (all_to_all) or of the message (broadcast, from ``root``); larger ones raise
        (before anything is launched: the sizes agree on every rank)."""
        if nbytes > LL_MAX_BYTES:
            raise UbnextError(f"{name}: algorithm 'll' takes at most {LL_MAX_BYTES} bytes "
                              f"{'per part' if root is None else 'per message'}, not {nbytes}")
        self._order.follow(handle, owner)
        issue(self._node.engine.ll_move(LL_ENTRIES[name], x, out, nbytes, sig, root), handle)

    def _run_copies(self, name: str, steps: list, sig: int, handle: int, owner) -> None:
        """``steps`` of the call ``name`` issued on ``handle``: copies, and the barrier
        carrying ``sig``."""
        flag = self._copy_flag(name, handle)
        for step in steps:
            if step is WAIT:
                self._dispatch.all_reduce(BARRIER, flag, flag, "sum", handle, owner, sig)
            elif step[0] == "copy":
                _copy(step[1], step[2], step[3], handle)
            else:
                _copy_rows(*step[1:], handle)

    def _copy_area(self) -> tuple:
        """The area's address in every rank's segment (allocated by ``_mover``)."""
        return self._areas[AREA_KEY][1]

    def _copy_flag(self, name: str, handle: int):
        """The barrier's flag: 4 float32 zeros of this communicator (a Buffer), allocated and
        zeroed at the first call, inside the section (on the communicator's device); that
        call refuses a CUDA graph capture of ``handle`` (``refuse_capture``)."""
        flag = self.__dict__.get("_copy_flag_buffer")
        if flag is None:
            import cupy

            refuse_capture(name, handle, "the copy form allocates its barrier's flag and waits for its zeroing")

            array = cupy.zeros(4, cupy.float32)
            cupy.cuda.get_current_stream(self.device).synchronize()  # zero before any stream's barrier reads it
            flag = self._copy_flag_buffer = _arrays.as_buffer(array, "barrier", handle)
        return flag
