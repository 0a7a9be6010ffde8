// ubnext kernels: group quantization of the quantized two-shot (ubnext/_quant.py states the
// arithmetic, which the host emulates bit for bit, and its error bound).
//
// A group is UB_QUANT_GROUP consecutive elements; it crosses the links as one one-byte code
// per element and one fp32 scale. Every fp32 step is an explicit round-to-nearest-even
// intrinsic (__fdiv_rn, __fmul_rn, __fadd_rn), so the compiler can neither contract a
// product and a sum into an FMA nor use an approximate division: the host reproduces the bits.
#pragma once
#include "common.cuh"

constexpr int kGroup = UB_QUANT_GROUP;           // elements (and code bytes) of a group
constexpr int kGroupVecs = kGroup / UB_VEC_BYTES;  // 16-byte vectors of a group's codes
constexpr float kFltMax = 3.402823466e+38f;     // the largest finite fp32
static_assert(kGroup % UB_VEC_BYTES == 0, "a group's codes are whole vectors");

// Codecs: encode4 packs the codes of four fp32 values y (|y| <= kMax, rounded to nearest
// even) into a 32-bit word, element 0 in the low byte; decode4 widens them to fp32 exactly.
struct QInt8 {
  static constexpr float kMax = 127.f;
  __device__ static u32 encode4(const float (&y)[4]) {
    u32 w = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) w |= ((u32)__float2int_rn(y[k]) & 0xffu) << (8 * k);
    return w;
  }
  __device__ static void decode4(u32 w, float (&f)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = (float)(int)(signed char)(w >> (8 * k));
  }
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
// FP8 e4m3 (OCP "e4m3fn": no infinity, largest finite 448), hardware conversions (sm_89+;
// the host refuses fp8 on older devices).
struct QFp8 {
  static constexpr float kMax = 448.f;
  __device__ static u32 encode4(const float (&y)[4]) {
    u16 lo, hi;  // cvt's first source goes to the high byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(y[1]), "f"(y[0]));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(y[3]), "f"(y[2]));
    return (u32)lo | ((u32)hi << 16);
  }
  __device__ static void decode4(u32 w, float (&f)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u32 pair;  // two f16, exact: every e4m3 value is one
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"((u16)(w >> (16 * h))));
      f[2 * h] = Elem<f16>::load(pair & 0xffffu);
      f[2 * h + 1] = Elem<f16>::load(pair >> 16);
    }
  }
};
#endif

// A group as it crosses the links: its codes and its scale.
struct QGroup {
  uint4 code[kGroupVecs];
  float scale;
};

// Quantizes a group of fp32 values: scale = max|x| / kMax (NaN if any element is NaN or
// infinite); where scale > 0 each code is x / scale clamped to +-kMax and rounded, else 0.
template <class Q> __device__ QGroup quantize_group(const float (&x)[kGroup]) {
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int e = 0; e < kGroup; ++e) {
    const float a = fabsf(x[e]);
    finite = finite && a <= kFltMax;
    amax = fmaxf(amax, a);
  }
  QGroup g;
  g.scale = finite ? __fdiv_rn(amax, Q::kMax) : __uint_as_float(Elem<float>::kNaN);
  const bool ok = g.scale > 0.f;
  u32 w[kGroup / 4];
#pragma unroll
  for (int i = 0; i < kGroup / 4; ++i) {
    float y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      y[k] = ok ? fminf(fmaxf(__fdiv_rn(x[4 * i + k], g.scale), -Q::kMax), Q::kMax) : 0.f;
    }
    w[i] = Q::encode4(y);
  }
#pragma unroll
  for (int v = 0; v < kGroupVecs; ++v) g.code[v] = make_uint4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
  return g;
}

// Stores a group into segment `seg`: its codes at byte offset code_off (16-byte aligned),
// its scale at scale_off. Weak stores, ordered by the barrier that follows.
__device__ __forceinline__ void put_group(char* seg, u64 code_off, u64 scale_off, const QGroup& g) {
#pragma unroll
  for (int v = 0; v < kGroupVecs; ++v) st_weak(seg + code_off + v * kVec, g.code[v]);
  *(float*)(seg + scale_off) = g.scale;
}

// Loads a group that peers stored into this rank's segment `seg` before a barrier (relaxed,
// system scope) and dequantizes it: code * scale, one fp32 product each.
template <class Q> __device__ void take_group(const char* seg, u64 code_off, u64 scale_off,
                                              float (&f)[kGroup]) {
  const float scale = __uint_as_float(ld_volatile_u32(seg + scale_off));
#pragma unroll
  for (int v = 0; v < kGroupVecs; ++v) {
    const uint4 c = ld_relaxed_sys(seg + code_off + v * kVec);
    const u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float d[4];
      Q::decode4(w[i], d);
#pragma unroll
      for (int k = 0; k < 4; ++k) f[v * UB_VEC_BYTES + 4 * i + k] = __fmul_rn(d[k], scale);
    }
  }
}

// Group g of a local array `a` of n elements of T (16-bit) in fp32; elements past n read
// as 0. Vector loads where the group is whole and 16-byte aligned, else one per element.
template <class T> __device__ void load_group(const char* a, u64 g, u64 n, float (&f)[kGroup]) {
  static_assert(Elem<T>::kBytes == 2, "the quantized two-shot takes 16-bit elements");
  constexpr int P = Vec<T>::kPer;
  const u64 i0 = g * kGroup;
  const char* p = a + i0 * Elem<T>::kBytes;
  if (i0 + kGroup <= n && ((u64)p % kVec) == 0) {
#pragma unroll
    for (int v = 0; v < kGroup / P; ++v) {
      float h[P];
      Vec<T>::unpack(ld_weak(p + v * kVec), h);
#pragma unroll
      for (int e = 0; e < P; ++e) f[v * P + e] = h[e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) f[e] = i0 + e < n ? Elem<T>::load(((const u16*)a)[i0 + e]) : 0.f;
  }
}

// Stores fp32 values f as group g of a local array `a` of n elements of T, each rounded
// to nearest even once; never past element n.
template <class T> __device__ void store_group(char* a, u64 g, u64 n, const float (&f)[kGroup]) {
  constexpr int P = Vec<T>::kPer;
  const u64 i0 = g * kGroup;
  char* p = a + i0 * Elem<T>::kBytes;
  if (i0 + kGroup <= n && ((u64)p % kVec) == 0) {
#pragma unroll
    for (int v = 0; v < kGroup / P; ++v) {
      float h[P];
#pragma unroll
      for (int e = 0; e < P; ++e) h[e] = f[v * P + e];
      st_weak(p + v * kVec, Vec<T>::pack(h));
    }
  } else {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      if (i0 + e < n) ((u16*)a)[i0 + e] = (u16)Elem<T>::store(f[e]);
    }
  }
}
