"""Running collectives on the GPU.

Owns: kernel sources and their compilation (``kernels``), low-overhead launches
(``launch``), ubnext's kernels on the pool with their launch shapes (``engine``), the
launches of a validated call (``dispatch``; reduce-scatter and all-gather: ``sliced``;
the separate add + RMSNorm kernel: ``epilogue``; staging copies: ``copies``), the
overlapped reduce-scatter's sum of slots, with or without the add + RMSNorm
(``slot_sum``), NCCL as an
engine (``nccl``), the failure records kernels write (``failures``), the node's
resources created and released together (``node``), who holds the node's memory
after close: arrays and captured CUDA graphs (``holders``), and when their releases may
run: not while a capture ubnext knows of is in progress (``captures``).
Imports: ``_protocol``, ``_environment``, ``_interop``, ``_memory``, ``_selection``.
"""
