// Point-to-point on the pool: send/recv and their batches (ub_p2p), and the all-to-all with
// split counts in device memory (ub_p2p_alltoallv), in LL lines (ll_lines.cuh) or, from
// UB_P2P_BULK_MIN_BYTES on, in flagged chunks of 16-byte vectors (p2p_bulk.cuh).
// Sentinel-free, no barrier: only the two ranks of a pair take part in the pair's messages.
//
// Matching rule, per ordered pair (NCCL's): the k-th message rank a sends rank b is the k-th
// message rank b receives from rank a. Each rank counts, in its own part of the area, the
// messages it sent to each rank (sent[d]) and received from each rank (recvd[s]); a message
// of more than UB_LL_MAX_BYTES travels as several, one per chunk, each counted. Message k of
// a pair travels in buffer k % 2 of the pair's slot in the receiver's area, in lines with
// flag k + 1 (never 0 before the count wraps; the area starts zeroed), after a header line
// carrying the call's signature (ubnext._protocol.signature: what is sent and how many bytes
// in all), which the receiver compares with its own before it writes anything.
//
// Credits: before it stores message k into buffer k % 2 of rank b, rank a waits until b has
// read message k - 2 out of that buffer: b stores k - 1 into credit[b][k % 2] of a's area
// (release, system scope) after it has read every line of message k - 2. So up to two
// messages of a pair are in flight before their receive is posted; a third send waits
// (bounded) for the receiver.
//
// Bulk form (p2p_bulk.cuh): a message of at least UB_P2P_BULK_MIN_BYTES still counts as one
// message k of its pair and sends its header line (its count) in buffer k % 2 as above, with
// no data lines; its bytes travel in the pair's bulk chunks. Both ends choose the form from
// the count alone: the sender from its own, the receiver from the header's (where it
// differs from the receiver's, out is not written and the call fails, but every chunk sent
// is read: the pair stays matched).
//
// Blocks: B per group of a launch (the host's choice: gridDim.x / groups), a group being the
// entries of one kind (send, recv) and one peer, in the order the host issued them. The
// group's block 0 moves the LL lines; every block of the group moves its share of the bulk
// chunks (Lane) and counts the pair's messages and chunks from the counts it read at its
// start; the last of them to finish stores the counts (p2p_bulk.cuh: arrive). So a launch
// moves several messages of one pair in order. Every block of a launch runs at once (the
// host keeps the grid within the SMs).
//
// Area (same offset in every segment): a line of credits, u32 credit[UB_MAX_RANKS][2]
// (written by the receivers), a line of this rank's counters, u32 sent[UB_MAX_RANKS] then
// u32 recvd[UB_MAX_RANKS]; then the slots, slot (s, b) (written by rank s, buffer b) at
// 2 * UB_HEADER_BYTES + (2 * s + b) * slot_bytes: its header line, then UB_HEADER_BYTES on,
// its data lines; then the bulk part (p2p_bulk.cuh).
#include "ll_lines.cuh"
#include "p2p_bulk.cuh"
#include "transport.cuh"

constexpr u64 kCountMask = (1ull << UB_SIG_COUNT_BITS) - 1ull;
// the count a sender puts in its header when its own splits were invalid (it sends no data)
constexpr u64 kInvalidCount = kCountMask;

// One launch's entries (ub_p2p): per entry two words, its local address, and its byte count
// (bits 0..47) | peer << 48 | kind << 56 (1: send, 0: recv). Entries of one group are
// adjacent, groups in any order.
struct P2PWork {
  u64 w[2 * UB_P2P_MAX_ENTRIES];
};

struct P2PArea {
  char* mine;  // this rank's area
  u64 off;     // the area's offset in every segment
  u64 slot_bytes;
};

