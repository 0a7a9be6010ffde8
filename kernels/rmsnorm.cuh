// ubnext kernels: the residual add + RMSNorm epilogue, shared by the fused all-reduce
// kernels, the separate add + RMSNorm kernel (rmsnorm.cu) and the overlapped
// reduce-scatter's slot sum + add + RMSNorm (slot_sum.cu).
//
// For one row of `hidden` elements, with `a` the all-reduced row rounded to T:
//   res    = round_T((a + bias) + residual)                   (fp32 arithmetic)
//   scale  = 1 / sqrt(sum(res * res) / hidden + eps)         (fp32 statistics of res)
//   normed = round_T((res * scale) * weight)
// bias and residual are optional (null). Every rank runs the same arithmetic in the same
// order (row_sum is a fixed tree), so ranks that normalize the same row get the same bits.
#pragma once
#include "sync.cuh"

// UB_NORM_THREADS (protocol.h): threads of a row group (a multiple of 32, <= 1024), a
// block or a cluster's blocks together.
// Blocks per thread-block cluster of the row groups (1: none, a group is one block). The
// host compiles the fused Lamport kernels once per cluster size it launches: the entry
// points carry the cluster shape (UB_CLUSTER_DIMS), so a plain cuLaunchKernel forms the
// clusters, and the row sums know the group's size at compile time. A cluster's blocks
// have at most UB_NORM_THREADS threads together (ubnext._protocol.algorithms.row_threads), which
// bounds a block's threads (UB_NORM_BLOCK_THREADS, the entry points' launch bound, with
// one resident block per SM: ptxas then keeps the fused kernels free of spills).
#ifndef UB_CLUSTER
#define UB_CLUSTER 1
#endif
#define UB_NORM_BLOCK_THREADS (UB_NORM_THREADS / UB_CLUSTER)
#if UB_CLUSTER > 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "thread-block clusters (UB_CLUSTER > 1) need sm_90 or newer"
#endif
#define UB_CLUSTER_DIMS __cluster_dims__(UB_CLUSTER, 1, 1)
#else
#define UB_CLUSTER_DIMS
#endif
// Vectors of a row each thread keeps in registers between the two passes of finish_row;
// vectors beyond are read back from res_out. The fused kernels keep one: under their
// launch bounds more spill to local memory or cost more than the re-read
// (bench/NOTES.md); the separate kernel (rmsnorm.cu) keeps four without spilling; the host
// compiles it with UB_ROW_KEEP = ubnext._protocol.algorithms.ROW_KEEP. The slot sum + add + RMSNorm
// (slot_sum.cu) keeps two (SLOT_NORM_ROW_KEEP): its slots' vectors are in flight besides.
#ifndef UB_ROW_KEEP
#define UB_ROW_KEEP 1
#endif

// The epilogue's operands: local arrays of the caller, rows x hidden, row-major.
struct NormArgs {
  const char* residual;  // may be null
  const char* bias;      // hidden elements; may be null
  const char* weight;    // hidden elements
  char* normed;
  char* res_out;
  u64 hidden;
  float eps;
};

__device__ __forceinline__ float residual_sum(float a, float bias, float residual) {
  return (a + bias) + residual;
}
// 1 / sqrt(sumsq / hidden + eps) with every step rounded to nearest (IEEE division, addition,
// square root and reciprocal, whatever the compiler's precision flags), so that the host
// reproduces a row's scale, and so normed, bit for bit (tests/reference.py: rms_scale);
// rsqrtf is an approximation whose bits no host can predict.
__device__ __forceinline__ float rms_scale(float sumsq, u64 hidden, float eps) {
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sumsq, (float)hidden), eps)));
}
__device__ __forceinline__ float normalized(float v, float scale, float w) { return (v * scale) * w; }

// Vector form, for rows whose vectors are all full (hidden % kPer == 0, 16-byte aligned).
// The operands of vector `col` of row `row`; a missing bias or residual reads as +0.0.
// Kernels load them before they wait for the reduction, so their latency is hidden; the
// weight is loaded too, so that normalize() finds it in cache after the row's reduction.
struct RowOperands {
  uint4 residual, bias, weight;
};
template <class T>
__device__ RowOperands load_operands(const NormArgs& a, u64 row, u64 col) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  RowOperands o{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), ld_weak(a.weight + col * kVec)};
  if (a.residual != nullptr) o.residual = ld_weak(a.residual + (row * vpr + col) * kVec);
  if (a.bias != nullptr) o.bias = ld_weak(a.bias + col * kVec);
  return o;
}

