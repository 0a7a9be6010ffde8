// LL lines: the low-latency movers' unit of transfer (kernels/ll_move.cu, kernels/p2p.cu).
//
// 8 data bytes travel in one 16-byte line of two 64-bit words {d0 | f << 32, d1 | f << 32},
// f a flag that the sender and the receiver agree on (never 0 on first use: the buffers
// start zeroed). A 64-bit access is single-copy atomic, so a receiver that sees f in both
// words sees the data stored with it; no sentinel, so every byte pattern travels as it is.
#pragma once
#include "sync.cuh"

// Stores the two words of an LL line carrying `data` (8 bytes) with flag f, relaxed at
// system scope, each 64-bit word whole.
__device__ __forceinline__ void ll_store(char* p, u64 data, u32 f) {
  const u64 w0 = (data & 0xffffffffull) | (u64)f << 32, w1 = (data >> 32) | (u64)f << 32;
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(w0), "l"(w1) : "memory");
}

// Volatile load of the two words of an LL line (re-read from memory on every call).
__device__ __forceinline__ void ll_load(const char* p, u64& w0, u64& w1) {
  asm volatile("ld.volatile.global.v2.u64 {%0,%1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(p) : "memory");
}

// Waits until the LL line at p carries flag f in both words; its 8 data bytes into `data`.
// False if the wait gave up (sync.cuh: spin), or if the communicator has failed for this
// thread (data seen then is not used).
__device__ __forceinline__ bool ll_wait(const char* p, u32 f, u64& data, WaitCtx& c, int peer) {
  u64 w0, w1;
  ll_load(p, w0, w1);
  const auto arrived = [&] { return (u32)(w0 >> 32) == f && (u32)(w1 >> 32) == f; };
  const bool ok = arrived() ? usable(c) : spin(c, [=] { return peer; }, kSiteLinePoll, [&] {
    ll_load(p, w0, w1);
    return arrived();
  });
  data = (w0 & 0xffffffffull) | w1 << 32;
  return ok;
}

// Bytes [8 * i, 8 * i + 8) of an array of n bytes at a (fewer at its end: the rest zero);
// one 8-byte load where it is whole and aligned.
__device__ __forceinline__ u64 load_line(const char* a, u64 i, u64 n) {
  const char* p = a + 8 * i;
  if (8 * i + 8 <= n && ((u64)p & 7u) == 0u) return *(const u64*)p;
  u64 v = 0;
  for (u64 k = 0; k < 8 && 8 * i + k < n; ++k) v |= (u64)(unsigned char)p[k] << (8 * k);
  return v;
}

// Stores the bytes of `v` that fall in [8 * i, 8 * i + 8) of an array of n bytes at a.
__device__ __forceinline__ void store_line(char* a, u64 i, u64 n, u64 v) {
  char* p = a + 8 * i;
  if (8 * i + 8 <= n && ((u64)p & 7u) == 0u) {
    *(u64*)p = v;
    return;
  }
  for (u64 k = 0; k < 8 && 8 * i + k < n; ++k) p[k] = (char)(v >> (8 * k));
}
