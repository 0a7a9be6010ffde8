"""``comm.describe()``: what a communicator runs, on which resources, and why."""

from __future__ import annotations

import dataclasses

from ubnext._environment.config import _env_text
from ubnext._protocol import quant as _quant
from ubnext._protocol.algorithms import ALGORITHMS, COLLECTIVES, DTYPES
from ubnext._selection.table import human_bytes

#: Message sizes the description shows: 1 KiB to 1 GiB, powers of 4.
SIZES = [1 << shift for shift in range(10, 31, 2)]


class Description(dict):
    """A communicator's description: a plain dict (JSON-ready); ``str()`` is the readable report.

    Keys: ``rank``, ``ranks``, ``local_rank``, ``local_ranks``, ``device``,
    ``device_name``, ``path`` (kernels or NCCL only, and why), ``algorithms``,
    ``pool`` (bytes, user heap and free bytes; None without a pool), ``nvls``,
    ``config`` (``UBNEXT_*`` -> value), ``quantized`` (whether and from which size ``auto``
    quantizes all-reduces and reduce-scatters, and where that size comes from:
    ``UBNEXT_QUANTIZED`` and the tables' quantized thresholds; each ``selection`` reason
    says it for its size too, and the reduce-scatter's in ``collectives``),
    ``tables`` (the selector tables, in the order consulted: each the entry chosen for
    this machine and why, ``"default table: NVIDIA H200 nvlink plain graph (exact
    match)"``), ``selection`` (every dtype -> ``[bytes, algorithm, reason]``
    for each of ``SIZES``: the all-reduce's) and ``collectives`` (reduce-scatter and
    all-gather -> their ``selection`` for bfloat16, sizes of the whole message). The
    report shows a dtype's rows as one where they all agree.
    """

    def __str__(self) -> str:
        return "\n".join(_render(self))


def report(comm) -> Description:
    """The description of ``comm`` (an open ``Communicator``). Local; no device work."""
    from ubnext._environment.devices import device_name

    config = comm.config
    kernels = comm.path.startswith("kernels")
    starts = {c: {dtype: comm.selector.quantized(config.quantized, dtype, c) for dtype in _quant.DTYPES}
              for c in _quant.COLLECTIVES}
    return Description(
        rank=comm.rank, ranks=comm.size, local_rank=comm.local_rank, local_ranks=comm.local_size,
        device=comm.device, device_name=device_name(comm.device), path=comm.path,
        algorithms=comm.algorithms(), pool=comm.pool, nvls=_nvls(comm),
        config={f.metadata["env"]: getattr(config, f.name) for f in dataclasses.fields(config)},
        quantized=_quant.describe(config.quantized, kernels, starts),
        tables=[f"{t.where} ({t.why})" for t in comm.selector.tables],
        selection={dtype: _selection(comm, dtype, "all_reduce", starts) for dtype in DTYPES},
        collectives={c: {"bfloat16": _selection(comm, "bfloat16", c, starts)}
                     for c in COLLECTIVES if c != "all_reduce"},
    )


def _selection(comm, dtype: str, collective: str, starts: dict) -> list:
    """``[bytes, algorithm, reason]`` of ``auto``'s choice for each of SIZES, the reason saying
    where sums and averages run quantized instead, for the collectives that quantize
    (``starts``: as ``_quant.describe`` takes them)."""
    setting, kernels = comm.config.quantized, comm.path.startswith("kernels")

    def note(nbytes: int) -> str:
        if collective not in starts:  # the all-gather: always exact
            return ""
        return _quant.selection_note(setting, kernels, dtype, nbytes, starts[collective].get(dtype, (None, "")),
                                     collective)

    return [[n, name, why + note(n)] for n in SIZES for name, why in [_choice(comm, n, dtype, collective)]]


def _nvls(comm) -> dict:
    """NVLink multicast: ``Communicator.nvls`` (a decision with ``enabled``/``reason``) where it exists."""
    decision = getattr(comm, "nvls", None)
    if decision is None:
        return {"enabled": False, "reason": "not available in this build"}
    return {"enabled": bool(decision.enabled), "reason": str(decision.reason)}


def _choice(comm, nbytes: int, dtype: str, collective: str = "all_reduce") -> tuple[str, str]:
    """What ``algorithm="auto"`` runs for the message, and why (``UBNEXT_ALGO`` wins over the
    table where it names an algorithm that serves the collective)."""
    forced = comm.config.algorithm
    algorithm = ALGORITHMS.get(forced)
    if algorithm is None or comm.algorithms() == ["nccl"] or not algorithm.supports(dtype, "sum", collective):
        # auto, or UBNEXT_ALGO naming an algorithm that does not take this collective or dtype
        return comm.selector.explain(nbytes, dtype, collective)
    if comm.selector.fits(forced, nbytes):
        return forced, f"UBNEXT_ALGO={forced}"
    return "error", f"UBNEXT_ALGO={forced} cannot take this size ({collective} raises)"


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
    lines.append(f"quantized all-reduce and reduce-scatter: {d['quantized']}")
    lines.append(f"selector tables: {', then '.join(d['tables'])}")
    lines.append('selection (algorithm="auto"):')
    for dtype, rows in d["selection"].items():
        lines.append(f"  {dtype}")
        lines += _rows(rows)
    for collective, by_dtype in d.get("collectives", {}).items():
        for dtype, rows in by_dtype.items():
            lines.append(f"  {collective} {dtype}")
            lines += _rows(rows)
    return lines


def _rows(rows) -> list[str]:
    """The lines of one selection: one "any size" line where every size gets the same choice."""
    if len({(name, why) for _, name, why in rows}) == 1:
        return [f"    {'any size':>8}  {rows[0][1]:<8} {rows[0][2]}"]
    return [f"    {human_bytes(n):>8}  {name:<8} {why}" for n, name, why in rows]


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
