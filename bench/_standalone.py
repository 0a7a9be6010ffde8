"""Lets ``python bench/<script>.py`` import its sibling modules as the ``bench`` package.

A script's own folder is the first entry of ``sys.path``. Adding the folder above
it there as well would also put the checkout's ``ubnext`` ahead of the installed
one, so the ``bench`` package is registered from this folder alone instead: the
benchmarks measure the ubnext installed in the environment (``PYTHONPATH=.``
still selects the checkout, on purpose). Each script imports this module first
when it runs as a script; imported as ``bench.<module>``, nothing is needed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if "bench" not in sys.modules:
    _here = Path(__file__).resolve().parent
    _spec = importlib.util.spec_from_file_location("bench", _here / "__init__.py",
                                                   submodule_search_locations=[str(_here)])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["bench"] = _package
    _spec.loader.exec_module(_package)
