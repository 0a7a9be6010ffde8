"""``comm.describe()``: what a communicator runs, on which resources, and why."""

from __future__ import annotations

import dataclasses

from ._algorithms import ALGORITHMS, DTYPES
from ._units import human_bytes
from ._config import _env_text

#: Message sizes the description shows: 1 KiB to 1 GiB, powers of 4.
SIZES = [1 << shift for shift in range(10, 31, 2)]


class Description(dict):
    """A communicator's description: a plain dict (JSON-ready); ``str()`` is the readable report.

    Keys: ``rank``, ``ranks``, ``local_rank``, ``local_ranks``, ``device``,
    ``device_name``, ``path`` (kernels or NCCL only, and why), ``algorithms``,
    ``pool`` (bytes, user heap and free bytes; None without a pool), ``nvls``,
    ``config`` (``UBNEXT_*`` -> value), ``tables`` (the selector tables, in
    the order consulted) and ``selection`` (every dtype -> ``[bytes, algorithm, reason]``
    for each of ``SIZES``; the report shows a dtype's rows as one where they all agree).
    """

    def __str__(self) -> str:
        return "\n".join(_render(self))


def report(comm) -> Description:
    """The description of ``comm`` (an open ``Communicator``). Local; no device work."""
    from ._info import device_name

    config = comm.config
    return Description(
        rank=comm.rank, ranks=comm.size, local_rank=comm.local_rank, local_ranks=comm.local_size,
        device=comm.device, device_name=device_name(comm.device), path=comm.path,
        algorithms=comm.algorithms(), pool=comm.pool, nvls=_nvls(comm),
        config={f.metadata["env"]: getattr(config, f.name) for f in dataclasses.fields(config)},
        tables=[t.source for t in comm.selector.tables],
        selection={dtype: [[n, *_choice(comm, n, dtype)] for n in SIZES] for dtype in DTYPES},
    )


def _nvls(comm) -> dict:
    """NVLink multicast: ``Communicator.nvls`` (a decision with ``enabled``/``reason``) where it exists."""
    decision = getattr(comm, "nvls", None)
    if decision is None:
        return {"enabled": False, "reason": "not available in this build"}
    return {"enabled": bool(decision.enabled), "reason": str(decision.reason)}


def _choice(comm, nbytes: int, dtype: str) -> tuple[str, str]:
    """What ``algorithm="auto"`` runs for the message, and why (``UBNEXT_ALGO`` wins over the table)."""
    forced = comm.config.algorithm
    if forced == "auto" or comm.algorithms() == ["nccl"] or not ALGORITHMS[forced].supports(dtype, "sum"):
        return comm.selector.explain(nbytes, dtype)  # UBNEXT_ALGO leaves the dtypes it does not take to auto
    if comm.selector.fits(forced, nbytes):
        return forced, f"UBNEXT_ALGO={forced}"
    return "error", f"UBNEXT_ALGO={forced} cannot take this size (all_reduce raises)"


def _render(d: Description) -> list[str]:
    lines = [
        f"ubnext communicator: rank {d['rank']} of {d['ranks']} (local rank {d['local_rank']} of "
        f"{d['local_ranks']}), device {d['device']} ({d['device_name']})",
        f"path: {d['path']}; algorithms: {', '.join(d['algorithms'])}",
    ]
    if d["pool"] is not None:
        p = d["pool"]
        lines.append(f"pool: {_mib(p['bytes'])} per rank; user heap {_mib(p['user_heap_bytes'])}, "
                     f"{_mib(p['user_heap_free_bytes'])} free")
    nvls = d["nvls"]
    lines.append(f"NVLink multicast: {'on' if nvls['enabled'] else 'off'} ({nvls['reason']})")
    lines.append("config:")
    lines += [f"  {k:<22} {_env_text(v) or '(empty)'}" for k, v in d["config"].items()]
    lines.append(f"selector tables: {', then '.join(d['tables'])}")
    lines.append('selection (algorithm="auto"):')
    for dtype, rows in d["selection"].items():
        lines.append(f"  {dtype}")
        if len({(name, why) for _, name, why in rows}) == 1:  # the same choice at every size
            lines.append(f"    {'any size':>8}  {rows[0][1]:<8} {rows[0][2]}")
        else:
            lines += [f"    {human_bytes(n):>8}  {name:<8} {why}" for n, name, why in rows]
    return lines


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
