"""Communicator handles (ubnext._api.handles), without torch: every Communicator has its
int handle from construction, the registry holds communicators weakly, and a handle
carries its communicator's size."""

from __future__ import annotations

import gc

import pytest
from thread_ranks import run_ranks

from ubnext import Communicator, UbnextError
from ubnext._api import handles


class _Stop(Exception):
    pass


class Stand:
    """An object with a size, as a communicator has (``assign`` reads it)."""

    def __init__(self, size):
        self.size = size


def test_a_communicator_has_its_handle_from_construction(monkeypatch):
    """``Communicator.__init__`` assigns the handle before any step that needs a GPU (the
    ranks' agreement, stopped here by a fake): each rank its own, which names it and
    carries the size."""
    from ubnext._api import communicator as _comm

    def stop(config, bootstrap):
        raise _Stop("at the agreement")

    monkeypatch.setattr(_comm._preflight, "check", lambda op, config: None)
    monkeypatch.setattr(_comm._agreement, "check", stop)

    def rank(boot):
        comm = Communicator.__new__(Communicator)
        with pytest.raises(_Stop):
            comm.__init__(bootstrap=boot)
        return comm

    comms = run_ranks(3, rank)
    hs = [c._handle for c in comms]
    assert all(type(h) is int for h in hs) and len(set(hs)) == 3, hs
    assert [handles.lookup(h) for h in hs] == comms
    assert [handles.size_of(h) for h in hs] == [3, 3, 3]
    assert [handles.assign(c) for c in comms] == hs  # once per communicator


def test_the_registry_forgets_collected_communicators():
    """The registry holds communicators weakly and drops a handle once its communicator is
    collected; a live one keeps its handle and a dead handle raises as an unknown one."""
    comms = [Stand(s) for s in (1, 2, 3, 4)]
    hs = [handles.assign(c) for c in comms]
    assert all(h in handles._by_handle and handles.lookup(h) is c for h, c in zip(hs, comms))
    keep = comms[1]
    del comms
    gc.collect()
    assert [h in handles._by_handle for h in hs] == [False, True, False, False]
    assert handles.assign(keep) == keep._handle == hs[1] and handles.size_of(hs[1]) == 2
    assert handles.lookup(hs[1]) is keep
    with pytest.raises(UbnextError, match=f"no open communicator has handle {hs[0]}"):
        handles.lookup(hs[0])
    del keep
    gc.collect()
    assert hs[1] not in handles._by_handle


def test_a_size_no_handle_carries_gets_none():
    """65536 ranks or more: no handle (None), nothing registered; the torch ops refuse it."""
    big = Stand(1 << handles.SIZE_BITS)
    assert handles.assign(big) is None and big._handle is None
    assert all(ref() is not big for ref in list(handles._by_handle.values()))
    assert handles.size_of(handles.assign(Stand((1 << handles.SIZE_BITS) - 1))) == 65535
