// The point-to-point kernel's bulk form (kernels/p2p.cu): a message of at least
// UB_P2P_BULK_MIN_BYTES moves in chunks of UB_P2P_BULK_CHUNK bytes, stored as 16-byte
// vectors into the receiver's chunk slots of the pair, each chunk followed by one flag
// line; the blocks of a pair's group share its chunks (block j of B takes chunks j, j + B,
// ...), so several blocks move one message.
//
// Chunk sequence, per ordered pair: the pair's bulk chunks are counted (q) by the sender
// and by the receiver, in the order of the pair's messages; chunk q travels in slot
// q % UB_P2P_BULK_DEPTH of the pair (source rank s) in the receiver's area, its flag line
// (an LL line: the message's header, flag q + 1) stored after its data with a system-scope
// fence. The receiver's block waits for the flag line, checks the header against its own,
// copies the chunk out (relaxed system-scope loads) and stores q + 1 into the pair's
// credit word of that slot in the sender's area (release); the sender waits, before chunk
// q, for the credit of chunk q - UB_P2P_BULK_DEPTH (acquire). Every chunk's waits depend
// only on chunks of lower sequence, so any split of the chunks among the blocks of either
// side makes progress, and the two sides need not run the same number of blocks.
//
// A group's blocks follow the pair's messages together: each counts the pair's messages
// and chunks from the counts it read at its start, the last of them to finish stores them
// (arrive). A receiving group's block 0 alone reads the headers (the LL lines); where the
// group has other blocks, it tells them each header's count and whether it may be written
// (its verdict: tell, heard), so that they follow the sender's count, whatever the
// receiver expected: every chunk sent is read, and the pair stays matched.
//
// Bulk part of the area, after the LL slots (bulk_part): a line of this rank's counters,
// u32 bulk_sent[UB_MAX_RANKS], bulk_recvd[UB_MAX_RANKS] and the groups' arrival counts
// arrivals[2][UB_MAX_RANKS] (receive, send); then u32 credit[UB_MAX_RANKS][DEPTH] (written
// by the receivers), the flag lines [UB_MAX_RANKS][DEPTH] (16 bytes, written by the
// senders), the verdict lines [UB_MAX_RANKS][UB_P2P_MAX_ENTRIES] (16 bytes, per source and
// entry of a receiving group; written by this rank's block 0 of the group), and the chunk
// slots [UB_NRANKS][DEPTH][UB_P2P_BULK_CHUNK] (written by the senders).
#pragma once
#include "ll_lines.cuh"

constexpr u32 kBulkDepth = UB_P2P_BULK_DEPTH;
constexpr u64 kBulkChunk = UB_P2P_BULK_CHUNK;
// vectors of a chunk per thread (the kernels run UB_P2P_THREADS threads per block)
constexpr u32 kChunkVecsPerThread = (u32)((kBulkChunk / 16 + UB_P2P_THREADS - 1) / UB_P2P_THREADS);

// Acquire-release fence at system scope: after a relaxed store's data (the sender's
// chunk before its flag line), or after a relaxed load that saw a flag (the receiver's
// data after it).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Block j of the `blocks` that a launch runs for one group (a pair and a direction); block
// 0 leads: it alone moves the pair's LL lines.
struct Lane {
  u32 j;
  u32 blocks;
};

// A pair's counts as a group's block carries them through a launch: k, its messages in LL
// buffers (a bulk message's header is one), q, its bulk chunks.
struct Count {
  u32 k;
  u32 q;
};

__device__ __forceinline__ u32 bulk_chunks(u64 n) { return (u32)((n + kBulkChunk - 1) / kBulkChunk); }

