"""Launch shapes: the grid, block and cluster sizes of every kernel launch.

Pure functions of a launch's size and the machine (SMs, ranks); the engine asks them for
each launch. The rules and the measurements behind them are in bench/NOTES.md
("Launch-shape rules").
"""

from __future__ import annotations

from ._algorithms import row_threads
from ._heap import round_up
from ._protocol import NORM_THREADS, TWOSHOT_ALIGN_VECS

#: portable thread-block cluster size (the one-shot's fused clusters)
MAX_CLUSTER = 8
#: largest cluster of the fused Lamport two-shot, whose clusters finish this rank's share
#: of the rows while the other ranks' rows arrive: smaller clusters leave SMs for them
TWOSHOT_MAX_CLUSTER = 4
#: least vectors of a row per block of a cluster
CLUSTER_BLOCK_VECTORS = 128
#: threads per block of the Lamport two-shot's narrow launches (lamport_twoshot_threads)
NARROW_THREADS = 128


def row_cluster(rows: int, vectors: int, blocks: int, largest: int = MAX_CLUSTER) -> int:
    """Blocks per cluster that finish one row of ``vectors`` 16-byte vectors when a launch
    of ``rows`` rows may use ``blocks`` blocks: a power of two up to ``largest``, with a
    cluster for every row and at least CLUSTER_BLOCK_VECTORS vectors per block, so that a
    few long rows spread their polls and passes over several SMs. Rows that one block
    covers with a vector per thread stay on one block."""
    if vectors < NORM_THREADS:
        return 1
    cluster = 1
    while (cluster * 2 <= largest and rows * cluster * 2 <= blocks
           and vectors >= cluster * 2 * CLUSTER_BLOCK_VECTORS):
        cluster *= 2
    return cluster


def lamport_shape(alg, nvec: int, nranks: int, max_blocks: int) -> tuple[int, int]:
    """(blocks, threads per block) of a plain launch of the Lamport family ``alg`` on
    ``nvec`` vectors: a block per ``alg.threads`` vectors, at most ``max_blocks`` (the
    two-shot kernel gives each block a part of every slice), on the narrow blocks of
    ``lamport_twoshot_threads`` where they apply."""
    blocks = max(1, min(max_blocks, -(-nvec // alg.threads)))
    threads = alg.threads
    if alg.family == "lamport_twoshot":
        threads = lamport_twoshot_threads(nvec, nranks, blocks, threads)
    return blocks, threads


def lamport_twoshot_threads(nvec: int, nranks: int, blocks: int, threads: int) -> int:
    """Threads per block of a plain Lamport two-shot launch of ``nvec`` vectors on
    ``blocks`` blocks (``threads``: the kernel's own). NARROW_THREADS where a block's
    part of a slice (kernels/lamport_twoshot.cu: block_part) gives each of them 2 or 3
    vectors: a thread's pushes leave in order, so its first vectors are reduced and
    gathered while the later ones still cross NVLink. With one vector per thread there is
    nothing to overlap, and with more, fewer pushes are in flight."""
    slice_vecs = round_up(-(-nvec // nranks), TWOSHOT_ALIGN_VECS)
    part = round_up(-(-slice_vecs // blocks), TWOSHOT_ALIGN_VECS)
    return NARROW_THREADS if 2 * NARROW_THREADS <= part <= 3 * NARROW_THREADS else threads


def twoshot_blocks(alg, nvec: int, nranks: int, max_blocks: int) -> int:
    """Blocks of a barrier two-shot launch of ``nvec`` vectors: one per ``alg.threads``
    vectors of a slice, at most ``max_blocks``; the multicast barrier counts arrivals per
    block, so every launch of it has ``max_blocks`` (the unicast one takes any grid)."""
    return grid(alg, -(-(-(-nvec // nranks)) // alg.threads), max_blocks)


def grid(alg, wanted: int, max_blocks: int) -> int:
    """``wanted`` blocks, at least 1 and at most ``max_blocks``; always ``max_blocks`` for a
    multicast barrier two-shot (whose counting barrier needs the same grid every launch)."""
    return max_blocks if alg.multicast else max(1, min(max_blocks, wanted))


def norm_shape(alg, rows: int, vpr: int, nranks: int, max_blocks: int, clusters: bool) -> tuple[int, int, int]:
    """(blocks, threads per block, blocks per cluster) of a fused launch of ``rows`` rows of
    ``vpr`` vectors by ``alg``; ``clusters``: whether the device runs thread-block clusters."""
    # rows that each rank normalizes: all (one-shot) or its own (two-shot kernels)
    owned = rows if alg.family == "lamport" else -(-rows // nranks)
    # few of them: a cluster per row, so a row's polls and passes run on several SMs
    largest = MAX_CLUSTER if alg.family == "lamport" else TWOSHOT_MAX_CLUSTER
    cluster = row_cluster(owned, vpr, max_blocks, largest) if alg.pushed and clusters else 1
    if alg.family == "twoshot":  # a block per owned row
        blocks = grid(alg, owned, max_blocks)
    elif alg.family == "lamport" and cluster > 1:
        blocks = cluster * rows
    else:  # enough blocks for every row, and for the pushes at ~`threads` vectors per block
        wanted = max(rows, -(-rows * vpr // alg.threads))
        blocks = max(cluster, min(max_blocks, wanted) // cluster * cluster)
    return blocks, row_threads(vpr, cluster), cluster
