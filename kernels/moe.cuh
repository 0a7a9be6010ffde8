// ubnext kernels: expert parallelism (docs/moe.md), what the dispatch (moe_dispatch.cu) and
// the combine (moe_combine.cu) share: the pool area's regions, the object's rotation, the
// headers and the polls.
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

// The end of a launch: the object's rotation, advanced by the last block to count itself
// done, and the family's launch state (sync.cuh: finish_launch). Thread 0 counts its block
// after a barrier (every thread of the block read the rotation before it) and before
// finish_launch's own count, so that the two atomics' round trips overlap.
__device__ void moe_finish(WaitCtx& c, const LaunchView& v, MoeRotation* r, const MoeSets& s) {
  __syncthreads();
  const u32 done = threadIdx.x == 0 ? atomicAdd(&r->done, 1u) : 0u;
  finish_launch(c, v, 0u);  // begins with __syncthreads
  if (threadIdx.x == 0 && done == gridDim.x - 1u) {
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
// later loads of this thread see what the flag's writer stored before its release fence;
// before a relaxed store, that release (what this thread, and its block before a barrier,
// stored earlier is visible to whoever acquires the store).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// A vector loaded with acquire semantics at system scope: later accesses of this thread
// (and of its block after a barrier) see what the writer stored before its release. A load
// and an L1 invalidation (LDG.STRONG.SYS, CCTL.IVALL), no fence: no wait for this
// thread's earlier stores.
__device__ __forceinline__ uint4 ld_acquire_sys_vec(const void* p) {
  uint4 v;
  asm volatile("ld.acquire.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Waits until v, loaded from p (pushed by `peer`), holds no sentinel element of W (fp32
// words, or the bf16 halves of the combine's bf16 partials), re-reading p (with kAcquire,
// by acquire loads: v's first load must be one too, so that the load that sees it written
// is an acquire); false if the wait gave up (sync.cuh: spin) or the communicator failed
// for this thread. The fp32 sentinel word (the re-poisoned state) is a bf16 sentinel in
// its high half: both read it as not yet written.
template <class W = float, bool kAcquire = false>
__device__ __forceinline__ bool moe_wait(const char* p, uint4& v, WaitCtx& c, int peer) {
  if (!has_sentinel<W>(v)) return usable(c);
  return spin(c, [=] { return peer; }, kSiteMoePoll, [&] {
    v = kAcquire ? ld_acquire_sys_vec(p) : ld_volatile(p);
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
    uint4 v = ld_volatile(h), t = tokens != nullptr ? ld_volatile(h + kVec) : v;  // both loads in flight
    ok = moe_wait(h, v, c, r);
    if (ok && unpack_signature(v) != sig) {
      fail(c, kFailMismatch, r, 0, sig, unpack_signature(v));
      ok = false;
    }
    if (tokens != nullptr) {
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
