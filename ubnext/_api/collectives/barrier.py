"""``barrier``: a stream-ordered barrier, as NCCL's (an all-reduce of one element, here
ubnext's own all-reduce, so it runs wherever ``all_reduce`` does)."""

from __future__ import annotations

from ubnext._interop import arrays as _arrays
from ubnext._interop.streams import refuse_capture


class Barrier:
    """The Communicator's ``barrier`` (module docstring)."""

    def barrier(self, stream=None) -> None:
        """Orders ``stream`` after every rank's work issued before; never blocks the host.

        An all-reduce of one float32 element of this communicator's (allocated at the first
        call): the work queued on ``stream`` after the barrier starts only once every rank
        has queued the barrier and the work it queued before it on its stream has run. To
        wait on the host too, follow it with ``synchronize(stream)``.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call (which allocates its element and
        compiles or sets up the all-reduce that serves it).

        Args:
            stream: torch/CuPy/cuda.core stream or raw handle; default: CuPy's current
                stream of this communicator's device.

        Raises:
            UbnextError: the first call captured in a CUDA graph (before anything is
                queued); as ``all_reduce`` raises it.
            BrokenCommunicatorError and its kinds: as ``all_reduce`` raises them.
        """
        with self._order:
            self._check_open("barrier")
            flag = self.__dict__.get("_barrier_flag")
            if flag is None:
                import cupy

                refuse_capture("barrier", _arrays.launch_stream(stream, None, self.device)[0],
                               "it allocates its element and waits for its zeroing")
                flag = cupy.zeros(1, cupy.float32)  # on the communicator's device: the section's
                cupy.cuda.get_current_stream(self.device).synchronize()  # zero before any stream's all-reduce reads it
                self._barrier_flag = flag
        self.all_reduce(flag, out=flag, stream=stream)
