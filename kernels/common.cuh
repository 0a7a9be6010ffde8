// ubnext kernels: element types, 16-byte vectors, reduction ops, memory primitives.
//
// No CUDA headers are included: the sources compile with plain NVRTC (CI, no GPU),
// with cupy.RawModule (run time) and with nvcc (CMakeLists.txt) alike.
// Every memory primitive names its memory order and scope in its contract.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The constants shared with the host (UB_MAX_RANKS, UB_VEC_BYTES, the sentinel, the launch
// state and error record layouts, ...): generated from ubnext/_protocol.py.
#include "protocol.h"

// Instantiation of the entry points: element type, reduction op, ranks of the node. The
// host passes all three (ubnext._protocol.algorithms.compile_defines); these defaults only serve
// a bare compile check (CMakeLists.txt).
#ifndef UB_T
#define UB_T bf16
#endif
#ifndef UB_OP
#define UB_OP OpSum
#endif
#ifndef UB_NRANKS
#define UB_NRANKS 4
#endif
// Deterministic mode (ubnext Config.deterministic): every algorithm reduces in rank order
// 0..N-1 and writes -0.0 as +0.0 in its inputs and results, so a result's bits depend on
// the inputs only, not on the algorithm (the Lamport kernels do both always).
#ifndef UB_DETERMINISTIC
#define UB_DETERMINISTIC 0
#endif
constexpr bool kDeterministic = UB_DETERMINISTIC != 0;

// ---------------------------------------------------------------------------------
// Element types: stored as raw bits, each reduced in its accumulator type Acc: bf16, f16
// and float in fp32 (rounded once to T), double in double, the integer types in their own
// type, sums wrapping around modulo 2^bits as NCCL's do (only the barrier two-shot,
// twoshot.cu, takes double and the integers: the Lamport kernels' -0.0 sentinel,
// lamport.cuh, exists in 16- and 32-bit floating types only).
// ---------------------------------------------------------------------------------
struct bf16 {};
struct f16 {};
typedef signed char i8;
typedef unsigned char u8;
typedef int i32;
typedef long long i64;

// Elem<T>: kBytes; Bits, the unsigned word that holds an element's bits (u64 for 8-byte
// elements, else u32); Acc and load(bits) -> Acc, store(Acc) -> bits; kFloat: a
// floating-point type (it has -0.0 and NaN, and avg takes it); kNaN: the poison a failed
// launch leaves in its outputs, the bits of a quiet NaN (integers, which have none: the top
// bit alone, a signed type's least value). ElemBase holds all but the conversions.
template <class T> struct Elem;
template <int Bytes> struct BitsOf { typedef u32 type; };
template <> struct BitsOf<8> { typedef u64 type; };
template <int Bytes, bool Float, class A, typename BitsOf<Bytes>::type Poison> struct ElemBase {
  static constexpr int kBytes = Bytes;
  static constexpr bool kFloat = Float;
  typedef typename BitsOf<Bytes>::type Bits;
  typedef A Acc;
  static constexpr Bits kNaN = Poison;
};

template <> struct Elem<bf16> : ElemBase<2, true, float, 0x7fc0u> {
  __device__ static float load(u32 bits) { return __uint_as_float(bits << 16); }
  __device__ static u32 store(float f) {  // round to nearest even
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
};

template <> struct Elem<f16> : ElemBase<2, true, float, 0x7e00u> {
  __device__ static float load(u32 bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)bits));
    return f;
  }
  __device__ static u32 store(float f) {  // round to nearest even
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
};

template <> struct Elem<float> : ElemBase<4, true, float, 0x7fc00000u> {
  __device__ static float load(u32 bits) { return __uint_as_float(bits); }
  __device__ static u32 store(float f) { return __float_as_uint(f); }
};

template <> struct Elem<double> : ElemBase<8, true, double, 0x7ff8000000000000ull> {
  __device__ static double load(u64 bits) { return __longlong_as_double((long long)bits); }
  __device__ static u64 store(double d) { return (u64)__double_as_longlong(d); }
};

