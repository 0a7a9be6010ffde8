"""``ProcessGroupUbnext``: a ``torch.distributed.ProcessGroup`` whose ops run on ubnext.

Groups come from ``init_process_group``, ``new_group``, ``split_group`` (``split_group``
below) and ``init_device_mesh``; each has a communicator of its own.

torch's C++ ``Backend`` cannot be subclassed from Python; a ``ProcessGroup`` can, and
then replaces the whole group: torch calls its methods from Python (``dist.*``) and,
through its trampoline, from C++ (functional collectives, DDP's reducer). So the group
overrides every c10d op under the names of both supported torch versions (2.11:
``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``,
``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``; 2.13:
``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single`` and
``*_single_coalesced``), and routes each by its tensors' device: the group's device type
(CUDA) to the ubnext communicator (``_collectives.CommOps``), CPU tensors to a Gloo
backend of the same ranks (``_cpu.GlooOps``), anything else raises. No inner backend
serves what the group does not override: the group's name, which torch keeps on a
group's C++ backends, is kept by the group itself where torch lets Python override
``getGroupName`` (2.13); where it does not, the CPU route's Gloo backend is registered
as the group's CPU backend to hold it (CPU ops go there anyway), and CUDA ops reach no
C++ backend (torch raises for a C++-only op rather than run it elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ubnext._protocol.errors import UbnextError

from ._collectives import CommOps
from ._cpu import GlooOps
from ._work import Work

__all__ = ["Options", "ProcessGroupUbnext", "NAME_OVERRIDABLE"]


@dataclass(frozen=True)
class Options:
    """Options of one ubnext group (``init_process_group(..., pg_options=)``, ``new_group(
    ..., pg_options=)``; groups made without them get these defaults).

    Args:
        pool_mb: the group communicator's pool size in MiB (``Config.pool_mb``); None: the
            ``UBNEXT_POOL_MB`` default. Allocated at the group's first op on CUDA tensors.
        precision: ``precision=`` of the group's all-reduces and reduce-scatters:
            ``"exact"`` (default: never lossy), or a quantized format the communicator
            offers (``"int8"``, ``"fp8"``, ``"int4"``; an opted-in communicator, see
            docs/quantized.md).

    Collective: no.
    Graph-capturable: no (host only; read when a group is made).

    Raises:
        Nothing (the communicator checks the values at the group's first op).
    """

    pool_mb: int | None = None
    precision: str = "exact"


def _probe_name_override() -> bool:
    """Whether this torch calls a Python subclass's ``getGroupName`` (2.13 does)."""

    class Probe(dist.ProcessGroup):
        def setGroupName(self, name):
            self._probe = name

        def getGroupName(self):
            return "ubnext-probe"

    try:
        p = Probe(0, 1)
        p._set_group_name("x")
        return p.group_name == "ubnext-probe"
    except RuntimeError:  # "ProcessGroup name not set": the base class answered
        return False


NAME_OVERRIDABLE = _probe_name_override()


class _BackendView:
    """What ``pg._get_backend(device)`` answers for a ubnext group, which has no C++
    backend: torch asks a group's backend what it supports. Splitting, yes
    (``ProcessGroupUbnext.split_group``; ``init_process_group(device_id=...)`` binds the
    group's device through ``eager_connect_single_device``, the communicator still comes at
    the first op); coalescing, tensor allocation and time estimates, no."""

    supports_splitting = True
    supports_coalescing = supports_time_estimate = supports_shrinking = False

    def __init__(self, pg):
        self._pg = pg

    @property
    def options(self):
        return self._pg._options

    def name(self) -> str:
        return self._pg.getBackendName()

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def eager_connect_single_device(self, device) -> None:
        self._pg.bound_device_id = device

    def perform_nocolor_split(self, device) -> None:
        """A rank outside a new group has nothing to do (no communicator is split)."""

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers are NCCL's and Gloo's (their flight recorder)."""


class _Routes(dict):
    """device type -> the op set serving it; a device without one raises."""

    def __missing__(self, device_type):
        raise UbnextError(f"ProcessGroupUbnext: tensors on {device_type} are not served (this group serves "
                          f"{', '.join(sorted(self))})")


def _op(name: str, where):
    """A group method that hands its arguments to the op set of its tensors' device."""

    def method(self, *args, **kwargs):
        t = where(args)
        try:
            return getattr(self._routes["cuda" if t.is_cuda else t.device.type], name)(*args, **kwargs)
        except Exception as exc:
            exc.add_note(self._where(name))
            raise

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"c10d ``{name}``, routed by its tensors' device (see the module docstring)."
    return method


def _first(i):  # the first tensor of argument i (a list)
    return lambda args: args[i][0]


def _arg(i):  # argument i (a tensor)
    return lambda args: args[i]


# c10d op -> where its tensor is: (argument, list or not); then the other version's names
_OPS = {
    "allreduce": _first(0), "allreduce_coalesced": _first(0), "reduce": _first(0), "broadcast": _first(0),
    "allgather": _first(1), "allgather_coalesced": _first(1), "all_gather_single": _arg(1),
    "all_gather_single_coalesced": _first(1), "reduce_scatter": _first(0), "reduce_scatter_single": _arg(1),
    "reduce_scatter_single_coalesced": _first(1), "all_to_all_single": _arg(1), "alltoall": _first(1),
    "gather": _first(1), "scatter": _first(0), "send": _first(0), "recv": _first(0),
}
_ALIASES = {  # torch 2.11's names (and 2.13's deprecated ones) -> the 2.13 names above
    "_allgather_base": "all_gather_single", "_reduce_scatter_base": "reduce_scatter_single",
    "alltoall_base": "all_to_all_single", "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
}


class ProcessGroupUbnext(dist.ProcessGroup):
    """A process group whose CUDA ops run on one ubnext communicator (see the module
    docstring); made by ``init_process_group(backend="ubnext")``, ``new_group`` and
    ``init_device_mesh``, not by hand.

    Collective: construction is not (the communicator comes at the first op).

    Args:
        store: the group's c10d store (torch's prefix store of the group).
        rank, size: this rank in the group, and its size.
        timeout: the group's timeout (``timedelta``).
        group_name: torch's name of the group (its unique id).
        options: ``Options``.
        make_communicator: ``make_communicator(store, rank, size, options)`` returns
            ``make(device_index) -> (communicator, on_close)``.
        device_type: the device type the communicator serves ("cuda").
        backend_name: the name the backend was registered under.
    """

    def __init__(self, store, rank: int, size: int, timeout, group_name: str, options: Options,
                 make_communicator, device_type: str = "cuda", backend_name: str = "ubnext"):
        try:
            super().__init__(store, rank, size)  # torch 2.13: the store is the group's (get_group_store)
        except TypeError:
            super().__init__(rank, size)
        self._group_name, self._group_desc = group_name, "undefined"
        self._store, self._timeout, self._options = store, timeout, options
        self._make_communicator, self._device_type, self._backend_name = make_communicator, device_type, backend_name
        self._comm_ops = CommOps(make_communicator(store, rank, size, options), rank, options.precision, self._where)
        self._cpu = GlooOps(store, rank, size, timeout) if device_type != "cpu" else None
        self._routes = _Routes({device_type: self._comm_ops})
        if self._cpu is not None:
            self._routes["cpu"] = self._cpu
            if not NAME_OVERRIDABLE:  # the Gloo backend holds the name (module docstring)
                self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._cpu.open())

    # -- identity --
    def getBackendName(self) -> str:
        return self._backend_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def _get_backend(self, device):
        """What torch asks of a group's backend (``_BackendView``): it has no C++ one."""
        return _BackendView(self)

    @property
    def communicator(self):
        """The group's ubnext communicator, or None before its first CUDA op."""
        return self._comm_ops._comm

    def _where(self, op: str) -> str:
        return f"ProcessGroupUbnext.{op}: rank {self.rank()} of {self.size()}, group {self._group_name!r}"

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """torch's ``split_group`` (and ``init_device_mesh`` on a group bound to a device):
        a new group of the ``ranks`` of this one (sorted, this group's ranks) holding this
        rank, its communicator created at its first op; None where this rank is not in
        ``ranks``. Not collective here (no communicator is split); not graph-capturable.

        Args:
            ranks: the new group's ranks in this group.
            timeout: its timeout (default: this group's).
            opts: its ``Options`` (default: this group's).
            group_name, group_desc: torch's name and description of it.
            device_types: the device types to keep; the communicator's and the CPU's are kept.

        Returns:
            The new ``ProcessGroupUbnext``, or None.

        Raises:
            TypeError: ``opts`` is not an ``Options``.
        """
        if self.rank() not in ranks:
            return None
        if opts is not None and not isinstance(opts, Options):
            raise TypeError(f"ProcessGroupUbnext.split_group: opts must be Options, not {type(opts).__name__}")
        child = ProcessGroupUbnext(dist.PrefixStore(f"{group_name}/", self._store), list(ranks).index(self.rank()),
                                   len(ranks), timeout or self._timeout, group_name, opts or self._options,
                                   self._make_communicator, self._device_type, self._backend_name)
        child._set_group_desc(group_desc or f"{self._group_desc}:split")
        return child

    # -- ops without tensors, or not served --
    def barrier(self, opts=None):
        """c10d ``barrier``: stream-ordered on the communicator; its work's ``wait()``
        synchronizes the host, as NCCL's."""
        if self._device_type == "cuda" and not torch.cuda.is_available():
            return self._routes["cpu"].barrier(opts)
        device = (torch.device("cuda", torch.cuda.current_device()) if self._device_type == "cuda"
                  else torch.device(self._device_type))
        try:
            return self._comm_ops.barrier(opts, device)
        except Exception as exc:
            exc.add_note(self._where("barrier"))
            raise

    def recv_anysource(self, tensors, tag):
        raise UbnextError("ProcessGroupUbnext.recv_anysource: receiving from any source is not served "
                          "(as with the NCCL backend); name the source rank")

    def monitored_barrier(self, *args):
        raise UbnextError("ProcessGroupUbnext.monitored_barrier: not served (a Gloo feature); use barrier()")

    # -- coalescing (torch's _coalescing_manager): pending point-to-point ops are issued at its end --
    def _start_coalescing(self, device):
        return None

    def _end_coalescing(self, device):
        if self._comm_ops._p2p:
            works = [w for *_, w in self._comm_ops._p2p]
            self._comm_ops._flush()
            return works[-1]
        return Work([])

    start_coalescing, end_coalescing = _start_coalescing, _end_coalescing

    # -- lifetime --
    def shutdown(self) -> None:
        """Closes the group's communicator and Gloo backend (``destroy_process_group``).
        Collective, as ``Communicator.close``."""
        try:
            self._comm_ops.close()
        finally:
            if self._cpu is not None:
                self._cpu.close()

    def abort(self) -> None:
        """Gives the group's communicator up at once (local, bounded)."""
        try:
            self._comm_ops.abort()
        finally:
            if self._cpu is not None:
                self._cpu.abort()


for _name, _where in _OPS.items():
    setattr(ProcessGroupUbnext, _name, _op(_name, _where))
for _old, _new in _ALIASES.items():
    setattr(ProcessGroupUbnext, _old, getattr(ProcessGroupUbnext, _new))
