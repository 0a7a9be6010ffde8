"""Run under ``mpiexec -n N``: MPIBootstrap collectives and FdChannel exchange.

Checks allgather/bcast/barrier/split_local of :class:`MPIBootstrap`, the
generic node-id ``split_local``, then passes memfd and temp-file descriptors
between the ranks of this node with :class:`FdChannel` and reads every
peer's bytes through them. Rank 0 prints ``bootstrap_check OK size=N`` last.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

from mpi4py import MPI

from ubnext._memory.descriptors import FdChannel
from ubnext._protocol.errors import ClosedError
from ubnext.bootstrap import Bootstrap, MPIBootstrap


def content(local_rank: int) -> bytes:
    """The bytes local rank ``local_rank`` shares (length differs per rank)."""
    return f"descriptor of local rank {local_rank};".encode() * (local_rank + 1)


def check_bootstrap(boot: MPIBootstrap) -> None:
    world = MPI.COMM_WORLD
    assert (boot.rank, boot.size) == (world.Get_rank(), world.Get_size())
    assert boot.comm != world, "MPIBootstrap must work on a duplicate"

    mine = f"rank {boot.rank}".encode() * (boot.rank + 1)
    assert boot.allgather(mine) == [f"rank {r}".encode() * (r + 1) for r in range(boot.size)]

    root = boot.size - 1
    got = boot.bcast(b"from the last rank" if boot.rank == root else None, root=root)
    assert got == b"from the last rank"
    assert Bootstrap.bcast(boot, b"generic" if boot.rank == 0 else None) == b"generic"
    assert boot.allgather_obj({"rank": boot.rank}) == [{"rank": r} for r in range(boot.size)]
    assert boot.bcast_obj(("x", boot.rank), root=0) == ("x", 0)
    boot.barrier()


def check_split(boot: MPIBootstrap) -> tuple[Bootstrap, Bootstrap]:
    local = boot.split_local()
    generic = Bootstrap.split_local(boot)  # node-id based default
    assert (local.rank, local.size) == (generic.rank, generic.size), (
        f"rank {boot.rank}: MPI split {local.rank}/{local.size} != "
        f"node-id split {generic.rank}/{generic.size}"
    )
    world_ranks = [int(b) for b in local.allgather(str(boot.rank).encode())]
    assert world_ranks == generic.parent_ranks
    assert world_ranks == sorted(world_ranks) and world_ranks[local.rank] == boot.rank
    generic.barrier()
    return local, generic


def check_fd_channel(local: Bootstrap) -> None:
    with FdChannel(local, timeout_s=30.0) as channel:
        directory = channel.directory
        assert os.stat(directory).st_mode & 0o777 == 0o700

        own = os.memfd_create(f"ubnext-check-{local.rank}")
        os.write(own, content(local.rank))
        fds = channel.allgather_fds(own)
        try:
            assert len(fds) == local.size and own not in fds
            for r, fd in enumerate(fds):
                assert os.pread(fd, 4096, 0) == content(r), f"wrong bytes from local rank {r}"
        finally:
            for fd in fds:
                os.close(fd)
            os.close(own)

        root = 2 if local.size > 2 else 0
        with tempfile.TemporaryFile() as f:
            if local.rank == root:
                f.write(b"broadcast " + content(root))
                f.flush()
            fd = channel.bcast_fd(f.fileno() if local.rank == root else None, root=root)
        try:
            assert os.pread(fd, 4096, 0) == b"broadcast " + content(root)
        finally:
            os.close(fd)
    local.barrier()
    assert not os.path.exists(directory), "close() must remove the socket directory"
    try:
        channel.allgather_fds(0)
    except ClosedError:
        pass
    else:
        raise AssertionError("allgather_fds after close() must raise ClosedError")


def main() -> None:
    with MPIBootstrap() as boot:
        check_bootstrap(boot)
        local, generic = check_split(boot)
        check_fd_channel(local)
        generic.close()
        size = boot.size
    assert boot.closed and local.closed, "closing the parent closes split_local children"
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"bootstrap_check OK size={size}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # a failed rank must not leave the others hanging
