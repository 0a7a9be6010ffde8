// Expert-parallel dispatch, low-latency mode: header, send, re-poison, receive and scatter
// (docs/moe.md, "Dispatch, step by step"; the area: moe.cuh).
//
// Every rank sends each of its T tokens' rows once to each GPU that holds one of its
// experts, into that GPU's area of this source (rows set `par`), then pushes the token's
// routing record to every rank after a fence (records set `cur`). Every rank then polls
// every source's records and, per local expert, lays the tokens routed to it out in
// (source, token) order from warp ballots: the layout is a function of the routing alone.
// The rows move as 16-byte vectors spread over a block's threads. A grid of at most one
// block per SM (every block resident): a block only waits for what every rank's blocks
// send before they wait.
#include "moe.cuh"
#include "quant.cuh"

// What a dispatch writes in this rank's own memory (ubnext/_moe/expert_parallel.py).
struct DispatchOut {
  char* recv_x;    // [L][C][H] of T: row j of local expert e (an FP8 dispatch: of e4m3 codes)
  char* scales;    // [L][C][H / UB_MOE_FP8_GROUP] fp32 of an FP8 dispatch, else null
  int* counts;     // [L] rows of each local expert (at most C)
  int* src;        // [L][C] source * M + token of each row
  float* weights;  // [L][C] the router weight of each row
  int* route;      // [N][M][K] each source token's slot: e * C + row, or a UB_MOE_ROUTE_* (the combine's)
  u32* tokens;     // [N] T of each source (the combine's)
  u32* dest;       // [M] the GPUs (bit g) of each of this rank's tokens (the combine's)
};

#if __CUDA_ARCH__ >= 890
// Lanes of one scale's group in an FP8 dispatch: its bf16 input vectors.
constexpr int kFp8Lanes = UB_MOE_FP8_GROUP / kLaneElems;

// The FP8 form of one bf16 row of H channels (kernels/quant.cuh's arithmetic, one fp32 scale
// per UB_MOE_FP8_GROUP channels): thread i of the block quantizes input vector i (then
// i + blockDim, ...) to 8 e4m3 codes at byte 8 i of the row's place `at` in each
// destination of `to`, and the first lane of each group stores its scale at byte H + 4 g.
// Every thread takes the same turns: a group's shuffles need the whole warp.
template <int N, class Tp>
__device__ void send_fp8_row(const Tp& tp, const char* xr, u64 at, u64 vpr, u64 hidden, u32 to) {
  for (u64 i0 = 0; i0 < vpr; i0 += blockDim.x) {
    const u64 i = i0 + threadIdx.x;
    const bool on = i < vpr;  // whole groups on or off: vpr is whole groups
    float f[kLaneElems];
    Vec<bf16>::unpack(on ? ld_weak(xr + i * kVec) : make_uint4(0u, 0u, 0u, 0u), f);
    u32 w[QFp8::kWords];
    const float scale = quantize_step<QFp8, kFp8Lanes>(f, w);
    if (!on) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int d = tp.peer(k);
      if (!(to >> d & 1u)) continue;
      char* row = tp.seg(d) + at;
      *(uint2*)(row + i * 8) = make_uint2(w[0], w[1]);
      if (i % kFp8Lanes == 0) *(float*)(row + hidden + i / kFp8Lanes * 4) = scale;
    }
  }
}
#endif

