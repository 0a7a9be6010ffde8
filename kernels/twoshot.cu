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
#include "rmsnorm.cuh"
#include "transport.cuh"

template <class T, class Op, int N, class Tp>
__device__ void twoshot_allreduce(const Tp& tp, u64 buf_off, u64 flags_off, const char* src,
                                  char* dst, u64 n, u64 sig,
                                  LaunchState* state) {
  constexpr int U = N >= 8 ? 2 : 4;  // vectors in flight per thread: U * N loads
  const Span<T> span(n);
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
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
        if (i < span.nvec) span.store(mine, i, span.load(src, i));  // never past element n
      }
    }
  }
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);

  // 3. reduce-scatter by loads, all-gather by stores (only once every rank's block arrived)
  for (u64 j0 = lo + threadIdx.x; entered && j0 < hi; j0 += (u64)blockDim.x * U) {
    u64 off[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 j = j0 + (u64)u * blockDim.x;
      const u64 i = tp.rank * slice + j;
      ok[u] = j < hi && i < span.nvec;
      off[u] = buf_off + i * kVec;
    }
    uint4 r[U];
    tp.template load_reduce<T, Op, U>(off, ok, r);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ok[u]) {
        const u64 i = (off[u] - buf_off) / kVec;
        tp.template store_all<T>(off[u], r[u], span.partial(i) ? span.tail : 0);
      }
    }
  }
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);

  // 5. copy-out; after a failure, poison where the result would have gone (the buffer
  //    itself when it is the output)
  if (dst != nullptr || !ok) {
    char* to = dst != nullptr ? dst : mine;
    for (int s = 0; s < N; ++s) {
      for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const u64 i = s * slice + j;
        if (i < span.nvec) span.store(to, i, ok ? ld_relaxed_sys(mine + i * kVec) : Vec<T>::poison());
      }
    }
  }
  finish_launch(c, l, (u32)span.nvec);
}

// Fused all-reduce + residual add + RMSNorm (rmsnorm.cuh) of `rows` rows of a.hidden
// elements (a multiple of the vector width). Rows are split among ranks: rank r owns rows
// [r * rpr, (r + 1) * rpr). The input is copied into buffer `buf_off`; between the
// barriers each rank reduces its own rows, normalizes them once, and stores the normed
// rows into every rank's `buf_off` and the residual sums into every rank's `res_off`;
// after the exit barrier every rank copies both out. Block b handles local row j of every
// rank's share for j = b, b + gridDim.x, ..., in every phase, so again each barrier
// only joins block b of every rank.
template <class T, int N, class Tp>
__device__ void twoshot_add_rmsnorm(const Tp& tp, u64 buf_off, u64 res_off, u64 flags_off,
                                    const char* src, u64 rows, const NormArgs& a, u64 sig,
                                    LaunchState* state) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  const u64 rpr = (rows + N - 1) / N;
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  char* buf = tp.seg(tp.rank) + buf_off;
  char* res = tp.seg(tp.rank) + res_off;

  for (int s = 0; s < N; ++s) {  // 1. copy-in
    for (u64 row = s * rpr + blockIdx.x; row < rows && row < (s + 1) * rpr; row += gridDim.x) {
      for (u64 v = threadIdx.x; v < vpr; v += blockDim.x) {
        st_weak(buf + (row * vpr + v) * kVec, ld_weak(src + (row * vpr + v) * kVec));
      }
    }
  }
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);

  // 2. reduce my rows, add, normalize, store both results into every rank (only once
  //    every rank's block arrived)
  const u64 end = (tp.rank + 1) * rpr < rows ? (tp.rank + 1) * rpr : rows;
  RowGroup g = row_group();  // launched without clusters: the block
  for (u64 row = tp.rank * rpr + blockIdx.x; entered && row < end; row += gridDim.x) {
    float ss = 0.f;
    for (u64 v = threadIdx.x; v < vpr; v += blockDim.x) {
      const u64 off = (row * vpr + v) * kVec;
      const u64 at[1] = {buf_off + off};
      const bool ok[1] = {true};
      const RowOperands o = load_operands<T>(a, row, v);
      uint4 ar[1];
      tp.template load_reduce<T, OpSum, 1>(at, ok, ar);
      const uint4 r = settle<T>(add_residual<T>(o, ar[0]));
      tp.template store_all<T>(res_off + off, r, 0);
      ss += sum_squares<T>(r);
    }
    const float scale = rms_scale(row_sum(g, ss), a.hidden, a.eps);
    for (u64 v = threadIdx.x; v < vpr; v += blockDim.x) {
      const u64 off = (row * vpr + v) * kVec;
      tp.template store_all<T>(buf_off + off, normalize<T>(a, v, ld_weak(res + off), scale), 0);
    }
  }
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);

  for (int s = 0; s < N; ++s) {  // 3. copy-out, or poison after a failure
    for (u64 row = s * rpr + blockIdx.x; row < rows && row < (s + 1) * rpr; row += gridDim.x) {
      for (u64 v = threadIdx.x; v < vpr; v += blockDim.x) {
        const u64 off = (row * vpr + v) * kVec;
        st_weak(a.normed + off, ok ? ld_relaxed_sys(buf + off) : Vec<T>::poison());
        st_weak(a.res_out + off, ok ? ld_relaxed_sys(res + off) : Vec<T>::poison());
      }
    }
  }
  finish_launch(c, l, (u32)(rows * vpr));
}

// ---- entry points, instantiated per (UB_T, UB_OP, UB_NRANKS, UB_TRANSPORT) ---------

extern "C" __global__ void __launch_bounds__(UB_TWOSHOT_THREADS)
ub_twoshot(char* base, u64 stride, int rank, char* mc, u64 flags_off, u64 buf_off,
           const char* src, char* dst, u64 n, u64 sig, LaunchState* state) {
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  twoshot_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, buf_off, flags_off, src, dst, n, sig, state);
}

#if UB_FUSED_T  // the fused entry point: 16- and 32-bit floating types only (common.cuh)
extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_twoshot_norm(char* base, u64 stride, int rank, char* mc, u64 buf_off, u64 res_off,
                u64 flags_off, const char* x, u64 rows, u64 hidden, const char* residual,
                const char* bias, const char* weight, char* normed, char* res_out, float eps,
                u64 sig, LaunchState* state) {
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  twoshot_add_rmsnorm<UB_T, UB_NRANKS>(tp, buf_off, res_off, flags_off, x, rows, a, sig, state);
}
#endif
