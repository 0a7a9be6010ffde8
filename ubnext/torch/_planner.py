"""Planned symmetric buffers for the row-parallel GEMMs' outputs.

A row-parallel GEMM writes its partial sums straight into symmetric memory
(``torch.matmul(..., out=view)``), so the all-reduce that follows reads them without a
staging copy. The buffers are planned ahead, like a max-pool double-buffer allocator:
each sized for the largest need over the layer kinds at the configured maximum tokens,
two of them (layer k+1's GEMM fills one while layer k's all-reduce reads the other), and
strictly assigned (a key always gets the same buffer, so CUDA graphs captured over them
stay valid).
"""

from __future__ import annotations

import threading

import torch

from ubnext._environment.log import log_once

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class BufferPlan:
    """Symmetric buffers for row-parallel outputs, planned for ``max_tokens``.

    Collective: yes (``Communicator.empty`` on every rank alike); its views are host-only.
    Graph-capturable: no (it allocates); ``view`` and ``assign`` yes (host only).

    The plan holds its communicator (``comm``) and its buffers hold their pool memory, so a
    plan (and a layer holding it) stays usable however its creator's references go; a
    closed communicator's plan keeps its buffers, and calls on them raise ClosedError.
    ``copy.deepcopy`` returns the plan itself (copies of a layer share it: the buffers are
    the communicator's memory, not state); pickling raises TypeError.

    Args:
        group: the ``ubnext.Communicator`` whose pool holds the buffers.
        max_tokens: the most tokens (rows) a call writes.
        widths: the output features of every layer kind (e.g. ``{"mlp": 4096, "attn": 4096}``).
        dtype: the outputs' torch dtype.
        buffers: how many buffers keys are spread over (2: double buffered).

    Raises:
        UbnextError: the pool cannot hold the buffers, or the communicator has no pool.
    """

    def __init__(self, group, max_tokens: int, widths: dict, dtype=torch.bfloat16, buffers: int = 2):
        self.comm = group
        self.max_tokens = int(max_tokens)
        self.capacity = self.max_tokens * max(int(w) for w in widths.values())  # elements per buffer
        self.dtype = dtype
        self.buffers = [group.empty(self.capacity, _DTYPE_NAMES[dtype], framework="torch") for _ in range(buffers)]
        self._slots: dict = {}
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("BufferPlan cannot be pickled: its buffers are a communicator's symmetric memory; save the "
                        "model's state_dict() and make the plan again")

    def assign(self, key) -> int:
        """The buffer of ``key``: the next one round-robin the first time, the same ever after
        (keys assigned in the same order on every rank get the same buffers).

        Collective: no (but every rank must assign its keys in the same order).
        Graph-capturable: yes (host only).

        Args:
            key: any hashable naming a layer.

        Returns:
            The index of its buffer in ``buffers``.

        Raises:
            Nothing.
        """
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = len(self._slots) % len(self.buffers)
            return slot

    def view(self, key, rows: int, cols: int, dtype):
        """A (rows, cols) view of ``key``'s buffer, or None (logged once) where the call is
        larger than planned or of another dtype: the caller then takes the staging path.

        Collective: no.
        Graph-capturable: yes (host only).

        Args:
            key: the layer's key.
            rows, cols: the output's shape.
            dtype: the output's torch dtype.

        Returns:
            A view of the buffer's first rows * cols elements, or None.

        Raises:
            Nothing.
        """
        if rows * cols > self.capacity or dtype != self.dtype:
            log_once(f"plan:{key}", f"BufferPlan: a {rows} x {cols} {dtype} output of {key!r} does not fit the "
                                    f"planned {self.capacity} {self.dtype} elements; it goes through a staging copy")
            return None
        return self.buffers[self.assign(key)][:rows * cols].view(rows, cols)
