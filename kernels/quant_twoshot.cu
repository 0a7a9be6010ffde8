// Quantized two-shot (opt-in): groups quantized to int8, fp8 or int4 codes with an fp32
// scale each (kernels/quant.cuh; ubnext/_protocol/quant.py states the arithmetic and the
// error bound), as an all-reduce (reduce-scatter and all-gather) and as a reduce-scatter
// alone (its first half, the sums in full precision).
//
// The inputs and outputs are local arrays of this rank (any 2-byte aligned address); only
// the quantized units cross the links, as records (kernels/quant.cuh: Record) in receive
// areas at the same offset of every rank's segment (QuantAreas). Rank r owns slice r: of
// the all-reduce, S = ceil(U / N) consecutive units of the U units of the message; of the
// reduce-scatter, the S = ceil(k / kUnit) units of slice r of its input (each slice is
// units of its own, the last one padded with zeros). A warp takes a unit at a time; block
// b handles part b of every slice, in every phase, so each barrier only joins block b of
// every rank (as kernels/twoshot.cu):
//   1. RS push     quantize part b of every slice of x, store it into its owner's slot [rank]
//   2. barrier     block b of every rank has stored its part b everywhere (signatures agree)
//   3. reduce      part b of own slice: dequantize every rank's slot, add in rank order
//                  0..N-1 (fp32), finish (avg); the all-reduce quantizes the sums once and
//                  stores them into its own all-gather area, the reduce-scatter rounds
//                  them once to the dtype into its output
//   4. barrier     block b of every rank has stored its part b (the reduce-scatter: has
//                  read its slots)
//   5. dequantize  the all-reduce: part b of every slice, loaded from its owner's
//                  all-gather area -> out (poison after a failure; the reduce-scatter
//                  poisons its part of out)
// The all-gather is by loads (phase 5 pulls the records) rather than stores in phase 3:
// the dequantization then runs under the link transfer instead of after it (measured in
// bench/NOTES.md, twenty-second session). Every rank dequantizes the same stored
// records: identical bits everywhere. The areas are this kernel's alone, so a peer's next
// launch may store into slot [peer] before its entry barrier: it starts only after its own
// launch passed the exit barrier, which this rank's blocks reach after reading their slots.
// Peers may still load this rank's all-gather area then (phase 5), so that area lies apart
// from the slots of any launch (the host passes its offset: ubnext/_protocol/quant.py,
// slots_bytes): the next launch's slots move with its size, format and collective and
// would otherwise overlap it. This rank's next launch writes its all-gather area only
// after its entry barrier, which every peer reaches only once its previous launch (phase
// 5 included) has ended: a launch waits for the one before it on its stream
// (enter_launch) before joining any barrier. Flags and launch state are the family's own
// too, shared by both entry points.
#include "quant.cuh"
#include "transport.cuh"

#ifndef UB_QFMT
#define UB_QFMT QInt8
#endif

// Byte offsets of a launch's records in a segment, for S units per slice: the
// reduce-scatter slots [N][S] from `slots`, the all-gather area [S] (the rank's own slice)
// from `gather`.
template <class Q> struct QuantAreas {
  u64 slots, gather;
  u64 s;  // units per slice
  __device__ u64 rs(int src, u64 j) const { return slots + (src * s + j) * Record<Q>::kBytes; }
  __device__ u64 ag(u64 j) const { return gather + j * Record<Q>::kBytes; }
};

// Units [lo, hi) of every slice of `slice` units that this block handles, and this
// thread's lane and warp (loops over units are warp-uniform: warp w takes units lo + w,
// lo + w + warps, ...).
struct UnitPart {
  u64 lo, hi;
  int lane;
  u32 warp, warps;
};
__device__ __forceinline__ UnitPart unit_part(u64 slice) {
  const u64 part = (slice + gridDim.x - 1) / gridDim.x;
  const u64 lo = blockIdx.x * part;
  return {lo, lo + part < slice ? lo + part : slice, (int)(threadIdx.x % kWarp), threadIdx.x / kWarp,
          blockDim.x / kWarp};
}