__device__ __forceinline__ u32* credit_word(char* area, int rank, u32 parity) {
  return (u32*)(area) + 2 * rank + parity;
}
__device__ __forceinline__ u32* sent_word(char* area, int peer) { return (u32*)(area + UB_HEADER_BYTES) + peer; }
__device__ __forceinline__ u32* recvd_word(char* area, int peer) {
  return (u32*)(area + UB_HEADER_BYTES) + UB_MAX_RANKS + peer;
}
// The slot that rank `src` writes in an area at `area`, for message k.
__device__ __forceinline__ char* slot_of(char* area, u64 slot_bytes, int src, u32 k) {
  return area + 2 * UB_HEADER_BYTES + (2ull * src + (k & 1u)) * slot_bytes;
}
// Chunks of a message of n bytes (an empty message is one chunk: its header).
__device__ __forceinline__ u32 chunks_of(u64 n) { return n == 0 ? 1u : (u32)((n + UB_LL_MAX_BYTES - 1) / UB_LL_MAX_BYTES); }

// Whether a message of n bytes takes the bulk form (an invalid count never does).
__device__ __forceinline__ bool bulk(u64 n) { return n != kInvalidCount && n >= UB_P2P_BULK_MIN_BYTES; }

// Bytes of a message of n bytes that travel in LL lines: none for an invalid count or the
// bulk form (its header only).
__device__ __forceinline__ u64 lined(u64 n) { return n == kInvalidCount || bulk(n) ? 0 : n; }

// Block 0 of a group sends the LL part of message n bytes at x to rank `to` as the pair's
// messages k, k + 1, ... with header `head | n` (a bulk message: the header alone); returns
// the next k. Thread 0 waits for each chunk's credit, the block stores the lines. On a
// failed wait the block stops sending (the receiver's waits then give up: the mark travels
// to every rank).
template <class Tp>
__device__ u32 send_lines(const Tp& tp, const P2PArea& a, int to, const char* x, u64 n, u64 head, u32 k,
                          WaitCtx& c) {
  const u32 chunks = chunks_of(lined(n));
  for (u32 ch = 0; ch < chunks; ++ch, ++k) {
    bool ok = true;
    if (threadIdx.x == 0) {
      ok = wait_flag(credit_word(a.mine, to, k & 1u), k - 1u, c, to, kSiteP2PCredit);
    }
    if (!__syncthreads_and(ok)) {
      c.failed = true;
      return k;
    }
    char* slot = slot_of(tp.seg(to) + a.off, a.slot_bytes, tp.rank, k);
    const u64 base = (u64)ch * UB_LL_MAX_BYTES;
    const u64 len = min((u64)UB_LL_MAX_BYTES, lined(n) - base);
    if (threadIdx.x == 0) ll_store(slot, head | n, k + 1u);
    for (u64 i = threadIdx.x; i < (len + 7) / 8; i += blockDim.x) {
      ll_store(slot + UB_HEADER_BYTES + 16 * i, load_line(x + base, i, len), k + 1u);
    }
  }
  return k;
}

// The block's part of sending message n bytes at x to rank `to`: block 0 its LL lines
// (send_lines), every block its share of a bulk message's chunks; advances ct.
template <class Tp>
__device__ void send_message(const Tp& tp, const P2PArea& a, int to, const char* x, u64 n, u64 head, Count& ct,
                             Lane ln, WaitCtx& c) {
  if (ln.j == 0) {
    ct.k = send_lines(tp, a, to, x, n, head, ct.k, c);
  } else {
    ct.k += chunks_of(lined(n));
  }
  if (!bulk(n)) return;
  send_bulk(a.mine, tp.seg(to) + a.off, a.slot_bytes, tp.rank, to, x, n, head | n, ct.q, ln, c);
  ct.q += bulk_chunks(n);
}

// What a receiver checks in a header: `head | want` expected (want: bytes), or with
// `any_count` any count of head's call (ub_p2p_alltoallv compares counts itself).
struct Expect {
  u64 head;
  u64 want;
  bool any_count;
};