// The integer type T, whose unsigned type of the same width is U: accumulates in T itself
// (acc_add wraps around through U).
template <class T, class U, class B = typename BitsOf<sizeof(T)>::type>
struct IntElem : ElemBase<sizeof(T), false, T, (B)1 << (8 * sizeof(T) - 1)> {
  typedef U Unsigned;
  __device__ static T load(B bits) { return (T)(U)bits; }  // the low sizeof(T) bytes
  __device__ static B store(T v) { return (B)(U)v; }       // zero-extended
};
template <> struct Elem<i8> : IntElem<i8, u8> {};
template <> struct Elem<u8> : IntElem<u8, u8> {};
template <> struct Elem<i32> : IntElem<i32, u32> {};
template <> struct Elem<u32> : IntElem<u32, u32> {};
template <> struct Elem<i64> : IntElem<i64, u64> {};
template <> struct Elem<u64> : IntElem<u64, u64> {};

// The element types of the fused all-reduce + residual add + RMSNorm entry points (fp32
// statistics: bf16, f16, float). The preprocessor sees UB_T's name, not its type:
// UB_FUSED_T is 1 where that name is one of them, else 0 (an undefined name in #if), and
// the kernel files compile their fused entry points only then.
#define UB_FUSED_T_bf16 1
#define UB_FUSED_T_f16 1
#define UB_FUSED_T_float 1
#define UB_PASTE_(a, b) a##b
#define UB_PASTE(a, b) UB_PASTE_(a, b)
#define UB_FUSED_T UB_PASTE(UB_FUSED_T_, UB_T)

// ---------------------------------------------------------------------------------
// 16-byte vectors: kPer elements of T in four 32-bit words, element 0 in the low bits.
// ---------------------------------------------------------------------------------
static_assert(sizeof(uint4) == UB_VEC_BYTES, "a vector is one uint4");
constexpr u64 kVec = UB_VEC_BYTES;  // bytes of a vector: the stride of vector addresses

