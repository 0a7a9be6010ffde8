// Lamport two-shot all-reduce: reduce-scatter and all-gather by pushes into
// sentinel-polled buffers (protocol: lamport.cuh). No barrier, and only stores cross
// NVLink.
//
// Rank r owns slice r of the message. Every rank
//   1. pushes slice s of its input into slot [rank] of rank s's reduce-scatter area,
//   2. re-poisons the previous launch's buffer in its own segment,
//   3. polls the N slots of its own slice, reduces them in rank order, pushes the result
//      into every other rank's all-gather area and writes it to `out`,
//   4. polls the other slices in its all-gather area and writes them to `out`.
// A peer needs this rank's step-3 data of a launch to finish that launch, so it is at
// most one launch ahead, as in the one-shot kernel.
//
// Layout of a set (same offset in every segment): buffer b (of 3) at
// set_off + b * 2 * area_bytes, its reduce-scatter area first, then its all-gather area.
#include "lamport.cuh"
#include "rmsnorm.cuh"
#include "transport.cuh"

#ifndef UB_LAMPORT_TWOSHOT_THREADS
#define UB_LAMPORT_TWOSHOT_THREADS 512
#endif

// Block b handles part b of every slice in every step, so it only waits for block b of
// every rank. The reduce-scatter area holds N slots of `slice` vectors (slot r: pushed by
// rank r); the all-gather area holds the message. N * slice * 16 <= area_bytes.
// Slices and parts are whole multiples of kAlignVecs vectors, so that every warp's
// 512-byte access covers whole 128-byte lines (a shifted warp touches 5 lines instead of
// 4, and a partial line costs an NVLink write as a whole one does). A thread handles the
// same index j of every slice in every step: its step-3 and step-4 writes to `out` hit
// only elements it read from `x` in step 1, so `out` may be `x`.
constexpr u64 kAlignVecs = 32;
__device__ __forceinline__ u64 round_up(u64 v, u64 to) { return (v + to - 1) / to * to; }

template <class T, class Op, int N, class Tp>
__device__ void lamport_twoshot_allreduce(const Tp& tp, u64 set_off, u64 area_bytes,
                                          const char* x, char* out, u64 n, LaunchState* state,
                                          ErrorRecord* err, u64 timeout_ns) {
  const Span<T> span(n);
  const LamportLaunch l = lamport_begin(state, set_off, 2 * area_bytes);
  const WaitCtx c{err, timeout_ns, tp.rank, l.epoch};
  const u64 slice = round_up((span.nvec + N - 1) / N, kAlignVecs);
  const u64 part = round_up((slice + gridDim.x - 1) / gridDim.x, kAlignVecs);
  const u64 lo = blockIdx.x * part;
  const u64 hi = lo + part < slice ? lo + part : slice;
  char* mine = tp.seg(tp.rank);
  const u64 rs = l.cur, ag = l.cur + area_bytes;

  // 1. Push slice s of my input into slot [rank] of rank s (all N loads before the stores).
  for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
    uint4 v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const u64 i = tp.peer(k) * slice + j;
      if (i < span.nvec) v[k] = span.load(x, i);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int s = tp.peer(k);
      if (s * slice + j < span.nvec) {
        st_weak(tp.seg(s) + rs + ((u64)tp.rank * slice + j) * 16, clear_sentinel<T>(v[k]));
      }
    }
  }
  // 2. Re-poison both areas of the previous launch's buffer.
  lamport_repoison<T>(mine + l.old, l.prev_vecs);
  lamport_repoison<T>(mine + l.old + area_bytes, l.prev_vecs);
  // 3. Reduce my slice in rank order; push it into every other rank's all-gather area,
  //    write it to `out` (every rank stores the same bits: -0.0 cleared everywhere).
  for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
    const u64 i = tp.rank * slice + j;
    if (i < span.nvec) {
      const uint4 r = clear_sentinel<T>(lamport_reduce<T, Op, N>(mine + rs, slice * 16, j, c));
      tp.store_peers(ag + i * 16, r);
      span.store(out, i, r);
    }
  }
  // 4. Gather the other slices from my all-gather area (all loads before the first wait).
  for (u64 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
    uint4 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s) {
      if (s != tp.rank && s * slice + j < span.nvec) v[s] = ld_volatile(mine + ag + (s * slice + j) * 16);
    }
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const u64 i = s * slice + j;
      if (s != tp.rank && i < span.nvec) {
        lamport_wait<T>(mine + ag + i * 16, v[s], c, s);
        span.store(out, i, v[s]);
      }
    }
  }
  finish_launch(state, l.epoch, (u32)(N * slice));
}