// Where the units of each slice come from: unit j of slice o is unit at(o, j) of the array
// array(o) of n 16-bit elements (elements past n read as 0); it exists while has(o, j).
// An all-reduce's message is one array whose U = ceil(n / kUnit) units are split into
// slices of `slice` consecutive units.
struct WholeMessage {
  const char* src;
  u64 n, units, slice;
  __device__ const char* array(int) const { return src; }
  __device__ u64 at(int o, u64 j) const { return o * slice + j; }
  __device__ bool has(int o, u64 j) const { return o * slice + j < units; }
};

// A reduce-scatter's input: N slices of n elements, `pitch` bytes apart, each an array of
// its own of `slice` = ceil(n / kUnit) units.
struct RankSlices {
  const char* src;
  u64 n, pitch, slice;
  __device__ const char* array(int o) const { return src + o * pitch; }
  __device__ u64 at(int, u64 j) const { return j; }
  __device__ bool has(int, u64 j) const { return j < slice; }
};

// Phase 1, the reduce-scatter by stores: units p of every slice of m, quantized by the
// warps of the block, each unit stored as a record into slot [rank] of its owner's
// reduce-scatter area, every owner in peer() order.
template <class T, class Q, int N, class M>
__device__ void push_slices(const Unicast<N>& tp, const QuantAreas<Q>& a, const M& m, const UnitPart& p) {
  typedef Record<Q> R;
  const int lane = p.lane;
  for (int k = 0; k < N; ++k) {
    const int o = tp.peer(k);
    const char* src = m.array(o);
    for (u64 j = p.lo + p.warp; j < p.hi && m.has(o, j); j += p.warps) {
      const u64 u = m.at(o, j);
      uint4 in[kSteps];  // every load in flight before the arithmetic
#pragma unroll
      for (int s = 0; s < kSteps; ++s) in[s] = load_step(src, step_elem(u, s, lane), m.n);
      char* rec = tp.seg(o) + a.rs(tp.rank, j);
      u32 words[R::kWords];
      float scale = 0.f;  // of step lane % kSteps (keep_scale)
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
#pragma unroll
        for (int t = 0; t < R::kStepsPerVec; ++t) {
          const int s = v * R::kStepsPerVec + t;
          float x[kLaneElems];
          Vec<T>::unpack(in[s], x);
          u32 w[Q::kWords];
          keep_scale(scale, s, lane, quantize_step<Q>(x, w));
#pragma unroll
          for (int i = 0; i < Q::kWords; ++i) words[s * Q::kWords + i] = w[i];
        }
        put_codes<Q>(rec, v, lane, words);
      }
      put_scale<Q>(rec, lane, scale);
    }
  }
}

// Phase 3's sum of unit j of this rank's slice: every rank's record [r][j] of this rank's
// reduce-scatter area (stored before the entry barrier), dequantized and added in rank order
// 0..N-1 in fp32, divided by N for avg. Calls emit(s, acc) with the sums of this lane's step
// s, for s = 0..kSteps-1 in order (a vector's codes are loaded before its steps).
template <class Op, class Q, int N, class Emit>
__device__ __forceinline__ void sum_unit(const char* mine, const QuantAreas<Q>& a, u64 j, int lane, Emit emit) {
  typedef Record<Q> R;
  float scales[N][kSteps];  // every rank's: loaded first, with each vector's codes below
#pragma unroll
  for (int r = 0; r < N; ++r) take_scales<Q>(mine + a.rs(r, j), lane, scales[r]);
#pragma unroll
  for (int v = 0; v < R::kVecs; ++v) {
    u32 codes[N][R::kWords];  // vector v of every rank's codes (the other words unused)
#pragma unroll
    for (int r = 0; r < N; ++r) {
      const uint4 cv = ld_relaxed_sys(mine + a.rs(r, j) + R::code(v, lane));
      codes[r][4 * v] = cv.x, codes[r][4 * v + 1] = cv.y, codes[r][4 * v + 2] = cv.z, codes[r][4 * v + 3] = cv.w;
    }
#pragma unroll
    for (int t = 0; t < R::kStepsPerVec; ++t) {
      const int s = v * R::kStepsPerVec + t;
      float acc[kLaneElems], f[kLaneElems];
      u32 w[Q::kWords];
      step_codes<Q>(codes[0], s, w);
      dequantize_step<Q>(w, scales[0][s], acc);
#pragma unroll
      for (int r = 1; r < N; ++r) {
        step_codes<Q>(codes[r], s, w);
        dequantize_step<Q>(w, scales[r][s], f);
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
      }
      if (Op::kFinishes) {  // avg: the sum divided by N
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) acc[e] = __fdiv_rn(acc[e], (float)N);
      }
      emit(s, acc);
    }
  }
}

