// ubnext kernels: group quantization of the quantized two-shot (ubnext/_protocol/quant.py states
// the arithmetic, which the host emulates bit for bit, and its error bound).
//
// The work is spread over lanes so that it runs at the speed of memory and links, not of one
// thread's chain: a lane takes a *step* of kLaneElems consecutive 16-bit elements (one
// 16-byte vector), a group of kGroup elements is kGroupLanes neighbouring lanes (its largest
// magnitude: log2(kGroupLanes) shuffles, exact), and a warp takes a *unit* of kUnitGroups
// groups in kSteps steps: lane l's step s holds elements [(s * 32 + l) * kLaneElems, + kLaneElems)
// of the unit, so each step's loads and stores of 16-bit data cover 512 contiguous bytes.
//
// A unit crosses the links as one Record of whole 128-byte lines (layout below), written by
// warp stores of 512 (codes) and 128 (scales) contiguous bytes.
//
// Every fp32 step is an explicit round-to-nearest-even intrinsic (__fdiv_rn, __frcp_rn,
// __fmul_rn, __fadd_rn), so the compiler can neither contract a product and a sum into an
// FMA nor use an approximate division or reciprocal: the host reproduces the bits.
#pragma once
#include "common.cuh"

constexpr int kWarp = 32;
constexpr int kGroup = UB_QUANT_GROUP;                      // elements of a group (one scale)
constexpr int kUnitGroups = UB_QUANT_UNIT_GROUPS;           // groups of a unit (one warp's work)
constexpr int kUnit = kUnitGroups * kGroup;                 // elements of a unit
constexpr int kLaneElems = UB_VEC_BYTES / 2;                // elements of a lane's step (16-bit input)
constexpr int kGroupLanes = kGroup / kLaneElems;            // lanes of a group
constexpr int kSteps = kUnit / (kWarp * kLaneElems);        // steps of a lane per unit
constexpr u32 kFltMaxBits = 0x7f7fffffu;                    // the largest finite fp32, as bits
constexpr float kFltMin = 1.17549435e-38f;                   // the least normal fp32, 2^-126
static_assert(kGroup % kLaneElems == 0 && kWarp % kGroupLanes == 0, "a group is whole lanes of a warp");
static_assert(kUnit % (kWarp * kLaneElems) == 0, "a unit is whole steps of a warp");
static_assert(kSteps == kGroupLanes && kSteps * sizeof(float) == UB_VEC_BYTES,
              "a lane stores the scale of one of its steps, and loads those of all its steps as one vector");

// Integer codes round by one fp32 addition: for |y| <= 2^22, y + 1.5 * 2^23 lies in
// [2^23, 2^24), where fp32 values are the integers, so the sum is rint(y) + 1.5 * 2^23
// (ties to even: 1.5 * 2^23 is even) and its low bits are rint(y) in two's complement
// (a -0.0 gives code 0). No float-to-int conversion (a quarter-rate unit).
constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23
__device__ __forceinline__ u32 rint_bits(float y) { return __float_as_uint(__fadd_rn(y, kRoundMagic)); }

// They widen the other way, exactly: the code's offset value u = code + 2^(bits-1) (its sign
// bit flipped) as the low mantissa bits of 2^23 is the fp32 value 2^23 + u; subtracting
// 2^23 + 2^(bits-1) leaves the code. `byte` holds u in byte k (k = 0..3).
template <int Bits> __device__ __forceinline__ float widen_code(u32 bytes, int k) {
  constexpr float kBias = 8388608.f + (float)(1 << (Bits - 1));  // 2^23 + 2^(bits-1)
  return __fadd_rn(__uint_as_float(__byte_perm(bytes, 0x4b000000u, 0x7440u | (u32)k)), -kBias);
}

// The low bytes of four words, packed into one (r[0]'s in the low byte).
__device__ __forceinline__ u32 low_bytes(u32 r0, u32 r1, u32 r2, u32 r3) {
  return __byte_perm(__byte_perm(r0, r1, 0x0040u), __byte_perm(r2, r3, 0x0040u), 0x5410u);
}

