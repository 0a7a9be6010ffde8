"""File-descriptor exchange between the ranks of one node.

The symmetric memory pool exports each rank's allocation as a POSIX file
descriptor; peers import it. Descriptors travel over Unix-domain sockets with
``SCM_RIGHTS`` (:func:`socket.send_fds` / :func:`socket.recv_fds`):

* Local rank 0 creates a fresh directory with mode 0700 and a random 32-byte
  token, and broadcasts both over the bootstrap. Every rank checks the
  directory (owned by us, mode 0700, not a symlink), then listens on
  ``<dir>/<local rank>.sock``.
* The sender connects to the receiver's socket. Each side checks the other's
  uid with ``SO_PEERCRED``. The receiver sends the token (challenge); the
  sender verifies it and only then sends ``token + sender rank`` with the
  descriptor. The receiver verifies both before keeping the descriptor and
  closes it otherwise.
* Every socket operation has a deadline; accepts run on a helper thread so all
  ranks send and receive at once; after each exchange the ranks agree on the
  outcome over the bootstrap, so either every rank succeeds or every rank
  raises (and the channel is closed).
"""

from __future__ import annotations

import hmac
import math
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable

from ubnext._protocol.errors import ClosedError, UbnextError
from ubnext.bootstrap import Bootstrap

__all__ = ["FdChannel"]

_TOKEN_BYTES = 32
_HELLO = struct.Struct("<32sI")  # token, sender local rank
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_JOIN_GRACE_S = 5.0  # beyond the deadline, for the accept thread to return


