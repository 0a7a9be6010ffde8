"""Logging: the ``ubnext`` logger, with a rank prefix, and log-once helper.

Every ubnext module logs through :func:`get_logger`. Messages look like::

    [ubnext rank 3] WARNING: all_reduce: falling back to nccl (pool full)

The communicator calls ``get_logger(config, rank)`` when it is created, which
sets the level from ``config.log_level`` and the rank shown in the prefix;
before that the level is ``WARNING`` and the rank shows as ``?``.

The logger has its own stderr handler and does not propagate to the root
logger (so messages are not printed twice). To route them elsewhere, use
``logging.getLogger("ubnext")``: replace its handlers or set ``propagate``.
"""

from __future__ import annotations

import logging
import sys
import threading

from ubnext._environment.config import Config

__all__ = ["get_logger", "log_once"]

_LOGGER_NAME = "ubnext"
_FORMAT = "[ubnext rank %(ubnext_rank)s] %(levelname)s: %(message)s"

# Process-wide state, as the logger itself is: the keys log_once has emitted.
_once_lock = threading.Lock()
_setup_lock = threading.Lock()
_once_keys: set[str] = set()


class _RankFilter(logging.Filter):
    """Stamps each record with the rank shown in the message prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.rank = "?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.ubnext_rank = self.rank
        return True


def _rank_filter(logger: logging.Logger) -> _RankFilter:
    """Return the logger's rank filter, installing handler and filter once (under a lock:
    communicators may be created on several threads at once)."""
    with _setup_lock:
        for existing in logger.filters:
            if isinstance(existing, _RankFilter):
                return existing
        rank_filter = _RankFilter()
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addFilter(rank_filter)
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.WARNING)
        return rank_filter


def get_logger(config: Config | None = None, rank: int | None = None) -> logging.Logger:
    """Return the ``ubnext`` logger, optionally applying a communicator's settings.

    Collective: no.

    Args:
        config: when given, the logger level becomes ``config.log_level``.
        rank: when given, the rank shown in the ``[ubnext rank R]`` prefix.

    Returns:
        The process-wide ``logging.Logger`` named ``"ubnext"``.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    rank_filter = _rank_filter(logger)
    if config is not None:
        logger.setLevel(config.log_level)
    if rank is not None:
        rank_filter.rank = str(rank)
    return logger


def log_once(key: str, msg: str, level: int = logging.WARNING) -> bool:
    """Log ``msg`` the first time ``key`` is seen in this process.

    Used for fallbacks ("every fallback is logged once with its reason"): the
    key names the situation (e.g. ``"fallback:nccl:pool-full"``), the message
    gives the reason.

    Collective: no.

    Args:
        key: identity of the event; later calls with the same key are silent.
        msg: the message, starting with the operation name.
        level: a ``logging`` level (default ``WARNING``).

    Returns:
        True on the first call for ``key`` (the message was handed to the
        logger, which may still filter it by level), else False.
    """
    with _once_lock:
        if key in _once_keys:
            return False
        _once_keys.add(key)
    get_logger().log(level, msg)
    return True
