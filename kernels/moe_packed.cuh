// ubnext kernels: expert parallelism, throughput mode (docs/moe.md, "Throughput mode"), what
// the packed dispatch (moe_packed_dispatch.cu) and the packed combine (moe_packed_combine.cu)
// share beyond moe.cuh: the object's rotation with a grid barrier, the bulk flags, the
// block-wide prefix sum and the routing records' reads.
//
// One packed object has an area at the same offset of every rank's segment
// (ubnext/_moe/packed_layout.py lays it out; the host passes each region's offset):
//   dispatch headers  [3 sets][N rank][UB_HEADER_BYTES]  vector 0: signature, 1: (T + 1, 1, 1, 1),
//                                                         2: the bulk flag (the signature again)
//   combine headers   [3 sets][N rank][UB_HEADER_BYTES]  vector 0: signature, 2: the bulk flag
//   progress flags    [N source][M] u32                   entry q: the dispatch's epoch + 1 once the
//                                                         source's token group q is sent (never reset)
//   routing records   [N source][M token][R vectors]      K int32 ids, K fp32 weights, padding 1
//   data              [N rank][M token][H x max(b, 4)]   the dispatch's token rows (per source),
//                                                         then the combine's fp32 partials (per GPU)
// and, in each rank's own segment only, the rotations (PackedRotation, one per kernel).
// Only the headers are polled for the sentinel. The records and the data are one set, not
// polled: every launch waits for every rank's header before it stores into a peer (a peer
// pushes its header only once its previous launch of the object, and every read of its
// area, is over); what it stores is published by its bulk flag (after a fence and a grid
// barrier: the records, the partials) or by a progress flag (after a fence and a block
// barrier: a group of the dispatch's rows), which the readers wait for.
#pragma once
#include "moe.cuh"

// Vector of a header line that holds the bulk flag: "every store of this launch into your
// area is done".
constexpr u64 kBulkFlagVec = 2;

// Exclusive prefix sum of v over the block (thread order), and the block's total; every
// thread of the block calls it. Uses the 33 words of `scratch` (shared).
__device__ u32 block_exclusive_scan(u32 v, u32& total, u32* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  u32 x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const u32 y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 run = 0;
    for (int w = 0; w < warps; ++w) {
      const u32 t = scratch[w];
      scratch[w] = run;
      run += t;
    }
    scratch[32] = run;
  }
  __syncthreads();
  const u32 out = scratch[warp] + x - v;
  total = scratch[32];
  __syncthreads();  // scratch free again
  return out;
}

// Rotation of one packed object's kernel: moe.cuh's, and the arrivals at the launch's grid
// barriers (reset by the last block to finish, when no block waits on it any more: moe.cuh's
// moe_finish with `arrivals`).
struct PackedRotation {
  MoeRotation rot;
  u32 arrive;
  u32 unused;
};

// A barrier of blocks of this launch (every block resident, grid <= SMs): the block's
// arrival counts once, then thread 0 waits (bounded: sync.cuh spin) until the launch's
// arrivals so far reach `target` (the grid's first barrier: gridDim; a later one of a part of
// the grid: what every earlier barrier counted plus that part). Release/acquire at gpu scope
// (__syncthreads, then a fence around the count, as cooperative groups' grid sync); a block
// whose communicator failed still arrives, so that the count stays whole. Whether the wait
// held, in every thread.
__device__ bool grid_barrier(PackedRotation* r, u32 target, WaitCtx& c) {
  __syncthreads();
  bool ok = true;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&r->arrive, 1u);
    ok = spin(c, [] { return (int)UB_ANY_PEER; }, kSiteMoePoll, [&] { return ld_volatile_u32(&r->arrive) >= target; });
    __threadfence();
  }
  return block_vote(ok, c);
}

// After the launch's bulk stores (each thread's own, fenced at system scope by the caller)
// and a grid barrier: block 0's last thread stores this rank's bulk flag (the signature) into
// header set `set` of every rank, after a system-scope fence.
template <int N, class Tp> __device__ void push_bulk_flag(const Tp& tp, u64 hdr_off, u32 set, u64 sig) {
  if (blockIdx.x != 0 || threadIdx.x != blockDim.x - 1) return;
  fence_sys();
  tp.push_all(header_at<N>(hdr_off, set, tp.rank) + kBulkFlagVec * kVec, pack_signature(sig));
}

// Every block, before it reads what the ranks stored in bulk: thread r < N waits for rank r's
// bulk flag of set `set` (relaxed polls, then an acquire-release fence at system scope in the
// polling thread); then the block votes. True in every thread if every wait held.
template <int N> __device__ bool wait_bulk_flags(const char* mine, u64 hdr_off, u32 set, WaitCtx& c) {
  bool ok = true;
  const int r = threadIdx.x;
  if (r < N) {
    const char* h = mine + header_at<N>(hdr_off, set, r) + kBulkFlagVec * kVec;
    uint4 v = ld_volatile(h);
    ok = moe_wait(h, v, c, r);
    fence_acq_rel_sys();
  }
  return block_vote(ok, c);
}

// The slot (0..K-1) of record (s, t) that holds expert `ge`, or -1: its ids only (the first
// ceil(K / 4) vectors), read from this rank's segment after the bulk flags.
template <int N> __device__ int slot_holding(const char* mine, const MoeShape& m, u64 rec_off, int s, u64 t, int ge) {
  const int K = (int)m.topk;
  int kk = -1;
  for (u64 q = 0; 4 * q < (u64)K; ++q) {
    const uint4 v = ld_volatile(mine + record_at<N>(rec_off, m, 0u, s, t, q));
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      if ((int)(4 * q) + h < K && (int)Vec<float>::word(v, h) == ge) kk = (int)(4 * q) + h;
    }
  }
  return kk;
}
