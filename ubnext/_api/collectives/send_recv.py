"""Point-to-point: ``send``, ``recv`` and ``batch_isend_irecv`` (``torch.distributed``'s
meanings). Run on NCCL (``ncclSend``/``ncclRecv``, a batch as one group), or on the pool's
point-to-point kernel (``algorithm="ll"``; ``auto`` where NCCL cannot run: ``p2p``).

Matching rule, per ordered pair of ranks (NCCL's): the k-th send of rank a to rank b
matches the k-th receive of rank b from rank a, counting single calls and the entries
of batches in issue order; the two move the same number of bytes (dtypes may differ:
bytes are moved as they are). Only the two ranks of a pair take part; no other rank
calls anything. Both ranks of a pair use one engine for their messages (the same
``algorithm``): NCCL's messages and the kernel's are counted apart.

On the kernel, a call repeated with the same arrays, peers, algorithm and stream launches
the plan its first call made (``ubnext._api.plans``; key: ``p2p_key``): the kernel keeps
the pairs' counters on the device, so its launch is the same every call."""

from __future__ import annotations

from ubnext._api.collectives.p2p import P2P
from ubnext._interop import arrays as _arrays
from ubnext._protocol.errors import UbnextError

#: what an entry of ``batch_isend_irecv`` may call its kind (a name, or the ``__name__``
#: of torch.distributed's isend/irecv that a ``P2POp`` holds) -> "send" or "recv"
_KINDS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class SendRecv(P2P):
    """The Communicator's point-to-point calls (module docstring)."""

    def send(self, x, peer: int, stream=None, algorithm: str = "auto") -> None:
        """Sends ``x`` to rank ``peer``, which receives it with ``recv``; never blocks the host.

        Matching rule: the module's (the k-th send to a peer matches the peer's k-th
        receive from this rank). Engines: NCCL (``"nccl"``), or the pool's point-to-point
        kernel (``"ll"``: the pair's messages through its own slots, no barrier, in LL
        lines below 64 KiB and in flagged chunks moved by several blocks from there; a send
        completes before its receive is posted while fewer than two of the pair's messages
        are in flight and a bulk one's chunks fit the pair's free chunk slots, else it waits,
        bounded, for the receiver: ``ubnext._api.collectives.p2p``). ``auto`` takes NCCL where it runs and the kernel
        where it cannot (ranks sharing a GPU). The first NCCL call of a communicator sets
        NCCL up, collectively: every rank must have reached its first NCCL call (of any kind).

        Collective: no: this rank and ``peer`` only (after NCCL is set up).
        Graph-capturable: yes, after a first eager call (which sets NCCL up).

        Args:
            x: CUDA array as ``all_reduce`` takes it (any dtype of ``ubnext.DTYPES``).
            peer: the receiving rank, not this one (a send to oneself belongs in a
                ``batch_isend_irecv`` with its receive).
            stream: as for ``all_reduce``.
            algorithm: ``"auto"``, ``"ll"`` or ``"nccl"``; the receiver names the same.

        Raises:
            UbnextError: bad arguments (``peer``, an unknown algorithm, ``"ll"`` without
                a pool), or NCCL cannot run here (ranks sharing a GPU) where it is named,
                raised before anything is launched; an error NCCL reports; a closed
                communicator. BrokenCommunicatorError and its kinds, as ``all_reduce``
                raises them (``"ll"``: a receiver that waited past the timeout raises
                CollectiveTimeoutError, the module ``p2p`` says how the others learn of it).
        """
        with self._order:
            self._check_open("send")
            self._p2p_call("send", [("send", x, peer)], stream, algorithm)

    def recv(self, out, peer: int, stream=None, algorithm: str = "auto"):
        """Receives into ``out`` what rank ``peer`` sends with ``send``; never blocks the host.

        Matching rule and engines: as for ``send``. With ``"ll"``, a send of another size
        (or another call's message) fails the communicator (CollectiveMismatchError) and
        ``out`` is not written.

        Collective: no: this rank and ``peer`` only (after NCCL is set up).
        Graph-capturable: yes, after a first eager call (which sets NCCL up).

        Args:
            out: CUDA array as ``all_reduce`` takes it, of the bytes the peer sends.
            peer: the sending rank, not this one.
            stream: as for ``all_reduce``.
            algorithm: as for ``send``; the sender names the same.

        Returns:
            ``out`` (its framework type for torch/CuPy, CuPy for other inputs).

        Raises:
            UbnextError: as for ``send``.
        """
        with self._order:
            self._check_open("recv")
            return self._p2p_call("recv", [("recv", out, peer)], stream, algorithm)

    def batch_isend_irecv(self, ops, stream=None, algorithm: str = "auto") -> None:
        """Issues several sends and receives as one group; never blocks the host.

        The group's entries run together (NCCL's ``ncclGroupStart`` ... ``ncclGroupEnd``;
        the kernel: a block per peer and direction, all at once): their order within the
        batch does not matter to progress, so a ring exchange or an all-to-all written as
        one batch cannot deadlock. Matching rule: the module's, with the batch's entries
        counted in their order. A rank may send to and receive from itself within one
        batch. Engines: as for ``send`` (the kernel takes at most ``P2P_MAX_ENTRIES``, 32,
        entries).

        Collective: no: the ranks the entries name (after NCCL is set up).
        Graph-capturable: yes, after a first eager call (which sets NCCL up).

        Args:
            ops: a non-empty list of ``("send", x, peer)`` / ``("recv", out, peer)``
                tuples, or objects with ``op``, ``tensor`` and ``peer`` attributes
                (``torch.distributed.P2POp``: its ``op`` is ``dist.isend`` or
                ``dist.irecv``), CUDA arrays as ``all_reduce`` takes them.
            stream: as for ``all_reduce`` (of the first entry's array); every entry runs on it.
            algorithm: as for ``send``; the peers name the same.

        Raises:
            UbnextError: a malformed entry, a peer that is not a rank, a receive buffer
                that overlaps another entry's array, an unknown algorithm, more entries than
                the kernel takes where it runs, or NCCL cannot run here where it is named, raised before
                anything is launched; an error NCCL reports; a closed communicator.
                BrokenCommunicatorError and its kinds, as ``all_reduce`` raises them.
        """
        with self._order:
            name = "batch_isend_irecv"
            self._check_open(name)
            self._p2p_call(name, _entries(name, ops), stream, algorithm)

    def _p2p_call(self, name: str, entries: list, stream, algorithm: str):
        """A call of ``entries`` (``(kind, array, peer)``; ``send`` and ``recv``: one, whose
        peer is not this rank) in the section, the communicator checked open: its plan
        (``ubnext._api.plans``) where an earlier call with the same key made one, else the
        full path (the arrays and peers checked, the kernel's launch kept as the plan, or an
        NCCL group); returns the first array."""
        handle, owner, side = self._launch_stream(name, stream, entries[0][1])
        arrays = tuple(arr for _, arr, _ in entries)
        key = None if self._node is None else p2p_key(name, entries, algorithm, handle, side)
        planned, key = self._planned(key, handle, owner, side, arrays)
        if planned:
            return arrays[0]
        single = name != "batch_isend_irecv"
        items = [(kind, self._input(name, arr, handle),
                  self._peer(name, peer) if single else self._rank_arg(name, peer, f"ops[{i}] peer"))
                 for i, (kind, arr, peer) in enumerate(entries)]
        for i, (kind, b, _) in enumerate(items):
            if kind == "recv" and any(j != i and _arrays.overlap(b, c) for j, (_, c, _) in enumerate(items)):
                raise UbnextError(f"{name}: ops[{i}]'s receive buffer overlaps another entry's array; the "
                                  f"entries run together, so a receive needs memory of its own")
        buffers = tuple(b for _, b, _ in items)
        written = tuple(i for i, (kind, _, _) in enumerate(items) if kind == "recv")
        launch = self._issue(name, items, handle, owner, side, self._p2p_algorithm(name, algorithm, len(items)))
        self._keep(key, launch, buffers, written)
        _arrays.mark_written([buffers[i] for i in written])
        return buffers[0].obj

    def _peer(self, name: str, peer) -> int:
        peer = self._rank_arg(name, peer, "peer")
        if peer == self.rank:
            raise UbnextError(f"{name}: peer {peer} is this rank; a lone {name} to itself has no match (put the send "
                              f"and the receive in one batch_isend_irecv)")
        return peer

    def _issue(self, name: str, items: list, handle: int, owner, side: bool, algo: str) -> tuple | None:
        """``items`` (``(kind, Buffer, peer)``) as one NCCL group or one launch of the pool's
        kernel (``algo``) on ``handle``; returns the kernel's launch (None: NCCL's)."""
        self._record(handle, owner, side, [b for _, b, _ in items])
        if algo == "ll":
            return self._run_p2p("send_recv", [(kind, b.ptr, b.nbytes, peer) for kind, b, peer in items], handle,
                                 owner)
        sends = [(b.ptr, b.nbytes, peer) for kind, b, peer in items if kind == "send" and b.nbytes]
        recvs = [(b.ptr, b.nbytes, peer) for kind, b, peer in items if kind == "recv" and b.nbytes]
        if sends or recvs:
            self._dispatch.nccl_for(handle, owner).exchange(sends, recvs, handle, name)
        return None


