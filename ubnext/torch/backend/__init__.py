"""The ``ubnext`` torch.distributed backend: ``import ubnext.torch`` registers it, and

    dist.init_process_group(backend="ubnext")      # torchrun, mpirun or srun, as with "nccl"

runs every c10d op of the group (and of ``new_group`` / ``init_device_mesh`` subgroups,
each its own ubnext communicator over the group's store) on ubnext: DDP, FSDP2, DTensor
and functional collectives, eager and compiled, with no other change. CPU tensors go to
a Gloo backend of the same ranks. See docs/pytorch.md ("The ubnext backend").

Modules: ``_group`` (the ProcessGroup subclass and its routing), ``_collectives`` (the
c10d ops on a Communicator), ``_cpu`` (the Gloo route), ``_work`` (work objects).
"""

from __future__ import annotations

import torch.distributed as dist

from ._group import NAME_OVERRIDABLE, Options, ProcessGroupUbnext

# ProcessGroupUbnext is torch's to create and call (init_process_group, new_group): not listed
__all__ = ["Options", "register", "ubnext_communicator"]


def ubnext_communicator(store, rank: int, size: int, options: Options):
    """The default communicator maker of a group: at the group's first CUDA op, a
    ``ubnext.Communicator`` over a ``StoreBootstrap`` of the group's store, on the op's
    device, with the group's pool size; closing it closes the bootstrap too.

    Collective: no (``make`` is: every rank of the group, at the group's first CUDA op).
    Graph-capturable: no (``make`` sets a communicator up).

    Args:
        store: the group's c10d store.
        rank, size: this rank in the group, and the group's size.
        options: the group's ``Options``.

    Returns:
        ``make(device_index) -> (communicator, on_close)``; ``on_close("close" | "abort")``
        releases the bootstrap after the communicator.

    Raises:
        Nothing itself; ``make`` raises what ``Communicator`` raises (its bootstrap aborted).
    """

    def make(device_index):
        from ubnext._api.communicator import Communicator
        from ubnext.bootstrap import StoreBootstrap

        boot = StoreBootstrap(store, rank, size, prefix="ubnext")
        overrides = {} if options.pool_mb is None else {"pool_mb": options.pool_mb}
        try:
            comm = Communicator(bootstrap=boot, device=device_index, **overrides)
        except BaseException:
            boot.abort()
            raise

        def on_close(how: str) -> None:
            boot.close() if how == "close" else boot.abort()

        return comm, on_close

    return make


def register(name: str = "ubnext", make_communicator=None, device_type: str = "cuda") -> None:
    """Registers a torch.distributed backend ``name`` whose groups are ``ProcessGroupUbnext``s
    (``import ubnext.torch`` registers ``"ubnext"``; registering again replaces it).

    Collective: no.
    Graph-capturable: no.

    Args:
        name: the backend string of ``init_process_group(backend=...)``.
        make_communicator: as ``ubnext_communicator`` (the default; tests pass fakes).
        device_type: the tensors' device type the communicator serves (tests: ``"cpu"``).

    Raises:
        Nothing itself; a group it makes raises TypeError for ``pg_options`` other than ``Options``.
    """

    make_communicator = make_communicator or ubnext_communicator

    def create(backend_opts, options):
        if options is None:
            options = Options()
        elif not isinstance(options, Options):
            raise TypeError(f"{name}: pg_options must be ubnext.torch.backend.Options, not {type(options).__name__}")
        return ProcessGroupUbnext(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                                  backend_opts.timeout, backend_opts.group_id, options, make_communicator,
                                  device_type, name)

    dist.Backend.register_backend(name, create, extended_api=True, devices=["cuda", "cpu"])
