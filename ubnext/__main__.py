"""``python -m ubnext <command>``.

    python -m ubnext info                 # versions, GPUs, P2P, configuration, selector tables
    python -m ubnext info --comm          # ... and comm.describe() of a 1-rank communicator
    mpirun -n 4 python -m ubnext info     # ... and comm.describe() of rank 0 (collective)

Tuning has its own module: ``mpirun -n 4 python -m ubnext.tune``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._cli import run_or_abort


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ubnext", description="ubnext command-line tools")
    commands = p.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions, GPUs, configuration, selector tables, comm.describe()")
    info.add_argument("--comm", action="store_true",
                      help="create a Communicator and print comm.describe() (always under mpirun with > 1 rank)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    args = build_parser().parse_args(argv)
    from ._info import info

    return info(with_comm=args.comm)


if __name__ == "__main__":
    sys.exit(run_or_abort(main))
