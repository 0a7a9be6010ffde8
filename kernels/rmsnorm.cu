// Residual add + RMSNorm on an already all-reduced array (rmsnorm.cuh): the epilogue of
// the unfused path, for what the fused kernels do not take (hidden sizes that are not a
// multiple of the vector width, unaligned arrays, the NCCL engine). One block per row:
// by 16-byte vectors through finish_row when the rows allow it, else element by element.
// `x` may alias `normed` (a row is read completely before the block writes its normed
// values) and `residual` may alias `res_out`.
#include "rmsnorm.cuh"

// Whether the rows can move as 16-byte vectors: hidden a multiple of the vector width,
// every array 16-byte aligned.
template <class T>
__device__ bool by_vectors(const char* x, const NormArgs& a) {
  const u64 any = (u64)x | (u64)a.residual | (u64)a.bias | (u64)a.weight | (u64)a.normed | (u64)a.res_out;
  return a.hidden % Vec<T>::kPer == 0 && any % kVec == 0;
}

template <class T>
__device__ void add_rmsnorm_rows(const char* x, u64 rows, const NormArgs& a) {
  RowGroup g = row_group();  // launched without clusters: the block
  if (by_vectors<T>(x, a)) {
    const u64 vpr = a.hidden / Vec<T>::kPer;
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
      finish_row<T>(a, row, g, [&](u64 v) {
        return add_residual<T>(load_operands<T>(a, row, v), ld_weak(x + (row * vpr + v) * kVec));
      }, [](float) {});
    }
    return;
  }
  for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
    float ss = 0.f;
    for (u64 k = threadIdx.x; k < a.hidden; k += blockDim.x) {
      const u64 i = row * a.hidden + k;
      const float ar = load_elem<T>(x, i);  // as rounded by the all-reduce
      const float b = a.bias != nullptr ? load_elem<T>(a.bias, k) : 0.f;
      const float r = a.residual != nullptr ? load_elem<T>(a.residual, i) : 0.f;
      store_elem<T>(a.res_out, i, residual_sum(ar, b, r));
      const float s = load_elem<T>(a.res_out, i);
      ss += s * s;
    }
    const float scale = rms_scale(row_sum(g, ss), a.hidden, a.eps);
    for (u64 k = threadIdx.x; k < a.hidden; k += blockDim.x) {
      const u64 i = row * a.hidden + k;
      store_elem<T>(a.normed, i, normalized(load_elem<T>(a.res_out, i), scale, load_elem<T>(a.weight, k)));
    }
  }
}

extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_add_rmsnorm(const char* x, u64 rows, u64 hidden, const char* residual, const char* bias,
               const char* weight, char* normed, char* res_out, float eps) {
  enter_dependent();
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  add_rmsnorm_rows<UB_T>(x, rows, a);
}