def _remaining(deadline: float) -> float:
    """Seconds left before ``deadline``; raises TimeoutError when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


def _check_fd(op: str, fd: object) -> int:
    """Return ``fd`` if it is an open descriptor, else raise UbnextError."""
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise UbnextError(f"{op}: expected a file descriptor (int >= 0), got {fd!r}")
    try:
        os.fstat(fd)
    except OSError as exc:
        raise UbnextError(f"{op}: {fd} is not an open file descriptor ({exc})") from exc
    return fd


def _check_private_dir(op: str, path: str) -> None:
    """Raise UbnextError unless ``path`` is a real directory, ours, mode 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UbnextError(
            f"{op}: socket directory {path} from local rank 0 does not exist here; "
            "the ranks of one node must share the same temporary directory (TMPDIR)"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UbnextError(f"{op}: {path} is not a directory (or is a symlink)")
    if st.st_uid != os.getuid():
        raise UbnextError(f"{op}: {path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise UbnextError(
            f"{op}: {path} has mode {stat.S_IMODE(st.st_mode):#o}, expected 0o700"
        )


def _check_peer_uid(op: str, sock: socket.socket, who: str) -> int:
    """Check with SO_PEERCRED that the peer runs as our uid; return its pid."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _gid = _UCRED.unpack(creds)
    if uid != os.getuid():
        raise UbnextError(
            f"{op}: {who} (pid {pid}) runs as uid {uid}, not {os.getuid()}; refused"
        )
    return pid


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str, op: str) -> bytes:
    """Read exactly ``n`` bytes before ``deadline``."""
    data = b""
    while len(data) < n:
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise UbnextError(f"{op}: connection closed while reading {what}")
        data += chunk
    return data


def _send_fd(op: str, path: str, token: bytes, rank: int, fd: int, deadline: float) -> None:
    """Client side: send ``fd`` to the receiver listening at ``path``.

    Connects, checks the receiver's uid, waits for the token challenge and
    verifies it, then sends ``token + rank`` with the descriptor.

    Raises:
        UbnextError: on a uid or token mismatch, a closed connection, or a
            timeout.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            while True:
                sock.settimeout(_remaining(deadline))
                try:
                    sock.connect(path)
                    break
                except BlockingIOError:  # listen backlog full: retry until the deadline
                    time.sleep(0.01)
            pid = _check_peer_uid(op, sock, f"receiver at {path}")
            challenge = _recv_exact(sock, _TOKEN_BYTES, deadline, "the token challenge", op)
            if not hmac.compare_digest(challenge, token):
                raise UbnextError(
                    f"{op}: receiver at {path} (pid {pid}) did not present the job "
                    "token; descriptor not sent"
                )
            sock.settimeout(_remaining(deadline))
            socket.send_fds(sock, [_HELLO.pack(token, rank)], [fd])
    except TimeoutError:
        raise UbnextError(f"{op}: timed out sending a descriptor to {path}") from None
    except OSError as exc:
        raise UbnextError(f"{op}: cannot send a descriptor to {path}: {exc}") from exc


def _serve_one(
    op: str, listener: socket.socket, token: bytes, senders: set[int], deadline: float
) -> tuple[int, int]:
    """Server side: accept one connection and receive one descriptor.

    Checks the client's uid, sends the token challenge, receives
    ``token + sender rank`` with one descriptor, and keeps the descriptor
    only if the token matches and the sender is one of ``senders``.

    Returns:
        ``(sender rank, received fd)``; the caller owns the fd.

    Raises:
        UbnextError: on a uid, token or sender mismatch (the descriptor is
            closed), a closed connection, or a timeout.
    """
    try:
        listener.settimeout(_remaining(deadline))
        conn, _ = listener.accept()
    except TimeoutError:
        raise UbnextError(
            f"{op}: timed out waiting for local rank(s) {sorted(senders)} to connect"
        ) from None
    try:
        with conn:
            pid = _check_peer_uid(op, conn, "connecting process")
            conn.settimeout(_remaining(deadline))
            conn.sendall(token)
            conn.settimeout(_remaining(deadline))
            msg, fds, flags, _ = socket.recv_fds(conn, _HELLO.size, 1)
            try:
                if not msg:
                    raise UbnextError(f"{op}: pid {pid} closed the connection unheard")
                if flags & socket.MSG_CTRUNC or len(fds) != 1:
                    raise UbnextError(
                        f"{op}: pid {pid} must send exactly one descriptor "
                        f"(got {len(fds)}{', truncated' if flags & socket.MSG_CTRUNC else ''})"
                    )
                msg += _recv_exact(conn, _HELLO.size - len(msg), deadline, "the hello", op)
                their_token, sender = _HELLO.unpack(msg)
                if not hmac.compare_digest(their_token, token):
                    raise UbnextError(
                        f"{op}: pid {pid} sent a wrong token; descriptor rejected"
                    )
                if sender not in senders:
                    raise UbnextError(
                        f"{op}: pid {pid} claims to be local rank {sender}, expected "
                        f"one of {sorted(senders)}; descriptor rejected"
                    )
            except BaseException:
                _close_fds(fds)
                raise
            return sender, fds[0]
    except TimeoutError:
        raise UbnextError(f"{op}: timed out receiving a descriptor") from None
    except OSError as exc:
        raise UbnextError(f"{op}: cannot receive a descriptor: {exc}") from exc


class _Acceptor(threading.Thread):
    """Receives one descriptor from each of ``senders`` on a helper thread."""

    def __init__(
        self, op: str, listener: socket.socket, token: bytes, senders: set[int], deadline: float
    ) -> None:
        super().__init__(name="ubnext-fdpass-accept", daemon=True)
        self._args = (op, listener, token, deadline)
        self._senders = set(senders)
        self.fds: dict[int, int] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        op, listener, token, deadline = self._args
        try:
            while len(self.fds) < len(self._senders):
                missing = self._senders - self.fds.keys()
                sender, fd = _serve_one(op, listener, token, missing, deadline)
                self.fds[sender] = fd
        except BaseException as exc:  # reported to the main thread by finish()
            self.error = exc

    def finish(self) -> None:
        """Join (bounded by the deadline). Received descriptors are in
        :attr:`fds` (``{sender: fd}``), for the caller to keep or close.

        Raises:
            UbnextError: the thread failed or did not stop.
        """
        op, _, _, deadline = self._args
        self.join(max(0.0, deadline - time.monotonic()) + _JOIN_GRACE_S)
        if self.is_alive():
            raise UbnextError(f"{op}: the accept thread did not stop in time")
        if self.error is not None:
            raise self.error


class FdChannel:
    """Passes file descriptors between the ranks of one node.

    Collective: yes (construction, :meth:`allgather_fds`, :meth:`bcast_fd`
    and :meth:`close` are called by every rank of ``local_boot``).

    Args:
        local_boot: a bootstrap over the ranks of this node (e.g.
            ``boot.split_local()``); not owned, not closed by this channel.
        timeout_s: bound on each exchange, in seconds.

    Raises:
        ValueError: ``timeout_s`` is not a finite number > 0.
        UbnextError: the directory or a socket could not be set up on some
            rank (every rank raises, naming the failing ranks).
    """

    _closed = True  # until setup succeeds; keeps __del__ quiet on failure
    _listener: socket.socket | None = None
    _path: str | None = None
    _dir: str | None = None

    def __init__(self, local_boot: Bootstrap, timeout_s: float) -> None:
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not (math.isfinite(timeout_s) and timeout_s > 0)
        ):
            raise ValueError(f"fdpass.setup: timeout_s must be a number > 0, got {timeout_s!r}")
        self._boot = local_boot
        self._timeout_s = float(timeout_s)
        self._rank = local_boot.rank
        self._size = local_boot.size
        try:
            self._setup()
        except BaseException:
            self._teardown(collective=False)
            raise
        self._closed = False

    def _setup(self) -> None:
        op = "fdpass.setup"
        payload = b""
        if self._rank == 0:
            try:
                directory = tempfile.mkdtemp(prefix="ubnext-fd-")
            except OSError as exc:
                self._boot.bcast(b"", root=0)
                raise UbnextError(f"{op}: cannot create the socket directory: {exc}") from exc
            self._dir = directory
            payload = secrets.token_bytes(_TOKEN_BYTES) + os.fsencode(directory)
        payload = self._boot.bcast(payload if self._rank == 0 else None, root=0)
        if not payload:
            raise UbnextError(f"{op}: local rank 0 could not create the socket directory")
        self._token = payload[:_TOKEN_BYTES]
        directory = self._dir = os.fsdecode(payload[_TOKEN_BYTES:])
        error = None
        try:
            _check_private_dir(op, directory)
            path = self._socket_path(directory, self._rank)
            if len(os.fsencode(path)) > _SUN_PATH_MAX:
                raise UbnextError(
                    f"{op}: socket path {path} is longer than {_SUN_PATH_MAX} bytes; "
                    "set TMPDIR to a shorter directory"
                )
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener = listener
            listener.bind(path)
            self._path = path
            listener.listen(max(self._size, 1))
        except Exception as exc:  # agreed on below, so no rank is left waiting
            error = exc
        self._agree(op, [] if error is None else [error])

    @staticmethod
    def _socket_path(directory: str, rank: int) -> str:
        return os.path.join(directory, f"{rank}.sock")

    @property
    def rank(self) -> int:
        """This process's local rank."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks on this node."""
        return self._size

    @property
    def directory(self) -> str | None:
        """The private socket directory (None once closed)."""
        return self._dir

    @property
    def closed(self) -> bool:
        """Whether the channel is closed (explicitly, or after a failed exchange)."""
        return self._closed

    def allgather_fds(self, fd: int) -> list[int]:
        """Send ``fd`` to every local rank and receive one from each.

        Collective: yes. Blocks the host for at most about ``timeout_s``.

        Args:
            fd: an open descriptor to share (not consumed; the caller still
                owns and closes it).

        Returns:
            ``size`` NEW descriptors, element ``r`` from local rank ``r``
            (own slot: ``os.dup(fd)``). The caller owns and closes them all.

        Raises:
            ClosedError: the channel is closed.
            UbnextError: ``fd`` is not open, a peer failed the uid or token
                checks, or the exchange timed out, on any rank (every rank
                raises, the channel is closed, no descriptor is leaked).
        """
        op = "fdpass.allgather_fds"
        self._check_open(op)
        peers = [(self._rank + k) % self._size for k in range(1, self._size)]
        deadline = time.monotonic() + self._timeout_s
        acceptor = _Acceptor(op, self._listener, self._token, set(peers), deadline)
        received: dict[int, int] = {}
        errors: list[Exception] = []  # agreed on below, so no rank is left waiting
        try:
            acceptor.start()
        except Exception as exc:  # no thread available
            errors.append(exc)
        else:
            # Serve the peers even if our own sends fail, so that the report
            # names only the rank at fault.
            try:
                _check_fd(op, fd)
                for peer in peers:
                    path = self._socket_path(self._dir, peer)
                    _send_fd(op, path, self._token, self._rank, fd, deadline)
            except Exception as exc:
                errors.append(exc)
            try:
                acceptor.finish()
            except Exception as exc:
                errors.append(exc)
            received.update(acceptor.fds)
        if not errors:
            try:
                received[self._rank] = os.dup(fd)
            except OSError as exc:
                errors.append(exc)
        try:
            self._agree(op, errors)
        except BaseException:
            _close_fds(received.values())
            raise
        return [received[r] for r in range(self._size)]

    def bcast_fd(self, fd: int | None, root: int) -> int:
        """Send ``fd`` from local rank ``root`` to every local rank.

        Collective: yes. Blocks the host for at most about ``timeout_s``.

        Args:
            fd: on ``root``, an open descriptor (not consumed); ignored (may be
                None) elsewhere.
            root: the sending local rank.

        Returns:
            A NEW descriptor on every rank (on ``root``: ``os.dup(fd)``); the
            caller owns and closes it.

        Raises:
            ClosedError: the channel is closed.
            ValueError: ``root`` is not a local rank.
            UbnextError: as for :meth:`allgather_fds`.
        """
        op = "fdpass.bcast_fd"
        self._check_open(op)
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._size:
            raise ValueError(f"{op}: root {root!r} is not a local rank in [0, {self._size})")
        deadline = time.monotonic() + self._timeout_s
        result: int | None = None
        errors: list[Exception] = []  # agreed on below, so no rank is left waiting
        try:
            if self._rank == root:
                _check_fd(op, fd)
                for peer in range(self._size):
                    if peer != root:
                        path = self._socket_path(self._dir, peer)
                        _send_fd(op, path, self._token, root, fd, deadline)
                result = os.dup(fd)
            else:
                _, result = _serve_one(op, self._listener, self._token, {root}, deadline)
        except Exception as exc:
            errors.append(exc)
        try:
            self._agree(op, errors)
        except BaseException:
            _close_fds([] if result is None else [result])
            raise
        return result

    def _agree(self, op: str, errors: list[Exception]) -> None:
        """Share each rank's errors; if any rank has some, tear down and raise
        everywhere, naming each failed rank and its reasons.

        Collective: yes.
        """
        prefix = f"{op}: "
        reasons = [str(e) or type(e).__name__ for e in errors]
        reasons = [r[len(prefix) :] if r.startswith(prefix) else r for r in reasons]
        outcomes = self._boot.allgather("; ".join(reasons).encode())
        failed = [(r, o.decode(errors="replace")) for r, o in enumerate(outcomes) if o]
        if not failed:
            return
        self._teardown(collective=False)
        self._closed = True
        detail = "; ".join(f"local rank {r}: {m}" for r, m in failed)
        raise UbnextError(f"{op}: failed on {len(failed)} rank(s): {detail}") from (
            errors[0] if errors else None
        )

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ClosedError(f"{op}: the descriptor channel is closed")

    def _teardown(self, collective: bool) -> None:
        """Close the socket and unlink its path; local rank 0 removes the
        directory (after a barrier when ``collective``)."""
        listener, self._listener = self._listener, None
        path, self._path = self._path, None
        directory, self._dir = self._dir, None
        if listener is not None:
            listener.close()
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if collective:
            self._boot.barrier()
        if self._rank == 0 and directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        """Close the socket, unlink it, and remove the directory; idempotent.

        Collective: yes (a barrier, so local rank 0 removes the directory
        after every rank has unlinked its socket).
        """
        if self._closed:
            return
        self._closed = True
        self._teardown(collective=True)

    def __enter__(self) -> FdChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Finalizers only warn: closing is collective.
        if not self._closed:
            warnings.warn(
                f"FdChannel (local rank {self._rank}) was not closed; its socket "
                f"directory {self._dir} is left behind. Call close() on every rank.",
                ResourceWarning,
                stacklevel=2,
            )
