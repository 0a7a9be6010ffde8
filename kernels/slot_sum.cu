// The sum of UB_NRANKS equal slots in slot order, rounded once: the reduction of the
// overlapped matmul + reduce-scatter (ubnext/torch/_overlap.py), whose slot s holds rank
// s's product of this rank's rows. One pass over the slots: each output element is
//   round_T(((slot[0] + slot[1]) + slot[2]) + ... + slot[N-1])
// in T's accumulator (kernels/common.cuh: Elem::Acc; fp32 for bf16, f16 and float, double
// for double), added in that order, rounded once to T. Local to this rank (the slots are
// this rank's pool memory, filled before the launch on its stream): no peers, no flags.
//
// Slot s starts `stride` bytes after slot s-1 (a whole number of elements); `n` elements
// each; `out` may be any array of n elements that does not overlap the slots. By 16-byte
// vectors where the slots, their stride and out are 16-byte aligned (the last vector
// partial where n is not a multiple of the vector width), else element by element.
#include "common.cuh"

template <class T, int N>
__device__ void slot_sum(const char* slots, u64 stride, u64 n, char* out) {
  typedef typename Elem<T>::Acc Acc;
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
  if ((((u64)slots | stride | (u64)out) % kVec) == 0) {
    const Span<T> span(n);
    for (u64 i = first; i < span.nvec; i += step) {
      uint4 v[N];  // every slot's vector in flight before the arithmetic
#pragma unroll
      for (int s = 0; s < N; ++s) v[s] = span.load(slots + s * stride, i);
      Acc acc[Vec<T>::kPer], f[Vec<T>::kPer];
      Vec<T>::unpack(v[0], acc);
#pragma unroll
      for (int s = 1; s < N; ++s) {
        Vec<T>::unpack(v[s], f);
#pragma unroll
        for (int e = 0; e < Vec<T>::kPer; ++e) acc[e] = acc_add(acc[e], f[e]);
      }
      span.store(out, i, Vec<T>::pack(acc));
    }
    return;
  }
  for (u64 i = first; i < n; i += step) {
    Acc acc = load_elem<T>(slots, i);
#pragma unroll
    for (int s = 1; s < N; ++s) acc = acc_add(acc, load_elem<T>(slots + s * stride, i));
    store_elem<T>(out, i, acc);
  }
}

// ---- entry point, instantiated per (UB_T, UB_NRANKS): floating types ------------------
extern "C" __global__ void __launch_bounds__(UB_SLOT_SUM_THREADS)
ub_slot_sum(const char* slots, u64 stride, u64 n, char* out) {
  enter_dependent();
  slot_sum<UB_T, UB_NRANKS>(slots, stride, n, out);
}