// The residual sum of one vector, packed as T; `ar`: the all-reduced vector.
template <class T> __device__ uint4 add_residual(const RowOperands& o, const uint4& ar) {
  constexpr int P = Vec<T>::kPer;
  float f[P], b[P], r[P];
  Vec<T>::unpack(ar, f);
  Vec<T>::unpack(o.bias, b);
  Vec<T>::unpack(o.residual, r);
#pragma unroll
  for (int e = 0; e < P; ++e) f[e] = residual_sum(f[e], b[e], r[e]);
  return Vec<T>::pack(f);
}

// Sum of squares of the elements of a packed vector (as stored, i.e. rounded to T).
template <class T> __device__ float sum_squares(const uint4& v) {
  constexpr int P = Vec<T>::kPer;
  float f[P];
  Vec<T>::unpack(v, f);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < P; ++e) s += f[e] * f[e];
  return s;
}

// normed vector from the residual-sum vector `res`, the weight vector `wv` and the row's scale.
template <class T> __device__ uint4 normalize(const uint4& res, const uint4& wv, float scale) {
  constexpr int P = Vec<T>::kPer;
  float f[P], w[P];
  Vec<T>::unpack(res, f);
  Vec<T>::unpack(wv, w);
#pragma unroll
  for (int e = 0; e < P; ++e) f[e] = normalized(f[e], scale, w[e]);
  return Vec<T>::pack(f);
}
// normed vector `col` from the residual-sum vector `res` and the row's scale.
template <class T>
__device__ uint4 normalize(const NormArgs& a, u64 col, const uint4& res, float scale) {
  return normalize<T>(res, ld_weak(a.weight + col * kVec), scale);
}

// ---- row groups --------------------------------------------------------------------
// The blocks that finish a row together: the UB_CLUSTER blocks of a thread-block cluster
// (sm_90; the host compiles and launches a kernel with clusters when a few rows would
// leave SMs idle), else one block. Group g of G finishes rows g, g + G, ...; its threads
// are numbered rank * blockDim.x + threadIdx.x, rank being the block's rank in the group.
//
// In a cluster, row_sum sends each warp's total into every block's shared memory with
// st.async, which counts the bytes on the receiving block's mbarrier; a block waits on its
// own mbarrier only. No cluster barrier, whose release would first wait for every store
// the block issued before it: the row's outputs, and in the two-shot the residual sums
// just pushed over NVLink. Each block inits its mbarriers at the start (row_group) and
// waits once for the cluster's inits before its first send.
struct RowGroup {
  u32 id, count, rank;
  u32 parity;  // which of the two slots (totals and mbarrier) the next row_sum uses
  u32 phase;   // bit s: the phase parity the next wait on mbarrier s waits for
  bool joined; // the cluster's mbarriers are known to be initialized
  const WaitCtx* wait;  // where a cluster's mailbox wait reports a timeout (null: no cluster)
};

// One block's shared state of the row sums: per slot, an mbarrier and the group's warp
// totals (at most 32), in block-rank order.
struct RowMail {
  u64 bar[2];
  float total[2][32];
};
__device__ __forceinline__ RowMail& row_mail() {
  __shared__ RowMail m;
  return m;
}

#if UB_CLUSTER > 1
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u64 a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (u32)a;
}
// The address of this block's shared address `local` in block `rank` of the cluster.
__device__ __forceinline__ u32 cluster_addr(u32 local, u32 rank) {
  u32 r;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
// Stores v at *p in block `rank`'s shared memory and counts 4 bytes on its mbarrier *bar
// (both given as this block's addresses of the same variables).
__device__ __forceinline__ void send_total(float* p, u64* bar, u32 rank, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(cluster_addr(smem_addr(p), rank)), "f"(v), "r"(cluster_addr(smem_addr(bar), rank))
               : "memory");
}
// Waits for the phase of parity `parity` of this block's mbarrier to complete (acquire,
// cluster scope: the totals sent by other blocks are visible after it). Every block of
// the cluster sends its totals, also after a failure, so this wait neither gives up on a
// failed communicator nor leaves early: it only reports a timeout and goes on.
__device__ __forceinline__ void wait_mail(u64* bar, u32 parity, const WaitCtx& c) {
  const u64 t0 = globaltimer(), timeout_ns = ld_volatile_u64(&c.state->timeout_ns);
  for (u32 k = 1;; ++k) {
    u32 done;
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    if (done) return;
    if ((k & 31u) == 0u && globaltimer() - t0 > timeout_ns) {
      report(c.state, c.rank, kFailTimeout, (int)UB_ANY_PEER, kSiteClusterMail, 0, 0);
      return;
    }
  }
}
#endif

