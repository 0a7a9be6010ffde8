// ubnext kernels: bounded waits, timeout reports, cross-rank block barriers, launch state.
//
// Every spin-wait is bounded by a timeout. On timeout the waiting thread writes who
// waited for whom into host-mapped memory (read by the host without synchronizing) and
// traps, so a dead peer becomes an error, never a silent hang.
#pragma once
#include "common.cuh"

// WaitSite, ErrorRecord (one per communicator, in host-mapped pinned memory; `flag` is
// written last) and LaunchState come from protocol.h.
//
// LaunchState: per rank and per kernel family, in the rank's own segment of the pool.
// All blocks read it at entry; the last block to finish advances it, so the next launch
// on the stream (which starts after this one completes) sees the new values. The kernel
// advances it itself, so a launch captured in a CUDA graph stays correct on every replay.

// Context every kernel carries for its waits.
struct WaitCtx {
  ErrorRecord* err;
  u64 timeout_ns;
  int rank;
  u32 epoch;
};

// Records the timeout in host memory (flag last, system-scope fences) and traps.
__device__ __noinline__ void fail_timeout(const WaitCtx& c, int peer, u32 site) {
  volatile ErrorRecord* r = c.err;
  r->rank = (u32)c.rank;
  r->peer = (u32)peer;
  r->site = site;
  r->epoch = c.epoch;
  __threadfence_system();
  r->flag = 1u;
  __threadfence_system();
  __trap();
}

// True while flag value `v` has not reached `target` (wrap-around safe).
__device__ __forceinline__ bool before(u32 v, u32 target) { return (int)(v - target) < 0; }

// Waits until *flag (written by `peer` with st_release_sys) reaches `target`.
// Acquire at system scope: the caller's later accesses see what the peer wrote before.
__device__ __forceinline__ void wait_flag(const u32* flag, u32 target, const WaitCtx& c,
                                          int peer, u32 site) {
  if (!before(ld_acquire_sys(flag), target)) return;
  const u64 t0 = globaltimer();
  while (before(ld_acquire_sys(flag), target)) {
    if (globaltimer() - t0 > c.timeout_ns) fail_timeout(c, peer, site);
  }
}

// Barrier flags in every rank's segment: u32 flags[UB_FLAG_PHASES][UB_MAX_BLOCKS][UB_MAX_RANKS];
// slot [phase][b][s] of rank r is written by block b of rank s.
__device__ __forceinline__ u64 flag_offset(int phase, int block, int src) {
  return 4ull * (((u64)phase * UB_MAX_BLOCKS + block) * UB_MAX_RANKS + src);
}

// Barrier of block blockIdx.x with the same block on every rank. Release/acquire at
// system scope: everything this block wrote before is visible to those blocks after,
// and everything they wrote before is visible to this block after. `value` must grow
// by one per launch (the launch epoch), so flags are never reset.
// tp.seg(r) gives the base of rank r's segment; flags_off locates the flag array in it.
template <int N, class Tp>
__device__ void block_barrier(const Tp& tp, u64 flags_off, int phase, u32 value,
                              const WaitCtx& c, u32 site) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < N) {
    fence_sys();
    st_release_sys(tp.seg(t) + flags_off + flag_offset(phase, blockIdx.x, c.rank), value);
    wait_flag((const u32*)(tp.seg(c.rank) + flags_off + flag_offset(phase, blockIdx.x, t)), value,
              c, t, site);
  }
  __syncthreads();
}

// What a launch reads of its family's LaunchState at entry.
struct LaunchView {
  u32 epoch;      // launches completed: barrier flag values grow with it (wrap-around safe)
  u32 prev_vecs;  // vectors of the previous launch
  u32 slot;       // Lamport receive buffer of this launch; the rotation is kept apart from
                  // the epoch, since 2^32 is not a multiple of 3
};
__device__ __forceinline__ LaunchView read_launch_state(LaunchState* s) {
  return {ld_volatile_u32(&s->epoch), ld_volatile_u32(&s->prev_vecs), ld_volatile_u32(&s->slot)};
}

// Called by every block at its end: the last block to finish advances the state.
// No fence: the state is read only by this rank's next launch of the family, which the
// stream starts after this one has completed (its writes are then visible), and the last
// block reads nothing the others wrote. A fence here would make every block wait for
// its outstanding NVLink stores before it counts itself done (measured: 0.4-1.5 µs
// per launch on 4xH200).
__device__ void finish_launch(LaunchState* s, const LaunchView& l, u32 vecs) {
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&s->done, 1u) == gridDim.x - 1) {
    s->done = 0u;
    s->prev_vecs = vecs;
    s->slot = l.slot == 2u ? 0u : l.slot + 1u;
    s->epoch = l.epoch + 1u;
  }
}
