// ubnext kernels: transports, the way a kernel reaches the other ranks' memory.
//
// The algorithms are written once over a transport:
//   seg(r)              base of rank r's segment of the symmetric pool (local view)
//   load_reduce(...)    reduce 16-byte vectors at one offset of every segment
//   store_all(...)      store one 16-byte vector at one offset of every segment (weak:
//                       ordered by the barriers of the two-shot kernel)
//   push_all(...)       the same as a Lamport push, which the receiver polls for
//   push_peers(...)     a Lamport push into every segment but this rank's (peer pointers)
//   barrier(...)        block b of every rank waits for block b of every other rank
// Unicast goes through every peer's mapped pointer (any P2P NVLink machine). Multicast
// (NVLS) goes through the multicast mapping of the pool: one multimem access at mc + off
// reaches offset off of every rank's segment, reduced or broadcast by the NVSwitch.
// The host picks one with UB_TRANSPORT (ubnext._protocol.algorithms.compile_defines).
#pragma once
#include "sync.cuh"

template <int N> struct Unicast {
  char* base;   // segment 0; segment r starts at base + r * stride
  u64 stride;
  int rank;
  char* mc;     // multicast mapping of the pool (Multicast only; null for Unicast)

  __device__ char* seg(int r) const { return base + (u64)r * stride; }

  // Rank visited k-th: starting with the next rank spreads the traffic of all ranks over
  // all links instead of every rank reaching rank 0 first.
  __device__ int peer(int k) const { return rank + k < N ? rank + k : rank + k - N; }

  // For each u with ok[u]: reduces the vectors at byte offset off[u] of every segment into
  // out[u], packed as T (fp32 accumulation). The order is peer(0..N-1): fixed for a given
  // rank, so the rank that owns an element always computes the same bits; in deterministic
  // mode rank order 0..N-1 with -0.0 read as +0.0 and the result's -0.0 written as +0.0,
  // as the Lamport kernels compute. All U*N loads are issued before the first is used.
  // Loads are relaxed, system scope.
  template <class T, class Op, int U>
  __device__ void load_reduce(const u64 (&off)[U], const bool (&ok)[U], uint4 (&out)[U]) const {
    uint4 v[U][N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < N; ++r) {
        if (ok[u]) v[u][r] = settle<T>(ld_relaxed_sys(seg(kDeterministic ? r : peer(r)) + off[u]));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) out[u] = settle<T>(reduce_vectors<T, Op, N>(v[u]));
  }

  // Stores v at byte offset off of every segment, in peer() order (weak stores), all of it
  // when valid == 0, else only its first `valid` elements.
  template <class T> __device__ void store_all(u64 off, const uint4& v, int valid) const {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      char* p = seg(peer(k)) + off;
      if (valid == 0) st_weak(p, v); else st_partial<T>(p, v, valid);
    }
  }

  // Pushes v to byte offset off of every segment, in peer() order (relaxed, system scope).
  __device__ void push_all(u64 off, const uint4& v) const {
#pragma unroll
    for (int k = 0; k < N; ++k) st_relaxed_sys(seg(peer(k)) + off, v);
  }

  // Pushes v to byte offset off of every other rank's segment, in peer() order (relaxed,
  // system scope).
  __device__ void push_peers(u64 off, const uint4& v) const {
#pragma unroll
    for (int k = 1; k < N; ++k) st_relaxed_sys(seg(peer(k)) + off, v);
  }

  // Barrier of block blockIdx.x with the same block on every rank, exchanging call
  // signatures when `sig` is nonzero (sync.cuh); whether it held in every thread of the block.
  __device__ bool barrier(u64 flags_off, int phase, u32 value, u64 sig, WaitCtx& c, u32 site) const {
    return block_barrier<N>(*this, flags_off, phase, value, sig, c, site);
  }
};

// ---- NVLink multicast (sm_90+) ----------------------------------------------------

// multimem.ld_reduce of one 16-byte vector: the sum (fp32 accumulation for 16-bit types),
// max or min over every rank's copy. Relaxed, system scope.
template <class T, class Op> struct MultimemReduce;

