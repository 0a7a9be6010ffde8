"""Timing all-reduce calls on the GPU: CUDA events around back-to-back calls, or
around launches of a CUDA graph that holds them (device time, no host overhead).

Shared by ``python -m ubnext.tune`` and ``bench/``; cupy is imported when a
function is called, so importing this module needs no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def capture_graph(launch: Callable[[], None], stream: Any, calls: int) -> Any:
    """Capture ``calls`` calls of ``launch`` on ``stream`` into one CUDA graph (cupy ``Graph``).

    Raises:
        Whatever ``launch`` raises; the capture is ended and discarded first.
    """
    stream.begin_capture()
    try:
        for _ in range(calls):
            launch()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:  # the capture is already invalid; the original error matters
            pass
        raise
    return stream.end_capture()


def elapsed_per_op(body: Callable[[], None], stream: Any, ops: int, barrier: Callable[[], None]) -> float:
    """Seconds per operation of ``body`` (which enqueues ``ops`` operations on ``stream``).

    Waits for ``stream``, meets the other ranks at ``barrier``, then times
    ``body`` with CUDA events recorded on ``stream`` before and after it.
    Blocks the host until the work is done.
    """
    import cupy

    stream.synchronize()
    barrier()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    body()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / max(ops, 1)


def timer(launch: Callable[[], None], stream: Any, iters: int, graph_launches: int,
          barrier: Callable[[], None]) -> Callable[[], float]:
    """A function that times ``launch`` once and returns seconds per call on this rank.

    Eager (``graph_launches == 0``): ``iters`` back-to-back calls between two
    CUDA events. Graph: ``iters`` calls are captured into one CUDA graph now,
    launched once (untimed: uploads it), and each timing launches it
    ``graph_launches`` times. Capturing is local; timing meets the other ranks
    at ``barrier`` first.
    """
    if graph_launches:
        graph = capture_graph(launch, stream, iters)
        graph.launch(stream)

        def body() -> None:
            for _ in range(graph_launches):
                graph.launch(stream)

        ops = iters * graph_launches
    else:

        def body() -> None:
            for _ in range(iters):
                launch()

        ops = iters
    return lambda: elapsed_per_op(body, stream, ops, barrier)

