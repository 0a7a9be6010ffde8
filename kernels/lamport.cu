// Lamport one-shot all-reduce: push, re-poison, poll (protocol: lamport.cuh).
//
// Every rank stores its call signature into header [rank] and its whole input into slot
// [rank] of the current receive buffer of every rank, then polls its own copy of that
// buffer until every rank's signature has arrived and agrees with its own and every slot
// has arrived, and reduces the slots in rank order 0..N-1, so every rank computes
// identical bits.
//
// Layout of a set (same offset in every segment): buffer b (of 3) at set_off + b * B,
// B = N * slot_bytes + N * kHeader: slot s at + s * slot_bytes, then header s at
// + N * slot_bytes + s * kHeader.
#include "lamport.cuh"
#include "rmsnorm.cuh"
#include "transport.cuh"

template <int N> __device__ __forceinline__ u64 buffer_bytes(u64 slot_bytes) { return N * (slot_bytes + kHeader); }

// Re-poisons the previous launch's slots and headers in this rank's segment.
template <class T, int N>
__device__ void lamport_repoison_slots(char* mine, const LamportLaunch& l, u64 slot_bytes) {
#pragma unroll
  for (int r = 0; r < N; ++r) lamport_repoison<T>(mine + l.old + r * slot_bytes, l.s.prev_vecs);
  repoison_headers<T, N>(mine + l.old + N * slot_bytes);
}

template <class T, class Op, int N, class Tp>
__device__ void lamport_allreduce(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x,
                                  char* out, u64 n, u64 sig, LaunchState* state) {
  const Span<T> span(n);
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 step = (u64)blockDim.x * gridDim.x;
  // The first vector is loaded before the launch state, so that both loads are in flight
  // together (the state decides where it goes).
  uint4 v0 = make_uint4(0u, 0u, 0u, 0u);
  if (first < span.nvec) v0 = span.load(x, first);
  const LamportLaunch l = lamport_begin(state, set_off, buffer_bytes<N>(slot_bytes));
  WaitCtx c = wait_ctx(state, tp.rank);

  // 1. Push: my signature and input into header and slot [rank] of the current buffer of
  //    every rank.
  push_signature(tp, l.cur + N * slot_bytes, sig);
  for (u64 i = first; i < span.nvec; i += step) {
    tp.push_all(l.cur + tp.rank * slot_bytes + i * kVec, clear_sentinel<T>(i == first ? v0 : span.load(x, i)));
  }
  // 2. Re-poison the previous launch's buffer in my own segment.
  char* mine = tp.seg(tp.rank);
  lamport_repoison_slots<T, N>(mine, l, slot_bytes);
  // 3. Poll my copy of every slot until it has arrived (the first vector together with
  //    the signatures, stored once the block agrees), reduce in rank order, store.
  uint4 v[N];
  const bool has = first < span.nvec;
  if (has) lamport_load<N>(mine + l.cur, slot_bytes, first, v);
  const uint4 r0 = lamport_collect_first<T, Op, N>(mine + l.cur, slot_bytes, first, v, has,
                                                   mine + l.cur + N * slot_bytes, sig, c);
  if (has) span.store(out, first, settle<T>(r0));
  for (u64 i = first + step; i < span.nvec; i += step) {
    span.store(out, i, settle<T>(lamport_reduce<T, Op, N>(mine + l.cur, slot_bytes, i, c)));
  }
  finish_launch(c, l.s, (u32)span.nvec);
}

// Fused all-reduce + residual add + RMSNorm (rmsnorm.cuh) of `rows` rows of a.hidden
// elements (a multiple of the vector width): every rank reduces and normalizes every row.
// The push is spread over every block in contiguous parts (a few tokens still use many
// SMs' store bandwidth); each row group (rmsnorm.cuh: a block, or a cluster when the host
// launches few rows in clusters) then reduces and normalizes its rows.
// The outputs must not overlap x (another block may still be pushing it).
template <class T, int N, class Tp>
__device__ void lamport_add_rmsnorm(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x,
                                    u64 rows, const NormArgs& a, u64 sig, LaunchState* state) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  const u64 nvec = rows * vpr;
  const u64 part = (nvec + gridDim.x - 1) / gridDim.x;
  const u64 end = (blockIdx.x + 1) * part < nvec ? (blockIdx.x + 1) * part : nvec;
  const u64 first = blockIdx.x * part + threadIdx.x;
  uint4 v0 = make_uint4(0u, 0u, 0u, 0u);  // loaded before the launch state, as above
  if (first < end) v0 = ld_weak(x + first * kVec);
  const LamportLaunch l = lamport_begin(state, set_off, buffer_bytes<N>(slot_bytes));
  WaitCtx c = wait_ctx(state, tp.rank);

  push_signature(tp, l.cur + N * slot_bytes, sig);
  for (u64 i = first; i < end; i += blockDim.x) {
    tp.push_all(l.cur + tp.rank * slot_bytes + i * kVec, clear_sentinel<T>(i == first ? v0 : ld_weak(x + i * kVec)));
  }
  char* mine = tp.seg(tp.rank);
  lamport_repoison_slots<T, N>(mine, l, slot_bytes);
  lamport_agree<T, N>(mine + l.cur + N * slot_bytes, sig, c);
  RowGroup g = row_group(&c);
  for (u64 row = g.id; row < rows; row += g.count) {
    finish_row<T, true>(a, row, g, [&](u64 v) {
      const RowOperands o = load_operands<T>(a, row, v);
      return settle<T>(add_residual<T>(o, settle<T>(lamport_reduce<T, OpSum, N>(mine + l.cur, slot_bytes,
                                                                                row * vpr + v, c))));
    }, [](float) {});
  }
  row_group_done(g);
  finish_launch(c, l.s, (u32)nvec);
}

// ---- entry points -------------------------------------------------------------------
// Instantiated per (UB_T, UB_OP, UB_NRANKS, UB_TRANSPORT); the fused one carries the
// cluster shape UB_CLUSTER too (rmsnorm.cuh).

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_THREADS)
ub_lamport(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 slot_bytes,
           const char* x, char* out, u64 n, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  lamport_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, set_off, slot_bytes, x, out, n, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_NORM_BLOCK_THREADS, 1) UB_CLUSTER_DIMS
ub_lamport_norm(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 slot_bytes,
                const char* x, u64 rows, u64 hidden, const char* residual, const char* bias,
                const char* weight, char* normed, char* res_out, float eps, u64 sig,
                LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  lamport_add_rmsnorm<UB_T, UB_NRANKS>(tp, set_off, slot_bytes, x, rows, a, sig, state);
}