// Send: one block per token t of this rank (a block takes tokens blockIdx.x, + gridDim.x,
// ...). Its warp 0 checks the K slots (an id out of range, or an expert a previous slot
// holds, fails the call with kFailInput and is dropped: -1) and forms the mask of
// destination GPUs; every thread of the block then stores its share of the row's vectors
// (with `fp8`, its e4m3 codes and scales: send_fp8_row) once into each destination GPU's
// area of this source; after the block's barrier, warp 0
// pushes the record (the K checked ids, then the K weights, -0.0 written as +0.0; padding
// 1) to every rank, after a system-scope fence in each lane whose record goes where the
// row went (the barrier, then the fence: the block's row stores before the record).
template <class T, int N, class Tp>
__device__ void send_tokens(const Tp& tp, const MoeShape& m, const MoeSets& s, u64 rec_off, u64 rows_off,
                            const char* x, const int* idx, const float* w, u64 count, u32* dest, WaitCtx& c,
                            u32* shared_mask, bool fp8) {
  const int lane = threadIdx.x & 31;
  const bool checker = threadIdx.x < 32;
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec;
  for (u64 t = blockIdx.x; t < count; t += gridDim.x) {
    MoeSlots k{-1, 0u, 0u};
    if (checker) {
      k = check_slots(m, idx, w, t, c);
      if (lane == 0) {
        dest[t] = k.mask;
        *shared_mask = k.mask;
      }
    }
    __syncthreads();
    const u32 to = *shared_mask;
    const char* xr = x + t * row_bytes;
    const u64 at = row_at<N>(rows_off, m, s.par, tp.rank, t, row_bytes);
#if __CUDA_ARCH__ >= 890
    if constexpr (Elem<T>::kBytes == 2) {
      if (fp8) send_fp8_row<N>(tp, xr, at, vpr, m.hidden, to);
    }
#endif
    if (!fp8) {
      pipelined(threadIdx.x, vpr, blockDim.x, [&](u64 i) { return ld_weak(xr + i * kVec); },
                [&](u64 i, const uint4& v) {
#pragma unroll
                  for (int k = 0; k < N; ++k) {
                    const int d = tp.peer(k);
                    if (to >> d & 1u) st_weak(tp.seg(d) + at + i * kVec, v);
                  }
                });
    }
    __syncthreads();  // the row's stores, then its record; the mask is free for the next token
    if (!checker) continue;
    store_record<N>(m, k, [&](int d, u64 q, const uint4& v) {
      if (k.mask >> d & 1u) fence_sys();  // the row before its record (release)
      st_relaxed_sys(tp.seg(d) + record_at<N>(rec_off, m, s.cur, tp.rank, t, q), v);
    });
  }
}

// The most vectors a routing record has (MoeShape::record_vecs at the largest top-k).
constexpr int kMaxRecordVecs = (2 * UB_MOE_MAX_TOPK + 3) / 4;

// One received row's record as a lane polls it: every vector waited for (its loads issued
// together first), then the slot kk of this GPU's expert `ge` (-1: none), its weight's bits
// and, with `others`, the route ELSEWHERE of every slot whose expert is not on this GPU.
struct Polled {
  int kk;
  u32 wbits;
  bool ok;
};
template <int N>
__device__ Polled poll_record(const char* rec, const MoeShape& m, int ge, int src, int* others, WaitCtx& c) {
  const int K = (int)m.topk, R = (int)m.record_vecs();
  uint4 v[kMaxRecordVecs];
#pragma unroll
  for (int q = 0; q < kMaxRecordVecs; ++q) {
    if (q < R) v[q] = ld_volatile(rec + q * kVec);
  }
  Polled p{-1, 0u, true};
#pragma unroll
  for (int q = 0; q < kMaxRecordVecs; ++q) {
    if (q < R) p.ok = p.ok && moe_wait(rec + q * kVec, v[q], c, src);
  }
  if (!p.ok) return p;
#pragma unroll
  for (int q = 0; q < kMaxRecordVecs; ++q) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int wi = 4 * q + h, id = (int)Vec<float>::word(v[q], h);
      if (wi < K && id == ge) p.kk = wi;
      if (wi < K && others != nullptr && !(id >= 0 && id / (int)m.local == c.rank)) others[wi] = UB_MOE_ROUTE_ELSEWHERE;
    }
  }
#pragma unroll
  for (int q = 0; q < kMaxRecordVecs; ++q) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      if (p.kk >= 0 && 4 * q + h == K + p.kk) p.wbits = Vec<float>::word(v[q], h);
    }
  }
  return p;
}