// Block 0 of a group receives the LL part of the pair's messages k, k + 1, ... from rank
// `from` into the `cap` bytes at out; returns the next k and, in `got`, the count the
// sender's header carried (kInvalidCount: the sender sent nothing), and in `write` whether
// the message's bytes may be written (its bulk chunks: recv_message). It follows the
// sender's chunks whatever its count, so both ends stay matched; it writes data only where
// the header is as expected and within cap (a header of another call fails the
// communicator: kFailMismatch), all-ones bytes where a wait gave up. Thread 0 stores each
// chunk's credit once the block has read it, and where the group has other blocks, the
// header's verdict into `verdict` (tell).
template <class Tp>
__device__ u32 recv_lines(const Tp& tp, const P2PArea& a, int from, char* out, u64 cap, const Expect& e,
                          bool& write, u32 k, u64& got, char* verdict, WaitCtx& c) {
  u32 chunks = 1;
  got = 0;
  for (u32 ch = 0; ch < chunks; ++ch, ++k) {
    const char* slot = slot_of(a.mine, a.slot_bytes, from, k);
    u64 h;
    if (!block_wait(slot, k + 1u, from, false, h, c)) {  // the header never came: poison what it would have written
      c.failed = true;
      if (write && ch == 0) {
        for (u64 i = threadIdx.x; i < (cap + 7) / 8; i += blockDim.x) store_line(out, i, cap, ~0ull);
      }
      return k;
    }
    if (ch == 0) {
      got = h & kCountMask;
      chunks = chunks_of(lined(got));
      const bool same = (h & ~kCountMask) == e.head && (e.any_count || got == e.want);
      if (!same && threadIdx.x == 0) fail(c, kFailMismatch, from, 0, e.head | e.want, h);
      write = write && same && got == e.want;
      if (verdict != nullptr && threadIdx.x == 0) tell(verdict, got, write, k);
    }
    const u64 base = (u64)ch * UB_LL_MAX_BYTES;
    const u64 len = min((u64)UB_LL_MAX_BYTES, lined(got) - base);
    for (u64 i = threadIdx.x; i < (len + 7) / 8; i += blockDim.x) {
      u64 v = 0;
      if (!ll_wait(slot + UB_HEADER_BYTES + 16 * i, k + 1u, v, c, from)) v = ~0ull;
      if (write) store_line(out + base, i, len, v);
    }
    __syncthreads();  // every line of the chunk read: the sender may reuse its buffer
    if (threadIdx.x == 0) st_release_sys(credit_word(tp.seg(from) + a.off, tp.rank, k & 1u), k + 1u);
  }
  return k;
}

// The block's part of receiving the pair's next message, its group's entry `entry`, from
// rank `from` into the `cap` bytes at out (recv_lines' arguments): block 0 its LL lines,
// the other blocks the header's verdict from block 0 (heard), then every block its share of
// a bulk message's chunks, of the count the header carried (the sender's: every chunk it
// sends is read, even where out is not written). Advances ct; `got`: the header's count.
template <class Tp>
__device__ void recv_message(const Tp& tp, const P2PArea& a, int from, char* out, u64 cap, const Expect& e,
                             bool write, u32 entry, Count& ct, u64& got, Lane ln, WaitCtx& c) {
  char* verdict = ln.blocks > 1 ? verdict_line(a.mine, a.slot_bytes, from, entry) : nullptr;
  if (ln.j == 0) {
    ct.k = recv_lines(tp, a, from, out, cap, e, write, ct.k, got, verdict, c);
  } else {
    if (!heard(verdict, ct.k, from, got, write, c)) return;
    ct.k += chunks_of(lined(got));
  }
  if (!bulk(got)) return;
  recv_bulk(a.mine, tp.seg(from) + a.off, a.slot_bytes, tp.rank, from, out, got, e.head | cap, write, ct.q, ln, c);
  ct.q += bulk_chunks(got);
}

// The first and last entry of group g (entries of one kind and peer are adjacent).
__device__ void group_range(const P2PWork& w, u32 n, u32 g, u32& first, u32& last) {
  first = 0;
  for (u32 e = 1, seen = 0; e < n && seen < g; ++e) {
    if ((w.w[2 * e + 1] >> 48) != (w.w[2 * e - 1] >> 48)) {
      ++seen;
      first = e;
    }
  }
  last = first + 1;
  while (last < n && (w.w[2 * last + 1] >> 48) == (w.w[2 * first + 1] >> 48)) ++last;
}

