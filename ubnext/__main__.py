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
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from ubnext._protocol.errors import UbnextError
from ubnext._tools.cli import run_or_abort
from ubnext._tools.info import gpu_count, report


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
        from ubnext._tools.selftest import main as selftest

        return selftest(nvls=args.nvls)
    return info(with_comm=args.comm)


def _mpi_world() -> tuple[int, int, str]:
    """``(rank, size, description)`` of ``MPI.COMM_WORLD``; ``(0, 1, why not)`` without MPI."""
    try:
        from mpi4py import MPI
    except Exception as exc:  # mpi4py or the MPI library missing
        return 0, 1, f"unavailable ({type(exc).__name__}: {exc})"
    world = MPI.COMM_WORLD
    library = MPI.Get_library_version().strip().splitlines()[0]
    return world.Get_rank(), world.Get_size(), f"{world.Get_size()} rank(s); {library}"


def info(with_comm: bool, out: Callable[[str], None] = print, environ: Mapping[str, str] | None = None) -> int:
    """Print the report on rank 0; with ``with_comm`` or more than one MPI rank, also ``comm.describe()``.

    Collective over ``MPI.COMM_WORLD`` when a communicator is created. Returns the exit status.
    """
    environ = os.environ if environ is None else environ
    rank, size, mpi = _mpi_world()
    say = out if rank == 0 else (lambda line: None)
    for line in report(environ, mpi):
        say(line)
    if not (with_comm or size > 1):
        return 0
    say("# communicator")
    if gpu_count()[0] == 0:
        say("  no CUDA device: no communicator to describe")
        return 0 if not with_comm else 1
    from ubnext._api.communicator import Communicator

    try:
        comm = Communicator()
    except UbnextError as exc:
        say(f"  Communicator() failed: {exc}")
        return 1
    try:
        for line in str(comm.describe()).splitlines():
            say(f"  {line}")
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_or_abort(main))
