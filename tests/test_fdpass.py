"""FdChannel without MPI: ranks as threads of one process, and the wire
protocol (token challenge, sender check, uid check, timeouts) driven by hand."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from ubnext._memory import descriptors
from ubnext._memory.descriptors import FdChannel
from ubnext._protocol.errors import ClosedError, UbnextError
from ubnext.bootstrap import Bootstrap, SelfBootstrap

JOIN_TIMEOUT_S = 60.0
TOKEN = b"t" * 32


class _ThreadGroup:
    """Shared state of a bootstrap whose ranks are threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=JOIN_TIMEOUT_S)
        self._slots: list[bytes] = [b""] * size

    def allgather(self, rank: int, data: bytes) -> list[bytes]:
        self._slots[rank] = data
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out


class ThreadBootstrap(Bootstrap):
    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def allgather(self, data: bytes) -> list[bytes]:
        self._check_open("bootstrap.allgather")
        return self._group.allgather(self._rank, data)

    def barrier(self) -> None:
        self.allgather(b"")


def run_ranks(size: int, body: Callable[[Bootstrap], Any]) -> tuple[list[Any], list[BaseException | None]]:
    """Run ``body(bootstrap)`` on ``size`` threads; return results and errors per rank."""
    group = _ThreadGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = body(ThreadBootstrap(group, rank))
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    return results, errors


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("ubnext-test")
    os.write(fd, data)
    return fd


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_allgather_and_bcast_between_threads():
    def body(boot: Bootstrap) -> str:
        with FdChannel(boot, timeout_s=20) as ch:
            own = memfd_with(b"rank %d" % boot.rank)
            fds = ch.allgather_fds(own)
            assert own not in fds
            assert [os.pread(fd, 64, 0) for fd in fds] == [b"rank %d" % r for r in range(boot.size)]
            one = ch.bcast_fd(own if boot.rank == 1 else None, root=1)
            assert os.pread(one, 64, 0) == b"rank 1"
            for fd in [*fds, one, own]:
                os.close(fd)
            return ch.directory

    before = open_fd_count()
    results, errors = run_ranks(3, body)
    assert errors == [None] * 3
    assert len(set(results)) == 1 and not os.path.exists(results[0])
    assert open_fd_count() == before


def test_single_rank_channel_dups():
    with FdChannel(SelfBootstrap(), timeout_s=5) as ch:
        own = memfd_with(b"solo")
        (mine,) = ch.allgather_fds(own)
        other = ch.bcast_fd(own, root=0)
        assert own not in (mine, other)
        assert os.pread(mine, 8, 0) == os.pread(other, 8, 0) == b"solo"
        for fd in (own, mine, other):
            os.close(fd)
        with pytest.raises(ValueError, match="fdpass.bcast_fd: root 1"):
            ch.bcast_fd(None, root=1)


def test_close_is_idempotent_and_final():
    ch = FdChannel(SelfBootstrap(), timeout_s=5)
    directory = ch.directory
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.listdir(directory) == ["0.sock"]
    ch.close()
    ch.close()
    assert ch.closed and not os.path.exists(directory)
    with pytest.raises(ClosedError, match="fdpass.allgather_fds"):
        ch.allgather_fds(0)


def test_unclosed_channel_warns():
    ch = FdChannel(SelfBootstrap(), timeout_s=5)
    directory = ch.directory
    with pytest.warns(ResourceWarning, match="not closed"):
        ch.__del__()
    ch.close()
    assert not os.path.exists(directory)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_invalid_timeout(timeout_s):
    with pytest.raises(ValueError, match="timeout_s"):
        FdChannel(SelfBootstrap(), timeout_s=timeout_s)


def _fake_mkdtemp(tmp_path, make: Callable[[str], str]) -> Callable[..., str]:
    def mkdtemp(prefix: str = "") -> str:
        return make(str(tmp_path / "dir"))

    return mkdtemp


def _public_dir(path: str) -> str:
    os.mkdir(path, 0o755)
    os.chmod(path, 0o755)
    return path


