// Lamport two-shot all-reduce: reduce-scatter and all-gather by pushes into
// sentinel-polled buffers (protocol: lamport.cuh). No barrier, and only stores cross
// NVLink.
//
// Rank r owns slice r of the message. Every rank
//   1. pushes its call signature into header [rank] of every rank's reduce-scatter area,
//      then slice s of its input into slot [rank] of rank s's reduce-scatter area,
//   2. re-poisons the previous launch's buffer in its own segment,
//   3. polls the N slots of its own slice, reduces them in rank order, pushes the result
//      into every other rank's all-gather area and writes it to `out` (the first vectors
//      once every rank's signature has arrived and agrees with its own),
//   4. polls the other slices in its all-gather area and writes them to `out`.
// A peer needs this rank's step-3 data of a launch to finish that launch, so it is at
// most one launch ahead, as in the one-shot kernel.
//
// Layout of a set (same offset in every segment): buffer b (of 3) at
// set_off + b * 2 * area_bytes, its reduce-scatter area first (the N headers, a line
// each, at its end: headers<N>), then its all-gather area.
#include "lamport.cuh"
#include "rmsnorm.cuh"
#include "transport.cuh"

// Block b handles part b of every slice in every step, so it only waits for block b of
// every rank. The reduce-scatter area holds N slots of `slice` vectors (slot r: pushed by
// rank r); the all-gather area holds the message. N * slice * kVec <= area_bytes.
// Slices and parts are whole multiples of UB_TWOSHOT_ALIGN_VECS vectors, so that every warp's
// 512-byte access covers whole 128-byte lines (a shifted warp touches 5 lines instead of
// 4, and a partial line costs an NVLink write as a whole one does). A thread handles the
// same index j of every slice in every step: its step-3 and step-4 writes to `out` hit
// only elements it read from `x` in step 1, so `out` may be `x`.
__device__ __forceinline__ u64 round_up(u64 v, u64 to) { return (v + to - 1) / to * to; }

// Part [lo, hi) of every slice of `slice` vectors that this block handles.
struct BlockPart {
  u64 lo, hi;
};
__device__ __forceinline__ BlockPart block_part(u64 slice) {
  const u64 part = round_up((slice + gridDim.x - 1) / gridDim.x, UB_TWOSHOT_ALIGN_VECS);
  const u64 lo = blockIdx.x * part;
  return {lo, lo + part < slice ? lo + part : slice};
}

// Step 1 of both kernels: part p of slice s of my input (vector i = s * slice + j for
// i < nvec, read by load(i)) into slot [rank] of rank s's reduce-scatter area at rs (all N
// loads before the stores).
template <class T, int N, class Tp, class Load>
__device__ void push_slices(const Tp& tp, u64 rs, u64 slice, u64 nvec, BlockPart p, Load load) {
  for (u64 j = p.lo + threadIdx.x; j < p.hi; j += blockDim.x) {
    uint4 v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const u64 i = tp.peer(k) * slice + j;
      if (i < nvec) v[k] = load(i);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int s = tp.peer(k);
      if (s * slice + j < nvec) {
        st_relaxed_sys(tp.seg(s) + rs + ((u64)tp.rank * slice + j) * kVec, clear_sentinel<T>(v[k]));
      }
    }
  }
}

// The headers of a reduce-scatter area: its last N * kHeader bytes (the host makes the
// area a multiple of kHeader).
template <int N> __device__ __forceinline__ u64 headers(u64 rs, u64 area_bytes) { return rs + area_bytes - N * kHeader; }

// Step 1 of every kernel of the family, first: pushes this rank's signature into header
// [rank] of every rank's current reduce-scatter area.
template <int N, class Tp>
__device__ void lamport_twoshot_sign(const Tp& tp, const LamportLaunch& l, u64 area_bytes, u64 sig) {
  push_signature(tp, headers<N>(l.cur, area_bytes), sig);
}

