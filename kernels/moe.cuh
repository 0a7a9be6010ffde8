// ubnext kernels: expert parallelism (docs/moe.md), what the dispatches and combines of both
// modes (moe_dispatch.cu, moe_combine.cu; moe_packed_*.cu through moe_packed.cuh) share: the
// pool area's regions, the object's rotation, the headers and the polls, the slot checks and
// routing records, the received rows and the arithmetic of a partial.
//
// One expert-parallel object has an area at the same offset of every rank's segment
// (ubnext/_moe/layout.py lays it out; the host passes each region's offset):
//   dispatch headers  [3 sets][N source][UB_HEADER_BYTES]   signature vector, then (T + 1, 1, 1, 1)
//   routing records   [3 sets][N source][M token][R vectors]  K int32 ids, K fp32 weights, padding 1
//   token rows        [2 sets][N source][M token][H elements]
//   combine headers   [3 sets][N rank][UB_HEADER_BYTES]     signature vector
//   partials          [2 sets][N expert GPU][M token][H fp32]
// and, in each rank's own segment only, the object's rotation (MoeRotation, one per kernel).
// The headers, records and partials hold the sentinel (-0.0 as fp32: every word) until
// written; the rows are not polled (their record, pushed after a fence, is their flag).
#pragma once
#include "lamport.cuh"
#include "transport.cuh"

// Rotation of one object's kernel: its launches so far, modulo 6, and the blocks of the
// running one that finished (the last one advances `launches`). Set `launches % 3` of the polled
// headers and records, `launches % 2` of the rows and partials: a peer is at most one
// launch of the object ahead, since each launch waits for every rank's header of it.
struct MoeRotation {
  u32 launches;
  u32 done;
};

// Sizes of one object (ubnext/_moe/layout.py: Shape), the same on every launch.
struct MoeShape {
  u64 experts;   // E
  u64 local;     // L = E / N
  u64 topk;      // K
  u64 hidden;    // H, elements (H * sizeof(T) a multiple of 16)
  u64 tokens;    // M, the most tokens a rank sends per launch
  u64 capacity;  // C, rows of each local expert
  __device__ u64 record_vecs() const { return (2 * topk + 3) / 4; }
};

// The sets of this launch: polled (3) and unpolled (2), and the previous polled one.
struct MoeSets {
  u32 launches, cur, old, par;
};
__device__ __forceinline__ MoeSets moe_sets(const MoeRotation* r) {
  const u32 n = ld_volatile_u32(&r->launches);
  const u32 cur = n % 3u;
  return {n, cur, cur == 0u ? 2u : cur - 1u, n & 1u};
}

// The end of a launch: the family's launch state (sync.cuh: finish_launch), then the
// object's rotation, advanced by the last block to finish, which also resets `arrivals`
// (the throughput mode's grid-barrier count, moe_packed.cuh; null: none).
__device__ void moe_finish(WaitCtx& c, const LaunchView& v, MoeRotation* r, const MoeSets& s,
                           u32* arrivals = nullptr) {
  finish_launch(c, v, 0u);  // begins with __syncthreads
  if (threadIdx.x == 0 && atomicAdd(&r->done, 1u) == gridDim.x - 1u) {
    if (arrivals != nullptr) *arrivals = 0u;
    r->done = 0u;
    r->launches = (s.launches + 1u) % 6u;  // 6: the sets' periods' lcm, so no wrap repeats a set early
  }
}

// Offsets in a segment (`off`: the region's) of header s of set `set`, record vector q of
// token t of source s, and of the row of token t from s (rows or partials: `row_bytes`).
template <int N> __device__ __forceinline__ u64 header_at(u64 off, u32 set, int s) {
  return off + ((u64)set * N + s) * kHeader;
}
template <int N> __device__ __forceinline__ u64 record_at(u64 off, const MoeShape& m, u32 set, int s, u64 t, u64 q) {
  return off + ((((u64)set * N + s) * m.tokens + t) * m.record_vecs() + q) * kVec;
}
template <int N> __device__ __forceinline__ u64 row_at(u64 off, const MoeShape& m, u32 set, int s, u64 t, u64 row_bytes) {
  return off + (((u64)set * N + s) * m.tokens + t) * row_bytes;
}

// Acquire-release fence at system scope: after a relaxed (volatile) load that saw a flag,
// later loads of this thread see what the flag's writer stored before its release fence.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Waits until v, loaded from p (pushed by `peer`), holds no sentinel element of W (fp32
// words, or the bf16 halves of the combine's bf16 partials), re-reading p; false if the
// wait gave up (sync.cuh: spin) or the communicator failed for this thread. The fp32
// sentinel word (the re-poisoned state) is a bf16 sentinel in its high half: both read it
// as not yet written.
template <class W = float>
__device__ __forceinline__ bool moe_wait(const char* p, uint4& v, WaitCtx& c, int peer) {
  if (!has_sentinel<W>(v)) return usable(c);
  return spin(c, [=] { return peer; }, kSiteMoePoll, [&] {
    v = ld_volatile(p);
    return !has_sentinel<W>(v);
  });
}

