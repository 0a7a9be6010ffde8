// ubnext kernels: the Lamport protocol, shared by the one-shot (lamport.cu) and the
// two-shot (lamport_twoshot.cu) kernels.
//
// Data is pushed into receive buffers that hold the sentinel (-0.0 in every element,
// compared bitwise) until it arrives; the receiver polls its own memory until no element
// is the sentinel. Values equal to -0.0 are sent as +0.0. No barrier: a peer can be at
// most one launch ahead (it needs this rank's data of its previous launch to finish it),
// so with three buffers used in turn (LaunchState.slot s), while this launch receives into
// buffer s and peers may already push into s + 1 (mod 3), this launch re-poisons s - 1,
// the one of the previous launch, whose every pushed vector it has already seen arrive.
// There is one set of three buffers per element width (2 or 4 bytes), since the
// sentinel's bit pattern depends on it.
#pragma once
#include "sync.cuh"

static_assert(Elem<UB_T>::kFloat && Elem<UB_T>::kBytes <= 4,
              "the Lamport kernels carry 16- and 32-bit floating types only: they need the -0.0 sentinel");

// Bit pattern of four 32-bit words filled with the sentinel (host fills new buffers with it).
template <class T> __device__ __forceinline__ u32 sentinel_word() {
  return Elem<T>::kBytes == 4 ? UB_SENTINEL32 : UB_SENTINEL16 * 0x10001u;
}

// True if any element of v is the sentinel.
template <class T> __device__ __forceinline__ bool has_sentinel(const uint4& v) {
  bool hit = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 w = Vec<T>::word(v, i);
    if (Elem<T>::kBytes == 4) {
      hit |= w == UB_SENTINEL32;
    } else {
      hit |= (w & 0xffffu) == UB_SENTINEL16 || (w >> 16) == UB_SENTINEL16;
    }
  }
  return hit;
}


// Context of one launch: which buffer it receives into, which one it re-poisons.
struct LamportLaunch {
  LaunchView s;
  u64 cur, old;  // offsets of the current and the previous launch's buffer
};

// `buffer_bytes`: size of one of the set's three buffers.
__device__ LamportLaunch lamport_begin(LaunchState* state, u64 set_off, u64 buffer_bytes) {
  LamportLaunch l;
  l.s = read_launch_state(state);
  l.cur = set_off + (u64)l.s.slot * buffer_bytes;
  l.old = set_off + (u64)(l.s.slot == 0u ? 2u : l.s.slot - 1u) * buffer_bytes;
  return l;
}

// Re-poisons `vecs` vectors at p, in this rank's segment (grid-stride over the launch).
template <class T> __device__ void lamport_repoison(char* p, u64 vecs) {
  const u32 s = sentinel_word<T>();
  const uint4 fill = make_uint4(s, s, s, s);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += (u64)blockDim.x * gridDim.x) {
    st_relaxed_sys(p + i * kVec, fill);
  }
}

// ---- call signatures (ubnext._protocol.signature) ---------------------------------------------
// Every rank pushes its call's 64-bit signature into a header vector of each receiving
// rank beside the data; a receiver compares every rank's with its own before it uses the
// data, so ranks that called with different arguments fail (kFailMismatch) instead of
// reducing mismatched data. Byte k of the signature travels in the low byte of 16-bit half
// k, so that no element of any width can look like the sentinel.
__device__ __forceinline__ uint4 pack_signature(u64 s) {
  u32 w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = (u32)(s >> (16 * k)) & 0xffu | ((u32)(s >> (16 * k + 8)) & 0xffu) << 16;
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ u64 unpack_signature(const uint4& v) {
  u64 s = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const u32 w = Vec<float>::word(v, k);
    s |= (u64)(w & 0xffu) << (16 * k) | (u64)((w >> 16) & 0xffu) << (16 * k + 8);
  }
  return s;
}

// Waits until v, loaded from p (pushed by `peer`), has no sentinel left, re-reading p;
// false if the wait gave up (sync.cuh: spin), or if the communicator has failed for this
// thread: data that arrived then is not used either (it may be another launch's).
template <class T>
__device__ __forceinline__ bool lamport_wait(const char* p, uint4& v, WaitCtx& c, int peer) {
  if (!has_sentinel<T>(v)) return usable(c);
  return spin(c, [=] { return peer; }, kSiteLamportPoll, [&] {
    v = ld_volatile(p);
    return !has_sentinel<T>(v);
  });
}

// Loads vector i of slots 0..N-1 (slot r at buf + r * slot_bytes, pushed by rank r).
template <int N>
__device__ __forceinline__ void lamport_load(const char* buf, u64 slot_bytes, u64 i, uint4 (&v)[N]) {
#pragma unroll
  for (int r = 0; r < N; ++r) v[r] = ld_volatile(buf + r * slot_bytes + i * kVec);
}

