// Expert-parallel dispatch, low-latency mode: header, send, re-poison, receive and scatter
// (docs/moe.md, "Dispatch, step by step"; the area: moe.cuh).
//
// Every rank sends each of its T tokens' rows once to each GPU that holds one of its
// experts, into that GPU's area of this source (rows set `par`), then pushes the token's
// routing record to every rank after a fence (records set `cur`). Every rank then polls
// every source's records and, per local expert, lays the tokens routed to it out in
// (source, token) order with a block-wide prefix sum: the layout is a function of the
// routing alone. A grid of at most one block per SM (every block resident): a block only
// waits for what every rank's blocks send before they wait.
#include "moe.cuh"

// What a dispatch writes in this rank's own memory (ubnext/_moe/expert_parallel.py).
struct DispatchOut {
  char* recv_x;    // [L][C][H] of T: row j of local expert e
  int* counts;     // [L] rows of each local expert (at most C)
  int* src;        // [L][C] source * M + token of each row
  float* weights;  // [L][C] the router weight of each row
  int* route;      // [N][M][K] each source token's slot: e * C + row, or a UB_MOE_ROUTE_* (the combine's)
  u32* tokens;     // [N] T of each source (the combine's)
  u32* dest;       // [M] the GPUs (bit g) of each of this rank's tokens (the combine's)
};

// Send: one warp per token t of this rank. Its K slots are checked (an id out of range, or
// an expert a previous slot holds, fails the call with kFailInput and is dropped: -1), its
// row is stored once into each destination GPU's area of this source, and its record (the
// K checked ids, then the K weights, -0.0 written as +0.0; padding 1) is pushed to every
// rank, after a system-scope fence in each lane whose record goes where the row went.
template <class T, int N, class Tp>
__device__ void send_tokens(const Tp& tp, const MoeShape& m, const MoeSets& s, u64 rec_off, u64 rows_off,
                            const char* x, const int* idx, const float* w, u64 count, u32* dest, WaitCtx& c) {
  constexpr u32 kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31, K = (int)m.topk;
  const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec, R = m.record_vecs(), nrec = N * R;
  for (u64 t = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < count; t += warps) {
    int id = -1;
    u32 wbits = 0u;
    if (lane < K) {
      id = idx[t * K + lane];
      wbits = clear_sentinel_word<float>(__float_as_uint(w[t * K + lane]));
    }
    const bool range = lane < K && (id < -1 || (long long)id >= (long long)m.experts);
    bool repeated = false;
    for (int j = 0; j < K; ++j) {
      const int other = __shfl_sync(kAll, id, j);
      repeated |= j < lane && lane < K && id >= 0 && !range && other == id;
    }
    if (range) fail(c, kFailInput, c.rank, kMoeBadExpert, t * K + lane, (u64)(long long)id);
    if (repeated) fail(c, kFailInput, c.rank, kMoeRepeatedExpert, t * K + lane, (u64)id);
    const int keep = range || repeated ? -1 : id;
    const u32 mask = __reduce_or_sync(kAll, keep >= 0 ? 1u << (keep / (int)m.local) : 0u);
    if (lane == 0) dest[t] = mask;

    const char* xr = x + t * row_bytes;
    const u64 at = row_at<N>(rows_off, m, s.par, tp.rank, t, row_bytes);
    for (u64 i = lane; i < vpr; i += 32) {
      const uint4 v = ld_weak(xr + i * kVec);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const int d = tp.peer(k);
        if (mask >> d & 1u) st_weak(tp.seg(d) + at + i * kVec, v);
      }
    }
    __syncwarp();
    for (u64 base = 0; base < nrec; base += 32) {  // lane j: vector j % R of rank j / R's record
      const u64 j = base + lane, q = j % R;
      const int d = (int)(j / R);
      u32 word[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int wi = (int)(4 * q) + h, from = wi < K ? wi : wi < 2 * K ? wi - K : 0;
        const int id_v = __shfl_sync(kAll, keep, from);
        const u32 w_v = __shfl_sync(kAll, wbits, from);
        word[h] = wi < K ? (u32)id_v : wi < 2 * K ? w_v : 1u;
      }
      if (j < nrec) {
        if (mask >> d & 1u) fence_sys();  // the row before its record (release)
        st_relaxed_sys(tp.seg(d) + record_at<N>(rec_off, m, s.cur, tp.rank, t, q),
                       make_uint4(word[0], word[1], word[2], word[3]));
      }
    }
  }
}