// Every thread of the group calls it, before the group's first row_sum; `wait`: the
// thread's wait context (needed with clusters).
__device__ __forceinline__ RowGroup row_group(const WaitCtx* wait = nullptr) {
  RowGroup g{blockIdx.x, gridDim.x, 0u, 0u, 0u, true, wait};
#if UB_CLUSTER > 1
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(g.id));
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(g.count));
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(g.rank));
  if (threadIdx.x == 0) {  // one arrival per phase: thread 0's, with the bytes expected
    RowMail& m = row_mail();
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&m.bar[0])) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&m.bar[1])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
  g.joined = false;
#endif
  return g;
}

// Sum of v over the group, the same value in every thread and the same bits on every
// launch with the same group shape: warp sums (butterfly), then lane l of every warp
// adds up warp total l of the group (warps in block-rank order, at most 32: the host
// gives a group at most 1024 threads) by another butterfly. Two slots used in turn.
// In a block, a slot is written again only after the next call's __syncthreads, which
// every thread reaches after reading it. In a cluster, a block sends into slot s for row
// k + 2 only after its wait for row k + 1, which needs every warp of every block to have
// sent row k + 1, i.e. to have read slot s of row k. Every thread of the group calls it.
// It starts by reconverging the warp, whose lanes left the fetch's spin loops at different
// times: ptxas then compiles what follows as converged code (uniform datapath, no
// divergence checks before the shuffles and the cluster waits); a second __syncwarp
// after wait_mail undoes that.
__device__ float row_sum(RowGroup& g, float v) {
  RowMail& m = row_mail();
  const u32 lane = threadIdx.x & 31u, warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const u32 s = g.parity;
  __syncwarp();
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  float t = 0.f;
#if UB_CLUSTER > 1
  if (!g.joined) {  // every block's mbarriers are initialized
    asm volatile("barrier.cluster.wait;" ::: "memory");
    g.joined = true;
  }
  if (lane < UB_CLUSTER) send_total(&m.total[s][g.rank * warps + warp], &m.bar[s], lane, v);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(&m.bar[s])), "r"(UB_CLUSTER * warps * 4u) : "memory");
  }
  wait_mail(&m.bar[s], (g.phase >> s) & 1u, *g.wait);
  g.phase ^= 1u << s;
  if (lane < UB_CLUSTER * warps) t = m.total[s][lane];
#else
  if (lane == 0) m.total[s][warp] = v;
  __syncthreads();
  if (lane < warps) t = m.total[s][lane];
#endif
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  g.parity ^= 1u;
  return t;
}

// Called by every thread at the end of a kernel that took a row_group(): pairs the
// start's cluster arrive with a wait where no row_sum did. Blocks may leave without a
// cluster barrier: a block's last wait saw every total sent to it, and no block reads
// another's shared memory.
__device__ __forceinline__ void row_group_done(const RowGroup& g) {
#if UB_CLUSTER > 1
  if (!g.joined) asm volatile("barrier.cluster.wait;" ::: "memory");
#endif
}

