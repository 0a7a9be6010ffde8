"""Belt and braces for the GPU machines: no test process ever reaches a real cuMulticast* call.

The lent GPU machines have NVLink multicast switched off, and creating a multicast
object there can take the host's GPUs out of service. ubnext's gate keeps multicast
off when the environment says so; in addition, ``conftest.py`` calls :func:`install`
when pytest starts, which replaces every ``cuda.bindings.driver.cuMulticast*``
function by one that records the attempt in :data:`attempts` and returns
``CUDA_ERROR_NOT_PERMITTED`` (so a bug turns into an agreed setup failure and a
failing test, never into a multicast object or a hang). Fake drivers are not affected.

Set ``ALLOW_NVLS_IN_TESTS=1`` on a machine where multicast may be exercised.
"""

from __future__ import annotations

import os

#: names of the cuMulticast* functions something tried to call, in order
attempts: list[str] = []


def install() -> None:
    """Replace the real driver's cuMulticast* functions (idempotent; a no-op when allowed)."""
    if os.environ.get("ALLOW_NVLS_IN_TESTS") == "1":
        return
    try:
        from cuda.bindings import driver
    except ImportError:
        return
    refused = driver.CUresult.CUDA_ERROR_NOT_PERMITTED
    for name in dir(driver):
        if name.startswith("cuMulticast") and not getattr(getattr(driver, name), "_nvls_guard", False):
            setattr(driver, name, _refuse(name, refused))


def _refuse(name: str, error):
    def refuse(*args):
        attempts.append(name)
        return (error,)

    refuse._nvls_guard = True
    return refuse