__device__ __forceinline__ char* bulk_part(char* area, u64 slot_bytes) {
  return area + 2 * UB_HEADER_BYTES + 2ull * UB_NRANKS * slot_bytes;
}
__device__ __forceinline__ u32* bulk_count_word(char* area, u64 slot_bytes, bool send, int peer) {
  return (u32*)bulk_part(area, slot_bytes) + (send ? 0 : UB_MAX_RANKS) + peer;
}
__device__ __forceinline__ u32* arrivals_word(char* area, u64 slot_bytes, bool send, int peer) {
  return (u32*)bulk_part(area, slot_bytes) + (send ? 3 : 2) * UB_MAX_RANKS + peer;
}
__device__ __forceinline__ u32* bulk_credit(char* area, u64 slot_bytes, int rank, u32 slot) {
  return (u32*)(bulk_part(area, slot_bytes) + UB_HEADER_BYTES) + rank * kBulkDepth + slot;
}
__device__ __forceinline__ char* bulk_flag(char* area, u64 slot_bytes, int src, u32 slot) {
  return bulk_part(area, slot_bytes) + UB_HEADER_BYTES + 4ull * UB_MAX_RANKS * kBulkDepth +
         16ull * (src * kBulkDepth + slot);
}
__device__ __forceinline__ char* verdict_line(char* area, u64 slot_bytes, int src, u32 entry) {
  return bulk_part(area, slot_bytes) + UB_HEADER_BYTES + 20ull * UB_MAX_RANKS * kBulkDepth +
         16ull * (src * UB_P2P_MAX_ENTRIES + entry);
}
__device__ __forceinline__ char* bulk_slot(char* area, u64 slot_bytes, int src, u32 slot) {
  return bulk_part(area, slot_bytes) + UB_HEADER_BYTES + 20ull * UB_MAX_RANKS * kBulkDepth +
         16ull * UB_MAX_RANKS * UB_P2P_MAX_ENTRIES + kBulkChunk * (src * kBulkDepth + slot);
}

// Thread 0 waits for the LL line at p to carry flag f (ll_wait; then, with `acquire`, a
// fence, so that the block's later loads see what the writer stored before the line);
// every thread gets its data and whether it came (false: the wait gave up).
__device__ bool block_wait(const char* p, u32 f, int from, bool acquire, u64& data, WaitCtx& c) {
  __shared__ u64 seen;
  __shared__ bool arrived;
  if (threadIdx.x == 0) {
    u64 v = 0;
    arrived = ll_wait(p, f, v, c, from);
    if (arrived && acquire) fence_acq_rel_sys();
    seen = v;
  }
  __syncthreads();
  const bool ok = arrived;
  data = seen;
  __syncthreads();  // every thread has read the shared words before thread 0's next wait
  return ok;
}

// Block 0's verdict on the header of the message that starts at the pair's count k (thread
// 0): its count, and whether the message may be written (bit 63), as an LL line of flag
// k + 1 (one line per entry of the group: a later message of the launch never overwrites
// a verdict another block has yet to hear).
__device__ __forceinline__ void tell(char* verdict, u64 got, bool write, u32 k) {
  ll_store(verdict, got | (u64)write << 63, k + 1u);
}

// The other blocks of the group hear the verdict on the message that starts at count k:
// `got` and `write` (which it only clears); false if the wait gave up.
__device__ bool heard(char* verdict, u32 k, int from, u64& got, bool& write, WaitCtx& c) {
  u64 told;
  if (!block_wait(verdict, k + 1u, from, false, told, c)) return c.failed = true, false;
  got = told & ~(1ull << 63);
  write = write && (told >> 63) != 0u;
  return true;
}

// Bytes [16 * i, 16 * i + 16) of an array of n bytes at a (fewer at its end: the rest
// zero); one 16-byte load where it is whole and aligned, else as two LL lines' loads.
__device__ __forceinline__ uint4 load_vec(const char* a, u64 i, u64 n) {
  const char* p = a + 16 * i;
  if (16 * i + 16 <= n && ((u64)p & 15u) == 0u) return ld_weak(p);
  const u64 lo = load_line(a, 2 * i, n), hi = load_line(a, 2 * i + 1, n);
  return make_uint4((u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32));
}

// Stores the bytes of v that fall in [16 * i, 16 * i + 16) of an array of n bytes at a.
__device__ __forceinline__ void store_vec(char* a, u64 i, u64 n, const uint4& v) {
  char* p = a + 16 * i;
  if (16 * i + 16 <= n && ((u64)p & 15u) == 0u) {
    st_weak(p, v);
    return;
  }
  store_line(a, 2 * i, n, (u64)v.x | (u64)v.y << 32);
  store_line(a, 2 * i + 1, n, (u64)v.z | (u64)v.w << 32);
}

// Copies the len bytes (at most a chunk) that load(i) gives as vector i to store(i, v):
// the thread's vectors threadIdx.x + r * UB_P2P_THREADS, all its loads issued before its
// first store (their latencies overlap).
template <class Load, class Store>
__device__ __forceinline__ void copy_chunk(u64 len, Load load, Store store) {
  const u64 vecs = (len + 15) / 16;
  uint4 v[kChunkVecsPerThread];
#pragma unroll
  for (u32 r = 0; r < kChunkVecsPerThread; ++r) {
    const u64 i = threadIdx.x + (u64)r * UB_P2P_THREADS;
    if (i < vecs) v[r] = load(i);
  }
#pragma unroll
  for (u32 r = 0; r < kChunkVecsPerThread; ++r) {
    const u64 i = threadIdx.x + (u64)r * UB_P2P_THREADS;
    if (i < vecs) store(i, v[r]);
  }
}

