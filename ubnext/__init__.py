"""ubnext: fast intra-node all-reduce on NVLink GPUs, for CuPy and PyTorch users.

    import ubnext
    with ubnext.Communicator() as comm:          # collective over every rank the launcher started
        y = comm.all_reduce(x)                    # x: torch.Tensor or cupy.ndarray

See the README for configuration (``UBNEXT_*``) and the algorithms.
"""

from . import bootstrap
from ._algorithms import ALGORITHMS, DTYPES, OPS
from ._comm import Communicator
from ._config import Config
from ._errors import (BrokenCommunicatorError, ClosedError, CollectiveMismatchError, CollectiveTimeoutError,
                      ConcurrentUseError, CudaError, UbnextError)

__version__ = "0.1.0"

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
    "UbnextError",
    "bootstrap",
]
