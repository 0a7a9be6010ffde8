"""Call plans of the point-to-point kernel's calls (no GPU): a repeated ``batch_isend_irecv``
(and ``send``, ``recv``) with the same arrays, peers, algorithm and stream launches the
plan its first call made (``ub_p2p``'s argument pack written once: the pairs' counters
live on the device, so the launch is the same every call), without checking the arrays
again; anything that could change what the call launches misses it.

On test_plans.py's fakes: a real Engine over a fake pool, kernels never compiled, a
recording driver that reads every launch's argument pack; one rank (a batch sends to and
receives from itself).
"""

from __future__ import annotations

import pytest
from test_plans import X, Y, Z, array, fakes, make_comm  # noqa: F401 - fixtures

from ubnext import CollectiveTimeoutError
from ubnext._api.collectives.send_recv import p2p_key
from ubnext._protocol.signature import encode


def ring(x, y, algorithm="ll"):
    return lambda comm: comm.batch_isend_irecv([("send", x, 0), ("recv", y, 0)], algorithm=algorithm)


def test_a_repeated_batch_launches_its_first_calls_pack_without_checking_again(make_comm, fakes):
    comm = make_comm()
    x, y = array(X, (100,)), array(Y, (100,))
    for _ in range(3):
        assert ring(x, y)(comm) is None
    assert fakes.as_buffer.calls == 2  # the first call's
    first, *later = fakes.driver.launches
    assert len(later) == 2 and all(launch == first for launch in later)
    assert comm.kernels[first[0]][1] == "ub_p2p" and first[1] == 2  # a block per group
    n, head, *words = first[4][-2 - 64:]
    assert (n, head) == (2, encode("send_recv", "uint8", "sum", 0))
    assert words[:4] == [X, 400 | 1 << 56, Y, 400]
    assert len(comm._plans) == 1


def test_the_plan_launches_what_the_full_path_packs(make_comm, fakes):
    x, y = array(X, (7,), "int8"), array(Y, (7,), "int8")
    warm = make_comm()
    ring(x, y)(warm)
    ring(x, y)(warm)
    cold = make_comm()
    ring(x, y)(cold)
    planned, full = fakes.driver.launches[1], fakes.driver.launches[2]
    assert planned[1:] == full[1:]


@pytest.mark.parametrize("other", [
    lambda x, y: [("recv", x, 0), ("send", y, 0)],                     # the same arrays, the kinds swapped
    lambda x, y: [("send", y, 0), ("recv", x, 0)],                     # the arrays swapped
    lambda x, y: [("send", x, 0), ("recv", array(Z, (100,)), 0)],      # another receive buffer
    lambda x, y: [("send", x, 0), ("recv", array(Y, (50,)), 0)],       # fewer bytes
    lambda x, y: [("send", x, 0), ("recv", array(Y, (50,), "float64"), 0)],  # as many bytes, another dtype
    lambda x, y: [("send", x, 0), ("recv", y, 0), ("send", x, 0)],     # one entry more
])
def test_another_batch_runs_the_full_path(make_comm, fakes, other):
    comm = make_comm()
    x, y = array(X, (100,)), array(Y, (100,))
    ring(x, y)(comm)
    comm.batch_isend_irecv(other(x, y), algorithm="ll")
    assert len(fakes.driver.launches) == 2
    assert fakes.as_buffer.calls == 2 + len(other(x, y))
    assert len(comm._plans) == 2


def test_invalid_batches_still_raise_and_are_not_planned(make_comm, fakes):
    from ubnext import UbnextError

    comm = make_comm()
    x = array(X, (100,))
    for _ in range(2):
        with pytest.raises(UbnextError, match=r"^batch_isend_irecv: ops\[1\]'s receive buffer overlaps"):
            comm.batch_isend_irecv([("send", x, 0), ("recv", x, 0)], algorithm="ll")
        with pytest.raises(UbnextError, match=r"^batch_isend_irecv: ops\[0\] peer 1 is not a rank"):
            comm.batch_isend_irecv([("send", x, 1)], algorithm="ll")
    assert fakes.driver.launches == [] and len(comm._plans) == 0