// Row f of the received rows, counted over the sources in rank order: its source and token.
template <int N> __device__ __forceinline__ int source_of(const u32 (&first)[N + 1], u32 f) {
  int s = 0;
  while (s + 1 < N && f >= first[s + 1]) ++s;
  return s;
}

// The slot of this GPU's expert `ge` in record (s, t) of set `set` (already arrived), its
// weight's bits, and (with `others`) the route ELSEWHERE of every slot not on this GPU.
template <int N>
__device__ int slot_of(const char* mine, const MoeShape& m, u64 rec_off, u32 set, int s, u64 t, int ge, u32& wbits,
                       int* others, int rank) {
  const int K = (int)m.topk;
  int kk = -1;
  for (u64 q = 0; q < m.record_vecs(); ++q) {
    const uint4 v = ld_volatile(mine + record_at<N>(rec_off, m, set, s, t, q));
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int wi = (int)(4 * q) + h;
      const u32 word = Vec<float>::word(v, h);
      if (wi < K) {
        if ((int)word == ge) kk = wi;
        const bool here = (int)word >= 0 && (int)word / (int)m.local == rank;
        if (others != nullptr && !here) others[wi] = UB_MOE_ROUTE_ELSEWHERE;
      } else if (kk >= 0 && wi == K + kk) {
        wbits = word;
      }
    }
  }
  return kk;
}

// Receive and scatter, by units (local expert e, part p of P): every thread polls the
// records of its share of the received rows (in (source, token) order), counts those that
// hold expert e; a block-wide prefix sum gives each its row j of e; part p lists the rows
// with j % P == p (below the capacity) and writes their src, weight and route; its warps
// then copy them from the sources' areas. Rows past the capacity fail the call
// (kFailInput) and route UB_MOE_ROUTE_OVERFLOW; unit (0, 0) also routes every slot whose
// expert is elsewhere.
template <class T, int N>
__device__ void scatter(const char* mine, const MoeShape& m, const MoeSets& s, u64 rec_off, u64 rows_off,
                        const u32* tok, const DispatchOut& o, WaitCtx& c, u32* scratch, u32* list) {
  const u64 L = m.local, C = m.capacity, K = m.topk, R = m.record_vecs(), M = m.tokens;
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec;
  const int rank = c.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  u32 first[N + 1];
  first[0] = 0u;
#pragma unroll
  for (int r = 0; r < N; ++r) first[r + 1] = first[r] + tok[r];
  const u32 rows = first[N], chunk = (rows + blockDim.x - 1) / blockDim.x;
  const u32 lo = min(rows, threadIdx.x * chunk), hi = min(rows, lo + chunk);
  const u32 P = gridDim.x > L ? gridDim.x / (u32)L : 1u;
  for (u64 u = blockIdx.x; u < L * P; u += gridDim.x) {
    const u64 e = u % L;
    const u32 p = (u32)(u / L);
    const int ge = (int)((u64)rank * L + e);
    u32 found = 0u;
    bool ok = true;
    for (u32 f = lo; f < hi && ok; ++f) {
      const int src = source_of<N>(first, f);
      const u64 t = f - first[src];
      int kk = -1;
      for (u64 q = 0; q < R && ok; ++q) {
        const char* pq = mine + record_at<N>(rec_off, m, s.cur, src, t, q);
        uint4 v = ld_volatile(pq);
        ok = moe_wait(pq, v, c, src);
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          if (4 * q + h < K && (int)Vec<float>::word(v, h) == ge) kk = (int)(4 * q + h);
        }
      }
      found += kk >= 0;
    }
    fence_acq_rel_sys();  // the records seen: the rows before them are visible to the block after the vote
    if (!block_vote(ok, c)) {
      if (p == 0u && threadIdx.x == 0) o.counts[e] = 0;
      continue;
    }
    u32 total;
    u32 j = block_exclusive_scan(found, total, scratch);
    for (u32 f = lo; f < hi; ++f) {
      const int src = source_of<N>(first, f);
      const u64 t = f - first[src];
      int* route = o.route + ((u64)src * M + t) * K;
      u32 wbits = 0u;
      const int kk = slot_of<N>(mine, m, rec_off, s.cur, src, t, ge, wbits, e == 0 && p == 0u ? route : nullptr, rank);
      if (kk < 0) continue;
      if (j % P == p) {
        if (j < C) {
          list[j / P] = (u32)(src * M + t);
          o.src[e * C + j] = (int)(src * M + t);
          o.weights[e * C + j] = __uint_as_float(wbits);
          route[kk] = (int)(e * C + j);
        } else {
          route[kk] = UB_MOE_ROUTE_OVERFLOW;
        }
      }
      ++j;
    }
    if (p == 0u && threadIdx.x == 0) {
      o.counts[e] = (int)min((u64)total, C);
      if (total > C) fail(c, kFailInput, rank, kMoeOverCapacity, (u64)ge, total);
    }
    __syncthreads();
    const u32 kept = (u32)min((u64)total, C), n = kept > p ? (kept - p + P - 1u) / P : 0u;
    for (u32 i = warp; i < n; i += warps) {
      const u32 st = list[i];
      const char* from = mine + row_at<N>(rows_off, m, s.par, (int)(st / M), st % M, row_bytes);
      char* to = o.recv_x + (e * C + (u64)i * P + p) * row_bytes;
      for (u64 v = lane; v < vpr; v += 32) st_weak(to + v * kVec, ld_relaxed_sys(from + v * kVec));
    }
    __syncthreads();  // the list is free for the block's next unit
  }
}