// Groups of a launch's n entries.
__device__ u32 group_count(const P2PWork& w, u32 n) {
  u32 groups = 1;
  for (u32 e = 1; e < n; ++e) groups += (w.w[2 * e + 1] >> 48) != (w.w[2 * e - 1] >> 48);
  return groups;
}

// The pair's counts at a block's start: its message count and its chunk count.
__device__ __forceinline__ Count counts_at_start(const P2PArea& a, bool send, int peer) {
  u32* counter = send ? sent_word(a.mine, peer) : recvd_word(a.mine, peer);
  return Count{ld_volatile_u32(counter), ld_volatile_u32(bulk_count_word(a.mine, a.slot_bytes, send, peer))};
}

// A block's end (thread 0, after the block's last access): the group's last block stores
// the pair's counts (arrive); returns whether this block was that one.
__device__ __forceinline__ bool counts_at_end(const P2PArea& a, bool send, int peer, const Count& ct, Lane ln) {
  return arrive(arrivals_word(a.mine, a.slot_bytes, send, peer),
                send ? sent_word(a.mine, peer) : recvd_word(a.mine, peer),
                bulk_count_word(a.mine, a.slot_bytes, send, peer), ct, ln);
}

// Batch of sends and receives: the blocks of group g (gridDim.x / groups of them) run group
// g's entries in order.
template <class Tp>
__device__ void p2p_batch(const Tp& tp, const P2PArea& a, u32 n, u64 head, const P2PWork& w, WaitCtx& c) {
  const u32 blocks = gridDim.x / group_count(w, n);
  const Lane ln{blockIdx.x % blocks, blocks};
  u32 first, last;
  group_range(w, n, blockIdx.x / blocks, first, last);
  const u64 word = w.w[2 * first + 1];
  const int peer = (int)(word >> 48 & 0xffu);
  const bool send = (word >> 56) != 0u;
  Count ct = counts_at_start(a, send, peer);
  for (u32 e = first; e < last; ++e) {
    const u64 n_bytes = w.w[2 * e + 1] & ((1ull << 48) - 1ull);
    char* p = (char*)w.w[2 * e];
    if (send) {
      send_message(tp, a, peer, p, n_bytes, head, ct, ln, c);
    } else {
      u64 got;
      recv_message(tp, a, peer, p, n_bytes, Expect{head, n_bytes, false}, true, e - first, ct, got, ln, c);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) counts_at_end(a, send, peer, ct, ln);
}

// One rank's split counts in device memory: `width`-byte signed ints (4: int32, 8: int64),
// one per rank. Each array has its own width: a caller may hold in_splits as int64 and
// out_splits as int32 (torch.tensor's default and an explicit dtype).
struct Splits {
  const void* p;
  u64 width;
};

// The split count of rank r, sign-extended.
__device__ __forceinline__ long long split_at(const Splits& s, int r) {
  return s.width == 4 ? (long long)((const int*)s.p)[r] : ((const long long*)s.p)[r];
}

// Whether N counts are non-negative and sum to at most `bound`; the rows before rank r in
// `start`; where they do not, the first rank whose count is negative or takes the running
// sum past `bound` in `bad`, its count in `value` (what the host's SplitError names).
template <int N>
__device__ bool splits_fit(const Splits& s, long long bound, int r, long long& start, int& bad, long long& value) {
  long long sum = 0;
  start = 0;
  bad = -1;
  value = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const long long v = split_at(s, j);
    if (j == r) start = sum;
    if (bad < 0 && (v < 0 || v > bound - sum)) {
      bad = j;
      value = v;
    }
    if (bad < 0) sum += v;
  }
  return bad < 0;
}

