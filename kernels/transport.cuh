// ubnext kernels: transports, the way a kernel reaches the other ranks' memory.
//
// The algorithms are written once over a transport:
//   seg(r)              base of rank r's segment of the symmetric pool (local view)
//   load_reduce(...)    reduce 16-byte vectors at one offset of every segment
//   store_all(...)      store one 16-byte vector at one offset of every segment
// Unicast goes through every peer's mapped pointer (any P2P NVLink machine).
#pragma once
#include "common.cuh"

template <int N> struct Unicast {
  char* base;   // segment 0; segment r starts at base + r * stride
  u64 stride;
  int rank;

  __device__ char* seg(int r) const { return base + (u64)r * stride; }

  // Rank visited k-th: starting with the next rank spreads the traffic of all ranks over
  // all links instead of every rank reaching rank 0 first.
  __device__ int peer(int k) const { return rank + k < N ? rank + k : rank + k - N; }

  // For each u with ok[u]: reduces the vectors at byte offset off[u] of every segment into
  // out[u], packed as T (fp32 accumulation). The order is peer(0..N-1): fixed for a given
  // rank, so the rank that owns an element always computes the same bits. All U*N loads
  // are issued before the first is used. Loads are relaxed, system scope.
  template <class T, class Op, int U>
  __device__ void load_reduce(const u64 (&off)[U], const bool (&ok)[U], uint4 (&out)[U]) const {
    constexpr int P = Vec<T>::kPer;
    uint4 v[U][N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < N; ++r) {
        if (ok[u]) v[u][r] = ld_relaxed_sys(seg(peer(r)) + off[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc[P], f[P];
      Vec<T>::unpack(v[u][0], acc);
#pragma unroll
      for (int r = 1; r < N; ++r) {
        Vec<T>::unpack(v[u][r], f);
#pragma unroll
        for (int e = 0; e < P; ++e) acc[e] = Op::combine(acc[e], f[e]);
      }
#pragma unroll
      for (int e = 0; e < P; ++e) acc[e] = Op::finish(acc[e], N);
      out[u] = Vec<T>::pack(acc);
    }
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
};