#define UB_MULTIMEM_LD_REDUCE(T, OP, SUFFIX)                                                  \
  template <> struct MultimemReduce<T, OP> {                                                 \
    __device__ static uint4 load(const char* p) {                                            \
      uint4 v;                                                                               \
      asm volatile("multimem.ld_reduce.relaxed.sys.global." SUFFIX " {%0,%1,%2,%3}, [%4];"  \
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");       \
      return v;                                                                              \
    }                                                                                        \
  };
#define UB_MULTIMEM_SUM_AVG(T, SUFFIX) \
  UB_MULTIMEM_LD_REDUCE(T, OpSum, SUFFIX) UB_MULTIMEM_LD_REDUCE(T, OpAvg, SUFFIX)
UB_MULTIMEM_SUM_AVG(bf16, "add.acc::f32.v4.bf16x2")
UB_MULTIMEM_SUM_AVG(f16, "add.acc::f32.v4.f16x2")
UB_MULTIMEM_SUM_AVG(float, "add.v4.f32")
UB_MULTIMEM_LD_REDUCE(bf16, OpMax, "max.v4.bf16x2")
UB_MULTIMEM_LD_REDUCE(bf16, OpMin, "min.v4.bf16x2")
UB_MULTIMEM_LD_REDUCE(f16, OpMax, "max.v4.f16x2")
UB_MULTIMEM_LD_REDUCE(f16, OpMin, "min.v4.f16x2")
#undef UB_MULTIMEM_SUM_AVG
#undef UB_MULTIMEM_LD_REDUCE

// multimem.st of one 16-byte vector into every rank's copy (weak: ordered by barriers).
__device__ __forceinline__ void multimem_st(char* p, const uint4& v) {
  asm volatile("multimem.st.weak.global.v4.f32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// multimem.st of one 16-byte vector that every rank polls for (relaxed, system scope).
__device__ __forceinline__ void multimem_push(char* p, const uint4& v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// multimem.red.add of a 32-bit counter on every rank, release at system scope.
__device__ __forceinline__ void multimem_red_release(char* p, u32 v) {
  asm volatile("multimem.red.release.sys.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

template <int N> struct Multicast : Unicast<N> {
  using Unicast<N>::seg;

  // One multimem.ld_reduce per vector: the switch reads and reduces every rank's copy.
  // Identical on every rank (one reduction, done in the switch).
  template <class T, class Op, int U>
  __device__ void load_reduce(const u64 (&off)[U], const bool (&ok)[U], uint4 (&out)[U]) const {
    constexpr int P = Vec<T>::kPer;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (ok[u]) out[u] = MultimemReduce<T, Op>::load(this->mc + off[u]);
    }
    if (Op::kFinishes) {  // average: divide the sum once
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float f[P];
        Vec<T>::unpack(out[u], f);
#pragma unroll
        for (int e = 0; e < P; ++e) f[e] = Op::finish(f[e], N);
        out[u] = Vec<T>::pack(f);
      }
    }
  }

  // One multimem.st per vector, a Lamport push into every rank's copy.
  __device__ void push_all(u64 off, const uint4& v) const { multimem_push(this->mc + off, v); }

  // One multimem.st per vector; a partial vector goes element by element through the
  // unicast path.
  template <class T> __device__ void store_all(u64 off, const uint4& v, int valid) const {
    if (valid == 0) {
      multimem_st(this->mc + off, v);
    } else {
      Unicast<N>::template store_all<T>(off, v, valid);
    }
  }

  // Counter barrier: one multimem.red adds 1 to this block's counter on every rank; the
  // block waits until its own counter shows all N arrivals of this launch (value * N).
  // Counters live in slot [phase][block][0] of the flag array and only grow. Signatures
  // (sig nonzero) go to every rank by unicast stores before the arrival, as in
  // block_barrier.
  // Whether it held, in every thread of the block; a block that failed before does not
  // arrive (sync.cuh: block_barrier).
  __device__ bool barrier(u64 flags_off, int phase, u32 value, u64 sig, WaitCtx& c, u32 site) const {
    if (__syncthreads_or(!usable(c))) return c.failed = true, false;
    const int t = threadIdx.x;
    if (sig != 0 && t < N) *(volatile u64*)(seg(t) + flags_off + signature_offset(blockIdx.x, c.rank)) = sig;
    __syncthreads();
    bool ok = true;
    if (t == 0) {
      const u64 off = flags_off + flag_offset(phase, blockIdx.x, 0);
      fence_sys();
      multimem_red_release(this->mc + off, 1u);
      ok = wait_flag((const u32*)(seg(c.rank) + off), value * (u32)N, c, (int)UB_ANY_PEER, site);
    }
    ok = __syncthreads_and(ok);
    if (ok && sig != 0 && t < N) ok = signature_agrees(seg(c.rank), flags_off, t, sig, c);
    ok = __syncthreads_and(ok);
    c.failed |= !ok;
    return ok;
  }
};

#ifndef UB_TRANSPORT
#define UB_TRANSPORT Unicast
#endif