template <class T> struct Vec {
  typedef typename Elem<T>::Acc Acc;
  typedef typename Elem<T>::Bits Bits;
  static constexpr int kPer = UB_VEC_BYTES / Elem<T>::kBytes;
  static constexpr int kBits = 8 * Elem<T>::kBytes;

  __device__ static u32 word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  }
  __device__ static Bits bits(const uint4& v, int e) {
    if constexpr (kBits == 64) {
      return (u64)word(v, 2 * e) | ((u64)word(v, 2 * e + 1) << 32);
    } else if constexpr (kBits == 8) {
      return (word(v, e >> 2) >> (8 * (e & 3))) & 0xffu;
    } else {
      return kBits == 32 ? word(v, e) : (word(v, e >> 1) >> (16 * (e & 1))) & 0xffffu;
    }
  }
  __device__ static void unpack(const uint4& v, Acc (&f)[kPer]) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) f[e] = Elem<T>::load(bits(v, e));
  }
  // Every element the poison (Elem<T>::kNaN): what a failed launch writes where its result
  // would go.
  __device__ static uint4 poison() {
    if constexpr (kBits == 64) {
      const u32 lo = (u32)Elem<T>::kNaN, hi = (u32)(Elem<T>::kNaN >> 32);
      return make_uint4(lo, hi, lo, hi);
    } else {
      const u32 w = kBits == 32   ? Elem<T>::kNaN
                    : kBits == 16 ? Elem<T>::kNaN * 0x10001u
                                  : Elem<T>::kNaN * 0x1010101u;
      return make_uint4(w, w, w, w);
    }
  }
  __device__ static uint4 pack(const Acc (&f)[kPer]) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kBits == 64) {
        const u64 b = Elem<T>::store(f[i >> 1]);
        w[i] = (i & 1) ? (u32)(b >> 32) : (u32)b;
      } else if constexpr (kBits == 8) {
        w[i] = Elem<T>::store(f[4 * i]) | (Elem<T>::store(f[4 * i + 1]) << 8) |
               (Elem<T>::store(f[4 * i + 2]) << 16) | (Elem<T>::store(f[4 * i + 3]) << 24);
      } else if (kBits == 32) {
        w[i] = Elem<T>::store(f[i]);
      } else {
        w[i] = Elem<T>::store(f[2 * i]) | (Elem<T>::store(f[2 * i + 1]) << 16);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// Replaces every -0.0 element of v by +0.0 (the Lamport kernels: so that it cannot be taken
// for the sentinel; deterministic mode: so that every algorithm gives the same bits).
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
// The same for a vector of two doubles: a zero of either sign becomes +0.0.
__device__ __forceinline__ uint4 clear_negative_zero64(const uint4& v) {
  const bool zero0 = v.x == 0u && (v.y << 1) == 0u, zero1 = v.z == 0u && (v.w << 1) == 0u;
  return make_uint4(v.x, zero0 ? 0u : v.y, v.z, zero1 ? 0u : v.w);
}
// In deterministic mode, v with -0.0 written as +0.0 (integers have none); else v itself.
template <class T> __device__ __forceinline__ uint4 settle(const uint4& v) {
  if constexpr (!kDeterministic || !Elem<T>::kFloat) {
    return v;
  } else if constexpr (Elem<T>::kBytes == 8) {
    return clear_negative_zero64(v);
  } else {
    return clear_sentinel<T>(v);
  }
}

// ---------------------------------------------------------------------------------
// Reduction ops: combine in the accumulator type A (Elem<T>::Acc); finish() runs once on
// the fully reduced value.
// ---------------------------------------------------------------------------------
// Arithmetic of an accumulator type: IEEE for float and double; an integer type in itself,
// a sum wrapping around modulo 2^bits (added as its unsigned type: no signed overflow),
// max and min exact.
template <class A> __device__ __forceinline__ A acc_add(A a, A b) {
  typedef typename Elem<A>::Unsigned U;
  return (A)(U)((U)a + (U)b);
}
template <> __device__ __forceinline__ float acc_add(float a, float b) { return a + b; }
template <> __device__ __forceinline__ double acc_add(double a, double b) { return a + b; }
// fmax/fmin for the floating types: where one operand is NaN, the other one.
template <class A> __device__ __forceinline__ A acc_max(A a, A b) { return a < b ? b : a; }
template <> __device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
template <> __device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }
template <class A> __device__ __forceinline__ A acc_min(A a, A b) { return b < a ? b : a; }
template <> __device__ __forceinline__ float acc_min(float a, float b) { return fminf(a, b); }
template <> __device__ __forceinline__ double acc_min(double a, double b) { return fmin(a, b); }

// kFinishes: finish() changes the value (a reduction done elsewhere, e.g. in the NVSwitch,
// still needs it).
struct OpSum {
  static constexpr bool kFinishes = false;
  template <class A> __device__ static A combine(A a, A b) { return acc_add(a, b); }
  template <class A> __device__ static A finish(A a, int) { return a; }
};
struct OpAvg {
  static constexpr bool kFinishes = true;
  template <class A> __device__ static A combine(A a, A b) { return acc_add(a, b); }
  template <class A> __device__ static A finish(A a, int n) {
    static_assert(Elem<A>::kFloat, "avg takes floating-point types (ubnext._protocol.algorithms.op_problem)");
    return a / (A)n;
  }
};
struct OpMax {
  static constexpr bool kFinishes = false;
  template <class A> __device__ static A combine(A a, A b) { return acc_max(a, b); }
  template <class A> __device__ static A finish(A a, int) { return a; }
};
struct OpMin {
  static constexpr bool kFinishes = false;
  template <class A> __device__ static A combine(A a, A b) { return acc_min(a, b); }
  template <class A> __device__ static A finish(A a, int) { return a; }
};

