"""The launches of a reduce-scatter or all-gather by ubnext's kernels.

Both collectives have a rank-sliced side (the reduce-scatter's input, the all-gather's
output: nranks slices of k elements) and a side of k elements. The kernels
(kernels/lamport_twoshot.cu, kernels/twoshot.cu) take the sliced side as whole 16-byte
vectors per slice (``slice = ceil(k / per)`` vectors, ``per`` elements a vector).

Where the caller's arrays have that layout (k a multiple of ``per``, 16-byte aligned, a
message one launch takes), the kernels read and write them directly; the barrier
two-shot then works in place on a symmetric array from ``Communicator.empty`` (the
reduce-scatter's input, the all-gather's output), or copies through the staging slot
inside the kernel. Otherwise the sliced side goes through the staging slot, each slice
padded to whole vectors by one 2-D copy, in launches of at most the buffers' size (a
part of every slice each). A k side that is not 16-byte aligned goes through a scratch
slice after the padded slices in the staging slot.
"""

from __future__ import annotations

from ubnext._engine.copies import aligned, copy, copy_rows
from ubnext._engine.launch import issue
from ubnext._protocol.algorithms import ALGORITHMS, DTYPES
from ubnext._protocol.constants import VEC_BYTES


class Sliced:
    """One reduce-scatter or all-gather call of ``k`` elements per rank by kernel ``algo``.

    Args:
        node: the node's kernel resources (``_node.Node``).
        limits: ``{algorithm: (largest bytes of one launch, setting)}`` (``Selector.limits``).
        algo: a kernel algorithm that serves the collective.
        dtype: a key of ``KERNEL_DTYPES``.
        k: elements per rank (> 0).
        stream: the launch stream.
    """

    def __init__(self, node, limits: dict, algo: str, dtype: str, k: int, stream: int):
        eng = self._eng = node.engine
        self._pool, self._algo, self._dtype, self._k, self._stream = node.pool, algo, dtype, k, stream
        self._alg = ALGORITHMS[algo]
        self._n = eng.nranks
        self._width = DTYPES[dtype][1]
        self._per = VEC_BYTES // self._width
        # vectors of a slice in one launch: the padded slices and a scratch slice fit the
        # staging slot, and a Lamport launch's message its buffers
        vecs = eng.staging_bytes // VEC_BYTES // (self._n + 1)
        if self._alg.pushed:
            vecs = min(vecs, limits[algo][0] // VEC_BYTES // self._n)
        self._chunk = vecs * self._per
        #: one launch on the caller's layout (where the arrays are aligned too)
        self._whole = k % self._per == 0 and k <= self._chunk

    def _chunks(self):
        """(first element, elements) of each launch's part of every slice."""
        return ((c0, min(self._chunk, self._k - c0)) for c0 in range(0, self._k, self._chunk))

    def _slice_bytes(self, kc: int) -> int:
        """Bytes of one padded slice of ``kc`` elements."""
        return -(-kc // self._per) * VEC_BYTES

    def reduce_scatter(self, x: int, out: int, op: str, sig: int) -> None:
        """``out`` (k elements) = this rank's slice of the reduction of ``x`` (nranks x k)."""
        eng, n, w, pitch = self._eng, self._n, self._width, self._k * self._width
        direct = self._whole and aligned(x)
        for c0, kc in self._chunks():
            padded = self._slice_bytes(kc)
            src = x
            if not direct:  # the slices, padded, into the staging slot
                copy_rows(eng.staging_ptr, padded, x + c0 * w, pitch, kc * w, n, self._stream)
                src = eng.staging_ptr
            o = out + c0 * w
            dst = o if aligned(o) else eng.staging_ptr + n * padded
            if self._alg.pushed:
                issue(eng.lamport(self._algo, self._dtype, op, src, dst, kc, sig, "reduce_scatter"), self._stream)
            else:
                off = self._pool.contains(x, n * pitch) if direct else None
                buf, copy_in = (off, 0) if off is not None else (eng.staging_off, x if direct else 0)
                issue(eng.twoshot(self._algo, self._dtype, op, buf, copy_in, dst, kc, sig, "reduce_scatter"),
                      self._stream)
            if dst != o:
                copy(o, dst, kc * w, self._stream)

    def all_gather(self, x: int, out: int, sig: int) -> None:
        """``out`` (nranks x k elements) = every rank's ``x`` (k elements), in rank order."""
        eng, n, w, pitch = self._eng, self._n, self._width, self._k * self._width
        direct = self._whole and aligned(out)
        for c0, kc in self._chunks():
            padded = self._slice_bytes(kc)
            src = x + c0 * w
            if not aligned(src):
                copy(eng.staging_ptr + n * padded, src, kc * w, self._stream)
                src = eng.staging_ptr + n * padded
            if self._alg.pushed:
                issue(eng.lamport(self._algo, self._dtype, "sum", src, out if direct else eng.staging_ptr, kc, sig,
                                  "all_gather"), self._stream)
            else:
                off = self._pool.contains(out, n * pitch) if direct else None
                if off is not None:  # in place on the symmetric output; x may be its slice already
                    mine = out + eng.rank * pitch
                    issue(eng.twoshot(self._algo, self._dtype, "sum", off, 0 if src == mine else src, 0, kc, sig,
                                      "all_gather"), self._stream)
                else:
                    issue(eng.twoshot(self._algo, self._dtype, "sum", eng.staging_off, src, out if direct else 0, kc,
                                      sig, "all_gather"), self._stream)
            if not direct:
                copy_rows(out + c0 * w, pitch, eng.staging_ptr, padded, kc * w, n, self._stream)