// Block ln.j's chunks of the n bytes at x (a bulk message, header `header`) to rank `to`,
// the pair's chunks q, q + 1, ... (peer_area: the pair's area in rank `to`'s segment).
// False if a credit's wait gave up (the block then stops sending).
__device__ bool send_bulk(char* mine, char* peer_area, u64 slot_bytes, int rank, int to, const char* x, u64 n,
                          u64 header, u32 q, Lane ln, WaitCtx& c) {
  const u32 chunks = bulk_chunks(n);
  for (u32 i = ln.j; i < chunks; i += ln.blocks) {
    const u32 s = q + i, slot = s % kBulkDepth;
    bool ok = true;
    if (threadIdx.x == 0) ok = wait_flag(bulk_credit(mine, slot_bytes, to, slot), s + 1u - kBulkDepth, c, to,
                                         kSiteP2PCredit);
    if (!__syncthreads_and(ok)) {
      c.failed = true;
      return false;
    }
    char* dst = bulk_slot(peer_area, slot_bytes, rank, slot);
    const u64 base = (u64)i * kBulkChunk, len = min(kBulkChunk, n - base);
    copy_chunk(len, [&](u64 v) { return load_vec(x + base, v, len); },
               [&](u64 v, const uint4& d) { st_weak(dst + 16 * v, d); });
    __syncthreads();  // the chunk stored: its flag line after a system-scope fence
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      ll_store(bulk_flag(peer_area, slot_bytes, rank, slot), header, s + 1u);
    }
  }
  return true;
}

// Block ln.j's chunks of a bulk message of n bytes from rank `from` (the pair's chunks q,
// q + 1, ...) into out, written where `write` and each chunk's header is `header`; all-ones
// bytes into this block's chunks from the one whose wait gave up on (where `write`).
// from_area: this pair's area in rank `from`'s segment (its credits).
__device__ bool recv_bulk(char* mine, char* from_area, u64 slot_bytes, int rank, int from, char* out, u64 n,
                          u64 header, bool write, u32 q, Lane ln, WaitCtx& c) {
  const u32 chunks = bulk_chunks(n);
  for (u32 i = ln.j; i < chunks; i += ln.blocks) {
    const u32 s = q + i, slot = s % kBulkDepth;
    u64 seen;  // the flag line seen: the chunk's data after it (acquire)
    const bool ok = block_wait(bulk_flag(mine, slot_bytes, from, slot), s + 1u, from, true, seen, c);
    const bool same = seen == header;
    if (!ok) {
      c.failed = true;
      for (u32 r = i; write && r < chunks; r += ln.blocks) {
        const u64 base = (u64)r * kBulkChunk, len = min(kBulkChunk, n - base);
        for (u64 v = threadIdx.x; v < (len + 15) / 16; v += blockDim.x) {
          store_vec(out + base, v, len, make_uint4(~0u, ~0u, ~0u, ~0u));
        }
      }
      return false;
    }
    const char* src = bulk_slot(mine, slot_bytes, from, slot);
    const u64 base = (u64)i * kBulkChunk, len = min(kBulkChunk, n - base);
    if (write && same) {
      copy_chunk(len, [&](u64 v) { return ld_relaxed_sys(src + 16 * v); },
                 [&](u64 v, const uint4& d) { store_vec(out + base, v, len, d); });
    }
    __syncthreads();  // every vector of the chunk read: the sender may reuse its slot
    if (threadIdx.x == 0) st_release_sys(bulk_credit(from_area, slot_bytes, rank, slot), s + 1u);
  }
  return true;
}

// The end of a group's block: the last of the group's blocks to arrive (a lone block: at
// once, no atomic on the LL form's path) stores the pair's counts (every block read them
// at its start) into k_word and q_word, clears the arrivals for the next launch and
// returns true. Thread 0, after the block's last access of the pair's buffers.
__device__ __forceinline__ bool arrive(u32* arrivals, u32* k_word, u32* q_word, const Count& ct, Lane ln) {
  if (ln.blocks > 1) {
    __threadfence();
    if (atomicAdd(arrivals, 1u) != ln.blocks - 1u) return false;
    *(volatile u32*)arrivals = 0u;
  }
  *(volatile u32*)k_word = ct.k;
  *(volatile u32*)q_word = ct.q;
  return true;
}