// Receive and scatter, by units (local expert e, part p of P), each block taking units
// blockIdx.x, + gridDim.x, ... In rounds of 32 rows per warp (the received rows in
// (source, token) order: round r gives warp w rows 32 (r W + w) ..), each lane polls its
// row's record and finds expert e's slot; the warp counts its matches (__ballot_sync,
// __popc) into shared memory, the block's vote is the round's only barrier, and each lane
// then takes its row j of e from the counts of the earlier warps and rounds (by
// (source, token): a function of the routing alone). Part p lists the rows with
// j % P == p below the capacity and writes their src, weight and route; where it listed
// any, after one more barrier the block's threads copy the listed rows from the sources' areas, their vectors
// spread over the whole block. Rows past the capacity fail the call (kFailInput) and
// route UB_MOE_ROUTE_OVERFLOW; unit (0, 0) also routes every slot whose expert is
// elsewhere.
template <class T, int N>
__device__ void scatter(const char* mine, const MoeShape& m, const MoeSets& s, u64 rec_off, u64 rows_off,
                        const u32* tok, const DispatchOut& o, WaitCtx& c, u32 (*counted)[32], u32* list) {
  const u64 L = m.local, C = m.capacity, K = m.topk, M = m.tokens;
  const u64 row_bytes = m.hidden * Elem<T>::kBytes;
  // vectors of a recv_x row, and of its place in the area (an FP8 row: its codes, then its scales)
  const u64 codes = o.scales != nullptr ? m.hidden / kVec : row_bytes / kVec;
  const u64 wire = o.scales != nullptr ? codes + m.hidden / UB_MOE_FP8_GROUP * 4 / kVec : codes;
  const int rank = c.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const Received<N> rx(tok);
  const u32 rows = rx.rows(), per_round = 32u * warps;
  const u32 P = gridDim.x > L ? gridDim.x / (u32)L : 1u;
  u32 turn = 0u;  // rounds so far, over the units: `counted` alternates with it
  for (u64 u = blockIdx.x; u < L * P; u += gridDim.x) {
    const u64 e = u % L;
    const u32 p = (u32)(u / L);
    const int ge = (int)((u64)rank * L + e);
    u32 before = 0u;  // rows of e in the earlier rounds
    bool ok = true;
    for (u32 round = 0; round * per_round < rows; ++round, ++turn) {
      const u32 f = round * per_round + 32u * warp + lane;
      const int src = f < rows ? rx.source(f) : 0;
      const u64 t = f < rows ? f - rx.first[src] : 0u;
      int* route = o.route + ((u64)src * M + t) * K;
      Polled got{-1, 0u, true};
      if (f < rows) {
        got = poll_record<N>(mine + record_at<N>(rec_off, m, s.cur, src, t, 0), m, ge, src,
                             e == 0 && p == 0u ? route : nullptr, c);
        fence_acq_rel_sys();  // the record seen: the row before it is visible to the block after the vote
      }
      const u32 hits = __ballot_sync(kWarpAll, got.kk >= 0);
      if (lane == 0) counted[turn & 1u][warp] = __popc(hits);
      if (!block_vote(ok && got.ok, c)) {
        ok = false;
        break;
      }
      u32 j = before + __popc(hits & ((1u << lane) - 1u));
      for (int w = 0; w < warps; ++w) {
        const u32 n = counted[turn & 1u][w];  // two buffers: a turn's counts are not written before the next vote
        j += w < warp ? n : 0u;
        before += n;
      }
      if (got.kk >= 0 && j % P == p) {
        if (j < C) {
          list[j / P] = (u32)(src * M + t);
          o.src[e * C + j] = (int)(src * M + t);
          o.weights[e * C + j] = __uint_as_float(got.wbits);
          route[got.kk] = (int)(e * C + j);
        } else {
          route[got.kk] = UB_MOE_ROUTE_OVERFLOW;
        }
      }
    }
    if (!ok) {
      if (p == 0u && threadIdx.x == 0) o.counts[e] = 0;
      continue;  // every thread of the block: the vote is block-wide
    }
    if (p == 0u && threadIdx.x == 0) {
      o.counts[e] = (int)min((u64)before, C);
      if (before > C) fail(c, kFailInput, rank, kMoeOverCapacity, (u64)ge, before);
    }
    const u32 kept = (u32)min((u64)before, C), n = kept > p ? (kept - p + P - 1u) / P : 0u;
    if (n == 0u) continue;  // block-uniform: nothing listed, nothing to copy
    __syncthreads();  // the list; the next unit writes it only after its first vote
    pipelined(threadIdx.x, (u64)n * wire, blockDim.x, [&](u64 q) {
      const u32 st = list[q / wire];
      return ld_relaxed_sys(mine + row_at<N>(rows_off, m, s.par, (int)(st / M), st % M, row_bytes) + q % wire * kVec);
    }, [&](u64 q, const uint4& v) {
      const u64 j = e * C + q / wire * P + p, k = q % wire;
      st_weak(k < codes ? o.recv_x + (j * codes + k) * kVec : o.scales + (j * (wire - codes) + k - codes) * kVec, v);
    });
  }
}