def _symlinked_dir(path: str) -> str:
    os.mkdir(path + ".real", 0o700)
    os.symlink(path + ".real", path)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [(_public_dir, "has mode 0o755, expected 0o700"), (_symlinked_dir, "is a symlink")],
)
def test_setup_rejects_unsafe_directory(tmp_path, monkeypatch, make, message):
    monkeypatch.setattr(descriptors.tempfile, "mkdtemp", _fake_mkdtemp(tmp_path, make))
    results, errors = run_ranks(2, lambda boot: FdChannel(boot, timeout_s=5))
    for err in errors:
        assert isinstance(err, UbnextError)
        assert str(err).startswith("fdpass.setup: failed on 2 rank(s)") and message in str(err)
    assert not any(p.name.endswith(".sock") for p in tmp_path.rglob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_setup_rejects_foreign_owner(tmp_path, monkeypatch):
    def foreign(path: str) -> str:
        os.mkdir(path, 0o700)
        os.chown(path, os.getuid() + 1, -1)
        return path

    monkeypatch.setattr(descriptors.tempfile, "mkdtemp", _fake_mkdtemp(tmp_path, foreign))
    with pytest.raises(UbnextError, match="is owned by uid"):
        FdChannel(SelfBootstrap(), timeout_s=5)


def test_bad_descriptor_fails_on_every_rank():
    def body(boot: Bootstrap) -> None:
        ch = FdChannel(boot, timeout_s=1)
        fd = 987654 if boot.rank == 0 else memfd_with(b"ok")
        try:
            ch.allgather_fds(fd)
        finally:
            assert ch.closed, "a failed exchange closes the channel"
            if boot.rank != 0:
                os.close(fd)

    before = open_fd_count()
    t0 = time.monotonic()
    _, errors = run_ranks(2, body)
    assert time.monotonic() - t0 < 20
    for err in errors:
        assert isinstance(err, UbnextError)
        assert "local rank 0: 987654 is not an open file descriptor" in str(err)
        assert "local rank 1: timed out waiting for local rank(s) [0]" in str(err)
    assert open_fd_count() == before, "no received descriptor may leak"


# --- the wire protocol, one connection at a time ------------------------------


@pytest.fixture
def listener(tmp_path):
    path = str(tmp_path / "0.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        sock.listen(4)
        yield sock, path


def serve_in_thread(sock: socket.socket, senders: set[int], timeout_s: float = 10) -> dict:
    """Run _serve_one on a thread; the returned dict gets 'result' or 'error'."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = descriptors._serve_one("test", sock, TOKEN, senders, time.monotonic() + timeout_s)
        except BaseException as exc:
            box["error"] = exc

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    return box


def finish(box: dict) -> dict:
    box["thread"].join(JOIN_TIMEOUT_S)
    assert not box["thread"].is_alive()
    return box


def raw_client(path: str, hello: bytes, fds: list[int]) -> bytes:
    """Connect, read the challenge, then send ``hello`` with ``fds`` (no checks)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        challenge = sock.recv(32)
        socket.send_fds(sock, [hello], fds)
        return challenge


def test_protocol_happy_path(listener):
    sock, path = listener
    box = serve_in_thread(sock, {1, 2})
    fd = memfd_with(b"payload")
    descriptors._send_fd("test", path, TOKEN, 2, fd, time.monotonic() + 10)
    sender, got = finish(box)["result"]
    assert sender == 2 and os.pread(got, 16, 0) == b"payload"
    os.close(got)
    os.close(fd)


@pytest.mark.parametrize(
    ("hello", "nfds", "message"),
    [
        (descriptors._HELLO.pack(b"x" * 32, 1), 1, "sent a wrong token; descriptor rejected"),
        (descriptors._HELLO.pack(TOKEN, 7), 1, "claims to be local rank 7, expected one of [1]"),
        (descriptors._HELLO.pack(TOKEN, 1), 0, "must send exactly one descriptor (got 0)"),
        (descriptors._HELLO.pack(TOKEN, 1), 2, "must send exactly one descriptor"),
    ],
)
def test_receiver_rejects_bad_hello(listener, hello, nfds, message):
    sock, path = listener
    fd = memfd_with(b"secret")
    before = open_fd_count()
    box = serve_in_thread(sock, {1})
    challenge = raw_client(path, hello, [fd] * nfds)
    err = finish(box).get("error")
    assert challenge == TOKEN
    assert isinstance(err, UbnextError) and message in str(err)
    assert open_fd_count() == before, "a rejected descriptor must be closed"
    os.close(fd)


def test_sender_refuses_receiver_without_token(listener):
    sock, path = listener
    box: dict = {}

    def impostor() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(b"y" * 32)
            conn.settimeout(10)
            box["heard"] = conn.recv(64)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    fd = memfd_with(b"secret")
    with pytest.raises(UbnextError, match="did not present the job token; descriptor not sent"):
        descriptors._send_fd("test", path, TOKEN, 1, fd, time.monotonic() + 10)
    t.join(JOIN_TIMEOUT_S)
    assert box["heard"] == b""
    os.close(fd)


def test_receiver_times_out_without_sender(listener):
    sock, _ = listener
    t0 = time.monotonic()
    with pytest.raises(UbnextError, match=r"timed out waiting for local rank\(s\) \[1\]"):
        descriptors._serve_one("test", sock, TOKEN, {1}, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5


def test_sender_times_out_without_challenge(listener):
    _, path = listener  # listens, never accepts, never sends the token
    fd = memfd_with(b"x")
    t0 = time.monotonic()
    with pytest.raises(UbnextError, match="timed out sending a descriptor"):
        descriptors._send_fd("test", path, TOKEN, 1, fd, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5
    os.close(fd)


def test_sender_rejects_missing_socket(tmp_path):
    with pytest.raises(UbnextError, match="cannot send a descriptor to"):
        descriptors._send_fd("test", str(tmp_path / "nope.sock"), TOKEN, 1, 0, time.monotonic() + 5)


def test_uid_mismatch_rejected_on_both_sides(listener, monkeypatch):
    sock, path = listener
    monkeypatch.setattr(descriptors.os, "getuid", lambda: os.geteuid() + 1)
    with pytest.raises(UbnextError, match=r"receiver at .* runs as uid \d+, not \d+; refused"):
        descriptors._send_fd("test", path, TOKEN, 1, 0, time.monotonic() + 5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
        with pytest.raises(UbnextError, match=r"connecting process .* runs as uid"):
            descriptors._serve_one("test", sock, TOKEN, {1}, time.monotonic() + 5)


def test_socket_path_too_long(monkeypatch):
    long_dir = tempfile.mkdtemp(prefix="ubnext-" + "x" * 120)
    try:
        monkeypatch.setattr(descriptors.tempfile, "mkdtemp", lambda prefix="": long_dir)
        with pytest.raises(UbnextError, match="set TMPDIR to a shorter directory"):
            FdChannel(SelfBootstrap(), timeout_s=5)
    finally:
        assert not os.path.exists(long_dir), "a failed setup removes the directory"
