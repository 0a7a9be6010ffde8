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
//
// The reduce-scatter and the all-gather are the two halves of the same launch, built
// from the same phases: the reduce-scatter runs 1-4 with the result of step 3 written to
// this rank's output instead of every rank's buffer; the all-gather runs 2-5 with step 3
// storing this rank's input (no reduction) into every rank's buffer.
#include "rmsnorm.cuh"
#include "transport.cuh"

// Part [lo, hi) of every slice of `slice` vectors that block b handles.
struct SlicePart {
  u64 lo, hi;
};
__device__ __forceinline__ SlicePart slice_part(u64 slice) {
  const u64 part = (slice + gridDim.x - 1) / gridDim.x;
  const u64 lo = blockIdx.x * part;
  return {lo, lo + part < slice ? lo + part : slice};
}

// Phases 1 and 5: part p of every slice (vector i = s * slice + j, i < span.nvec) into
// local `to`, vector i being load(i).
template <class T, int N, class Load>
__device__ void copy_slices(const Span<T>& span, u64 slice, SlicePart p, char* to, Load load) {
  for (int s = 0; s < N; ++s) {
    for (u64 j = p.lo + threadIdx.x; j < p.hi; j += blockDim.x) {
      const u64 i = s * slice + j;
      if (i < span.nvec) span.store(to, i, load(i));  // never past element n
    }
  }
}

// Phase 5: the buffer `mine` (local) into dst, or after a failure poison into dst (the
// buffer itself when dst is null).
template <class T, int N>
__device__ void copy_out(const Span<T>& span, u64 slice, SlicePart p, const char* mine, char* dst, bool ok) {
  copy_slices<T, N>(span, slice, p, dst != nullptr ? dst : (char*)mine,
                    [&](u64 i) { return ok ? ld_relaxed_sys(mine + i * kVec) : Vec<T>::poison(); });
}

// Phase 3's reduce-scatter half: for each vector j of part p of slice `owner` (vector
// i = owner * slice + j < nvec of the buffer at buf_off of every segment), reduces it
// over every rank (transport order) and calls emit(i, j, off, r) with its offset and
// the result; U vectors in flight per thread.
template <class T, class Op, int N, class Tp, class Emit>
__device__ void reduce_part(const Tp& tp, u64 buf_off, u64 slice, u64 nvec, SlicePart p, bool go,
                            Emit emit) {
  constexpr int U = N >= 8 ? 2 : 4;  // vectors in flight per thread: U * N loads
  for (u64 j0 = p.lo + threadIdx.x; go && j0 < p.hi; j0 += (u64)blockDim.x * U) {
    u64 off[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 j = j0 + (u64)u * blockDim.x;
      const u64 i = tp.rank * slice + j;
      ok[u] = j < p.hi && i < nvec;
      off[u] = buf_off + i * kVec;
    }
    uint4 r[U];
    tp.template load_reduce<T, Op, U>(off, ok, r);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ok[u]) emit((off[u] - buf_off) / kVec, j0 + (u64)u * blockDim.x, off[u], r[u]);
    }
  }
}

template <class T, class Op, int N, class Tp>
__device__ void twoshot_allreduce(const Tp& tp, u64 buf_off, u64 flags_off, const char* src,
                                  char* dst, u64 n, u64 sig,
                                  LaunchState* state) {
  const Span<T> span(n);
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u64 slice = (span.nvec + N - 1) / N;
  const SlicePart p = slice_part(slice);
  char* mine = tp.seg(tp.rank) + buf_off;

  // 1. copy-in
  if (src != nullptr) copy_slices<T, N>(span, slice, p, mine, [&](u64 i) { return span.load(src, i); });
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);

  // 3. reduce-scatter by loads, all-gather by stores (only once every rank's block arrived)
  reduce_part<T, Op, N>(tp, buf_off, slice, span.nvec, p, entered, [&](u64 i, u64, u64 off, const uint4& r) {
    tp.template store_all<T>(off, r, span.partial(i) ? span.tail : 0);
  });
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);

  // 5. copy-out; after a failure, poison where the result would have gone (the buffer
  //    itself when it is the output)
  if (dst != nullptr || !ok) copy_out<T, N>(span, slice, p, mine, dst, ok);
  finish_launch(c, l, (u32)span.nvec);
}

