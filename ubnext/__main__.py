"""``python -m ubnext <command>``.

    python -m ubnext info                 # versions, GPUs, P2P, configuration, selector tables
    python -m ubnext info --comm          # ... and comm.describe() of a 1-rank communicator
    mpirun -n 4 python -m ubnext info     # ... and comm.describe() of rank 0 (collective)
    python -m ubnext selftest             # every algorithm x dtype checked bit for bit (any launcher)
    python -m ubnext selftest --nvls      # ... with NVLink multicast opted in, where allowed

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
    selftest = commands.add_parser(
        "selftest", help="check every usable algorithm x dtype bit for bit against a host reference and time it; "
                         "exit status 0 all passed, 1 a check failed on some rank, 2 could not start")
    selftest.add_argument("--nvls", action="store_true",
                          help="opt in to NVLink multicast (UBNEXT_NVLS=1) and check its kernels too; refused "
                               "where a variable forbids multicast (NCCL_NVLS_ENABLE=0, ...)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    args = build_parser().parse_args(argv)
    if args.command == "selftest":
        from ._selftest import main as selftest

        return selftest(nvls=args.nvls)
    from ._info import info

    return info(with_comm=args.comm)


if __name__ == "__main__":
    sys.exit(run_or_abort(main))
