// Expert-parallel dispatch, throughput mode: header, records, bulk flag; then, at once, the
// rows (sender blocks) and the count and lay-out (receiver blocks) (docs/moe.md, "Throughput
// mode"; the area: moe_packed.cuh).
//
// Every rank waits for every rank's header (T_s, and: the peer's previous launch is over),
// then stores each token's routing record into every rank (every warp of the grid), fences,
// meets its own blocks at a grid barrier and stores its bulk flag into every rank: "my
// records are there". Then the grid splits. The first S blocks (senders) send the rows: each
// group of W tokens (a warp each, W = warps per block) once to each GPU that holds one of
// their experts, into that GPU's area of this source, 16-byte vectors; after each group, a
// fence and the group's progress flag (the launch's epoch + 1) into every rank. The other
// blocks (receivers) wait for the N bulk flags, count the tokens of each local expert (a
// unit per expert: a block-wide prefix sum over the records in (source, token) order gives
// each token its row within the expert), meet at a barrier of the receivers, take the
// experts' offsets (a prefix sum of the counts), and lay out the rows in token order while
// they arrive: row (s, t) waits for its group's progress flag, is read once and stored at
// offset[e] + its row within e for each local expert e it holds. The layout is a function of
// the routing alone; the count and the lay-out overlap the rows' transfer.
#include "moe_packed.cuh"

// What a packed dispatch writes in this rank's own memory (ubnext/_moe/packed.py).
struct PackedOut {
  char* recv_x;  // [R][H] of T: the packed rows, expert by expert
  int* offsets;  // [L + 1] the first row of each local expert, then the rows in all (each at most R)
  int* src;      // [R] source * M + token of each row
  float* weights;  // [R] the router weight of each row
  int* route;    // [N][M][K] each source token's slot: its packed row, or a UB_MOE_ROUTE_* (the combine's)
  u32* tokens;   // [N] T of each source (the combine's)
  u32* dest;     // [M] the GPUs (bit g) of each of this rank's tokens (the combine's)
  u32* counts;   // [L] tokens of each local expert, before the bound R (scratch between the phases)
};

// Records: one warp per token t of this rank (the whole grid). Its K slots are checked (an id
// out of range, or an expert a previous slot holds, fails the call with kFailInput and is
// dropped: -1), its GPUs' mask written to dest[t], and its record (the K checked ids, then the
// K weights, -0.0 written as +0.0 as the low-latency mode does; padding 1) stored into every
// rank. Weak stores: the bulk flag publishes them.
template <int N, class Tp>
__device__ void send_records(const Tp& tp, const MoeShape& m, u64 rec_off, const int* idx, const float* w, u64 count,
                             u32* dest, WaitCtx& c) {
  const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
  for (u64 t = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < count; t += warps) {
    const MoeSlots k = check_slots(m, idx, w, t, c);
    if ((threadIdx.x & 31) == 0) dest[t] = k.mask;
    store_record<N>(m, k, [&](int d, u64 q, const uint4& v) {
      st_weak(tp.seg(d) + record_at<N>(rec_off, m, 0u, tp.rank, t, q), v);
    });
  }
  fence_sys();  // this thread's stores before the grid barrier and the bulk flag (release)
}