template <class T, class Op, class Q, int N>
__device__ void quant_twoshot_allreduce(const Unicast<N>& tp, u64 flags_off, u64 slots_off, u64 gather_off,
                                        const char* src, char* dst, u64 n, u64 sig, LaunchState* state) {
  static_assert(Elem<T>::kBytes == 2, "the quantized two-shot takes 16-bit elements");
  typedef Record<Q> R;
  const u64 units = (n + kUnit - 1) / kUnit;
  const u64 slice = (units + N - 1) / N;
  const QuantAreas<Q> a{slots_off, gather_off, slice};
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  const UnitPart p = unit_part(slice);
  const int lane = p.lane;
  char* mine = tp.seg(tp.rank);

  // 1. reduce-scatter by stores of quantized units
  push_slices<T, Q, N>(tp, a, WholeMessage{src, n, units, slice}, p);
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);

  // 3. reduce own units in rank order, quantize once into the own all-gather area
  for (u64 j = p.lo + p.warp; entered && j < p.hi && tp.rank * slice + j < units; j += p.warps) {
    u32 words[R::kWords];
    float scale = 0.f;  // of step lane % kSteps (keep_scale)
    sum_unit<Op, Q, N>(mine, a, j, lane, [&](int s, float (&acc)[kLaneElems]) {
      u32 w[Q::kWords];
      keep_scale(scale, s, lane, quantize_step<Q>(acc, w));
#pragma unroll
      for (int i = 0; i < Q::kWords; ++i) words[s * Q::kWords + i] = w[i];
      if ((s + 1) % R::kStepsPerVec == 0) put_codes<Q>(mine + a.ag(j), s / R::kStepsPerVec, lane, words);
    });
    put_scale<Q>(mine + a.ag(j), lane, scale);
  }
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);

  // 5. all-gather by loads: every owner's part b dequantized into out, owners in peer()
  //    order (spreads the loads over the links); poison after a failure
  for (int k = 0; k < N; ++k) {
    const int o = tp.peer(k);
    const char* rec = tp.seg(o);
    for (u64 j = p.lo + p.warp; j < p.hi && o * slice + j < units; j += p.warps) {
      const u64 u = o * slice + j;
      u32 words[R::kWords];
      float scale[kSteps];
      if (ok) {
        take_codes<Q>(rec + a.ag(j), lane, words);
        take_scales<Q>(rec + a.ag(j), lane, scale);
      }
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        uint4 out = Vec<T>::poison();
        if (ok) {
          float f[kLaneElems];
          u32 w[Q::kWords];
          step_codes<Q>(words, s, w);
          dequantize_step<Q>(w, scale[s], f);
          out = Vec<T>::pack(f);
        }
        store_step(dst, step_elem(u, s, lane), n, out);
      }
    }
  }
  finish_launch(c, l, (u32)units);
}

