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

// Waits until v, loaded from p (pushed by `peer`), has no sentinel left, re-reading p;
// false if the wait gave up (sync.cuh: spin), or if the communicator has failed for this
// thread: data that arrived then is not used either (it may be another launch's).
template <class T>
__device__ __forceinline__ bool lamport_wait(const char* p, uint4& v, WaitCtx& c, int peer) {
  if (!has_sentinel<T>(v)) return !c.failed;
  return spin(c, peer, kSiteLamportPoll, [&] {
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

// Waits until each of the N vectors loaded by lamport_load has arrived, then reduces
// them in rank order and packs the result as T; poison if a wait gave up.
template <class T, class Op, int N>
__device__ uint4 lamport_collect(const char* buf, u64 slot_bytes, u64 i, uint4 (&v)[N], WaitCtx& c) {
  bool ok = true;
#pragma unroll
  for (int r = 0; r < N; ++r) ok &= lamport_wait<T>(buf + r * slot_bytes + i * kVec, v[r], c, r);
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

// ---- call signatures (ubnext._signature) ---------------------------------------------
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

// Every block calls it before its threads use pushed data: thread r < N waits for the
// signature rank r pushed at headers + r * kVec and compares it with `sig`. Returns, in
// every thread of the block, whether every rank called alike; a difference fails the
// communicator (kFailMismatch, both signatures recorded).
template <class T, int N>
__device__ bool lamport_agree(const char* headers, u64 sig, WaitCtx& c) {
  bool ok = true;
  const int r = threadIdx.x;
  if (r < N) {
    uint4 h = ld_volatile(headers + r * kVec);
    ok = lamport_wait<T>(headers + r * kVec, h, c, r);
    const u64 theirs = unpack_signature(h);
    if (ok && theirs != sig) {
      fail(c, kFailMismatch, r, 0, sig, theirs);
      ok = false;
    }
  }
  ok = __syncthreads_and(ok);
  c.failed |= !ok;
  return ok;
}