// A vector of four sentinel words: what the polled regions hold until written.
__device__ __forceinline__ uint4 sentinel_vec() {
  const u32 s = sentinel_word<float>();
  return make_uint4(s, s, s, s);
}

// Re-poisons `vecs` vectors at p in this rank's segment (grid-stride over the launch).
__device__ void moe_repoison(char* p, u64 vecs) {
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += (u64)blockDim.x * gridDim.x) {
    st_relaxed_sys(p + i * kVec, sentinel_vec());
  }
}

// Every block, before it uses what its peers pushed: thread r < N waits for rank r's header
// (set `set` of the headers at `off` in this rank's segment `mine`), compares its signature
// with `sig` (a difference fails the communicator: kFailMismatch) and, with `tokens`, reads
// the T + 1 of its second vector into tokens[r]. The block then votes: true in every
// thread if every wait held and every rank called alike.
template <int N>
__device__ bool moe_headers(const char* mine, u64 off, u32 set, u64 sig, u32* tokens, u64 most, WaitCtx& c) {
  bool ok = true;
  const int r = threadIdx.x;
  if (r < N) {
    const char* h = mine + header_at<N>(off, set, r);
    uint4 v = ld_volatile(h);
    ok = moe_wait(h, v, c, r);
    if (ok && unpack_signature(v) != sig) {
      fail(c, kFailMismatch, r, 0, sig, unpack_signature(v));
      ok = false;
    }
    if (tokens != nullptr) {
      uint4 t = ld_volatile(h + kVec);
      ok = ok && moe_wait(h + kVec, t, c, r);
      tokens[r] = ok && t.x - 1u <= most ? t.x - 1u : 0u;
    }
  }
  return block_vote(ok, c);
}

// Pushes this rank's header into set `set` of every rank (block 0's last thread): its
// signature, and with `with_tokens` (the dispatch) a second vector (T + 1, 1, 1, 1).
template <int N, class Tp>
__device__ void moe_push_header(const Tp& tp, u64 off, u32 set, u64 sig, bool with_tokens, u64 tokens) {
  if (blockIdx.x != 0 || threadIdx.x != blockDim.x - 1) return;
  const u64 at = header_at<N>(off, set, tp.rank);
  if (with_tokens) tp.push_all(at + kVec, make_uint4((u32)tokens + 1u, 1u, 1u, 1u));
  tp.push_all(at, pack_signature(sig));
}

// Vectors q = begin, begin + step, ... below end, `kIlp` at a time: the loads of a batch
// all issue before its first store, so a thread's vectors wait for memory once per batch,
// not once each (a row spread over a block or the grid: kernels/moe_dispatch.cu,
// moe_combine.cu). load(q) returns vector q, store(q, v) writes it.
constexpr int kIlp = 4;
template <class Load, class Store>
__device__ __forceinline__ void pipelined(u64 begin, u64 end, u64 step, Load load, Store store) {
  for (u64 q0 = begin; q0 < end; q0 += kIlp * step) {
    uint4 v[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      if (q0 + u * step < end) v[u] = load(q0 + u * step);
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      if (q0 + u * step < end) store(q0 + u * step, v[u]);
    }
  }
}

// A full warp's mask for the *_sync intrinsics.
constexpr u32 kWarpAll = 0xffffffffu;

// One token's routing slots, checked by one warp (every lane calls it; lane k < K reads slot
// k of token t): an id below -1 or at least E, or an expert an earlier slot holds, fails the
// call (kFailInput, at slot t * K + k) and is dropped (-1). keep: this lane's checked id;
// wbits: its weight's bits, -0.0 written as +0.0; mask: the GPUs (bit g) of the token's kept
// slots, the same in every lane.
struct MoeSlots {
  int keep;
  u32 wbits, mask;
};
__device__ __forceinline__ MoeSlots check_slots(const MoeShape& m, const int* idx, const float* w, u64 t, WaitCtx& c) {
  const int lane = threadIdx.x & 31, K = (int)m.topk;
  int id = -1;
  u32 wbits = 0u;
  if (lane < K) {
    id = idx[t * K + lane];
    wbits = clear_sentinel_word<float>(__float_as_uint(w[t * K + lane]));
  }
  const bool range = lane < K && (id < -1 || (long long)id >= (long long)m.experts);
  bool repeated = false;
  for (int j = 0; j < K; ++j) {
    const int other = __shfl_sync(kWarpAll, id, j);
    repeated |= j < lane && lane < K && id >= 0 && !range && other == id;
  }
  if (range) fail(c, kFailInput, c.rank, kMoeBadExpert, t * K + lane, (u64)(long long)id);
  if (repeated) fail(c, kFailInput, c.rank, kMoeRepeatedExpert, t * K + lane, (u64)id);
  const int keep = range || repeated ? -1 : id;
  return {keep, wbits, __reduce_or_sync(kWarpAll, keep >= 0 ? 1u << (keep / (int)m.local) : 0u)};
}

