"""ubnext: fast intra-node collectives on NVLink GPUs, for CuPy and PyTorch users.

    import ubnext
    with ubnext.Communicator() as comm:          # collective over every rank the launcher started
        y = comm.all_reduce(x)                    # x: torch.Tensor or cupy.ndarray

See the README for configuration (``UBNEXT_*``) and the algorithms.
"""

from ubnext._environment import install as _install

_install.check_install()  # one line naming the install choices, before anything needs CuPy or cuda-bindings

from ubnext import bootstrap  # noqa: E402
from ubnext._api.communicator import Communicator  # noqa: E402
from ubnext._environment.config import Config  # noqa: E402
from ubnext._moe.expert_parallel import ExpertParallel  # noqa: E402
from ubnext._moe.packed import PackedExpertParallel  # noqa: E402
from ubnext._protocol.algorithms import ALGORITHMS, DTYPES, OPS  # noqa: E402
from ubnext._protocol.errors import (  # noqa: E402
                      BrokenCommunicatorError,
                      ClosedError,
                      CollectiveMismatchError,
                      CollectiveTimeoutError,
                      ConcurrentUseError,
                      CudaError,
                      RoutingError,
                      SplitError,
                      UbnextError,
)
from ubnext._version import __version__ as __version__  # noqa: E402 (re-exported)

__all__ = [
    "ALGORITHMS",
    "DTYPES",
    "OPS",
    "BrokenCommunicatorError",
    "ClosedError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConcurrentUseError",
    "Communicator",
    "Config",
    "CudaError",
    "ExpertParallel",
    "PackedExpertParallel",
    "RoutingError",
    "SplitError",
    "UbnextError",
    "bootstrap",
]