// The quantized reduce-scatter of N slices of k elements (slice o at src + o * pitch
// bytes): phases 1 to 4, phase 3 rounding this rank's sums once to T into dst (k elements,
// local) instead of requantizing them (a group whose sum overflowed: NaN throughout, as the
// all-reduce's requantization makes it); after a failure, poison into dst. dst may be this
// rank's slice of src (in place): a unit of it is read (phase 1) and written (phase 3) by
// the same warp.
template <class T, class Op, class Q, int N>
__device__ void quant_twoshot_reduce_scatter(const Unicast<N>& tp, u64 flags_off, u64 slots_off, const char* src,
                                             char* dst, u64 k, u64 pitch, u64 sig, LaunchState* state) {
  static_assert(Elem<T>::kBytes == 2, "the quantized two-shot takes 16-bit elements");
  const u64 slice = (k + kUnit - 1) / kUnit;
  const QuantAreas<Q> a{slots_off, 0, slice};  // no all-gather area
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  const UnitPart p = unit_part(slice);
  const char* mine = tp.seg(tp.rank);

  // 1. reduce-scatter by stores of quantized units
  push_slices<T, Q, N>(tp, a, RankSlices{src, k, pitch, slice}, p);
  const bool entered = tp.barrier(flags_off, 0, l.epoch + 1u, sig, c, kSiteEntryBarrier);

  // 3. reduce own units in rank order into dst, each sum rounded once
  for (u64 j = p.lo + p.warp; entered && j < p.hi; j += p.warps) {
    sum_unit<Op, Q, N>(mine, a, j, p.lane, [&](int s, float (&acc)[kLaneElems]) {
      poison_non_finite_group(acc);  // the all-reduce's requantization does the same
      store_step(dst, step_elem(j, s, p.lane), k, Vec<T>::pack(acc));
    });
  }
  const bool ok = tp.barrier(flags_off, 1, l.epoch + 1u, 0, c, kSiteExitBarrier);
  for (u64 j = p.lo + p.warp; !ok && j < p.hi; j += p.warps) {  // after a failure: poison
#pragma unroll
    for (int s = 0; s < kSteps; ++s) store_step(dst, step_elem(j, s, p.lane), k, Vec<T>::poison());
  }
  finish_launch(c, l, (u32)(N * slice));
}

// ---- entry points, instantiated per (UB_T, UB_OP, UB_QFMT, UB_NRANKS); sum and avg only -
// One block per SM (the grid never exceeds the SM count: the barriers need every block
// resident), so a thread may use 65536 / UB_QUANT_TWOSHOT_THREADS registers: without the
// minimum of 1 block, ptxas capped it at 64 and spilled the owner's loads of every rank.

extern "C" __global__ void __launch_bounds__(UB_QUANT_TWOSHOT_THREADS, 1)
ub_quant_twoshot(char* base, u64 stride, int rank, char* mc, u64 flags_off, u64 slots_off, u64 gather_off,
                 const char* src, char* dst, u64 n, u64 sig, LaunchState* state) {
  enter_launch(state);
  const Unicast<UB_NRANKS> tp{base, stride, rank, mc};
  quant_twoshot_allreduce<UB_T, UB_OP, UB_QFMT, UB_NRANKS>(tp, flags_off, slots_off, gather_off, src, dst, n, sig,
                                                          state);
}

extern "C" __global__ void __launch_bounds__(UB_QUANT_TWOSHOT_THREADS, 1)
ub_quant_twoshot_rs(char* base, u64 stride, int rank, char* mc, u64 flags_off, u64 slots_off, const char* src,
                    char* dst, u64 k, u64 pitch, u64 sig, LaunchState* state) {
  enter_launch(state);
  const Unicast<UB_NRANKS> tp{base, stride, rank, mc};
  quant_twoshot_reduce_scatter<UB_T, UB_OP, UB_QFMT, UB_NRANKS>(tp, flags_off, slots_off, src, dst, k, pitch, sig,
                                                               state);
}
