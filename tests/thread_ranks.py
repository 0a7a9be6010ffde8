"""The ranks of one node as threads of this process, for CPU tests of collective setup.

``run_ranks(n, fn)`` runs ``fn(boot)`` on ``n`` threads named ``rank0`` ...
``rank{n-1}``, each with a :class:`ThreadBootstrap` of the group, and returns
what each returned or raised. Every collective waits on a ``threading.Barrier``
with a timeout, and the threads are joined with a timeout, so a rank that
skips a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ubnext.bootstrap import Bootstrap

TIMEOUT_S = 20.0


class _Group:
    def __init__(self, n: int):
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=TIMEOUT_S)


class ThreadBootstrap(Bootstrap):
    """One thread's view of a group of threads (see :func:`run_ranks`)."""

    def __init__(self, group: _Group, rank: int):
        self._group, self._rank = group, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._group.slots)

    def allgather(self, data: bytes) -> list[bytes]:
        self._check_open("bootstrap.allgather")
        self._group.slots[self._rank] = data
        self._group.barrier.wait()
        out = list(self._group.slots)
        self._group.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def barrier(self) -> None:
        self._check_open("bootstrap.barrier")
        self._group.barrier.wait()


def run_ranks(n: int, fn: Callable[[ThreadBootstrap], Any]) -> list[Any]:
    """Run ``fn(boot)`` on ``n`` rank threads; element r is what rank r returned or raised.

    Fails (AssertionError) when a thread does not finish in time.
    """
    group = _Group(n)
    results: list[Any] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadBootstrap(group, rank))
        except BaseException as exc:  # handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"ranks {stuck} hang"
    return results


def run_threads(n: int, fn: Callable[[int], Any]) -> None:
    """Run ``fn(t)`` on ``n`` threads (t = 0 .. n-1), joined with a timeout; re-raises the
    first exception a thread raised, and fails (AssertionError) when one does not finish."""
    errors: list[BaseException] = []

    def body(t: int) -> None:
        try:
            fn(t)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    assert not [t for t in threads if t.is_alive()], "threads hang"
    if errors:
        raise errors[0]


def raise_first(results: list[Any]) -> list[Any]:
    """``results`` if no rank raised, else re-raise the first rank's exception."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
