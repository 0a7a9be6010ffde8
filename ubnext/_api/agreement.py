"""Ranks agree on what shapes their kernels: checked once, when a communicator is made.

The pool layout, the grids, the selection and the protocol follow from the
configuration (every ``Config`` field not marked ``local``), from ubnext's version and
from the kernel sources. Ranks that differ in any of these would push to other offsets
or pair other ranges, silently; so every rank's values are gathered once through the
bootstrap, and a difference raises on every rank, naming the setting and the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict

from ubnext._environment.config import Config
from ubnext._protocol.errors import UbnextError


def agreed_fields(config: Config) -> dict[str, object]:
    """``{environment variable: value}`` of every field the ranks must hold alike."""
    return {f.metadata["env"]: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.metadata["local"] is None}


def kernel_digest() -> str:
    """A hash of every kernel source as compiled (local includes and the generated header
    expanded): ranks with other kernel files would run another protocol."""
    from ubnext._engine.kernels import kernel_dir, source

    digest = hashlib.sha256()
    for path in sorted(kernel_dir().glob("*.cu")):
        digest.update(path.name.encode() + b"\0" + source(path.name).encode())
    return digest.hexdigest()[:16]


def facts(config: Config) -> dict[str, object]:
    """What this rank brings to the comparison: the agreed fields, the version, the kernels."""
    from ubnext._version import __version__

    return {**agreed_fields(config), "ubnext version": __version__, "kernel sources": kernel_digest()}


def check(config: Config, bootstrap) -> None:
    """Compares every rank's :func:`facts`. Collective over ``bootstrap``.

    Raises:
        UbnextError: on every rank alike, naming each setting that differs and which
            ranks hold which value (e.g. ``UBNEXT_STAGING_MB: 128 on ranks 0, 2; 64 on
            rank 1``).
    """
    everyone = bootstrap.allgather_obj(facts(config))
    differences = [difference_text(key, [f.get(key) for f in everyone]) for key in everyone[0]
                   if len({repr(f.get(key)) for f in everyone}) > 1]
    if differences:
        raise UbnextError(f"Communicator: the ranks disagree on {'; '.join(differences)} (these shape the "
                          f"pool layout, the grids or the selection: set them alike on every rank)")


def difference_text(key: str, values: list) -> str:
    """``"KEY: a on ranks 0, 2; b on rank 1"`` for the values of every rank (pure)."""
    ranks_of: dict[str, list[int]] = defaultdict(list)
    for rank, value in enumerate(values):
        ranks_of[repr(value) if isinstance(value, str) else str(value)].append(rank)
    parts = [f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
             for value, ranks in ranks_of.items()]
    return f"{key}: {'; '.join(parts)}"