def test_a_broken_communicator_raises_on_a_planned_batch(make_comm, fakes):
    comm = make_comm()
    x, y = array(X, (100,)), array(Y, (100,))
    ring(x, y)(comm)
    comm._node.error = CollectiveTimeoutError("batch_isend_irecv", 0, 0, "point-to-point credit", 1.0)
    with pytest.raises(CollectiveTimeoutError):
        ring(x, y)(comm)
    assert len(fakes.driver.launches) == 1 and len(comm._plans) == 0


def test_keys_name_the_call_the_kinds_and_plain_int_peers():
    x, y = array(X, (100,)), array(Y, (100,))
    send = p2p_key("send", [("send", x, 1)], "ll", 5, False)
    assert send != p2p_key("recv", [("recv", x, 1)], "ll", 5, False)
    assert send != p2p_key("send", [("send", x, 1)], "ll", 6, False)
    assert send != p2p_key("send", [("send", x, 1)], "auto", 5, False)
    assert p2p_key("send", [("send", x, True)], "ll", 5, False) is None  # _rank_arg refuses a bool
    assert p2p_key("send", [("send", object(), 1)], "ll", 5, False) is None
    assert p2p_key("batch_isend_irecv", [("send", x, 0), ("recv", y, 0)], "ll", 5, False) != \
        p2p_key("batch_isend_irecv", [("recv", x, 0), ("send", y, 0)], "ll", 5, False)


# ---- the all-to-all with splits on the kernel ---------------------------------------------------------
def test_a_repeated_all_to_all_with_host_splits_launches_its_plan(make_comm, fakes):
    comm = make_comm()
    x, out = array(X, (100, 3)), array(Y, (100, 3))
    for _ in range(3):
        assert comm.all_to_all(x, out, [100], [100], algorithm="ll") is out
    assert fakes.as_buffer.calls == 2
    first, *later = fakes.driver.launches
    assert comm.kernels[first[0]][1] == "ub_p2p" and all(launch == first for launch in later) and len(later) == 2
    n, head, *words = first[4][-2 - 64:]
    assert (n, head) == (2, encode("all_to_all", "uint8", "sum", 0))
    assert words[:4] == [X, 1200 | 1 << 56, Y, 1200]


def test_a_repeated_all_to_all_with_device_splits_launches_its_plan_each_split_at_its_width(make_comm, fakes):
    """The plan's launch is the full path's: ub_p2p_alltoallv with in_splits' width (int64:
    8) and out_splits' (int32: 4), each its own."""
    comm = make_comm()
    x, out = array(X, (100, 3)), array(Y, (103, 3))
    ins, outs = array(Z, (1,), "int64"), array(Z + 64, (1,), "int32")
    for _ in range(2):
        assert comm.all_to_all(x, out, ins, outs, algorithm="ll") is out
    assert fakes.as_buffer.calls == 4
    first, second = fakes.driver.launches
    assert comm.kernels[first[0]][1] == "ub_p2p_alltoallv" and second == first
    assert first[4][-10:] == (X, Y, 100, 103, 12, Z, 8, Z + 64, 4, encode("all_to_all", "uint8", "sum", 0))


def test_all_to_all_keys():
    from ubnext._api.collectives.all_to_all import all_to_all_key

    x, out = array(X, (100,)), array(Y, (100,))
    ins, outs = array(Z, (1,), "int64"), array(Z + 64, (1,), "int32")
    host = all_to_all_key(x, out, [60, 40], [50, 50], "ll", 5, False)
    assert host != all_to_all_key(x, out, [50, 50], [50, 50], "ll", 5, False)
    assert host != all_to_all_key(x, out, [60, 40], [40, 60], "ll", 5, False)
    assert all_to_all_key(x, None, [60, 40], [50, 50], "ll", 5, False) is None  # out allocated every call
    assert all_to_all_key(x, out, [60, True], [50, 50], "ll", 5, False) is None
    assert all_to_all_key(x, out, [60, 40], outs, "ll", 5, False) is None  # mixed: the full path raises
    device = all_to_all_key(x, out, ins, outs, "ll", 5, False)
    assert device is not None and device != all_to_all_key(x, out, outs, ins, "ll", 5, False)