// Rows, by the sender blocks (b < S): group q of W tokens (warp i: token q * W + i) for q = b,
// b + S, ...: each token's row (read from x in 16-byte vectors) stored once into the area of
// this source of each GPU of its mask (dest, from send_records); then every thread fences, and
// N threads store the group's progress flag (`epoch`) into every rank, release at system
// scope. A sender whose header wait failed sends nothing but still flags every group, so
// that no receiver waits for it (its communicator is broken: the call fails everywhere).
template <class T, int N, class Tp>
__device__ void send_rows(const Tp& tp, const MoeShape& m, u64 data_off, u64 prog_off, const char* x, u64 count,
                          const u32* dest, u32 senders, u32 epoch, bool ok) {
  const int lane = threadIdx.x & 31;
  const u64 W = blockDim.x >> 5, row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec;
  for (u64 q = blockIdx.x; q * W < count; q += senders) {
    const u64 t = q * W + (threadIdx.x >> 5);
    if (ok && t < count) {
      const u32 mask = ld_volatile_u32(dest + t);  // another block's (send_records), before the grid barrier
      const char* xr = x + t * row_bytes;
      const u64 at = row_at<N>(data_off, m, 0u, tp.rank, t, row_bytes);
      constexpr int U = kIlp;  // vectors a lane loads before it stores them: U x 512 bytes in flight per warp
      for (u64 base = lane; base < vpr; base += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (base + 32 * u < vpr) v[u] = ld_weak(xr + (base + 32 * u) * kVec);
        }
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const int d = tp.peer(k);
          if (!(mask >> d & 1u)) continue;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (base + 32 * u < vpr) st_weak(tp.seg(d) + at + (base + 32 * u) * kVec, v[u]);
          }
        }
      }
    }
    fence_sys();  // this thread's rows before the group's flag (release, cumulative through the barrier)
    __syncthreads();
    if (threadIdx.x < N) {
      st_release_sys(tp.seg(tp.peer(threadIdx.x)) + prog_off + 4 * ((u64)tp.rank * m.tokens + q), epoch);
    }
  }
}

// Count, by units (one local expert e per receiver block, from block `first` on): each
// thread takes a run of the received rows in (source, token) order and counts those whose
// record holds e; a block-wide prefix sum gives the first row within e of each thread's run,
// which it writes into the route of each token's slot of e (reading again only the records of
// the rows that hold e, where the run is at most 32 rows: N x M <= 16384); thread 0 writes the
// count of e.
template <int N>
__device__ void count_rows(const char* mine, const MoeShape& m, u64 rec_off, const Received<N>& rx,
                           const PackedOut& o, u32* scratch, int rank, u32 first) {
  const u64 L = m.local, K = m.topk, M = m.tokens;
  const u32 rows = rx.rows(), chunk = (rows + blockDim.x - 1) / blockDim.x;
  const u32 lo = min(rows, threadIdx.x * chunk), hi = min(rows, lo + chunk);
  for (u64 e = blockIdx.x - first; e < L; e += gridDim.x - first) {
    const int ge = (int)((u64)rank * L + e);
    u32 found = 0u, holds = 0u;  // bit i of holds: row lo + i holds e (the run's first 32 rows)
#pragma unroll 4
    for (u32 f = lo; f < hi; ++f) {
      const int s = rx.source(f);
      const bool here = slot_holding<N>(mine, m, rec_off, s, f - rx.first[s], ge) >= 0;
      found += here;
      if (f - lo < 32u) holds |= (u32)here << (f - lo);
    }
    u32 total;
    u32 j = block_exclusive_scan(found, total, scratch);
    for (u32 f = lo; f < hi; ++f) {
      if (f - lo < 32u && !(holds >> (f - lo) & 1u)) continue;  // known not to hold e: no second read
      const int s = rx.source(f);
      const u64 t = f - rx.first[s];
      const int kk = slot_holding<N>(mine, m, rec_off, s, t, ge);
      if (kk >= 0) o.route[((u64)s * M + t) * K + kk] = (int)j++;
    }
    if (threadIdx.x == 0) o.counts[e] = total;
  }
}

// Offsets: every receiver block's exclusive prefix sum of the L counts into offs[0..L]
// (shared); the first receiver (block `first`) writes them, bounded by R, and fails the call
// (kFailInput) where the rows exceed R.
__device__ void take_offsets(const MoeShape& m, const PackedOut& o, u32* offs, u32* scratch, WaitCtx& c, u32 first) {
  const u32 L = (u32)m.local;
  u32 carry = 0u;
  for (u32 base = 0; base < L; base += blockDim.x) {
    const u32 e = base + threadIdx.x;
    u32 total;
    const u32 ex = block_exclusive_scan(e < L ? ld_volatile_u32(o.counts + e) : 0u, total, scratch);
    if (e < L) offs[e] = carry + ex;
    carry += total;
  }
  if (threadIdx.x == 0) offs[L] = carry;
  __syncthreads();
  if (blockIdx.x == first) {
    for (u32 e = threadIdx.x; e <= L; e += blockDim.x) o.offsets[e] = (int)min((u64)offs[e], m.capacity);
    if (threadIdx.x == 0 && carry > m.capacity) fail(c, kFailInput, c.rank, kMoeOverRows, m.capacity, carry);
  }
}