// Waits until none of the vectors this thread wants holds the sentinel: when `data`, v[r]
// (vector i of slot r at buf + r * slot_bytes, pushed by rank r) for every r; when
// `header`, h (rank threadIdx.x's call signature, at hdr: see below), which must then
// agree with `sig`: a difference fails the communicator at once (kFailMismatch, both
// signatures recorded), so no thread keeps waiting for data that a peer called
// differently will never send. Each round reloads every vector still pending, so vectors
// that arrive together cost one load latency, not one each. False as lamport_wait; a
// timeout names the lowest rank still pending.
template <class T, int N>
__device__ __forceinline__ bool lamport_arrive(const char* buf, u64 slot_bytes, u64 i, uint4 (&v)[N], bool data,
                                               const char* hdr, uint4& h, bool header, u64 sig, WaitCtx& c) {
  const auto pending = [&] {
    u32 m = header && has_sentinel<T>(h) ? 1u << N : 0u;
#pragma unroll
    for (int r = 0; r < N; ++r) m |= data && has_sentinel<T>(v[r]) ? 1u << r : 0u;
    return m;
  };
  u32 m = pending();
  bool compared = !header;
  const auto differs = [&] {  // once h has arrived: whether its signature differs (then fails)
    if (compared || (m >> N & 1u)) return false;
    compared = true;
    const u64 theirs = unpack_signature(h);
    if (theirs != sig) fail(c, kFailMismatch, (int)threadIdx.x, 0, sig, theirs);
    return theirs != sig;
  };
  if (differs()) return false;
  if (m == 0u) return usable(c);
  const auto peer = [&] { return __ffs(m) - 1 < N ? __ffs(m) - 1 : (int)threadIdx.x; };
  return spin(c, peer, kSiteLamportPoll, [&] {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (m >> r & 1u) v[r] = ld_volatile(buf + r * slot_bytes + i * kVec);
    }
    if (m >> N & 1u) h = ld_volatile(hdr);
    m = pending();
    return differs() || m == 0u;
  }) && !c.failed;
}

// Waits until each of the N vectors loaded by lamport_load has arrived, then reduces
// them in rank order and packs the result as T; poison if a wait gave up.
template <class T, class Op, int N>
__device__ uint4 lamport_collect(const char* buf, u64 slot_bytes, u64 i, uint4 (&v)[N], WaitCtx& c) {
  uint4 h;
  const bool ok = lamport_arrive<T, N>(buf, slot_bytes, i, v, true, nullptr, h, false, 0, c);
  return ok ? reduce_vectors<T, Op, N>(v) : Vec<T>::poison();
}

// Polls vector i of slots 0..N-1 until each has arrived, reduces them in rank order (all
// N loads are issued before the first wait); poison if a wait gave up.
template <class T, class Op, int N>
__device__ uint4 lamport_reduce(const char* buf, u64 slot_bytes, u64 i, WaitCtx& c) {
  uint4 v[N];
  lamport_load<N>(buf, slot_bytes, i, v);
  return lamport_collect<T, Op, N>(buf, slot_bytes, i, v, c);
}

// ---- signature checks ----------------------------------------------------------------
// Each rank's signature header has a line of its own: header r at headers + r * kHeader.
constexpr u64 kHeader = UB_HEADER_BYTES;

// Re-poisons the N headers at `headers`, in this rank's segment.
template <class T, int N> __device__ void repoison_headers(char* headers) {
  const u32 s = sentinel_word<T>();
  if (blockIdx.x == 0 && threadIdx.x < N) st_relaxed_sys(headers + threadIdx.x * kHeader, make_uint4(s, s, s, s));
}

// Pushes this rank's call signature into header [rank] (at hdr + rank * kHeader) of every
// rank: before the data, so that it arrives with them, from block 0's last thread, which
// has no data of its own in small messages (the first threads take the first vectors),
// so the header leaves at once, beside the data.
template <class Tp> __device__ void push_signature(const Tp& tp, u64 hdr, u64 sig) {
  if (blockIdx.x == 0 && threadIdx.x == blockDim.x - 1) tp.push_all(hdr + tp.rank * kHeader, pack_signature(sig));
}

// The block's vote: whether every thread's waits succeeded (and so every rank's signature
// agreed), in every thread of the block; after a failure every thread gives up.
__device__ __forceinline__ bool block_vote(bool ok, WaitCtx& c) {
  ok = __syncthreads_and(ok);
  c.failed |= !ok;
  return ok;
}

// Every block calls it before its threads use pushed data: thread r < N waits for the
// signature rank r pushed at headers + r * kHeader and compares it with `sig`; then the block
// votes. True in every thread if every rank called alike.
template <class T, int N>
__device__ bool lamport_agree(const char* headers, u64 sig, WaitCtx& c) {
  const bool header = threadIdx.x < N;
  const char* hdr = headers + threadIdx.x * kHeader;
  uint4 h = header ? ld_volatile(hdr) : make_uint4(0u, 0u, 0u, 0u), none[N];
  return block_vote(lamport_arrive<T, N>(nullptr, 0, 0, none, false, hdr, h, header, sig, c), c);
}

// The first vector of a thread's loop, with the block's signature check: as
// lamport_collect when `data` (v loaded by lamport_load), thread r < N polling rank r's
// header in the same rounds (it was pushed just before the data), then the block's vote
// before any result is used. Every thread of the block calls it; the result is poison
// unless every wait succeeded and every rank called alike.
template <class T, class Op, int N>
__device__ uint4 lamport_collect_first(const char* buf, u64 slot_bytes, u64 i, uint4 (&v)[N], bool data,
                                       const char* headers, u64 sig, WaitCtx& c) {
  const bool header = threadIdx.x < N;
  const char* hdr = headers + threadIdx.x * kHeader;
  uint4 h = header ? ld_volatile(hdr) : make_uint4(0u, 0u, 0u, 0u);
  const bool ok = block_vote(lamport_arrive<T, N>(buf, slot_bytes, i, v, data, hdr, h, header, sig, c), c);
  return ok ? reduce_vectors<T, Op, N>(v) : Vec<T>::poison();
}
