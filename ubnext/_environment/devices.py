"""Which GPU each rank of a node uses, matched by device UUID.

Device ordinals belong to a process: ``CUDA_VISIBLE_DEVICES`` (a user's, Slurm's
``--gpus-per-task``, Kubernetes') can give the ranks of one node different device
lists, in different orders, so ordinal 0 of two ranks may be two GPUs and ordinal 1
of one the ordinal 0 of another. ubnext never needs a peer's ordinal: the pool
exchanges its memory as file descriptors and each rank grants access to its own
device only (``_pool.py``; CUDA 10.1 and later map memory of devices a process
cannot see), and NCCL finds peers by bus id. So the ranks of a node share their
lists of device UUIDs, and each takes the first device it sees that no other rank
has taken (a device asked for explicitly stays its own; see :func:`assign`).

Several ranks on one GPU still work (the multi-rank tests run so), but they take
turns on it and every call is many times slower, so :func:`map_devices` warns
once, naming the ranks and the device. NCCL refuses such ranks outright
(``_nccl.py`` checks with :func:`shared`).
"""

from __future__ import annotations

import logging
import uuid as _uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ubnext._environment.cuda import drv
from ubnext._environment.log import log_once
from ubnext._protocol.errors import UbnextError

__all__ = ["DeviceView", "assign", "device_uuid", "map_devices", "shared", "visible_uuids"]


@dataclass(frozen=True)
class DeviceView:
    """What one rank reports about its devices.

    Attributes:
        visible: UUIDs of the devices the rank sees, by ordinal.
        requested: the ordinal the caller asked for (``device=``, or a current
            device set to something other than 0), or None.
        error: why the rank cannot take part (e.g. the requested ordinal does
            not exist), or None.
    """

    visible: tuple[str, ...]
    requested: int | None = None
    error: str | None = None


def assign(views: Sequence[DeviceView]) -> list[int]:
    """The ordinal each rank uses, given every rank's view (element r: local rank r).

    Requested ordinals are kept. The others take the first device they see that
    is not taken yet, ranks that see fewer devices first (they have less choice),
    then in local-rank order; where every device a rank sees is taken, the rank
    shares: its local rank modulo the number it sees, so ranks that see the same
    list spread over it in turn.

    Pure. Collective: no.
    """
    ordinals = [v.requested for v in views]
    taken = {v.visible[o] for v, o in zip(views, ordinals) if o is not None}
    for rank in sorted(range(len(views)), key=lambda r: (len(views[r].visible), r)):
        view = views[rank]
        if ordinals[rank] is None:
            free = [i for i, u in enumerate(view.visible) if u not in taken]
            ordinals[rank] = free[0] if free else rank % len(view.visible)
            taken.add(view.visible[ordinals[rank]])
    return ordinals


def shared(uuids: Sequence[str]) -> dict[str, list[int]]:
    """The devices several ranks use: UUID -> those ranks (ascending), for
    ``uuids[r]`` the device of rank r. Pure. Collective: no."""
    users: dict[str, list[int]] = {}
    for rank, u in enumerate(uuids):
        users.setdefault(u, []).append(rank)
    return {u: ranks for u, ranks in users.items() if len(ranks) > 1}


def device_uuid(ordinal: int, driver: Any = None) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` of this process's device ``ordinal``
    (a MIG instance has its own). Creates no context. Collective: no.

    Raises:
        CudaError: the driver cannot be initialized or has no such device.
    """
    drv("cuInit", 0, driver=driver)
    return _uuid_of(ordinal, driver)


def visible_uuids(driver: Any = None) -> tuple[str, ...]:
    """The UUIDs of the devices this process sees, by ordinal. Creates no context.
    Collective: no.

    Raises:
        CudaError: the driver cannot be initialized.
    """
    drv("cuInit", 0, driver=driver)
    return tuple(_uuid_of(i, driver) for i in range(drv("cuDeviceGetCount", driver=driver)))


def _uuid_of(ordinal: int, driver: Any) -> str:
    raw = drv("cuDeviceGetUuid", drv("cuDeviceGet", ordinal, driver=driver), driver=driver).bytes
    return f"GPU-{_uuid.UUID(bytes=bytes(raw))}"


def map_devices(local: Any, device: int | None, current: int = 0, driver: Any = None) -> int:
    """This rank's device ordinal, chosen with the node's other ranks by UUID.

    Warns once (the lowest of them logs it) when several local ranks end up on
    one GPU, and notes once when the ranks see different device lists.

    Collective: yes, over ``local`` (one allgather). Blocks the host.

    Args:
        local: bootstrap of this node's ranks.
        device: the ordinal the caller asked for, or None.
        current: the caller's current device; a non-zero one counts as asked for.
        driver: the ``cuda.bindings.driver`` module (default) or a fake, for tests.

    Returns:
        The ordinal, in this process's numbering.

    Raises:
        UbnextError: on every rank, when a rank asked for a device it does not
            have (the message names the rank).
    """
    requested = device if device is not None else (current or None)
    visible = visible_uuids(driver)
    error = None
    if requested is not None and not 0 <= requested < len(visible):
        error = f"device {requested} does not exist ({len(visible)} visible)"
    views = [DeviceView(*v) for v in local.allgather_obj((visible, requested, error))]
    failed = [(r, v.error) for r, v in enumerate(views) if v.error]
    if failed:
        rank, why = failed[0]
        raise UbnextError(f"Communicator: local rank {rank}: {why}; pass device= within range or fix "
                          f"CUDA_VISIBLE_DEVICES")
    ordinals = assign(views)
    uuids = [v.visible[o] for v, o in zip(views, ordinals)]
    for u, ranks in shared(uuids).items():
        if local.rank == ranks[0]:
            log_once(f"shared-gpu:{u}",
                     f"Communicator: local ranks {', '.join(map(str, ranks))} share one GPU (ordinal "
                     f"{ordinals[local.rank]} here, {u}); they take turns on it, so every call is many times "
                     f"slower than with a GPU each: start one rank per GPU (sharing is meant for tests)")
    if any(v.visible != views[0].visible for v in views):
        log_once("device-lists",
                 f"Communicator: the local ranks see different CUDA device lists (CUDA_VISIBLE_DEVICES "
                 f"differs; {', '.join(str(len(v.visible)) for v in views)} devices); GPUs are matched by "
                 f"UUID and peer memory is mapped by descriptor, not by ordinal", logging.INFO)
    return ordinals[local.rank]


def device_name(device: int) -> str:
    """The name of CUDA device ``device``, e.g. ``"NVIDIA H200"``."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else name
