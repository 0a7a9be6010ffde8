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
//
// ub_slot_sum_add_rmsnorm (bf16, f16, float) takes the slots as rows x hidden and
// finishes each row's sum, as rounded to T, with the residual add + RMSNorm of
// rmsnorm.cuh (add_rmsnorm_rows: the separate kernel's arithmetic and row groups), in the
// same pass: the overlapped matmul + reduce-scatter + add + RMSNorm.
#include "rmsnorm.cuh"

// Vector i of the slots' sum, rounded once to T; every slot's vector in flight before the
// arithmetic.
template <class T, int N>
__device__ uint4 sum_vector(const char* slots, u64 stride, const Span<T>& span, u64 i) {
  typedef typename Elem<T>::Acc Acc;
  uint4 v[N];
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
  return Vec<T>::pack(acc);
}

// Element i of the slots' sum in T's accumulator, not yet rounded.
template <class T, int N>
__device__ typename Elem<T>::Acc sum_elem(const char* slots, u64 stride, u64 i) {
  typename Elem<T>::Acc acc = load_elem<T>(slots, i);
#pragma unroll
  for (int s = 1; s < N; ++s) acc = acc_add(acc, load_elem<T>(slots + s * stride, i));
  return acc;
}

template <class T, int N>
__device__ void slot_sum(const char* slots, u64 stride, u64 n, char* out) {
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
  if ((((u64)slots | stride | (u64)out) % kVec) == 0) {
    const Span<T> span(n);
    for (u64 i = first; i < span.nvec; i += step) span.store(out, i, sum_vector<T, N>(slots, stride, span, i));
    return;
  }
  for (u64 i = first; i < n; i += step) store_elem<T>(out, i, sum_elem<T, N>(slots, stride, i));
}

// ---- entry points, instantiated per (UB_T, UB_NRANKS): floating types ------------------
extern "C" __global__ void __launch_bounds__(UB_SLOT_SUM_THREADS)
ub_slot_sum(const char* slots, u64 stride, u64 n, char* out) {
  enter_dependent();
  slot_sum<UB_T, UB_NRANKS>(slots, stride, n, out);
}

#if UB_FUSED_T
// The slots hold `rows` rows of `hidden` elements; residual (or null), bias (or null),
// weight, normed and res_out as NormArgs says (rows x hidden, hidden): one block per row.
extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_slot_sum_add_rmsnorm(const char* slots, u64 stride, u64 rows, u64 hidden, const char* residual,
                        const char* bias, const char* weight, char* normed, char* res_out, float eps) {
  enter_dependent();
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  const Span<UB_T> span(rows * hidden);
  add_rmsnorm_rows<UB_T>(rows, a, rows_by_vectors<UB_T>((u64)slots | stride, a),
                         [&](u64 i) { return sum_vector<UB_T, UB_NRANKS>(slots, stride, span, i); },
                         [&](u64 i) { return rounded<UB_T>(sum_elem<UB_T, UB_NRANKS>(slots, stride, i)); });
}
#endif
