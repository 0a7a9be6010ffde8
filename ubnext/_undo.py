"""Transactional setup: undo steps registered as resources are created, run newest first
on a failed setup or at close (the pool, the multicast range, the node use one each)."""

from __future__ import annotations

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
