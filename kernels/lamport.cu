// Lamport one-shot all-reduce: push, re-poison, poll.
//
// Every rank stores its whole input into slot [rank] of receive buffer (epoch % 3) of
// every rank, then polls its own copy of that buffer until no element is the sentinel
// (-0.0, compared bitwise) and reduces the slots in rank order 0..N-1, so every rank
// computes identical bits. Inputs equal to -0.0 are sent as +0.0. No barrier: a peer
// can be at most one launch ahead (it needs this rank's data of its previous launch to
// finish it), so while this launch uses buffer e % 3 and peers may already write
// (e + 1) % 3, this launch re-poisons buffer (e + 2) % 3, the one of the previous launch.
// There is one set of three buffers per element width (2 or 4 bytes), since the
// sentinel's bit pattern depends on it.
//
// Layout of a set (same offset in every segment): buffer b, slot s at
//   set_off + (b * N + s) * slot_bytes.
#include "sync.cuh"
#include "transport.cuh"

#ifndef UB_LAMPORT_THREADS
#define UB_LAMPORT_THREADS 256
#endif

// Bit pattern of four 32-bit words filled with the sentinel (host fills new buffers with it).
template <class T> __device__ __forceinline__ u32 sentinel_word() {
  return Elem<T>::kBytes == 4 ? 0x80000000u : 0x80008000u;
}

// True if any element of v is the sentinel.
template <class T> __device__ __forceinline__ bool has_sentinel(const uint4& v) {
  bool hit = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 w = Vec<T>::word(v, i);
    if (Elem<T>::kBytes == 4) {
      hit |= w == 0x80000000u;
    } else {
      hit |= (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u;
    }
  }
  return hit;
}

// Replaces every -0.0 element of v by +0.0 so that it cannot be taken for the sentinel.
template <class T> __device__ __forceinline__ u32 clear_sentinel_word(u32 w) {
  if (Elem<T>::kBytes == 4) return w == 0x80000000u ? 0u : w;
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}
template <class T> __device__ __forceinline__ uint4 clear_sentinel(const uint4& v) {
  return make_uint4(clear_sentinel_word<T>(v.x), clear_sentinel_word<T>(v.y),
                    clear_sentinel_word<T>(v.z), clear_sentinel_word<T>(v.w));
}

template <class T, class Op, int N, class Tp>
__device__ void lamport_allreduce(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x,
                                  char* out, u64 n, LaunchState* state, ErrorRecord* err,
                                  u64 timeout_ns) {
  const Span<T> span(n);
  u32 epoch, prev_vecs;
  read_launch_state(state, epoch, prev_vecs);
  const WaitCtx c{err, timeout_ns, tp.rank, epoch};
  const u64 cur = set_off + (u64)(epoch % 3u) * N * slot_bytes;
  const u64 old = set_off + (u64)((epoch + 2u) % 3u) * N * slot_bytes;
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 step = (u64)blockDim.x * gridDim.x;

  // 1. Push: my input into slot [rank] of the current buffer of every rank.
  for (u64 i = first; i < span.nvec; i += step) {
    tp.template store_all<T>(cur + tp.rank * slot_bytes + i * 16,
                             clear_sentinel<T>(span.load(x, i)), 0);
  }

  // 2. Re-poison the previous launch's buffer in my own segment.
  const u32 s = sentinel_word<T>();
  const uint4 poison = make_uint4(s, s, s, s);
  char* mine = tp.seg(tp.rank);
  for (u64 i = first; i < prev_vecs; i += step) {
#pragma unroll
    for (int r = 0; r < N; ++r) st_weak(mine + old + r * slot_bytes + i * 16, poison);
  }

  // 3. Poll my copy of every slot until it has arrived, reduce in rank order, store.
  constexpr int P = Vec<T>::kPer;
  for (u64 i = first; i < span.nvec; i += step) {
    uint4 v[N];
#pragma unroll
    for (int r = 0; r < N; ++r) v[r] = ld_volatile(mine + cur + r * slot_bytes + i * 16);
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (has_sentinel<T>(v[r])) {
        const u64 t0 = globaltimer();
        do {
          if (globaltimer() - t0 > timeout_ns) fail_timeout(c, r, kSiteLamportPoll);
          v[r] = ld_volatile(mine + cur + r * slot_bytes + i * 16);
        } while (has_sentinel<T>(v[r]));
      }
    }
    float acc[P], f[P];
    Vec<T>::unpack(v[0], acc);
#pragma unroll
    for (int r = 1; r < N; ++r) {
      Vec<T>::unpack(v[r], f);
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] = Op::combine(acc[e], f[e]);
    }
#pragma unroll
    for (int e = 0; e < P; ++e) acc[e] = Op::finish(acc[e], N);
    span.store(out, i, Vec<T>::pack(acc));
  }

  finish_launch(state, epoch, (u32)span.nvec);
}

// ---- entry point, instantiated per (UB_T, UB_OP, UB_NRANKS) by the host ----------

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_THREADS)
ub_lamport(char* base, u64 stride, int rank, u64 set_off, u64 slot_bytes, const char* x,
           char* out, u64 n, LaunchState* state, ErrorRecord* err, u64 timeout_ns) {
  const Unicast<UB_NRANKS> tp{base, stride, rank};
  lamport_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, set_off, slot_bytes, x, out, n, state, err,
                                            timeout_ns);
}