def p2p_key(name: str, entries: list, algorithm: str, stream: int, side: bool) -> tuple | None:
    """The plan key (``ubnext._api.plans``) of a call ``name`` of ``entries`` (``(kind,
    array, peer)``) on the launch stream ``stream`` (``side``: another than the current
    one), or None where it is never planned: an array that ``_arrays.identity`` does not
    name, a peer that is not a plain int. Everything else the full path reads is fixed for
    the communicator's life (its size and rank, the pool, whether NCCL can run)."""
    parts = []
    for kind, arr, peer in entries:
        ident = _arrays.identity(arr)
        if ident is None or type(peer) is not int:
            return None
        parts.append((kind, ident, peer))
    return name, tuple(parts), algorithm, stream, side


def _entries(name: str, ops) -> list:
    """``ops`` as ``(kind, array, peer)`` triples, ``kind`` "send" or "recv"; raises on a
    malformed entry."""
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        raise UbnextError(f"{name}: ops must be a list of ('send' | 'recv', array, peer) entries, got {ops!r}")
    entries = []
    for i, op in enumerate(ops):
        if isinstance(op, tuple) and len(op) == 3:
            kind, arr, peer = op
        else:
            kind, arr, peer = (getattr(op, a, None) for a in ("op", "tensor", "peer"))
        kind = _KINDS.get(kind if isinstance(kind, str) else getattr(kind, "__name__", None))
        if kind is None or arr is None:
            raise UbnextError(f"{name}: ops[{i}] is not a ('send' | 'recv', array, peer) tuple nor a P2POp with "
                              f"op isend or irecv: {op!r}")
        entries.append((kind, arr, peer))
    if not entries:
        raise UbnextError(f"{name}: ops is empty; pass at least one send or receive")
    return entries
