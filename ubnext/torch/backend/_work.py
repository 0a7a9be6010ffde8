"""Work objects of the ubnext process group: what a c10d op returns (``async_op=True``).

ubnext enqueues a collective on the caller's current stream (the NCCL backend on a
stream of its own), so the work is ordered before anything the caller enqueues next on
that stream. ``Work`` keeps that stream (and an event recorded right after the op when
the caller asked for async), and gives the NCCL backend's answers:

* ``wait()`` makes the caller's current stream wait for the op (nothing when it is the
  op's own stream); it never blocks the host, except for ``barrier``'s work, which
  synchronizes as NCCL's barrier does, and ``wait(timeout)``, which waits on the host up
  to the timeout and raises past it.
* ``is_completed()`` asks the device whether the op has finished (no host wait).
* ``get_future()`` a CUDA-aware ``torch.futures.Future`` completed with the op's output
  tensors and a stream recorded that is ordered after the op (the caller's current one,
  made to wait for the op where it is another), so ``then()`` callbacks (DDP
  communication hooks) and ``wait()`` order their stream after the op, as with NCCL.

CPU work (what ran on the CPU, complete when the op returned) has no stream.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from ubnext._protocol.errors import UbnextError

__all__ = ["DONE", "PendingWork", "Work"]


class Work(dist._Work):
    """The work of one c10d op ubnext enqueued (see the module docstring).

    Not collective; graph-capturable: ``wait()`` yes (a stream wait), ``is_completed()``
    no (it queries the device), ``get_future()`` no.

    Args:
        result: the op's output tensors (what the future yields).
        stream: the ``torch.cuda.Stream`` the op was enqueued on; None for CPU work.
        event: a ``torch.cuda.Event`` recorded on ``stream`` right after the op, or None
            (then ``wait()`` on another stream records one when it is called, which also
            covers what was enqueued on ``stream`` since).
        blocking: ``wait()`` synchronizes the host with ``stream`` (barrier).
    """

    def __init__(self, result, stream=None, event=None, blocking: bool = False):
        super().__init__()
        self._result, self._stream, self._event, self._blocking = result, stream, event, blocking
        self._future = None

    def wait(self, timeout=None) -> bool:
        """Orders the caller's current stream after the op (barrier: the host waits). With a
        ``timeout`` (a positive ``timedelta``, as NCCL's ``wait(timeout)``), the host waits
        for the op instead, up to ``timeout``.

        Raises:
            UbnextError: the op did not finish within ``timeout``.
        """
        stream = self._stream
        if stream is None:
            return True
        if timeout is not None and timeout.total_seconds() > 0:
            self._wait_host(timeout.total_seconds())
        if self._blocking:
            stream.synchronize()
            return True
        self._order_current(stream)
        return True

    def _wait_host(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise UbnextError(f"Work.wait: the op did not finish within {seconds:g} s (a rank did not take "
                                  f"part, or the stream is blocked)")
            time.sleep(1e-4)

    def is_completed(self) -> bool:
        if self._stream is None:
            return True
        return self._event.query() if self._event is not None else self._stream.query()

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self):
        if self._future is None:
            stream = self._stream
            if stream is None:
                fut = torch.futures.Future()
            else:
                # the future records the caller's current stream, which is the op's or is made
                # to wait for it here (wait()'s ordering): no stream guard entered
                fut = torch.futures.Future(devices=[stream.device])
                self._order_current(stream)
            fut.set_result(self._result)
            self._future = fut
        return self._future

    def _order_current(self, stream) -> None:
        current = torch.cuda.current_stream(stream.device)
        if current != stream:
            current.wait_event(self._event if self._event is not None else stream.record_event())


class PendingWork(Work):
    """The work of a send or recv not yet issued: ubnext issues the pending
    point-to-point ops together (one ``batch_isend_irecv``, as NCCL's group calls) at the
    first ``wait()`` (or future, or completion query) of one of them, or before the
    group's next other op, whichever comes first. Where issuing the batch raised, every
    work of it is completed, not successful, and raises that error at ``wait()``.

    Args:
        result: the op's tensors.
        flush: issues the pending ops; returns the stream they were enqueued on (or None).
    """

    def __init__(self, result, flush):
        super().__init__(result)
        self._flush, self._issued, self._error = flush, False, None

    def _issue(self) -> None:
        """Issues the pending ops if not yet done; raises what issuing them raised."""
        if not self._issued:
            self._stream = self._flush()
            self._issued = True
        if self._error is not None:
            raise self._error

    def mark_issued(self, stream) -> None:
        """Called by the flush: the op is enqueued on ``stream``."""
        self._stream, self._issued = stream, True

    def mark_failed(self, error: BaseException) -> None:
        """Called by the flush: issuing the op's batch raised ``error`` (nothing of it was
        enqueued); every later wait raises it."""
        self._error, self._issued = error, True

    def wait(self, timeout=None) -> bool:
        self._issue()
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._issued:
            with contextlib.suppress(Exception):  # the work holds it: wait() raises it, exception() gives it
                self._issue()
        return self._error is not None or super().is_completed()

    def is_success(self) -> bool:
        return self._error is None and self.is_completed()

    def exception(self):
        return self._error

    def get_future(self):
        self._issue()
        return super().get_future()


#: the work of every blocking op (``async_op=False``): finished for whoever waits on it
DONE = Work([])