// A reduce-scatter's or all-gather's geometry: N slices of k elements, `slice` whole
// vectors each (one: a slice's k elements; all: the N slices as whole vectors), and this
// block's part of every slice.
template <class T, int N> struct Slices {
  Span<T> one;
  u64 slice;
  Span<T> all;
  SlicePart p;
  __device__ explicit Slices(u64 k)
      : one(k), slice(one.nvec), all(N * one.nvec * Vec<T>::kPer), p(slice_part(one.nvec)) {}
};

// Reduce-scatter of N slices of k elements: slice s of the buffer (slice = ceil(k / kPer)
// vectors, whole vectors: the host pads each slice in the staging slot when k is not a
// multiple of kPer) reduced over every rank into this rank's `dst` (k elements, local)
// when s is this rank. Phases 1 (if src: the buffer's image, whole vectors), 2, 3 with the
// result to dst, 4 (no rank refills its buffer while another still loads from it); after
// a failure, poison into dst. dst may be this rank's slice of the buffer (in place: only
// the thread that loaded a vector writes it).
template <class T, class Op, int N, class Tp>
__device__ void twoshot_reduce_scatter(const Tp& tp, u64 buf_off, u64 flags_off, const char* src,
                                       char* dst, u64 k, u64 sig, LaunchState* state) {
  const Slices<T, N> g(k);
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);

  if (src != nullptr) {
    copy_slices<T, N>(g.all, g.slice, g.p, tp.seg(tp.rank) + buf_off, [&](u64 i) { return ld_weak(src + i * kVec); });
  }
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);
  reduce_part<T, Op, N>(tp, buf_off, g.slice, g.all.nvec, g.p, entered, [&](u64, u64 j, u64, const uint4& r) {
    g.one.store(dst, j, r);
  });
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);
  if (!ok) {
    for (u64 j = g.p.lo + threadIdx.x; j < g.p.hi; j += blockDim.x) g.one.store(dst, j, Vec<T>::poison());
  }
  finish_launch(c, l, (u32)g.all.nvec);
}

// All-gather of N slices of k elements into the buffer (slice s at vector s * slice,
// slice = ceil(k / kPer) whole vectors, padded as for the reduce-scatter): phase 2, then
// 3 storing this rank's k elements (from `src`, local, or when null already in its slice
// of the buffer) into its slice of every rank's buffer, 4, and 5 (if dst: the buffer's
// image, whole vectors; after a failure poison into dst, or the buffer when it is the
// output).
template <class T, int N, class Tp>
__device__ void twoshot_all_gather(const Tp& tp, u64 buf_off, u64 flags_off, const char* src,
                                   char* dst, u64 k, u64 sig, LaunchState* state) {
  const Slices<T, N> g(k);
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  char* mine = tp.seg(tp.rank) + buf_off;

  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);
  for (u64 j = g.p.lo + threadIdx.x; entered && j < g.p.hi; j += blockDim.x) {
    const u64 off = buf_off + (tp.rank * g.slice + j) * kVec;
    tp.template store_all<T>(off, src != nullptr ? g.one.load(src, j) : ld_weak(mine - buf_off + off), 0);
  }
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);
  if (dst != nullptr || !ok) copy_out<T, N>(g.all, g.slice, g.p, mine, dst, ok);
  finish_launch(c, l, (u32)g.all.nvec);
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
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  twoshot_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, buf_off, flags_off, src, dst, n, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_TWOSHOT_THREADS)
ub_twoshot_rs(char* base, u64 stride, int rank, char* mc, u64 flags_off, u64 buf_off,
              const char* src, char* dst, u64 k, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  twoshot_reduce_scatter<UB_T, UB_OP, UB_NRANKS>(tp, buf_off, flags_off, src, dst, k, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_TWOSHOT_THREADS)
ub_twoshot_ag(char* base, u64 stride, int rank, char* mc, u64 flags_off, u64 buf_off,
              const char* src, char* dst, u64 k, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  twoshot_all_gather<UB_T, UB_NRANKS>(tp, buf_off, flags_off, src, dst, k, sig, state);
}

#if UB_FUSED_T  // the fused entry point: 16- and 32-bit floating types only (common.cuh)
extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_twoshot_norm(char* base, u64 stride, int rank, char* mc, u64 buf_off, u64 res_off,
                u64 flags_off, const char* x, u64 rows, u64 hidden, const char* residual,
                const char* bias, const char* weight, char* normed, char* res_out, float eps,
                u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  twoshot_add_rmsnorm<UB_T, UB_NRANKS>(tp, buf_off, res_off, flags_off, x, rows, a, sig, state);
}
#endif