// Reduces N packed vectors of T in array order (in Elem<T>::Acc), finishes, packs the
// result as T. A fixed order gives the same bits wherever the same vectors are reduced.
template <class T, class Op, int N> __device__ uint4 reduce_vectors(const uint4 (&v)[N]) {
  constexpr int P = Vec<T>::kPer;
  typename Elem<T>::Acc acc[P], f[P];
  Vec<T>::unpack(v[0], acc);
#pragma unroll
  for (int r = 1; r < N; ++r) {
    Vec<T>::unpack(v[r], f);
#pragma unroll
    for (int e = 0; e < P; ++e) acc[e] = Op::combine(acc[e], f[e]);
  }
#pragma unroll
  for (int e = 0; e < P; ++e) acc[e] = Op::finish(acc[e], N);
  return Vec<T>::pack(acc);
}

// ---------------------------------------------------------------------------------
// Memory primitives. "weak" = ordinary access; "strong" ones bypass the L1 cache.
// ---------------------------------------------------------------------------------

// Weak 16-byte load (ordinary global load, may be cached in L1).
__device__ __forceinline__ uint4 ld_weak(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Weak 16-byte store.
__device__ __forceinline__ void st_weak(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Relaxed, system-scope 16-byte load: sees peers' stores that reached this memory (no L1).
__device__ __forceinline__ uint4 ld_relaxed_sys(const void* p) {
  uint4 v;
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Volatile 16-byte load for polling: re-read from memory on every call.
__device__ __forceinline__ uint4 ld_volatile(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Relaxed, system-scope 16-byte store: a store another rank polls for (the Lamport
// pushes and re-poison), issued as written, never merged, cached or elided.
__device__ __forceinline__ void st_relaxed_sys(void* p, const uint4& v) {
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Volatile 32-bit load.
__device__ __forceinline__ u32 ld_volatile_u32(const void* p) {
  u32 v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Volatile 64-bit load.
__device__ __forceinline__ u64 ld_volatile_u64(const void* p) {
  u64 v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Acquire, system scope: later accesses of this thread are ordered after the load.
__device__ __forceinline__ u32 ld_acquire_sys(const void* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release, system scope: earlier accesses of this thread are ordered before the store.
__device__ __forceinline__ void st_release_sys(void* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Sequentially consistent fence at system scope (cumulative over what the thread observed).
__device__ __forceinline__ void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

// Nanoseconds from the GPU's global timer.
__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90 and later; the host launches every kernel with
// the programmatic stream-serialization attribute unless Config.pdl is off:
// ubnext._engine.launch). Such a launch may start while the kernel before it on the
// stream is still running, so its launch and set-up overlap that kernel's tail.
// ---------------------------------------------------------------------------------

// Returns once the grids this one depends on (the kernel before it on the stream) have
// completed and their writes are visible to it; at once for a launch without the
// attribute. Every entry point calls it before it reads its input or any state a
// previous kernel may still use (launch state, flags, buffers, staging).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream, if launched with the attribute, be scheduled once
// every block of this one has called this or exited. Always correct: that kernel still
// waits (grid_dependency_wait) for this one to complete before it touches its results.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first step of an entry point that keeps no launch state (sync.cuh: enter_launch).
__device__ __forceinline__ void enter_dependent() {
  grid_dependency_wait();
  launch_dependents();
}

// ---------------------------------------------------------------------------------
// Partial vectors: the last vector of a message may hold fewer than kPer elements.
// ---------------------------------------------------------------------------------

// Loads `valid` (1..kPer-1) elements at p; missing elements read as +0.0 bits.
template <class T> __device__ uint4 ld_partial(const void* p, int valid) {
  constexpr int P = Vec<T>::kPer;
  u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int e = 0; e < P; ++e) {
    if (e < valid) {
      if constexpr (Elem<T>::kBytes == 8) {
        const u64 b = ((const volatile u64*)p)[e];
        w[2 * e] = (u32)b;
        w[2 * e + 1] = (u32)(b >> 32);
      } else if constexpr (Elem<T>::kBytes == 1) {
        w[e >> 2] |= (u32)((const volatile u8*)p)[e] << (8 * (e & 3));
      } else if (Elem<T>::kBytes == 4) {
        w[e] = ((const volatile u32*)p)[e];
      } else {
        w[e >> 1] |= (u32)((const volatile u16*)p)[e] << (16 * (e & 1));
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores the first `valid` (1..kPer-1) elements of v at p, element by element.
template <class T> __device__ void st_partial(void* p, const uint4& v, int valid) {
#pragma unroll
  for (int e = 0; e < Vec<T>::kPer; ++e) {
    if (e < valid) {
      if constexpr (Elem<T>::kBytes == 8) {
        ((volatile u64*)p)[e] = Vec<T>::bits(v, e);
      } else if constexpr (Elem<T>::kBytes == 1) {
        ((volatile u8*)p)[e] = (u8)Vec<T>::bits(v, e);
      } else if (Elem<T>::kBytes == 4) {
        ((volatile u32*)p)[e] = Vec<T>::bits(v, e);
      } else {
        ((volatile u16*)p)[e] = (u16)Vec<T>::bits(v, e);
      }
    }
  }
}

// Element i of an array of a 2-, 4- or 8-byte T, one element at a time (arrays the
// vectors cannot take: unaligned ones), in and out of T's accumulator type.
template <class T>
__device__ typename Elem<T>::Acc load_elem(const char* p, u64 i) {
  constexpr int B = Elem<T>::kBytes;
  static_assert(B == 2 || B == 4 || B == 8, "load_elem: 2-, 4- or 8-byte elements");
  if constexpr (B == 8) return Elem<T>::load(((const u64*)p)[i]);
  else if constexpr (B == 4) return Elem<T>::load(((const u32*)p)[i]);
  else return Elem<T>::load((u32)((const u16*)p)[i]);
}
template <class T>
__device__ void store_elem(char* p, u64 i, typename Elem<T>::Acc v) {
  constexpr int B = Elem<T>::kBytes;
  static_assert(B == 2 || B == 4 || B == 8, "store_elem: 2-, 4- or 8-byte elements");
  if constexpr (B == 8) ((u64*)p)[i] = Elem<T>::store(v);
  else if constexpr (B == 4) ((u32*)p)[i] = Elem<T>::store(v);
  else ((u16*)p)[i] = (u16)Elem<T>::store(v);
}

// v rounded to T, to nearest even, and widened back: the value T stores for v.
template <class T>
__device__ typename Elem<T>::Acc rounded(typename Elem<T>::Acc v) {
  return Elem<T>::load(Elem<T>::store(v));
}

// Geometry of a message of n elements cut into 16-byte vectors.
template <class T> struct Span {
  u64 nvec;   // vectors, the last one possibly partial
  int tail;   // elements in the last vector when partial, else 0
  __device__ explicit Span(u64 n) {
    nvec = (n + Vec<T>::kPer - 1) / Vec<T>::kPer;
    tail = (int)(n % Vec<T>::kPer);
  }
  __device__ bool partial(u64 i) const { return tail != 0 && i == nvec - 1; }
  // Loads vector i of a local array; a partial vector is padded with +0.0.
  __device__ uint4 load(const char* a, u64 i) const {
    return partial(i) ? ld_partial<T>(a + i * kVec, tail) : ld_weak(a + i * kVec);
  }
  // Stores vector i of a local or peer array; never writes past element n.
  __device__ void store(char* a, u64 i, const uint4& v) const {
    if (partial(i)) st_partial<T>(a + i * kVec, v, tail); else st_weak(a + i * kVec, v);
  }
};
