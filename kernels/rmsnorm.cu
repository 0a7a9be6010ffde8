// Residual add + RMSNorm on an already all-reduced array (rmsnorm.cuh): the epilogue of
// the unfused path, for what the fused kernels do not take (hidden sizes that are not a
// multiple of the vector width, unaligned arrays, the NCCL engine). One block per row:
// by 16-byte vectors through finish_row when the rows allow it, else element by element
// (rmsnorm.cuh: add_rmsnorm_rows). `x` may alias `normed` (a row is read completely
// before the block writes its normed values) and `residual` may alias `res_out`.
#include "rmsnorm.cuh"

extern "C" __global__ void __launch_bounds__(UB_NORM_THREADS)
ub_add_rmsnorm(const char* x, u64 rows, u64 hidden, const char* residual, const char* bias,
               const char* weight, char* normed, char* res_out, float eps) {
  enter_dependent();
  const NormArgs a{residual, bias, weight, normed, res_out, hidden, eps};
  add_rmsnorm_rows<UB_T>(rows, a, rows_by_vectors<UB_T>((u64)x, a),
                         [&](u64 i) { return ld_weak(x + i * kVec); },
                         [&](u64 i) { return load_elem<UB_T>(x, i); });
}