// Lay out: one warp of the receivers per received row (s, t), in token order (t, then s: the
// order the senders send in). Lane k < K takes slot k of the record: where its expert e is on
// this GPU, its packed row p = offs[e] + its row within e (the count's route); p < R writes
// src[p], weights[p] and the route p, else the route UB_MOE_ROUTE_OVERFLOW (the call fails:
// take_offsets); a slot elsewhere (or dropped) routes UB_MOE_ROUTE_ELSEWHERE. A row with a
// slot here then waits for its group's progress flag (every lane: acquire at system scope),
// is read once from the source's area and stored into each of its packed rows.
template <class T, int N>
__device__ void lay_out(const char* mine, const MoeShape& m, u64 rec_off, u64 data_off, u64 prog_off,
                        const Received<N>& rx, const PackedOut& o, const u32* offs, u32 first, u32 epoch, WaitCtx& c) {
  const int lane = threadIdx.x & 31, K = (int)m.topk, rank = c.rank;
  const u64 L = m.local, M = m.tokens, R = m.capacity, W = blockDim.x >> 5;
  const u64 row_bytes = m.hidden * Elem<T>::kBytes, vpr = row_bytes / kVec;
  u64 most = 0;  // the longest source's tokens
#pragma unroll
  for (int r = 0; r < N; ++r) most = max(most, (u64)(rx.first[r + 1] - rx.first[r]));
  const u64 warps = (u64)(gridDim.x - first) * W;
  for (u64 f = (u64)(blockIdx.x - first) * W + (threadIdx.x >> 5); f < most * N; f += warps) {
    const int s = (int)(f % N);
    const u64 t = f / N;
    if (t >= rx.first[s + 1] - rx.first[s]) continue;
    int* route = o.route + ((u64)s * M + t) * K;
    long long p = UB_MOE_ROUTE_ELSEWHERE;
    if (lane < K) {
      const uint4 ids = ld_volatile(mine + record_at<N>(rec_off, m, 0u, s, t, (u64)lane / 4));
      const uint4 ws = ld_volatile(mine + record_at<N>(rec_off, m, 0u, s, t, (u64)(K + lane) / 4));
      const int id = (int)Vec<float>::word(ids, lane % 4);
      if (id >= 0 && (u64)id / L == (u64)rank) {
        const u32 within = *(const volatile int*)(route + lane);  // the count's (another block's)
        const u64 row = (u64)offs[(u64)id - rank * L] + within;   // a bad count only goes past R
        p = row < R ? (long long)row : UB_MOE_ROUTE_OVERFLOW;
        if (row < R) {
          o.src[row] = (int)((u64)s * M + t);
          o.weights[row] = __uint_as_float(Vec<float>::word(ws, (K + lane) % 4));
        }
      }
      route[lane] = (int)p;
    }
    const u32 kept = __ballot_sync(kWarpAll, p >= 0);
    if (kept == 0u) continue;
    const u32* flag = (const u32*)(mine + prog_off + 4 * ((u64)s * M + t / W));
    if (!__all_sync(kWarpAll, wait_flag(flag, epoch, c, s, kSiteMoePoll))) continue;  // gave up: nothing read
    const char* from = mine + row_at<N>(data_off, m, 0u, s, t, row_bytes);
    constexpr int U = kIlp;  // vectors a lane loads before it stores them: U x 512 bytes in flight per warp
    for (u64 base = 0; base < vpr; base += 32 * U) {  // a warp-uniform trip count: the shuffles below
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const u64 i = base + 32 * u + lane;
        v[u] = i < vpr ? ld_relaxed_sys(from + i * kVec) : make_uint4(0u, 0u, 0u, 0u);
      }
      for (u32 b = kept; b != 0u; b &= b - 1u) {
        char* to = o.recv_x + (u64)__shfl_sync(kWarpAll, p, __ffs(b) - 1) * row_bytes;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const u64 i = base + 32 * u + lane;
          if (i < vpr) st_weak(to + i * kVec, v[u]);
        }
      }
    }
  }
}

