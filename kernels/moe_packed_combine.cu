// Expert-parallel combine, throughput mode: header, partials, bulk flag, sum (docs/moe.md,
// "Throughput mode"; the area: moe_packed.cuh; the route: moe_packed_dispatch.cu).
//
// Every rank waits for every rank's header (the peer's previous launch is over: its area is
// free), then every warp computes, for each token (s, t) it received, the fp32 partial of the
// token's slots on this GPU in top-k order (acc = +0.0, then acc + w * y for each, the
// product and the sum rounded separately) and stores it into rank s's area of this GPU;
// then a fence, a grid barrier and the bulk flag into every rank. Rank s waits for the N
// bulk flags and sums, for each of its tokens, the partials of the GPUs that hold its
// experts, in rank order from +0.0, rounded once: the low-latency combine's arithmetic.
#include "moe_packed.cuh"

// Partials: one warp per received row (s, t) that has a slot on this GPU (a route other than
// UB_MOE_ROUTE_ELSEWHERE: a slot past R adds no term, but the row's source still reads this
// GPU's partial). Weak stores: the bulk flag publishes them.
template <class T, int N, class Tp>
__device__ void store_partials(const Tp& tp, const MoeShape& m, u64 data_off, const CombineIn& in) {
  constexpr int P = Vec<T>::kPer;
  const int lane = threadIdx.x & 31, K = (int)m.topk;
  const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec, M = m.tokens;
  const Received<N> rx(in.tokens, (u32)M);
  for (u64 f = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); f < rx.rows(); f += warps) {
    const int src = rx.source((u32)f);
    const u64 t = f - rx.first[src];
    const int* route = in.route + ((u64)src * M + t) * K;
    if (__ballot_sync(kWarpAll, lane < K && route[lane] != UB_MOE_ROUTE_ELSEWHERE) == 0u) continue;
    char* to = tp.seg(src) + row_at<N>(data_off, m, 0u, tp.rank, t, m.hidden * 4);
#pragma unroll 2
    for (u64 i = lane; i < vpr; i += 32) {
      float acc[P];
      partial_of<T, 1>(acc, route, K, in.y, in.weights, row_bytes, i);
#pragma unroll
      for (int h = 0; h < P / 4; ++h) {
        st_weak(to + (i * P + 4 * h) * 4, make_uint4(__float_as_uint(acc[4 * h]), __float_as_uint(acc[4 * h + 1]),
                                                     __float_as_uint(acc[4 * h + 2]), __float_as_uint(acc[4 * h + 3])));
      }
    }
  }
  fence_sys();  // this thread's stores before the grid barrier and the bulk flag (release)
}

// Sum: one thread per 16-byte vector of this rank's output (count tokens): the partials of
// the token's GPUs in rank order, from +0.0; poison where `ok` is false (a wait failed).
template <class T, int N>
__device__ void sum_partials(const char* mine, const MoeShape& m, u64 data_off, const u32* dest, u64 count,
                             char* out, bool ok) {
  constexpr int P = Vec<T>::kPer;
  sum_rows<T>(m, count, out, [&](u64 t, u64 i, float (&acc)[P]) {
    const u32 mask = dest[t];
#pragma unroll
    for (int g = 0; g < N; ++g) {
      if (!(mask >> g & 1u)) continue;
      const char* p = mine + row_at<N>(data_off, m, 0u, g, t, m.hidden * 4) + i * P * 4;
#pragma unroll
      for (int h = 0; h < P / 4; ++h) {
        const uint4 v = ld_relaxed_sys(p + h * kVec);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[4 * h + e] = __fadd_rn(acc[4 * h + e], __uint_as_float(Vec<float>::word(v, e)));
      }
    }
    return ok;
  });
}

template <class T, int N, class Tp>
__device__ void moe_packed_combine(const Tp& tp, const MoeShape& m, u64 rot_off, u64 hdr_off, u64 data_off,
                                   const CombineIn& in, char* out, u64 sig, LaunchState* state) {
  char* mine = tp.seg(tp.rank);
  PackedRotation* rot = (PackedRotation*)(mine + rot_off) + 1;  // the dispatch's is the first
  const MoeSets s = moe_sets(&rot->rot);
  const LaunchView v = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  // 1. header; every rank's (each peer's previous launch is over: its area is free)
  moe_push_header<N>(tp, hdr_off, s.cur, sig, false, 0);
  bool ok = moe_headers<N>(mine, hdr_off, s.cur, sig, nullptr, 0, c);
  moe_repoison(mine + header_at<N>(hdr_off, s.old, 0), N * kHeader / kVec);
  // 2. partials, then the bulk flag after every block's stores
  if (ok) store_partials<T, N>(tp, m, data_off, in);
  ok = grid_barrier(rot, gridDim.x, c) && ok;
  push_bulk_flag<N>(tp, hdr_off, s.cur, sig);
  // 3. every rank's bulk flag, then the sums
  ok = wait_bulk_flags<N>(mine, hdr_off, s.cur, c) && ok;
  sum_partials<T, N>(mine, m, data_off, in.dest, min((u64)in.tokens[tp.rank], m.tokens), out, ok);
  moe_finish(c, v, &rot->rot, s, &rot->arrive);
}

// ---- entry point, instantiated per (UB_T: bf16 or float, UB_NRANKS) ---------------------
extern "C" __global__ void __launch_bounds__(UB_MOE_PACKED_COMBINE_THREADS)
ub_moe_packed_combine(char* base, u64 stride, int rank, char* mc, u64 rot_off, u64 hdr_off, u64 data_off,
                      u64 experts, u64 local, u64 topk, u64 hidden, u64 tokens, u64 max_rows, const char* y,
                      const float* weights, const int* route, const u32* src_tokens, const u32* dest, char* out,
                      u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const MoeShape m{experts, local, topk, hidden, tokens, max_rows};
  const CombineIn in{y, weights, route, src_tokens, dest};
  moe_packed_combine<UB_T, UB_NRANKS>(tp, m, rot_off, hdr_off, data_off, in, out, sig, state);
}