template <class T, int N, class Tp>
__device__ void moe_dispatch(const Tp& tp, const MoeShape& m, u64 rot_off, u64 hdr_off, u64 rec_off, u64 rows_off,
                             const char* x, const int* idx, const float* w, u64 count, const DispatchOut& o,
                             u64 sig, LaunchState* state) {
  __shared__ u32 tok[N], mask, counted[2][32], list[UB_MOE_MAX_CAPACITY];
  char* mine = tp.seg(tp.rank);
  MoeRotation* rot = (MoeRotation*)(mine + rot_off);
  const MoeSets s = moe_sets(rot);
  const LaunchView v = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  // 1. header, 2. send
  moe_push_header<N>(tp, hdr_off, s.cur, sig, true, count);
  send_tokens<T, N>(tp, m, s, rec_off, rows_off, x, idx, w, count, o.dest, c, &mask, o.scales != nullptr);
  // 3. re-poison the previous launch's headers and records in this rank's segment
  moe_repoison(mine + header_at<N>(hdr_off, s.old, 0), N * kHeader / kVec);
  moe_repoison(mine + record_at<N>(rec_off, m, s.old, 0, 0, 0), N * m.tokens * m.record_vecs());
  // this rank's own count first: it bounds the combine's rows of `out` even where the
  // headers' vote below fails (a failed launch must leave no stale count behind)
  if (blockIdx.x == 0 && threadIdx.x == 0) o.tokens[tp.rank] = (u32)count;
  // 4. every rank's header, then receive and scatter
  if (moe_headers<N>(mine, hdr_off, s.cur, sig, tok, m.tokens, c)) {
    if (blockIdx.x == 0 && threadIdx.x < N) o.tokens[threadIdx.x] = tok[threadIdx.x];
    scatter<T, N>(mine, m, s, rec_off, rows_off, tok, o, c, counted, list);
  }
  moe_finish(c, v, rot, s);
}

// ---- entry point, instantiated per (UB_T: bf16 or float, UB_NRANKS) ---------------------
// scales: null, or (an FP8 dispatch: a bf16 payload, H a multiple of 512, sm_89 and up; the
// host checks) the e4m3 codes' scales, recv_x then holding the codes.
extern "C" __global__ void __launch_bounds__(UB_MOE_DISPATCH_THREADS)
ub_moe_dispatch(char* base, u64 stride, int rank, char* mc, u64 rot_off, u64 hdr_off, u64 rec_off, u64 rows_off,
                u64 experts, u64 local, u64 topk, u64 hidden, u64 tokens, u64 capacity, const char* x, const int* idx,
                const float* w, u64 count, char* recv_x, char* scales, int* counts, int* src, float* weights,
                int* route, u32* src_tokens, u32* dest, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const MoeShape m{experts, local, topk, hidden, tokens, capacity};
  const DispatchOut o{recv_x, scales, counts, src, weights, route, src_tokens, dest};
  moe_dispatch<UB_T, UB_NRANKS>(tp, m, rot_off, hdr_off, rec_off, rows_off, x, idx, w, count, o, sig, state);
}
