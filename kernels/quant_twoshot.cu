// Quantized two-shot all-reduce (opt-in): reduce-scatter and all-gather of groups quantized
// to one-byte codes with an fp32 scale each (kernels/quant.cuh; ubnext/_quant.py states the
// arithmetic and the error bound).
//
// The input x and the output are local arrays of this rank (any 2-byte aligned address);
// only the quantized groups cross the links, into receive areas at the same offset of every
// rank's segment (QuantAreas). Rank r owns slice r: S = ceil(G / N) consecutive groups of
// the G groups of the message. Block b handles part b of every slice, in every phase, so
// each barrier only joins block b of every rank (as kernels/twoshot.cu):
//   1. RS push     quantize part b of every slice of x, store it into its owner's slot [rank]
//   2. barrier     block b of every rank has stored its part b everywhere (signatures agree)
//   3. reduce, AG  part b of own slice: dequantize every rank's slot, add in rank order
//                  0..N-1 (fp32), finish (avg), quantize once, store into every rank's
//                  all-gather area
//   4. barrier     block b of every rank has stored its part b everywhere
//   5. dequantize  part b of every slice of the all-gather area -> out (poison after a failure)
// Every rank dequantizes the same stored groups: identical bits everywhere. The areas are
// this kernel's alone, so a peer's next launch may store into slot [peer] before its entry
// barrier: it starts only after its own launch passed the exit barrier, which this rank's
// blocks reach after reading their slots. Flags and launch state are the family's own too.
#include "quant.cuh"
#include "transport.cuh"

#ifndef UB_QFMT
#define UB_QFMT QInt8
#endif

// Byte offsets of a launch's receive areas in a segment, for S groups per slice: the codes of
// the reduce-scatter slots [N][S] and of the all-gather area [N * S], then their scales.
struct QuantAreas {
  u64 base;   // offset of the quant slot
  u64 s;      // groups per slice
  u64 total;  // N * S
  __device__ u64 rs_code(int src, u64 j) const { return base + (src * s + j) * kGroup; }
  __device__ u64 ag_code(u64 g) const { return base + (total + g) * kGroup; }
  __device__ u64 rs_scale(int src, u64 j) const { return base + 2 * total * kGroup + (src * s + j) * sizeof(float); }
  __device__ u64 ag_scale(u64 g) const { return base + 2 * total * kGroup + (total + g) * sizeof(float); }
};

template <class T, class Op, class Q, int N>
__device__ void quant_twoshot_allreduce(const Unicast<N>& tp, u64 flags_off, u64 area_off, const char* src,
                                        char* dst, u64 n, u64 sig, LaunchState* state) {
  const u64 groups = (n + kGroup - 1) / kGroup;
  const u64 slice = (groups + N - 1) / N;
  const QuantAreas a{area_off, slice, (u64)N * slice};
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u64 part = (slice + gridDim.x - 1) / gridDim.x;
  const u64 lo = blockIdx.x * part;
  const u64 hi = lo + part < slice ? lo + part : slice;
  const char* mine = tp.seg(tp.rank);

  // 1. reduce-scatter by stores of quantized groups, every owner in peer() order
  for (int k = 0; k < N; ++k) {
    const int o = tp.peer(k);
    for (u64 j = lo + threadIdx.x; j < hi && o * slice + j < groups; j += blockDim.x) {
      float x[kGroup];
      load_group<T>(src, o * slice + j, n, x);
      put_group(tp.seg(o), a.rs_code(tp.rank, j), a.rs_scale(tp.rank, j), quantize_group<Q>(x));
    }
  }
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);

  // 3. reduce own groups in rank order, quantize once, all-gather by stores
  for (u64 j = lo + threadIdx.x; entered && j < hi && tp.rank * slice + j < groups; j += blockDim.x) {
    float acc[kGroup], f[kGroup];
    take_group<Q>(mine, a.rs_code(0, j), a.rs_scale(0, j), acc);
#pragma unroll 1
    for (int s = 1; s < N; ++s) {
      take_group<Q>(mine, a.rs_code(s, j), a.rs_scale(s, j), f);
#pragma unroll
      for (int e = 0; e < kGroup; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
    }
    if (Op::kFinishes) {  // avg: the sum divided by N
#pragma unroll
      for (int e = 0; e < kGroup; ++e) acc[e] = __fdiv_rn(acc[e], (float)N);
    }
    const QGroup q = quantize_group<Q>(acc);
    const u64 g = tp.rank * slice + j;
#pragma unroll
    for (int k = 0; k < N; ++k) put_group(tp.seg(tp.peer(k)), a.ag_code(g), a.ag_scale(g), q);
  }
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);

  // 5. dequantize every gathered group of part b into out; poison after a failure
  for (int o = 0; o < N; ++o) {
    for (u64 j = lo + threadIdx.x; j < hi && o * slice + j < groups; j += blockDim.x) {
      const u64 g = o * slice + j;
      float f[kGroup];
      if (ok) {
        take_group<Q>(mine, a.ag_code(g), a.ag_scale(g), f);
      } else {
#pragma unroll
        for (int e = 0; e < kGroup; ++e) f[e] = __uint_as_float(Elem<float>::kNaN);
      }
      store_group<T>(dst, g, n, f);
    }
  }
  finish_launch(c, l, (u32)groups);
}

// ---- entry point, instantiated per (UB_T, UB_OP, UB_QFMT, UB_NRANKS); sum and avg only --

extern "C" __global__ void __launch_bounds__(UB_QUANT_TWOSHOT_THREADS)
ub_quant_twoshot(char* base, u64 stride, int rank, char* mc, u64 flags_off, u64 area_off,
                 const char* src, char* dst, u64 n, u64 sig, LaunchState* state) {
  enter_launch(state);
  const Unicast<UB_NRANKS> tp{base, stride, rank, mc};
  quant_twoshot_allreduce<UB_T, UB_OP, UB_QFMT, UB_NRANKS>(tp, flags_off, area_off, src, dst, n, sig, state);
}