// Fused all-reduce + residual add + RMSNorm (rmsnorm.cuh) of `rows` rows of a.hidden
// elements (a multiple of the vector width). Rank r owns rows [r * rpr, (r + 1) * rpr).
// Steps 1 and 3 are spread over every block by vectors; in step 3 the owner adds bias and
// residual to its reduced rows and pushes the residual sums (not normalized) to every
// rank; in step 4 every rank normalizes every row (by row groups, rmsnorm.cuh),
// the same arithmetic on the same data, so every rank gets the same bits. Slot r of the
// reduce-scatter area holds rpr rows: N * rpr * hidden * sizeof(T) <= area_bytes. The
// outputs must not overlap x (another block may still be pushing it).
template <class T, int N, class Tp>
__device__ void lamport_twoshot_add_rmsnorm(const Tp& tp, u64 set_off, u64 area_bytes,
                                            const char* x, u64 rows, const NormArgs& a,
                                            LaunchState* state, ErrorRecord* err,
                                            u64 timeout_ns) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  const u64 rpr = (rows + N - 1) / N;
  const LamportLaunch l = lamport_begin(state, set_off, 2 * area_bytes);
  const WaitCtx c{err, timeout_ns, tp.rank, l.epoch};
  char* mine = tp.seg(tp.rank);
  const u64 rs = l.cur, ag = l.cur + area_bytes;
  const u64 step = (u64)blockDim.x * gridDim.x;

  // 1. Push row s * rpr + k of my input into row k of slot [rank] of rank s
  //    (kPushBatch loads before their stores).
  constexpr int kPushBatch = 4;
  for (u64 i0 = (u64)blockIdx.x * blockDim.x + threadIdx.x; i0 < rows * vpr; i0 += kPushBatch * step) {
    uint4 v[kPushBatch];
#pragma unroll
    for (int u = 0; u < kPushBatch; ++u) {
      if (i0 + u * step < rows * vpr) v[u] = ld_weak(x + (i0 + u * step) * 16);
    }
#pragma unroll
    for (int u = 0; u < kPushBatch; ++u) {
      const u64 i = i0 + u * step;
      if (i < rows * vpr) {
        const u64 row = i / vpr;
        const int s = (int)(row / rpr);
        const u64 at = ((u64)tp.rank * rpr + row - s * rpr) * vpr + (i - row * vpr);
        st_weak(tp.seg(s) + rs + at * 16, clear_sentinel<T>(v[u]));
      }
    }
  }
  // 2. Re-poison both areas of the previous launch's buffer.
  lamport_repoison<T>(mine + l.old, l.prev_vecs);
  lamport_repoison<T>(mine + l.old + area_bytes, l.prev_vecs);
  // 3. Reduce my rows, add bias and residual, push the sums into every rank.
  const u64 first = (u64)tp.rank * rpr;
  const u64 mine_vecs = ((first + rpr < rows ? first + rpr : rows) - (first < rows ? first : rows)) * vpr;
  for (u64 q = (u64)blockIdx.x * blockDim.x + threadIdx.x; q < mine_vecs; q += step) {
    const u64 row = first + q / vpr, v = q % vpr;
    const RowOperands o = load_operands<T>(a, row, v);
    const uint4 sum = add_residual<T>(o, lamport_reduce<T, OpSum, N>(mine + rs, rpr * vpr * 16, q, c));
    tp.template store_all<T>(ag + (row * vpr + v) * 16, clear_sentinel<T>(sum), 0);
  }
  // 4. Every row: residual sums from my all-gather area, then the norm.
  RowGroup g = row_group();
  for (u64 row = g.id; row < rows; row += g.count) {
    const char* sums = mine + ag + row * vpr * 16;
    const int owner = (int)(row / rpr);
    finish_row<T>(a, row, g, [&](u64 v) { return lamport_poll<T>(sums + v * 16, c, owner); });
  }
  row_group_done(g);
  finish_launch(state, l.epoch, (u32)(N * rpr * vpr));
}

// ---- entry points, instantiated per (UB_T, UB_OP, UB_NRANKS, UB_TRANSPORT) ---------

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_TWOSHOT_THREADS)
ub_lamport_twoshot(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 area_bytes,
                   const char* x, char* out, u64 n, LaunchState* state, ErrorRecord* err,
                   u64 timeout_ns) {
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  lamport_twoshot_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, set_off, area_bytes, x, out, n, state,
                                                    err, timeout_ns);
}

extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_lamport_twoshot_norm(char* base, u64 stride, int rank, char* mc, u64 set_off,
                        u64 area_bytes, const char* x, u64 rows, u64 hidden,
                        const char* residual, const char* bias, const char* weight,
                        char* normed, char* res_out, float eps, LaunchState* state,
                        ErrorRecord* err, u64 timeout_ns) {
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  lamport_twoshot_add_rmsnorm<UB_T, UB_NRANKS>(tp, set_off, area_bytes, x, rows, a, state, err,
                                               timeout_ns);
}
