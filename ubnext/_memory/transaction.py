"""Transactional setup: undo steps registered as resources are created, run newest first
on a failed setup or at close (the pool, the multicast range, the node use one each),
and the close and finalizer that the resources built this way share."""

from __future__ import annotations

import warnings
from typing import Any, Callable


class UndoStack:
    """Undo actions registered by each setup step, run last-in first-out."""

    def __init__(self) -> None:
        self._actions: list[tuple[Callable[..., Any], tuple]] = []

    def push(self, action: Callable[..., Any], *args: Any) -> None:
        self._actions.append((action, args))

    def unwind(self) -> list[Exception]:
        """Run every action, newest first; return the errors (never raises)."""
        errors = []
        while self._actions:
            action, args = self._actions.pop()
            try:
                action(*args)
            except Exception as exc:  # keep undoing: one failure must not leak the rest
                errors.append(exc)
        return errors


class TornDown:
    """Base of a resource whose setup committed an UndoStack to ``self._teardown`` (None
    once closed): :meth:`close` runs it once, newest step first; ``with`` closes it; the
    finalizer only warns, naming what :attr:`_leaks` (it never calls the driver, which may
    be gone at interpreter shutdown)."""

    _teardown: UndoStack | None = None
    #: what stays behind where the resource is not closed (the finalizer's warning)
    _leaks = "its resources stay until the process exits"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._teardown is None

    def close(self) -> None:
        """Runs every undo step, newest first; idempotent.

        Raises:
            The first error of a step, after every other step ran.
        """
        teardown, self._teardown = self._teardown, None
        if teardown is None:
            return
        errors = teardown.unwind()
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_teardown", None) is not None:
            warnings.warn(f"{self!r} was not closed; {self._leaks}", ResourceWarning, source=self)