// Codecs: kBits per code, kWords 32-bit words per step. encode packs the codes of a step's
// fp32 values y (|y| <= kMax) into kWords words, element 0 in the low bits; decode widens
// them to fp32 exactly.
struct QInt8 {
  static constexpr int kBits = 8, kWords = 2;
  static constexpr float kMax = 127.f;
  __device__ static void encode(const float (&y)[kLaneElems], u32 (&w)[kWords]) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      w[i] = low_bytes(rint_bits(y[4 * i]), rint_bits(y[4 * i + 1]), rint_bits(y[4 * i + 2]), rint_bits(y[4 * i + 3]));
    }
  }
  __device__ static void decode(const u32 (&w)[kWords], float (&f)[kLaneElems]) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) f[4 * i + k] = widen_code<8>(w[i] ^ 0x80808080u, k);
    }
  }
};

// int4: two codes per byte, element 2i in the low nibble.
struct QInt4 {
  static constexpr int kBits = 4, kWords = 1;
  static constexpr float kMax = 7.f;
  __device__ static void encode(const float (&y)[kLaneElems], u32 (&w)[kWords]) {
    u32 b[4];  // byte i: the codes of elements 2i (low nibble) and 2i + 1
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = (rint_bits(y[2 * i]) & 0xfu) | (rint_bits(y[2 * i + 1]) << 4);
    w[0] = low_bytes(b[0], b[1], b[2], b[3]);
  }
  __device__ static void decode(const u32 (&w)[kWords], float (&f)[kLaneElems]) {
    const u32 u = w[0] ^ 0x88888888u;  // offset values
    const u32 even = u & 0x0f0f0f0fu, odd = (u >> 4) & 0x0f0f0f0fu;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = widen_code<4>(even, i);
      f[2 * i + 1] = widen_code<4>(odd, i);
    }
  }
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
// FP8 e4m3 (OCP "e4m3fn": no infinity, largest finite 448), hardware conversions (sm_89+;
// the host refuses fp8 on older devices).
struct QFp8 {
  static constexpr int kBits = 8, kWords = 2;
  static constexpr float kMax = 448.f;
  __device__ static void encode(const float (&y)[kLaneElems], u32 (&w)[kWords]) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      u16 lo, hi;  // cvt's first source goes to the high byte
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(y[4 * i + 1]), "f"(y[4 * i]));
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(y[4 * i + 3]), "f"(y[4 * i + 2]));
      w[i] = (u32)lo | ((u32)hi << 16);
    }
  }
  __device__ static void decode(const u32 (&w)[kWords], float (&f)[kLaneElems]) {
#pragma unroll
    for (int h = 0; h < 2 * kWords; ++h) {
      u32 pair;  // two f16, exact: every e4m3 value is one
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"((u16)(w[h / 2] >> (16 * (h % 2)))));
      f[2 * h] = Elem<f16>::load(pair & 0xffffu);
      f[2 * h + 1] = Elem<f16>::load(pair >> 16);
    }
  }
};
#endif