template <class T, int N, class Tp>
__device__ void moe_dispatch(const Tp& tp, const MoeShape& m, u64 rot_off, u64 hdr_off, u64 rec_off, u64 rows_off,
                             const char* x, const int* idx, const float* w, u64 count, const DispatchOut& o,
                             u64 sig, LaunchState* state) {
  __shared__ u32 tok[N], scratch[33], list[UB_MOE_MAX_CAPACITY];
  char* mine = tp.seg(tp.rank);
  MoeRotation* rot = (MoeRotation*)(mine + rot_off);
  const MoeSets s = moe_sets(rot);
  const LaunchView v = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  // 1. header, 2. send
  moe_push_header<N>(tp, hdr_off, s.cur, sig, true, count);
  send_tokens<T, N>(tp, m, s, rec_off, rows_off, x, idx, w, count, o.dest, c);
  // 3. re-poison the previous launch's headers and records in this rank's segment
  moe_repoison(mine + header_at<N>(hdr_off, s.old, 0), N * kHeader / kVec);
  moe_repoison(mine + record_at<N>(rec_off, m, s.old, 0, 0, 0), N * m.tokens * m.record_vecs());
  // this rank's own count first: it bounds the combine's rows of `out` even where the
  // headers' vote below fails (a failed launch must leave no stale count behind)
  if (blockIdx.x == 0 && threadIdx.x == 0) o.tokens[tp.rank] = (u32)count;
  // 4. every rank's header, then receive and scatter
  if (moe_headers<N>(mine, hdr_off, s.cur, sig, tok, m.tokens, c)) {
    if (blockIdx.x == 0 && threadIdx.x < N) o.tokens[threadIdx.x] = tok[threadIdx.x];
    scatter<T, N>(mine, m, s, rec_off, rows_off, tok, o, c, scratch, list);
  }
  moe_finish(c, v, rot, s);
}

// ---- entry point, instantiated per (UB_T: bf16 or float, UB_NRANKS) ---------------------
extern "C" __global__ void __launch_bounds__(UB_MOE_DISPATCH_THREADS)
ub_moe_dispatch(char* base, u64 stride, int rank, char* mc, u64 rot_off, u64 hdr_off, u64 rec_off, u64 rows_off,
                u64 experts, u64 local, u64 topk, u64 hidden, u64 tokens, u64 capacity, const char* x, const int* idx,
                const float* w, u64 count, char* recv_x, int* counts, int* src, float* weights, int* route,
                u32* src_tokens, u32* dest, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const MoeShape m{experts, local, topk, hidden, tokens, capacity};
  const DispatchOut o{recv_x, counts, src, weights, route, src_tokens, dest};
  moe_dispatch<UB_T, UB_NRANKS>(tp, m, rot_off, hdr_off, rec_off, rows_off, x, idx, w, count, o, sig, state);
}