// Step 3 of the all-reduce and the reduce-scatter: polls the N slots of vector j of this
// rank's slice (i = rank * slice + j < nvec) in the reduce-scatter area at rs (the first
// one together with the signatures, emitted once the block agrees), reduces them in rank
// order (-0.0 cleared from the result, so that every rank stores the same bits) and
// calls emit(i, j, r); after a failure r is poison, which goes the same way, so the other
// ranks finish with poison, not waits.
template <class T, class Op, int N, class Tp, class Emit>
__device__ void lamport_reduce_own(const Tp& tp, u64 rs, u64 area_bytes, u64 slice, u64 nvec, BlockPart p,
                                   u64 sig, WaitCtx& c, Emit emit) {
  const char* mine = tp.seg(tp.rank);
  uint4 v[N];
  const u64 j0 = p.lo + threadIdx.x;
  const bool has = j0 < p.hi && tp.rank * slice + j0 < nvec;
  if (has) lamport_load<N>(mine + rs, slice * kVec, j0, v);
  const uint4 r0 = lamport_collect_first<T, Op, N>(mine + rs, slice * kVec, j0, v, has,
                                                   mine + headers<N>(rs, area_bytes), sig, c);
  if (has) emit(tp.rank * slice + j0, j0, clear_sentinel<T>(r0));
  for (u64 j = j0 + blockDim.x; j < p.hi; j += blockDim.x) {
    const u64 i = tp.rank * slice + j;
    if (i < nvec) emit(i, j, clear_sentinel<T>(lamport_reduce<T, Op, N>(mine + rs, slice * kVec, j, c)));
  }
}

// Step 4 of the all-reduce and the all-gather: polls vector j of every other rank's slice
// (i = s * slice + j < nvec) in the all-gather area `ag` of this rank's segment (all loads
// before the first wait) and calls store(i, v), v being poison if the wait gave up.
template <class T, int N, class Tp, class Store>
__device__ void lamport_gather_others(const Tp& tp, const char* ag, u64 slice, u64 nvec, BlockPart p, WaitCtx& c,
                                      Store store) {
  for (u64 j = p.lo + threadIdx.x; j < p.hi; j += blockDim.x) {
    uint4 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s) {
      if (s != tp.rank && s * slice + j < nvec) v[s] = ld_volatile(ag + (s * slice + j) * kVec);
    }
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const u64 i = s * slice + j;
      if (s != tp.rank && i < nvec) store(i, lamport_wait<T>(ag + i * kVec, v[s], c, s) ? v[s] : Vec<T>::poison());
    }
  }
}

// Step 2 of every kernel of the family: re-poisons both areas of the previous launch's
// buffer and its headers.
template <class T, int N, class Tp>
__device__ void lamport_twoshot_repoison(const Tp& tp, const LamportLaunch& l, u64 area_bytes) {
  char* mine = tp.seg(tp.rank);
  lamport_repoison<T>(mine + l.old, l.s.prev_vecs);
  lamport_repoison<T>(mine + l.old + area_bytes, l.s.prev_vecs);
  repoison_headers<T, N>(mine + headers<N>(l.old, area_bytes));
}

template <class T, class Op, int N, class Tp>
__device__ void lamport_twoshot_allreduce(const Tp& tp, u64 set_off, u64 area_bytes,
                                          const char* x, char* out, u64 n, u64 sig,
                                          LaunchState* state) {
  const Span<T> span(n);
  const LamportLaunch l = lamport_begin(state, set_off, 2 * area_bytes);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u64 slice = round_up((span.nvec + N - 1) / N, UB_TWOSHOT_ALIGN_VECS);
  const BlockPart p = block_part(slice);
  const u64 rs = l.cur, ag = l.cur + area_bytes;

  // 1. Push my signature into header [rank] of every rank, slice s of my input into slot
  //    [rank] of rank s.
  lamport_twoshot_sign<N>(tp, l, area_bytes, sig);
  push_slices<T, N>(tp, rs, slice, span.nvec, p, [&](u64 i) { return span.load(x, i); });
  // 2. Re-poison both areas of the previous launch's buffer.
  lamport_twoshot_repoison<T, N>(tp, l, area_bytes);
  // 3. Reduce my slice; push it into every other rank's all-gather area, write it to `out`.
  lamport_reduce_own<T, Op, N>(tp, rs, area_bytes, slice, span.nvec, p, sig, c, [&](u64 i, u64, const uint4& r) {
    tp.push_peers(ag + i * kVec, r);
    span.store(out, i, r);
  });
  // 4. Gather the other slices from my all-gather area.
  lamport_gather_others<T, N>(tp, tp.seg(tp.rank) + ag, slice, span.nvec, p, c,
                              [&](u64 i, const uint4& v) { span.store(out, i, v); });
  finish_launch(c, l.s, (u32)(N * slice));
}