// The record of a unit in format Q, at a 128-byte aligned offset, UB_QRECORD_BYTES long
// (the host's _quant.record_bytes, checked here):
//   codes   kVecs 16-byte vectors per lane, lane-major: vector v of lane l at byte
//           (v * 32 + l) * 16, so that each warp store covers 512 contiguous bytes. A lane's
//           codes are kWords words per step, step s at words [s * kWords, (s + 1) * kWords);
//           vector v holds words [4v, 4v + 4).
//   scales  kUnitGroups fp32 at byte kCodeBytes: the group of step s of lanes
//           [q * kGroupLanes, (q + 1) * kGroupLanes) at index q * kSteps + s, so that lane j
//           stores the scale of its own step j % kSteps (one 128-byte warp store, no
//           shuffle) and a lane loads those of its kSteps steps as one vector.
template <class Q> struct Record {
  static constexpr int kWords = kSteps * Q::kWords;      // code words of a lane
  static constexpr int kVecs = kWords / 4;               // 16-byte vectors of them
  static constexpr int kStepsPerVec = kSteps / kVecs;    // steps of a vector
  static constexpr u64 kCodeBytes = (u64)kUnit * Q::kBits / 8;
  static constexpr u64 kBytes = kCodeBytes + kUnitGroups * sizeof(float);
  static_assert(kWords % 4 == 0 && kSteps % kVecs == 0, "a lane's codes are whole vectors of whole steps");
  static_assert(kBytes % 128 == 0, "a record is whole 128-byte lines");
#ifdef UB_QRECORD_BYTES
  static_assert(kBytes == UB_QRECORD_BYTES, "the record layout of ubnext/_protocol/quant.py (record_bytes)");
#endif
  __device__ static u64 code(int v, int lane) { return ((u64)v * kWarp + lane) * kVec; }
  __device__ static u64 scales(int lane) { return kCodeBytes + (u64)(lane / kGroupLanes) * kVec; }
  __device__ static u64 scale(int lane) { return kCodeBytes + (u64)lane * sizeof(float); }
};

// Quantizes this lane's step x of a group (every lane of the warp calls it together, the
// group's lanes being its `Lanes` aligned neighbours, kGroupLanes by default): scale = max|x| / kMax over the
// group (NaN if any element is NaN or infinite); where scale > 0 each code is x * (1 /
// scale) clamped to +-kMax and rounded, else 0 (x / scale where the scale is below fp32's
// normal range and its reciprocal could overflow). One product per element instead of an
// IEEE division, about ten instructions each. Returns the scale, sets the codes w.
// The largest |x| of the group of this lane's step x as bits (their order is the
// magnitudes'; every lane of the warp calls it together): past kFltMaxBits where the group
// holds an infinity or a NaN, so one integer maximum finds both. A group is `Lanes`
// aligned neighbouring lanes (the expert-parallel FP8 dispatch's 128 channels: 16).
template <int Lanes = kGroupLanes>
__device__ __forceinline__ u32 group_top(const float (&x)[kLaneElems]) {
  static_assert(Lanes >= 1 && Lanes <= kWarp && (Lanes & (Lanes - 1)) == 0, "a group is aligned lanes of a warp");
  u32 top = 0u;
#pragma unroll
  for (int e = 0; e < kLaneElems; ++e) top = max(top, __float_as_uint(x[e]) & 0x7fffffffu);
#pragma unroll
  for (int d = 1; d < Lanes; d *= 2) top = max(top, __shfl_xor_sync(~0u, top, d));
  return top;
}

// The overflow rule of both collectives: a group of the owner's fp32 sums that holds an
// infinity (a sum that overflowed) or a NaN becomes NaN throughout, as the all-reduce's
// requantization of it does (its scale is NaN). Every lane of the warp calls it together.
__device__ __forceinline__ void poison_non_finite_group(float (&x)[kLaneElems]) {
  if (group_top(x) > kFltMaxBits) {  // group-uniform
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) x[e] = __uint_as_float(Elem<float>::kNaN);
  }
}

template <class Q, int Lanes = kGroupLanes>
__device__ float quantize_step(const float (&x)[kLaneElems], u32 (&w)[Q::kWords]) {
  const u32 top = group_top<Lanes>(x);
  const float scale = top <= kFltMaxBits ? __fdiv_rn(__uint_as_float(top), Q::kMax)
                                         : __uint_as_float(Elem<float>::kNaN);
  float y[kLaneElems] = {};  // the codes of a group of zeros or with a NaN scale: 0
  if (scale >= kFltMin) {    // group-uniform branches; the reciprocal is finite
    const float inv = __frcp_rn(scale);
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) y[e] = fminf(fmaxf(__fmul_rn(x[e], inv), -Q::kMax), Q::kMax);
  } else if (scale > 0.f) {
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) y[e] = fminf(fmaxf(__fdiv_rn(x[e], scale), -Q::kMax), Q::kMax);
  }
  Q::encode(y, w);
  return scale;
}

