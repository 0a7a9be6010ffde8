// ubnext kernels: bounded waits, failure reports, cross-rank block barriers, launch state.
//
// Every spin-wait is bounded by a timeout and never traps. A wait that times out marks
// its kernel family broken (LaunchState.broken, so every wait of the launch gives up at
// once; the host passes the mark on to the other families and ranks), and the first
// failing thread writes who waited for whom into host-mapped memory (read by the host
// without synchronizing). A wait that gives up returns false; the kernel then runs to its end
// without waiting again and writes poison (NaN) where its result would have gone, so the
// CUDA context survives and no output holds plausible garbage.
#pragma once
#include "common.cuh"

// WaitSite, FailKind, LaunchState and ErrorRecord (one per LaunchState, in host-mapped
// pinned memory; `flag` is written last) come from protocol.h.
//
// LaunchState: per rank and per kernel family, in the rank's own segment of the pool.
// All blocks read it at entry; the last block to finish advances it, so the next launch
// on the stream (which starts after this one completes) sees the new values. The kernel
// advances it itself, so a launch captured in a CUDA graph stays correct on every replay.

// 32-bit relaxed, system-scope store (a word another rank polls).
__device__ __forceinline__ void st_relaxed_sys_u32(void* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Context of one thread's waits: the family's LaunchState (broken, claim, and where to
// report), and whether the communicator already failed for this thread (its later waits
// then give up at once). Kept small: it lives in registers through the kernels' loops.
struct WaitCtx {
  LaunchState* state;
  int rank;
  bool failed;
  u32 entry;    // LaunchState.broken as loaded at entry (checked by usable)
  u32 started;  // thread 0: LaunchState.blocks before this block counted itself started
};

// Reports a failure of kind `kind`: an original failure (not kFailPeer) marks the family's
// LaunchState.broken, so that every wait of the launch gives up (the host tells the other
// families and ranks: ubnext._engine.failures); then the first failing thread claims the family's
// ErrorRecord and fills it (flag last, system-scope fences).
__device__ __noinline__ void report(LaunchState* state, int rank, u32 kind, int peer, u32 site,
                                    u64 mine, u64 theirs) {
  if (kind != kFailPeer) st_relaxed_sys_u32(&state->broken, (kind << 8) | (u32)(rank + 1));
  if (atomicCAS(&state->claim, 0u, 1u) == 0u) {
    volatile ErrorRecord* r = (ErrorRecord*)ld_volatile_u64(&state->record);
    r->kind = kind;
    r->rank = (u32)rank;
    r->peer = (u32)peer;
    r->site = site;
    r->epoch = ld_volatile_u32(&state->epoch);  // the failing launch's: it has not finished
    r->mine = mine;
    r->theirs = theirs;
    __threadfence_system();
    r->flag = 1u;
    __threadfence_system();
    *(volatile u32*)ld_volatile_u64(&state->tripped) = 1u;  // the host reads this word first
    __threadfence_system();
  }
}

// A failure seen by this thread: reports it, and this thread's later waits give up at once.
__device__ __forceinline__ void fail(WaitCtx& c, u32 kind, int peer, u32 site, u64 mine = 0,
                                     u64 theirs = 0) {
  c.failed = true;
  report(c.state, c.rank, kind, peer, site, mine, theirs);
}

// The wait context of a launch of the family whose state is `state`, made by every thread
// at its start. It loads the broken word without waiting for it: a communicator that was
// already broken (a failure seen by an earlier launch, or announced by a peer) fails the
// launch at its first use of data (usable), so the load's latency hides behind the
// pushes. Thread 0 counts its block in LaunchState.blocks as started (finish_launch
// counts it finished); the value is used only by finish_launch, so that latency is hidden too.
__device__ __forceinline__ WaitCtx wait_ctx(LaunchState* state, int rank) {
  WaitCtx c{state, rank, false, ld_volatile_u32(&state->broken), 0u};
  if (threadIdx.x == 0) c.started = atomicAdd(&state->blocks, 1u << 16);
  return c;
}

// Whether this thread may use data: false once the communicator failed for it, or if it
// was marked broken when the launch started (recorded then as kFailPeer). Every wait and
// barrier asks before it lets data through.
__device__ __forceinline__ bool usable(WaitCtx& c) {
  if (c.entry != 0u && !c.failed) fail(c, kFailPeer, (int)(c.entry & 0xffu) - 1, c.entry >> 8);
  return !c.failed;
}

// Rounds of a spin between two looks at the broken word and the clock: every thread of
// every block polling that one word each round slowed the polls of the data (0.4 us of a
// 4-GPU Lamport two-shot at 2 KiB, 0.9 at 512 KiB); a failure is still seen within
// microseconds.
constexpr u32 kSpinCheckRounds = 16;

// Spins until done() is true (returns true), or gives up (returns false): at once when
// the communicator already failed for this thread, when it is marked broken, or after
// the family's timeout (recorded as a timeout waiting for rank peer() at `site`); the
// last two are looked at every kSpinCheckRounds rounds.
template <class Peer, class Done>
__device__ __forceinline__ bool spin(WaitCtx& c, Peer peer, u32 site, Done done) {
  if (!usable(c)) return false;
  const u64 t0 = globaltimer();
  for (u32 k = 1;; ++k) {
    if (done()) return true;
    if (k % kSpinCheckRounds != 0u) continue;
    const u32 broken = ld_volatile_u32(&c.state->broken);
    if (broken != 0u) {
      fail(c, kFailPeer, (int)(broken & 0xffu) - 1, broken >> 8);
      return false;
    }
    if (globaltimer() - t0 > ld_volatile_u64(&c.state->timeout_ns)) {
      fail(c, kFailTimeout, peer(), site);
      return false;
    }
  }
}

// True while flag value `v` has not reached `target` (wrap-around safe).
__device__ __forceinline__ bool before(u32 v, u32 target) { return (int)(v - target) < 0; }

// Waits until *flag (written by `peer` with st_release_sys) reaches `target`; false if
// the wait gave up (spin). Acquire at system scope: the caller's later accesses see what
// the peer wrote before.
__device__ __forceinline__ bool wait_flag(const u32* flag, u32 target, WaitCtx& c, int peer,
                                          u32 site) {
  if (!before(ld_acquire_sys(flag), target)) return true;
  return spin(c, [=] { return peer; }, site, [&] { return !before(ld_acquire_sys(flag), target); });
}

// Barrier flags in every rank's segment: u32 flags[UB_FLAG_PHASES][UB_MAX_BLOCKS][UB_MAX_RANKS];
// slot [phase][b][s] of rank r is written by block b of rank s. Then the call signatures
// of the entry barrier: u64 sigs[UB_MAX_BLOCKS][UB_MAX_RANKS], slot [b][s] written by block
// b of rank s before its flag.
__device__ __forceinline__ u64 flag_offset(int phase, int block, int src) {
  return 4ull * (((u64)phase * UB_MAX_BLOCKS + block) * UB_MAX_RANKS + src);
}
__device__ __forceinline__ u64 signature_offset(int block, int src) {
  return flag_offset(UB_FLAG_PHASES, 0, 0) + 8ull * ((u64)block * UB_MAX_RANKS + src);
}

// Thread t of a barrier's arrival: rank t's signature, stored by its block before its flag
// (so visible after the acquire of that flag), compared with `sig`; a difference fails the
// communicator (kFailMismatch).
__device__ __forceinline__ bool signature_agrees(const char* mine, u64 flags_off, int t, u64 sig,
                                                 WaitCtx& c) {
  const u64 theirs = *(const volatile u64*)(mine + flags_off + signature_offset(blockIdx.x, t));
  if (theirs == sig) return true;
  fail(c, kFailMismatch, t, 0, sig, theirs);
  return false;
}

// Barrier of block blockIdx.x with the same block on every rank. Release/acquire at
// system scope: everything this block wrote before is visible to those blocks after,
// and everything they wrote before is visible to this block after. `value` must grow
// by one per launch (the launch epoch), so flags are never reset. With `sig` nonzero
// (the entry barrier), every rank's block also brings its call's signature, and the
// barrier fails unless all agree.
// tp.seg(r) gives the base of rank r's segment; flags_off locates the flag array in it.
// Returns, in every thread of the block, whether every wait succeeded; after a failure
// every thread of the block gives up its later waits. A block that failed before does not
// arrive (stores no flag), so no peer takes it for having done its part of the launch.
template <int N, class Tp>
__device__ bool block_barrier(const Tp& tp, u64 flags_off, int phase, u32 value, u64 sig,
                              WaitCtx& c, u32 site) {
  if (__syncthreads_or(!usable(c))) return c.failed = true, false;
  const int t = threadIdx.x;
  bool ok = true;
  if (t < N) {
    if (sig != 0) *(volatile u64*)(tp.seg(t) + flags_off + signature_offset(blockIdx.x, c.rank)) = sig;
    fence_sys();
    st_release_sys(tp.seg(t) + flags_off + flag_offset(phase, blockIdx.x, c.rank), value);
    ok = wait_flag((const u32*)(tp.seg(c.rank) + flags_off + flag_offset(phase, blockIdx.x, t)),
                   value, c, t, site);
    if (ok && sig != 0) ok = signature_agrees(tp.seg(c.rank), flags_off, t, sig, c);
  }
  ok = __syncthreads_and(ok);
  c.failed |= !ok;
  return ok;
}

// The first step of every entry point with a launch state: block 0 stamps the global
// timer into LaunchState.entered_ns (a word no kernel reads: the host reads it to see
// programmatic dependent launch in effect, a stamp earlier than the end of the kernel
// before), then the grid waits for the kernel before it (everything after reads the
// state, the input or the buffers) and lets the next one be scheduled (common.cuh).
__device__ __forceinline__ void enter_launch(LaunchState* state) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(&state->entered_ns), "l"(globaltimer()) : "memory");
  }
  enter_dependent();
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
// block reads nothing the others wrote; a fence would make every block wait for its
// outstanding NVLink stores before it counts itself done.
// LaunchState.blocks counts the blocks that started and finished, with atomics on one
// word (ordered as each block issued them): when the last block of this launch counts
// itself finished, exactly its gridDim.x blocks started, unless a launch of the same
// family ran at the same time on this rank (the two share buffers and state: a CUDA graph
// replayed on one stream while other calls ran on another), which fails the communicator
// (kFailConcurrent; the host raises ConcurrentUseError).
__device__ void finish_launch(WaitCtx& c, const LaunchView& l, u32 vecs) {
  __syncthreads();
  LaunchState* s = c.state;
  if (threadIdx.x == 0) {
    u32 one;  // 1, computed from c.started: this atomic issues after the start's returned
    asm volatile("and.b32 %0, %1, 0;\n\tadd.u32 %0, %0, 1;" : "=r"(one) : "r"(c.started));
    const u32 counts = atomicAdd(&s->blocks, one);
    if ((counts & 0xffffu) == gridDim.x - 1u) {
      if ((counts >> 16) != gridDim.x) report(s, c.rank, kFailConcurrent, c.rank, 0, 0, 0);
      s->blocks = 0u;
      s->prev_vecs = vecs;
      s->slot = l.slot == 2u ? 0u : l.slot + 1u;
      s->epoch = l.epoch + 1u;
    }
  }
}
