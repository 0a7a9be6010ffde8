"""The NVLS gate: whether a communicator may use NVLink multicast.

On shared GPU hosts a multicast object can take the host's GPUs out of service,
and ubnext's multicast kernels have not yet run on hardware (they are compile-checked,
and their setup is tested against a recording fake driver). So multicast is opt-in.
``UBNEXT_NVLS`` (``Config.nvls``) selects the mode:

* ``auto`` (default): off, with the reason; no device is queried for multicast;
* ``0``: off;
* ``1``: opt in: on when no rank's environment holds one of :data:`ENV_BLOCKERS`
  and every local rank's device reports ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``;
  otherwise refused with :class:`~ubnext._protocol.errors.UbnextError` naming the variable
  or the device.

The environment is checked before any device is queried, and the gate itself
never calls a ``cuMulticast*`` function; a multicast object is only created
(by ``_multicast.MulticastRange``) when the decision says ``enabled``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ubnext._environment.cuda import default_driver, drv
from ubnext._protocol.errors import UbnextError

__all__ = ["ENV_BLOCKERS", "OPT_IN", "NvlsDecision", "decide", "env_blockers", "fallback", "verdict"]

#: (variable, value): any of these set in a rank's environment keeps multicast off.
ENV_BLOCKERS = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("UBNEXT_NVLS", "0"),
)

#: why ``auto`` leaves multicast off where nothing forbids it
OPT_IN = ("opt-in: the multicast kernels have not yet run on hardware; validate them with "
          "`python -m ubnext selftest --nvls`, then set UBNEXT_NVLS=1")


@dataclass(frozen=True)
class NvlsDecision:
    """Whether the communicator uses NVLink multicast, and why.

    Attributes:
        enabled: multicast is (to be) set up.
        reason: one line for logs and ``describe()``.
    """

    enabled: bool
    reason: str

    def __str__(self) -> str:
        return f"{'on' if self.enabled else 'off'} ({self.reason})"


def env_blockers(environ: Mapping[str, str]) -> list[str]:
    """The ``VAR=value`` settings in ``environ`` that forbid multicast (pure).

    A variable counts when its value, stripped, equals the blocking value of
    :data:`ENV_BLOCKERS` (e.g. ``NCCL_NVLS_ENABLE=0``); any other value of the
    same variable does not count.
    """
    return [f"{var}={value}" for var, value in ENV_BLOCKERS
            if environ.get(var, "").strip() == value]


def decide(mode: str, environ: Mapping[str, str], local: Any, device: int,
           driver: Any = None) -> NvlsDecision:
    """The NVLS decision for this node; identical on every local rank.

    Each rank checks its own environment first and queries its device's
    multicast support only in mode ``1`` and when nothing blocks; then the ranks
    gather what they found (one ``allgather`` over ``local``, whatever the mode,
    so no rank is left waiting).

    Collective: yes, over ``local`` (the node's ranks). Blocks the host.

    Args:
        mode: ``Config.nvls``: ``"auto"``, ``"0"`` or ``"1"``.
        environ: this rank's environment (``os.environ``).
        local: bootstrap of the node's ranks.
        device: this rank's CUDA device ordinal.
        driver: ``cuda.bindings.driver`` (default) or a fake, for tests.

    Returns:
        The decision; ``enabled`` only in mode ``1``.

    Raises:
        UbnextError: mode ``1`` on a node where multicast is forbidden or
            unsupported (on every rank, naming the variable or the ranks).
    """
    blockers = env_blockers(environ)
    supported = None
    if mode == "1" and not blockers:
        supported = _device_supports_multicast(device, driver)
    reports = local.allgather_obj((blockers, supported))
    return verdict(mode, reports)


def verdict(mode: str, reports: list[tuple[list[str], bool | None]]) -> NvlsDecision:
    """The decision from every local rank's ``(env blockers, device supports multicast)``.

    Pure; ``supported`` is None where the device was not queried.

    Raises:
        UbnextError: mode ``1`` where the decision would be off.
    """
    if mode == "0":
        return NvlsDecision(False, "UBNEXT_NVLS=0")
    blocked = sorted({b for blockers, _ in reports for b in blockers})
    if blocked:
        return fallback(mode, f"{', '.join(blocked)} set in the environment (multicast is switched off "
                              "on this machine)")
    if mode == "auto":
        return NvlsDecision(False, OPT_IN)
    missing = [r for r, (_, supported) in enumerate(reports) if not supported]
    if missing:
        return fallback(mode, f"the device of local rank(s) {', '.join(map(str, missing))} does not report "
                              "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED")
    return NvlsDecision(True, f"all {len(reports)} local devices support multicast and no variable forbids it")


def fallback(mode: str, reason: str) -> NvlsDecision:
    """The decision when multicast cannot be used for ``reason``.

    Returns:
        ``NvlsDecision(False, reason)`` in modes ``auto`` and ``0``.

    Raises:
        UbnextError: in mode ``1``, naming the reason.
    """
    if mode == "1":
        raise UbnextError(f"Communicator: UBNEXT_NVLS=1 requires NVLink multicast, but {reason}; "
                          "use UBNEXT_NVLS=auto (or 0) to run without it")
    return NvlsDecision(False, reason)


def _device_supports_multicast(device: int, driver: Any) -> bool:
    """``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` of ``device``; False when it cannot be read."""
    d = default_driver() if driver is None else driver
    try:
        drv("cuInit", 0, driver=d)
        dev = drv("cuDeviceGet", device, driver=d)
        attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
        return bool(drv("cuDeviceGetAttribute", attr, dev, driver=d))
    except UbnextError:
        return False