// Finishes row `row`: res = fetch(v), the residual sum of vector v packed as T, for every
// vector of the row, stored to res_out; then normed from res and the row's scale. The
// vectors are spread over the group's threads in a fixed pattern (the same bits on every
// rank that uses the same group shape). Every thread of the group calls it; each calls
// on_scale(scale) once the row's scale is known, before the normed pass.
// KeepWeight: the kept vectors' weights are loaded into registers before the row sum. In
// a cluster the sum's wait (acquire, cluster scope) invalidates L1, so weights loaded after
// it come from L2. The fused one-shot gains from it; the fused Lamport two-shot does not,
// and the separate kernel (four kept vectors) would spill, so they load the weights in
// the normed pass (bench/NOTES.md).
template <class T, bool KeepWeight = false, class Fetch, class OnScale>
__device__ void finish_row(const NormArgs& a, u64 row, RowGroup& g, Fetch fetch, OnScale on_scale) {
  const u64 vpr = a.hidden / Vec<T>::kPer;
  char* res_out = a.res_out + row * vpr * kVec;
  char* normed = a.normed + row * vpr * kVec;
  const u64 first = (u64)g.rank * blockDim.x + threadIdx.x;
  const u64 step = (u64)UB_CLUSTER * blockDim.x;
  const u64 kept = (u64)UB_ROW_KEEP * step;
  uint4 keep[UB_ROW_KEEP];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < UB_ROW_KEEP; ++k) {
    const u64 v = first + (u64)k * step;
    if (v < vpr) {
      keep[k] = fetch(v);
      st_weak(res_out + v * kVec, keep[k]);
      ss += sum_squares<T>(keep[k]);
    }
  }
  for (u64 v = first + kept; v < vpr; v += step) {
    const uint4 r = fetch(v);
    st_weak(res_out + v * kVec, r);
    ss += sum_squares<T>(r);
  }
  uint4 weight[UB_ROW_KEEP];
#pragma unroll
  for (int k = 0; k < UB_ROW_KEEP; ++k) {
    const u64 v = first + (u64)k * step;
    if (KeepWeight && v < vpr) weight[k] = ld_weak(a.weight + v * kVec);
  }
  const float scale = rms_scale(row_sum(g, ss), a.hidden, a.eps);
  on_scale(scale);
#pragma unroll
  for (int k = 0; k < UB_ROW_KEEP; ++k) {
    const u64 v = first + (u64)k * step;
    if (v < vpr) {
      const uint4 r = KeepWeight ? normalize<T>(keep[k], weight[k], scale) : normalize<T>(a, v, keep[k], scale);
      st_weak(normed + v * kVec, r);
    }
  }
  for (u64 v = first + kept; v < vpr; v += step) {
    st_weak(normed + v * kVec, normalize<T>(a, v, ld_weak(res_out + v * kVec), scale));
  }
}

// ---- rows of an array reduced before the launch -------------------------------------
// The separate kernel (rmsnorm.cu) reads them from an all-reduced array, the slot sum +
// add + RMSNorm (slot_sum.cu) adds them up from its slots as it goes.

// Whether the rows can move as 16-byte vectors: hidden a multiple of the vector width,
// every operand 16-byte aligned and so is `source` (the OR of the reduced input's
// addresses and strides).
template <class T>
__device__ bool rows_by_vectors(u64 source, const NormArgs& a) {
  const u64 any = source | (u64)a.residual | (u64)a.bias | (u64)a.weight | (u64)a.normed | (u64)a.res_out;
  return a.hidden % Vec<T>::kPer == 0 && any % kVec == 0;
}

// Residual add + RMSNorm of `rows` rows, one row per block (grid-stride beyond), launched
// without clusters. The reduced values, as rounded to T: `vector_of(i)`, vector i of the
// rows (row * hidden / kPer + v, packed T), where `by_vectors` (rows_by_vectors), through
// finish_row; else `elem_of(i)`, element i (row * hidden + k, in fp32), element by element.
// A row's reduced values are read before the block writes its outputs (so the input may
// alias normed) and the residual before res_out (which it may alias).
template <class T, class VectorOf, class ElemOf>
__device__ void add_rmsnorm_rows(u64 rows, const NormArgs& a, bool by_vectors, VectorOf vector_of, ElemOf elem_of) {
  RowGroup g = row_group();  // launched without clusters: the block
  if (by_vectors) {
    const u64 vpr = a.hidden / Vec<T>::kPer;
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
      finish_row<T>(a, row, g, [&](u64 v) {
        return add_residual<T>(load_operands<T>(a, row, v), vector_of(row * vpr + v));
      }, [](float) {});
    }
    return;
  }
  for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
    float ss = 0.f;
    for (u64 k = threadIdx.x; k < a.hidden; k += blockDim.x) {
      const u64 i = row * a.hidden + k;
      const float ar = elem_of(i);  // as rounded by the reduction
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
