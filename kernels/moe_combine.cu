// Expert-parallel combine, low-latency mode: header, partials, re-poison, sum (docs/moe.md,
// "Combine, step by step"; the area: moe.cuh; the dispatch's route: moe_dispatch.cu).
//
// Every GPU g computes, for each token (s, t) it received, the fp32 partial of the token's
// slots on g in top-k order (acc = +0.0, then acc + w * y for each, the product and the sum
// rounded separately), and pushes it, as fp32 or rounded to bf16 (Q: the call's partials),
// into rank s's partial area of g (set `par`; a bf16 partial fills the first half of its
// row's place). Rank s sums, for each of its tokens, the partials of the GPUs that hold its
// experts in rank order from +0.0 in fp32, re-poisons each partial as it reads it (no other
// thread reads it), and rounds once. Every rank also waits for every rank's header, so no rank is more than one combine
// of the object ahead of another.
#include "moe.cuh"

// Partials: one thread per 16-byte vector of y's width of a received row (s, t) that has a
// slot on this GPU (a route other than UB_MOE_ROUTE_ELSEWHERE: a slot past the capacity
// adds no term, but the row's source still waits for this GPU's partial), grid-stride over
// every received row's vectors. The loads of a batch of slots issue together; the sum
// takes them in top-k order.
template <class T, class Q, int N, class Tp>
__device__ void push_partials(const Tp& tp, const MoeShape& m, const MoeSets& s, u64 part_off, const CombineIn& in) {
  constexpr int P = Vec<T>::kPer, PQ = Vec<Q>::kPer, kBatch = 8;
  static_assert(P % PQ == 0, "a vector of y makes whole vectors of partials");
  const int K = (int)m.topk;
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec, M = m.tokens;
  const Received<N> rx(in.tokens, (u32)M);
  const u64 step = (u64)gridDim.x * blockDim.x;
  for (u64 q = (u64)blockIdx.x * blockDim.x + threadIdx.x; q < rx.rows() * vpr; q += step) {
    const u64 f = q / vpr, i = q % vpr;
    const int src = rx.source((u32)f);
    const u64 t = f - rx.first[src];
    const int* route = in.route + ((u64)src * M + t) * K;
    bool here = false;
    for (int k = 0; k < K; ++k) here |= route[k] != UB_MOE_ROUTE_ELSEWHERE;
    if (!here) continue;
    float acc[P];
    partial_of<T, kBatch>(acc, route, K, in.y, in.weights, row_bytes, i);
    char* to = tp.seg(src) + row_at<N>(part_off, m, s.par, tp.rank, t, m.hidden * 4) + i * P * Elem<Q>::kBytes;
#pragma unroll
    for (int h = 0; h < P / PQ; ++h) {
      float part[PQ];
#pragma unroll
      for (int e = 0; e < PQ; ++e) part[e] = acc[h * PQ + e];
      st_relaxed_sys(to + h * kVec, clear_sentinel<Q>(Vec<Q>::pack(part)));
    }
  }
}

