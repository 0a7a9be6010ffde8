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
#include "rmsnorm.cuh"
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

// Context of one launch: which buffer it receives into, which one it re-poisons.
struct LamportLaunch {
  u32 epoch, prev_vecs;
  u64 cur, old;  // offsets of the current and the previous launch's buffer
};

__device__ LamportLaunch lamport_begin(LaunchState* state, u64 set_off, u64 set_bytes) {
  LamportLaunch l;
  read_launch_state(state, l.epoch, l.prev_vecs);
  l.cur = set_off + (u64)(l.epoch % 3u) * set_bytes;
  l.old = set_off + (u64)((l.epoch + 2u) % 3u) * set_bytes;
  return l;
}

// Re-poisons the previous launch's buffer in this rank's segment (grid-stride).
template <class T, int N>
__device__ void lamport_repoison(char* mine, const LamportLaunch& l, u64 slot_bytes) {
  const u32 s = sentinel_word<T>();
  const uint4 poison = make_uint4(s, s, s, s);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < l.prev_vecs;
       i += (u64)blockDim.x * gridDim.x) {
#pragma unroll
    for (int r = 0; r < N; ++r) st_weak(mine + l.old + r * slot_bytes + i * 16, poison);
  }
}

// Polls vector i of every slot of buffer `buf` (in this rank's segment) until it has
// arrived, then reduces the slots in rank order 0..N-1 and packs the result as T.
template <class T, class Op, int N>
__device__ uint4 lamport_reduce(const char* buf, u64 slot_bytes, u64 i, const WaitCtx& c) {
  uint4 v[N];
#pragma unroll
  for (int r = 0; r < N; ++r) v[r] = ld_volatile(buf + r * slot_bytes + i * 16);
#pragma unroll
  for (int r = 0; r < N; ++r) {
    if (has_sentinel<T>(v[r])) {
      const u64 t0 = globaltimer();
      do {
        if (globaltimer() - t0 > c.timeout_ns) fail_timeout(c, r, kSiteLamportPoll);
        v[r] = ld_volatile(buf + r * slot_bytes + i * 16);
      } while (has_sentinel<T>(v[r]));
    }
  }
  return reduce_vectors<T, Op, N>(v);
}

template <class T, class Op, int N, class Tp>
__device__ void lamport_allreduce(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x,
                                  char* out, u64 n, LaunchState* state, ErrorRecord* err,
                                  u64 timeout_ns) {
  const Span<T> span(n);
  const LamportLaunch l = lamport_begin(state, set_off, N * slot_bytes);
  const WaitCtx c{err, timeout_ns, tp.rank, l.epoch};
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 step = (u64)blockDim.x * gridDim.x;

  // 1. Push: my input into slot [rank] of the current buffer of every rank.
  for (u64 i = first; i < span.nvec; i += step) {
    tp.template store_all<T>(l.cur + tp.rank * slot_bytes + i * 16,
                             clear_sentinel<T>(span.load(x, i)), 0);
  }
  // 2. Re-poison the previous launch's buffer in my own segment.
  char* mine = tp.seg(tp.rank);
  lamport_repoison<T, N>(mine, l, slot_bytes);
  // 3. Poll my copy of every slot until it has arrived, reduce in rank order, store.
  for (u64 i = first; i < span.nvec; i += step) {
    span.store(out, i, lamport_reduce<T, Op, N>(mine + l.cur, slot_bytes, i, c));
  }
  finish_launch(state, l.epoch, (u32)span.nvec);
}

// Fused all-reduce + residual add + RMSNorm (rmsnorm.cuh) of `rows` rows of a.hidden
// elements (a multiple of the vector width): every rank reduces and normalizes every row.
// The push is spread over every block in contiguous parts (a few tokens still use many
// SMs' store bandwidth); block b then reduces and normalizes rows b, b + gridDim.x, ...
// The outputs must not overlap x (another block may still be pushing it).
template <class T, int N, class Tp>
__device__ void lamport_add_rmsnorm(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x,
                                    u64 rows, const NormArgs& a, LaunchState* state,
                                    ErrorRecord* err, u64 timeout_ns) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  const LamportLaunch l = lamport_begin(state, set_off, N * slot_bytes);
  const WaitCtx c{err, timeout_ns, tp.rank, l.epoch};

  const u64 nvec = rows * vpr;
  const u64 part = (nvec + gridDim.x - 1) / gridDim.x;
  const u64 end = (blockIdx.x + 1) * part < nvec ? (blockIdx.x + 1) * part : nvec;
  for (u64 i = blockIdx.x * part + threadIdx.x; i < end; i += blockDim.x) {
    tp.template store_all<T>(l.cur + tp.rank * slot_bytes + i * 16,
                             clear_sentinel<T>(ld_weak(x + i * 16)), 0);
  }
  char* mine = tp.seg(tp.rank);
  lamport_repoison<T, N>(mine, l, slot_bytes);
  for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
    float ss = 0.f;
    for (u64 v = threadIdx.x; v < vpr; v += blockDim.x) {
      const u64 i = row * vpr + v;
      const RowOperands o = load_operands<T>(a, row, v);
      const uint4 res = add_residual<T>(o, lamport_reduce<T, OpSum, N>(mine + l.cur, slot_bytes, i, c));
      st_weak(a.res_out + i * 16, res);
      ss += sum_squares<T>(res);
    }
    const float scale = rms_scale(block_sum(ss), a.hidden, a.eps);
    for (u64 v = threadIdx.x; v < vpr; v += blockDim.x) {
      const u64 i = row * vpr + v;
      st_weak(a.normed + i * 16, normalize<T>(a, v, ld_weak(a.res_out + i * 16), scale));
    }
  }
  finish_launch(state, l.epoch, (u32)nvec);
}

// ---- entry points, instantiated per (UB_T, UB_OP, UB_NRANKS, UB_TRANSPORT) ---------

extern "C" __global__ void __launch_bounds__(UB_LAMPORT_THREADS)
ub_lamport(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 slot_bytes,
           const char* x, char* out, u64 n, LaunchState* state, ErrorRecord* err,
           u64 timeout_ns) {
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  lamport_allreduce<UB_T, UB_OP, UB_NRANKS>(tp, set_off, slot_bytes, x, out, n, state, err,
                                            timeout_ns);
}

extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_lamport_norm(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 slot_bytes,
                const char* x, u64 rows, u64 hidden, const char* residual, const char* bias,
                const char* weight, char* normed, char* res_out, float eps,
                LaunchState* state, ErrorRecord* err, u64 timeout_ns) {
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  lamport_add_rmsnorm<UB_T, UB_NRANKS>(tp, set_off, slot_bytes, x, rows, a, state, err,
                                       timeout_ns);
}