// A reduce-scatter's or all-gather's launch: N slices of k elements, `slice` whole vectors
// each (nvec in all; span: a slice's k elements), this launch's buffer and this block's
// part of every slice.
template <class T, int N> struct LamportSlices {
  Span<T> span;
  u64 slice, nvec;
  LamportLaunch l;
  BlockPart p;
  __device__ LamportSlices(u64 k, LaunchState* state, u64 set_off, u64 area_bytes)
      : span(k), slice(span.nvec), nvec(N * span.nvec), l(lamport_begin(state, set_off, 2 * area_bytes)),
        p(block_part(span.nvec)) {}
};

// Reduce-scatter of N slices of k elements: x holds them as N * slice whole vectors
// (slice = ceil(k / kPer); the host pads each slice in the staging slot when k is not a
// multiple of kPer), out (local) gets this rank's k reduced elements. Steps 1-3 of the
// all-reduce, step 3 writing to `out` only. out may be this rank's slice of x.
template <class T, class Op, int N, class Tp>
__device__ void lamport_twoshot_reduce_scatter(const Tp& tp, u64 set_off, u64 area_bytes, const char* x,
                                               char* out, u64 k, u64 sig, LaunchState* state) {
  const LamportSlices<T, N> g(k, state, set_off, area_bytes);
  WaitCtx c = wait_ctx(state, tp.rank);

  lamport_twoshot_sign<N>(tp, g.l, area_bytes, sig);
  push_slices<T, N>(tp, g.l.cur, g.slice, g.nvec, g.p, [&](u64 i) { return ld_weak(x + i * kVec); });
  lamport_twoshot_repoison<T, N>(tp, g.l, area_bytes);
  lamport_reduce_own<T, Op, N>(tp, g.l.cur, area_bytes, g.slice, g.nvec, g.p, sig, c,
                               [&](u64, u64 j, const uint4& r) { g.span.store(out, j, r); });
  finish_launch(c, g.l.s, (u32)g.nvec);
}

// All-gather of N slices of k elements: this rank's x (k elements, local, -0.0 sent as
// +0.0) goes into its slice of every other rank's all-gather area and of `out`; out
// (local) gets every slice as N * slice whole vectors (slice = ceil(k / kPer); padded as
// for the reduce-scatter). Step 1 pushes, steps 2 and 4 of the all-reduce, the signatures
// checked before the gather. x may be this rank's slice of out.
template <class T, int N, class Tp>
__device__ void lamport_twoshot_all_gather(const Tp& tp, u64 set_off, u64 area_bytes, const char* x,
                                           char* out, u64 k, u64 sig, LaunchState* state) {
  const LamportSlices<T, N> g(k, state, set_off, area_bytes);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u64 ag = g.l.cur + area_bytes;

  lamport_twoshot_sign<N>(tp, g.l, area_bytes, sig);
  for (u64 j = g.p.lo + threadIdx.x; j < g.p.hi; j += blockDim.x) {
    const u64 i = tp.rank * g.slice + j;
    const uint4 v = clear_sentinel<T>(g.span.load(x, j));
    tp.push_peers(ag + i * kVec, v);
    st_weak(out + i * kVec, v);
  }
  lamport_twoshot_repoison<T, N>(tp, g.l, area_bytes);
  lamport_agree<T, N>(tp.seg(tp.rank) + headers<N>(g.l.cur, area_bytes), sig, c);
  lamport_gather_others<T, N>(tp, tp.seg(tp.rank) + ag, g.slice, g.nvec, g.p, c,
                              [&](u64 i, const uint4& v) { st_weak(out + i * kVec, v); });
  finish_launch(c, g.l.s, (u32)g.nvec);
}