// All-to-all with device splits: the blocks of group g < N (gridDim.x / 2N of them) send
// part peer(g) of x, those of group N + g receive from peer(g). A sender whose in_splits
// are invalid sends only a header marking it (kInvalidCount); a receiver whose out_splits
// are invalid, or whose count differs from the sender's, reads the sender's chunks and
// writes nothing. Each reports kFailInput after its messages (the last of its group's
// blocks to finish), so that every pair's messages still travel: kSplitBadIn, kSplitBadOut (the block
// of its own pair, once; the first rank whose count is wrong, and that count),
// kSplitDisagree (where rank `peer` sent another count: the rank, the count in rows).
template <int N, class Tp>
__device__ void p2p_alltoallv(const Tp& tp, const P2PArea& a, const char* x, char* out, u64 x_rows, u64 out_rows,
                              u64 row_bytes, const Splits& ins, const Splits& outs, u64 head, WaitCtx& c) {
  const u32 blocks = gridDim.x / (2 * N);
  const Lane ln{blockIdx.x % blocks, blocks};
  const u32 g = blockIdx.x / blocks;
  const bool send = g < N;
  const int peer = tp.peer((int)(g % N));
  long long start, value;
  int bad;
  Count ct = counts_at_start(a, send, peer);
  if (send) {
    const bool fits = splits_fit<N>(ins, (long long)x_rows, peer, start, bad, value);
    const u64 n = fits ? (u64)split_at(ins, peer) * row_bytes : kInvalidCount;
    send_message(tp, a, peer, x + (fits ? (u64)start * row_bytes : 0), n, head, ct, ln, c);
    __syncthreads();
    if (threadIdx.x == 0) {
      const bool last = counts_at_end(a, send, peer, ct, ln);
      if (!fits && peer == tp.rank && last) fail(c, kFailInput, peer, kSplitBadIn, (u64)bad, (u64)value);
    }
  } else {
    const bool fits = splits_fit<N>(outs, (long long)out_rows, peer, start, bad, value);
    const u64 want = fits ? (u64)split_at(outs, peer) * row_bytes : 0;
    u64 got;
    recv_message(tp, a, peer, out + (fits ? (u64)start * row_bytes : 0), want, Expect{head, want, true}, fits, 0u,
                 ct, got, ln, c);
    __syncthreads();
    if (threadIdx.x == 0) {
      const bool last = counts_at_end(a, send, peer, ct, ln);
      if (!fits && peer == tp.rank && last) fail(c, kFailInput, peer, kSplitBadOut, (u64)bad, (u64)value);
      if (last && fits && got != kInvalidCount && got != want && !c.failed) {
        fail(c, kFailInput, peer, kSplitDisagree, (u64)peer, row_bytes ? got / row_bytes : got);
      }
    }
  }
}

// ---- entry points -------------------------------------------------------------------
// Instantiated per UB_NRANKS (unicast transport): they move bytes, whatever the dtype.
// ub_p2p's work is its last parameter: the host packs its words after the others.

extern "C" __global__ void __launch_bounds__(UB_P2P_THREADS)
ub_p2p(char* base, u64 stride, int rank, char* mc, u64 area_off, u64 slot_bytes, LaunchState* state, u64 n,
       u64 head, const __grid_constant__ P2PWork work) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const P2PArea a{tp.seg(rank) + area_off, area_off, slot_bytes};
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, rank);
  p2p_batch(tp, a, (u32)n, head, work, c);
  finish_launch(c, l, 0u);
}

extern "C" __global__ void __launch_bounds__(UB_P2P_THREADS)
ub_p2p_alltoallv(char* base, u64 stride, int rank, char* mc, u64 area_off, u64 slot_bytes, LaunchState* state,
                 const char* x, char* out, u64 x_rows, u64 out_rows, u64 row_bytes, const void* in_splits,
                 u64 in_width, const void* out_splits, u64 out_width, u64 head) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  const P2PArea a{tp.seg(rank) + area_off, area_off, slot_bytes};
  const LaunchView l = read_launch_state(state);
  WaitCtx c = wait_ctx(state, rank);
  p2p_alltoallv<UB_NRANKS>(tp, a, x, out, x_rows, out_rows, row_bytes, Splits{in_splits, in_width},
                           Splits{out_splits, out_width}, head, c);
  finish_launch(c, l, 0u);
}