template <class T, int N, class Tp>
__device__ void moe_packed_dispatch(const Tp& tp, const MoeShape& m, u64 rot_off, u64 hdr_off, u64 prog_off,
                                    u64 rec_off, u64 data_off, u32 senders, const char* x, const int* idx,
                                    const float* w, u64 count, const PackedOut& o, u64 sig, LaunchState* state) {
  __shared__ u32 tok[N], scratch[33], offs[(1u << UB_MOE_EXPERT_BITS) + 1];  // L: below the signature's bound
  char* mine = tp.seg(tp.rank);
  PackedRotation* rot = (PackedRotation*)(mine + rot_off);
  const MoeSets s = moe_sets(&rot->rot);
  const LaunchView v = read_launch_state(state);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u32 epoch = v.epoch + 1u;  // the progress flags' value this launch: the same on every rank
  // this rank's own count first: it bounds the combine's rows of `out` even where a wait fails
  if (blockIdx.x == 0 && threadIdx.x == 0) o.tokens[tp.rank] = (u32)count;
  // 1. header; every rank's (each peer's previous launch is over: its area is free)
  moe_push_header<N>(tp, hdr_off, s.cur, sig, true, count);
  bool ok = moe_headers<N>(mine, hdr_off, s.cur, sig, tok, m.tokens, c);
  moe_repoison(mine + header_at<N>(hdr_off, s.old, 0), N * kHeader / kVec);
  // 2. records, then the bulk flag after every block's stores
  if (ok) send_records<N>(tp, m, rec_off, idx, w, count, o.dest, c);
  ok = grid_barrier(rot, gridDim.x, c) && ok;
  push_bulk_flag<N>(tp, hdr_off, s.cur, sig);
  if (blockIdx.x < senders) {  // 3. the rows
    send_rows<T, N>(tp, m, data_off, prog_off, x, count, o.dest, senders, epoch, ok);
  } else {  // 3. every rank's bulk flag, the counts, the offsets, then the rows as they arrive
    ok = wait_bulk_flags<N>(mine, hdr_off, s.cur, c) && ok;
    if (!ok && threadIdx.x < N) tok[threadIdx.x] = 0u;  // nothing received: nothing laid out
    __syncthreads();
    if (blockIdx.x == senders && threadIdx.x < N) o.tokens[threadIdx.x] = tok[threadIdx.x];
    const Received<N> rx(tok);
    count_rows<N>(mine, m, rec_off, rx, o, scratch, tp.rank, senders);
    ok = grid_barrier(rot, 2u * gridDim.x - senders, c) && ok;  // the receivers' own barrier
    take_offsets(m, o, offs, scratch, c, senders);
    if (ok) lay_out<T, N>(mine, m, rec_off, data_off, prog_off, rx, o, offs, senders, epoch, c);
  }
  moe_finish(c, v, &rot->rot, s, &rot->arrive);
}

// ---- entry point, instantiated per (UB_T: bf16 or float, UB_NRANKS) ---------------------
extern "C" __global__ void __launch_bounds__(UB_MOE_PACKED_DISPATCH_THREADS)
ub_moe_packed_dispatch(char* base, u64 stride, int rank, char* mc, u64 rot_off, u64 hdr_off, u64 prog_off,
                       u64 rec_off, u64 data_off, u64 experts, u64 local, u64 topk, u64 hidden, u64 tokens,
                       u64 max_rows, u64 senders, const char* x, const int* idx, const float* w, u64 count,
                       char* recv_x, int* offsets, int* src, float* weights, int* route, u32* src_tokens, u32* dest,
                       u32* counts, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const MoeShape m{experts, local, topk, hidden, tokens, max_rows};
  const PackedOut o{recv_x, offsets, src, weights, route, src_tokens, dest, counts};
  moe_packed_dispatch<UB_T, UB_NRANKS>(tp, m, rot_off, hdr_off, prog_off, rec_off, data_off, (u32)senders, x, idx, w,
                                       count, o, sig, state);
}