// A row's scale as the fused kernel pushes it: one byte of its fp32 bits per 32-bit word,
// so that no element of any width can look like the sentinel.
__device__ __forceinline__ uint4 pack_scale(float s) {
  const u32 b = __float_as_uint(s);
  return make_uint4(b & 0xffu, (b >> 8) & 0xffu, (b >> 16) & 0xffu, b >> 24);
}
__device__ __forceinline__ float unpack_scale(const uint4& v) {
  return __uint_as_float(v.x | (v.y << 8) | (v.z << 16) | (v.w << 24));
}

// Fused all-reduce + residual add + RMSNorm (rmsnorm.cuh) of `rows` rows of a.hidden
// elements (a multiple of the vector width). Rank r owns rows [r * rpr, (r + 1) * rpr) (its
// slice, pushed in step 1 as the all-reduce pushes slices) and is the only one to
// normalize them: in step 3 its row groups (rmsnorm.cuh: clusters when it owns few rows)
// reduce its rows, add bias and residual, push the residual sums to every other rank,
// finish the rows (res_out, row_sum, normed) and push each row's scale; in step 4 every
// rank finishes the other rows vector by vector (normed from the pushed residual sum and
// scale: the owner's bits), with no row-wide step. Slot r of the reduce-scatter area
// holds rpr rows; the all-gather area holds N * rpr rows, then N * rpr scales (a vector
// each): N * rpr * (hidden * sizeof(T) + 16) <= area_bytes. The outputs must not overlap
// x (another block may still be pushing it).
template <class T, int N, class Tp>
__device__ void lamport_twoshot_add_rmsnorm(const Tp& tp, u64 set_off, u64 area_bytes,
                                            const char* x, u64 rows, const NormArgs& a,
                                            u64 sig, LaunchState* state) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  const u64 rpr = (rows + N - 1) / N;
  const LamportLaunch l = lamport_begin(state, set_off, 2 * area_bytes);
  WaitCtx c = wait_ctx(state, tp.rank);
  char* mine = tp.seg(tp.rank);
  const u64 rs = l.cur, ag = l.cur + area_bytes, scales = ag + N * rpr * vpr * kVec;
  const u64 step = (u64)blockDim.x * gridDim.x;
  constexpr int kBatch = 4;

  // 1. Push my signature, then my rows of rank s's slice into slot [rank] of rank s (as
  //    the all-reduce does).
  lamport_twoshot_sign<N>(tp, l, area_bytes, sig);
  push_slices<T, N>(tp, rs, rpr * vpr, rows * vpr, block_part(rpr * vpr), [&](u64 i) { return ld_weak(x + i * kVec); });
  // 2. Re-poison both areas of the previous launch's buffer.
  lamport_twoshot_repoison<T, N>(tp, l, area_bytes);
  // 3. My rows, by row groups, once the signatures agree: reduce, add bias and residual,
  //    push the sums, finish the row here, pushing its scale as soon as it is known.
  lamport_agree<T, N>(mine + headers<N>(rs, area_bytes), sig, c);
  const u64 first = (u64)tp.rank * rpr < rows ? (u64)tp.rank * rpr : rows;
  const u64 last = first + rpr < rows ? first + rpr : rows;
  RowGroup g = row_group(&c);
  for (u64 row = first + g.id; row < last; row += g.count) {
    finish_row<T>(a, row, g, [&](u64 v) {
      const RowOperands o = load_operands<T>(a, row, v);
      const uint4 r = lamport_reduce<T, OpSum, N>(mine + rs, rpr * vpr * kVec, (row - first) * vpr + v, c);
      const uint4 sum = clear_sentinel<T>(add_residual<T>(o, settle<T>(r)));
      tp.push_peers(ag + (row * vpr + v) * kVec, sum);
      return sum;
    }, [&](float scale) {
      if (g.rank == 0 && threadIdx.x == 0) tp.push_peers(scales + row * kVec, pack_scale(scale));
    });
  }
  // 4. The other ranks' rows, vector by vector over every thread (kBatch polls issued
  //    before the first wait): res_out and normed from the pushed sum and scale. The
  //    scale is polled once the sum has arrived (it is pushed after the row's sums):
  //    polling both at once kept every thread of a row spinning on one address.
  const u64 others = (rows - (last - first)) * vpr;
  // vector i of the message that is vector q of the other rows (mine skipped)
  const auto other = [&](u64 q) { return q < first * vpr ? q : q + (last - first) * vpr; };
  for (u64 q0 = (u64)blockIdx.x * blockDim.x + threadIdx.x; q0 < others; q0 += kBatch * step) {
    uint4 sum[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const u64 q = q0 + u * step;
      if (q < others) sum[u] = ld_volatile(mine + ag + other(q) * kVec);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const u64 q = q0 + u * step;
      if (q < others) {
        const u64 i = other(q), row = i / vpr, v = i - row * vpr;
        const int owner = (int)(row / rpr);
        bool ok = lamport_wait<T>(mine + ag + i * kVec, sum[u], c, owner);
        uint4 scale = ld_volatile(mine + scales + row * kVec);
        ok = lamport_wait<T>(mine + scales + row * kVec, scale, c, owner) && ok;
        st_weak(a.res_out + i * kVec, ok ? sum[u] : Vec<T>::poison());
        st_weak(a.normed + i * kVec, ok ? normalize<T>(a, v, sum[u], unpack_scale(scale)) : Vec<T>::poison());
      }
    }
  }
  row_group_done(g);
  finish_launch(c, l.s, (u32)(N * rpr * (vpr + 1)));
}