// Sum: one thread per 16-byte vector of this rank's output (count tokens): the partials (of
// Q) of the token's GPUs in rank order, from +0.0 in fp32, each re-poisoned once read;
// poison where a wait gave up or `ok` is false (a header's wait failed). For each vector
// of the partials, the loads of every GPU's issue together before the first wait.
template <class T, class Q, int N>
__device__ void sum_partials(char* mine, const MoeShape& m, const MoeSets& s, u64 part_off, const CombineIn& in,
                             u64 count, char* out, bool ok, WaitCtx& c) {
  constexpr int P = Vec<T>::kPer, PQ = Vec<Q>::kPer;
  sum_rows<T>(m, count, out, [&](u64 t, u64 i, float (&acc)[P]) {
    const u32 mask = in.dest[t];
    bool good = ok;
#pragma unroll
    for (int h = 0; h < P / PQ; ++h) {
      char* p[N];
      uint4 v[N];
#pragma unroll
      for (int g = 0; g < N; ++g) {
        p[g] = mine + row_at<N>(part_off, m, s.par, g, t, m.hidden * 4) + (i * P + h * PQ) * Elem<Q>::kBytes;
        if (good && (mask >> g & 1u)) v[g] = ld_volatile(p[g]);
      }
#pragma unroll
      for (int g = 0; g < N; ++g) {
        if (!(mask >> g & 1u) || !good) continue;
        good = moe_wait<Q>(p[g], v[g], c, g);
        if (!good) break;
        st_relaxed_sys(p[g], sentinel_vec());  // consumed: ready for the set's next use
        float part[PQ];
        Vec<Q>::unpack(v[g], part);
#pragma unroll
        for (int e = 0; e < PQ; ++e) acc[h * PQ + e] = __fadd_rn(acc[h * PQ + e], part[e]);
      }
    }
    return good;
  });
}

template <class T, class Q, int N, class Tp>
__device__ void moe_combine(const Tp& tp, const MoeShape& m, u64 rot_off, u64 hdr_off, u64 part_off,
                            const CombineIn& in, char* out, u64 sig, LaunchState* state) {
  char* mine = tp.seg(tp.rank);
  MoeRotation* rot = (MoeRotation*)(mine + rot_off) + 1;  // the dispatch's is the first
  const MoeSets s = moe_sets(rot);
  const LaunchView v = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  // 1. header, 2. partials, 3. re-poison the previous launch's headers
  moe_push_header<N>(tp, hdr_off, s.cur, sig, false, 0);
  push_partials<T, Q, N>(tp, m, s, part_off, in);
  moe_repoison(mine + header_at<N>(hdr_off, s.old, 0), N * kHeader / kVec);
  // 4. every rank's header, then the sums
  const bool ok = moe_headers<N>(mine, hdr_off, s.cur, sig, nullptr, 0, c);
  sum_partials<T, Q, N>(mine, m, s, part_off, in, min((u64)in.tokens[tp.rank], m.tokens), out, ok, c);
  moe_finish(c, v, rot, s);
}

// The combine with partials of bf16 (`bf16_partials`, the call's: a bf16 payload only, the
// host refuses it for float32) or of fp32.
template <class T, int N, class Tp>
__device__ void moe_combine_as(bool bf16_partials, const Tp& tp, const MoeShape& m, u64 rot_off, u64 hdr_off,
                               u64 part_off, const CombineIn& in, char* out, u64 sig, LaunchState* state) {
  if constexpr (Vec<T>::kPer % Vec<bf16>::kPer == 0) {
    if (bf16_partials) return moe_combine<T, bf16, N>(tp, m, rot_off, hdr_off, part_off, in, out, sig, state);
  }
  moe_combine<T, float, N>(tp, m, rot_off, hdr_off, part_off, in, out, sig, state);
}

// ---- entry point, instantiated per (UB_T: bf16 or float, UB_NRANKS) ---------------------
// bf16_partials: 0 or 1; the signature says which, so ranks that differ fail with a
// mismatch before any partial is read.
extern "C" __global__ void __launch_bounds__(UB_MOE_COMBINE_THREADS)
ub_moe_combine(char* base, u64 stride, int rank, char* mc, u64 rot_off, u64 hdr_off, u64 part_off, u64 experts,
               u64 local, u64 topk, u64 hidden, u64 tokens, u64 capacity, const char* y, const float* weights,
               const int* route, const u32* src_tokens, const u32* dest, char* out, u64 bf16_partials, u64 sig,
               LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const MoeShape m{experts, local, topk, hidden, tokens, capacity};
  const CombineIn in{y, weights, route, src_tokens, dest};
  moe_combine_as<UB_T, UB_NRANKS>(bf16_partials != 0u, tp, m, rot_off, hdr_off, part_off, in, out, sig, state);
}