// code * scale for a step's codes w: one fp32 product each.
template <class Q> __device__ void dequantize_step(const u32 (&w)[Q::kWords], float scale, float (&f)[kLaneElems]) {
  Q::decode(w, f);
#pragma unroll
  for (int e = 0; e < kLaneElems; ++e) f[e] = __fmul_rn(f[e], scale);
}

// The codes of step s of this lane, out of its words.
template <class Q> __device__ __forceinline__ void step_codes(const u32 (&words)[Record<Q>::kWords], int s,
                                                             u32 (&w)[Q::kWords]) {
#pragma unroll
  for (int k = 0; k < Q::kWords; ++k) w[k] = words[s * Q::kWords + k];
}

// Stores this lane's vector v of a record (weak, ordered by the barrier that follows).
template <class Q> __device__ __forceinline__ void put_codes(char* rec, int v, int lane, const u32 (&words)[Record<Q>::kWords]) {
  st_weak(rec + Record<Q>::code(v, lane), make_uint4(words[4 * v], words[4 * v + 1], words[4 * v + 2], words[4 * v + 3]));
}

// The scale this lane stores (put_scale): that of its step lane % kSteps, kept as the steps
// are quantized (a register, not an array indexed by the lane: that would go to local memory).
__device__ __forceinline__ void keep_scale(float& mine, int s, int lane, float scale) {
  if (lane % kSteps == s) mine = scale;
}

// Stores this lane's scale slot of a record (weak).
template <class Q> __device__ __forceinline__ void put_scale(char* rec, int lane, float mine) {
  *(float*)(rec + Record<Q>::scale(lane)) = mine;
}

// Loads this lane's codes and scales of a record that peers stored before a barrier
// (relaxed, system scope).
template <class Q> __device__ __forceinline__ void take_codes(const char* rec, int lane, u32 (&words)[Record<Q>::kWords]) {
#pragma unroll
  for (int v = 0; v < Record<Q>::kVecs; ++v) {
    const uint4 c = ld_relaxed_sys(rec + Record<Q>::code(v, lane));
    words[4 * v] = c.x, words[4 * v + 1] = c.y, words[4 * v + 2] = c.z, words[4 * v + 3] = c.w;
  }
}
template <class Q> __device__ __forceinline__ void take_scales(const char* rec, int lane, float (&scale)[kSteps]) {
  const uint4 s = ld_relaxed_sys(rec + Record<Q>::scales(lane));
  scale[0] = __uint_as_float(s.x), scale[1] = __uint_as_float(s.y);
  scale[2] = __uint_as_float(s.z), scale[3] = __uint_as_float(s.w);
}

// Elements [i0, i0 + kLaneElems) of a local array `a` of n 16-bit elements, packed; elements
// past n read as 0. One vector load where they are whole and 16-byte aligned.
__device__ __forceinline__ uint4 load_step(const char* a, u64 i0, u64 n) {
  const char* p = a + i0 * 2;
  if (i0 + kLaneElems <= n && (u64)p % kVec == 0) return ld_weak(p);
  u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int e = 0; e < kLaneElems; ++e) {
    if (i0 + e < n) w[e / 2] |= (u32)((const u16*)a)[i0 + e] << (16 * (e % 2));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores packed elements v as [i0, i0 + kLaneElems) of a local array `a` of n 16-bit
// elements, never past element n. One vector store where whole and 16-byte aligned.
__device__ __forceinline__ void store_step(char* a, u64 i0, u64 n, const uint4& v) {
  char* p = a + i0 * 2;
  if (i0 + kLaneElems <= n && (u64)p % kVec == 0) {
    st_weak(p, v);
    return;
  }
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < kLaneElems; ++e) {
    if (i0 + e < n) ((u16*)a)[i0 + e] = (u16)(w[e / 2] >> (16 * (e % 2)));
  }
}

// The first element of this lane's step s of unit u.
__device__ __forceinline__ u64 step_elem(u64 u, int s, int lane) {
  return u * kUnit + ((u64)s * kWarp + lane) * kLaneElems;
}