// A token's routing record (the K checked ids of `k`, then the K weights, padding 1) for every
// rank, formed by the warp that checked it: in rounds of 32, lane j takes vector j % R of rank
// j / R's copy and calls store(rank, j % R, vector); the caller's store orders and places it.
template <int N, class Store>
__device__ __forceinline__ void store_record(const MoeShape& m, const MoeSlots& k, Store store) {
  const int lane = threadIdx.x & 31, K = (int)m.topk;
  const u64 R = m.record_vecs(), nrec = N * R;
  for (u64 base = 0; base < nrec; base += 32) {
    const u64 j = base + lane, q = j % R;
    const int d = (int)(j / R);
    u32 word[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int wi = (int)(4 * q) + h, from = wi < K ? wi : wi < 2 * K ? wi - K : 0;
      const int id_v = __shfl_sync(kWarpAll, k.keep, from);
      const u32 w_v = __shfl_sync(kWarpAll, k.wbits, from);
      word[h] = wi < K ? (u32)id_v : wi < 2 * K ? w_v : 1u;
    }
    if (j < nrec) store(d, q, make_uint4(word[0], word[1], word[2], word[3]));
  }
}

// The received rows, counted over the sources in rank order: first[s] is the row of source
// s's token 0, first[N] all of them (tok[s]: T_s, taken at most `most`).
template <int N> struct Received {
  u32 first[N + 1];
  __device__ explicit Received(const u32* tok, u32 most = 0xffffffffu) {
    first[0] = 0u;
#pragma unroll
    for (int r = 0; r < N; ++r) first[r + 1] = first[r] + min(tok[r], most);
  }
  __device__ u32 rows() const { return first[N]; }
  // The source of received row f (its token: f - first[source]).
  __device__ int source(u32 f) const {
    int s = 0;
    while (s + 1 < N && f >= first[s + 1]) ++s;
    return s;
  }
};

// What a combine reads of the dispatch before it (this rank's own memory: the dispatch's
// outputs, moe_dispatch.cu's DispatchOut or moe_packed_dispatch.cu's PackedOut).
struct CombineIn {
  const char* y;         // the experts' outputs, row for row as recv_x ([L][C][H] or [R][H] of T)
  const float* weights;  // a weight per row of y
  const int* route;      // [N][M][K] each received token's slot: a row of y, or a UB_MOE_ROUTE_*
  const u32* tokens;     // [N] T of each source
  const u32* dest;       // [M] the GPUs (bit g) of each of this rank's tokens
};

// The fp32 partial of a received token on this GPU over vector i of y's width (Vec<T>::kPer
// channels): acc = +0.0, then acc + w * y for each of its K slots in top-k order whose route
// r is a row (r >= 0: row r of y, weight weights[r]), the product and the sum each rounded
// (no fused multiply-add: the host reference's arithmetic). The loads of `Batch` slots issue
// together before their sums.
template <class T, int Batch>
__device__ __forceinline__ void partial_of(float (&acc)[Vec<T>::kPer], const int* route, int K, const char* y,
                                           const float* weights, u64 row_bytes, u64 i) {
  constexpr int P = Vec<T>::kPer;
#pragma unroll
  for (int e = 0; e < P; ++e) acc[e] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += Batch) {
    int r[Batch];
    uint4 v[Batch];
    float wk[Batch];
#pragma unroll
    for (int b = 0; b < Batch; ++b) {
      r[b] = k0 + b < K ? route[k0 + b] : -1;
      if (r[b] >= 0) {
        v[b] = ld_weak(y + (u64)r[b] * row_bytes + i * kVec);
        wk[b] = weights[r[b]];
      }
    }
#pragma unroll
    for (int b = 0; b < Batch; ++b) {
      if (r[b] < 0) continue;
      float f[P];
      Vec<T>::unpack(v[b], f);
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(wk[b], f[e]));
    }
  }
}

// The sum of a combine: each 16-byte vector i of each of this rank's `count` output rows t, one
// per thread over the grid: acc = +0.0 in each of its Vec<T>::kPer channels, add(t, i, acc)
// adds the token's partials into it (false: a wait failed), then out's vector holds the sum
// rounded once to T, or poison.
template <class T, class Add>
__device__ __forceinline__ void sum_rows(const MoeShape& m, u64 count, char* out, Add add) {
  constexpr int P = Vec<T>::kPer;
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec;
  const u64 step = (u64)gridDim.x * blockDim.x;
  for (u64 q = (u64)blockIdx.x * blockDim.x + threadIdx.x; q < count * vpr; q += step) {
    const u64 t = q / vpr, i = q % vpr;
    float acc[P];
#pragma unroll
    for (int e = 0; e < P; ++e) acc[e] = 0.0f;
    const bool good = add(t, i, acc);
    st_weak(out + t * row_bytes + i * kVec, good ? Vec<T>::pack(acc) : Vec<T>::poison());
  }
}
