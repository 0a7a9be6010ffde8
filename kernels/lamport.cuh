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

// Replaces every -0.0 element of v by +0.0 so that it cannot be taken for the sentinel.
template <class T> __device__ __forceinline__ u32 clear_sentinel_word(u32 w) {
  if (Elem<T>::kBytes == 4) return w == UB_SENTINEL32 ? 0u : w;
  if ((w & 0xffffu) == UB_SENTINEL16) w &= 0xffff0000u;
  if ((w >> 16) == UB_SENTINEL16) w &= 0x0000ffffu;
  return w;
}
template <class T> __device__ __forceinline__ uint4 clear_sentinel(const uint4& v) {
  return make_uint4(clear_sentinel_word<T>(v.x), clear_sentinel_word<T>(v.y),
                    clear_sentinel_word<T>(v.z), clear_sentinel_word<T>(v.w));
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
  const uint4 poison = make_uint4(s, s, s, s);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += (u64)blockDim.x * gridDim.x) {
    st_relaxed_sys(p + i * kVec, poison);
  }
}

// Waits until v, loaded from p (pushed by `peer`), has no sentinel left, re-reading p.
template <class T>
__device__ __forceinline__ void lamport_wait(const char* p, uint4& v, const WaitCtx& c, int peer) {
  if (!has_sentinel<T>(v)) return;
  const u64 t0 = globaltimer();
  do {
    if (globaltimer() - t0 > c.timeout_ns) fail_timeout(c, peer, kSiteLamportPoll);
    v = ld_volatile(p);
  } while (has_sentinel<T>(v));
}

// The vector pushed by `peer` at p, once it has arrived.
template <class T> __device__ __forceinline__ uint4 lamport_poll(const char* p, const WaitCtx& c, int peer) {
  uint4 v = ld_volatile(p);
  lamport_wait<T>(p, v, c, peer);
  return v;
}

// Polls vector i of slots 0..N-1 (slot r at buf + r * slot_bytes, pushed by rank r) until
// each has arrived, then reduces them in rank order and packs the result as T. All N
// loads are issued before the first wait.
template <class T, class Op, int N>
__device__ uint4 lamport_reduce(const char* buf, u64 slot_bytes, u64 i, const WaitCtx& c) {
  uint4 v[N];
#pragma unroll
  for (int r = 0; r < N; ++r) v[r] = ld_volatile(buf + r * slot_bytes + i * kVec);
#pragma unroll
  for (int r = 0; r < N; ++r) lamport_wait<T>(buf + r * slot_bytes + i * kVec, v[r], c, r);
  return reduce_vectors<T, Op, N>(v);
}
