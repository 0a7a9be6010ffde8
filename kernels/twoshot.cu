// Two-shot all-reduce: copy-in, entry barrier, reduce-scatter + all-gather, exit barrier,
// copy-out.
//
// The message lives in a buffer at the same offset of every rank's segment: a user's
// symmetric array (zero copy), or the staging slot, filled from `src` in phase 1 and
// copied to `dst` in phase 3. Rank r owns slice r (a contiguous range of vectors). Block b
// handles part b of every slice, in every phase, so each barrier only joins block b of
// every rank:
//   1. copy-in     part b of every slice, src -> own buffer              (if src)
//   2. barrier     block b of every rank has its part b in place
//   3. RS + AG     part b of own slice: load from every rank, reduce (fixed order),
//                  store the result into every rank's buffer ("UB in place")
//   4. barrier     block b of every rank has stored its part b everywhere
//   5. copy-out    part b of every slice, own buffer -> dst               (if dst)
// Per-block flags carry the launch epoch (monotonic, never reset); release/acquire at
// system scope. The grid must not exceed what the GPU runs at once (host: <= SM count).
#include "sync.cuh"
#include "transport.cuh"

#ifndef UB_TWOSHOT_THREADS
#define UB_TWOSHOT_THREADS 512
#endif

template <class T, class Op, int N, class Tp>
__device__ void twoshot_allreduce(const Tp& tp, u64 buf_off, u64 flags_off, const char* src,
                                  char* dst, u64 n, LaunchState* state, ErrorRecord* err,
                                  u64 timeout_ns) {
  constexpr int U = N >= 8 ? 2 : 4;  // vectors in flight per thread: U * N loads
  const Span<T> span(n);
  u32 epoch, prev_vecs;
  read_launch_state(state, epoch, prev_vecs);
  const WaitCtx c{err, timeout_ns, tp.rank, epoch};
  const u64 slice = (span.nvec + N - 1) / N;
  const u64 part = (slice + gridDim.x - 1) / gridDim.x;
  const u64 lo = blockIdx.x * part;
  const u64 hi = lo + part < slice ? lo + part : slice;
  char* mine = tp.seg(tp.rank) + buf_off;

  // 1. copy-in
  if (src != nullptr) {
    for (int s = 0; s < N; ++s) {
      for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const u64 i = s * slice + j;
        if (i < span.nvec) st_weak(mine + i * 16, span.load(src, i));
      }
    }
  }
  block_barrier<N>(tp, flags_off, 0, epoch + 1u, c, kSiteEntryBarrier);

  // 3. reduce-scatter by loads, all-gather by stores
  for (u64 j0 = lo + threadIdx.x; j0 < hi; j0 += (u64)blockDim.x * U) {
    u64 off[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 j = j0 + (u64)u * blockDim.x;
      const u64 i = tp.rank * slice + j;
      ok[u] = j < hi && i < span.nvec;
      off[u] = buf_off + i * 16;
    }
    uint4 r[U];
    tp.template load_reduce<T, Op, U>(off, ok, r);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ok[u]) {
        const u64 i = (off[u] - buf_off) / 16;
        tp.template store_all<T>(off[u], r[u], span.partial(i) ? span.tail : 0);
      }
    }
  }
  block_barrier<N>(tp, flags_off, 1, epoch + 1u, c, kSiteExitBarrier);

  // 5. copy-out
  if (dst != nullptr) {
    for (int s = 0; s < N; ++s) {
      for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const u64 i = s * slice + j;
        if (i < span.nvec) span.store(dst, i, ld_relaxed_sys(mine + i * 16));
      }
    }
  }
  finish_launch(state, epoch, (u32)span.nvec);
}

// ---- entry point, instantiated per (UB_T, UB_OP, UB_NRANKS) by the host ----------

extern "C" __global__ void __launch_bounds__(UB_TWOSHOT_THREADS)
ub_twoshot(char* base, u64 stride, int rank, u64 buf_off, u64 flags_off, const char* src,
           char* dst, u64 n, LaunchState* state, ErrorRecord* err, u64 timeout_ns) {
  const Unicast<UB_NRANKS> tp{base, stride, rank};
  twoshot_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, buf_off, flags_off, src, dst, n, state, err,
                                            timeout_ns);
}