// ---- entry points -------------------------------------------------------------------
// Instantiated per (UB_T, UB_OP, UB_NRANKS, UB_TRANSPORT); the fused one carries the
// cluster shape UB_CLUSTER too (rmsnorm.cuh). Both ask for one resident block per SM,
// which lets ptxas use the registers of a lone block: with the thread bound alone it kept
// 64 per thread and spilled (16 bytes of spill stores in ub_lamport_twoshot).

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_TWOSHOT_THREADS, 1)
ub_lamport_twoshot(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 area_bytes,
                   const char* x, char* out, u64 n, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  lamport_twoshot_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, set_off, area_bytes, x, out, n, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_TWOSHOT_THREADS, 1)
ub_lamport_twoshot_rs(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 area_bytes,
                      const char* x, char* out, u64 k, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  lamport_twoshot_reduce_scatter<UB_T, UB_OP, UB_NRANKS>(tp, set_off, area_bytes, x, out, k, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_TWOSHOT_THREADS, 1)
ub_lamport_twoshot_ag(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 area_bytes,
                      const char* x, char* out, u64 k, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  lamport_twoshot_all_gather<UB_T, UB_NRANKS>(tp, set_off, area_bytes, x, out, k, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_NORM_BLOCK_THREADS, 1) UB_CLUSTER_DIMS
ub_lamport_twoshot_norm(char* base, u64 stride, int rank, char* mc, u64 set_off,
                        u64 area_bytes, const char* x, u64 rows, u64 hidden,
                        const char* residual, const char* bias, const char* weight,
                        char* normed, char* res_out, float eps, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  lamport_twoshot_add_rmsnorm<UB_T, UB_NRANKS>(tp, set_off, area_bytes, x, rows, a, sig, state);
}
