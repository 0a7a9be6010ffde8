// Low-latency data movers: the all-to-all of even parts and the broadcast, for small
// messages. Pushed lines, polled by the receiver; no sentinel and no barrier, so every byte
// arrives as it was sent (-0.0, NaN payloads, every integer pattern).
//
// LL lines (ll_lines.cuh): 8 data bytes and the launch's flag (its epoch + 1) per 16-byte
// line. Every rank stores its call signature in the header line of its slot of every rank's
// buffer, and polls every rank's header of its own buffer (comparing it with its own
// signature) before it uses any data.
//
// Two buffers, used by epoch parity: a peer can be at most one launch ahead (its launch
// completes only once this rank's header of that launch has arrived, which this rank
// pushes only once its previous launch has completed), so while this launch reads buffer
// e % 2, peers may push into (e + 1) % 2 only. Lines of older launches carry older flags.
//
// Layout of the set (same offset in every segment): buffer b at set_off + b * N * slot_bytes;
// slot s (written by rank s) at + s * slot_bytes: its header line, then UB_HEADER_BYTES on,
// its data lines.
#include "ll_lines.cuh"
#include "transport.cuh"

// What a launch reads first: its flag and the buffer of its parity.
struct LLLaunch {
  LaunchView s;
  u32 flag;
  u64 buf;  // offset of this launch's buffer
};
template <int N> __device__ LLLaunch ll_begin(LaunchState* state, u64 set_off, u64 slot_bytes) {
  LLLaunch l;
  l.s = read_launch_state(state);
  l.flag = l.s.epoch + 1u;
  l.buf = set_off + (u64)(l.s.epoch & 1u) * N * slot_bytes;
  return l;
}

// Block 0's thread 0 stores this rank's signature in the header line of slot [rank] of
// every rank's buffer, before any data leaves.
template <int N, class Tp> __device__ void ll_push_signature(const Tp& tp, const LLLaunch& l, u64 slot_bytes, u64 sig) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
#pragma unroll
  for (int k = 0; k < N; ++k) ll_store(tp.seg(tp.peer(k)) + l.buf + (u64)tp.rank * slot_bytes, sig, l.flag);
}

// Every block calls it before it uses pushed data: thread r < N waits for rank r's header
// line in this rank's buffer and compares the signature with `sig` (a difference fails the
// communicator: kFailMismatch); then the block votes. True in every thread if every rank
// arrived and called alike.
template <int N> __device__ bool ll_agree(const char* mine, const LLLaunch& l, u64 slot_bytes, u64 sig, WaitCtx& c) {
  bool ok = true;
  const int t = threadIdx.x;
  if (t < N) {
    u64 theirs = 0;
    ok = ll_wait(mine + l.buf + (u64)t * slot_bytes, l.flag, theirs, c, t);
    if (ok && theirs != sig) {
      fail(c, kFailMismatch, t, 0, sig, theirs);
      ok = false;
    }
  }
  ok = __syncthreads_and(ok);
  c.failed |= !ok;
  return ok;
}

// Receives `lines` lines of slot [src] of this rank's buffer into the n bytes at `out`
// (thread-strided over the grid from `first`); all-ones bytes where a wait gave up.
__device__ void ll_receive(const char* slot, u32 f, char* out, u64 n, u64 lines, u64 first, u64 step,
                           WaitCtx& c, int src) {
  for (u64 i = first; i < lines; i += step) {
    u64 v = 0;
    if (!ll_wait(slot + UB_HEADER_BYTES + 16 * i, f, v, c, src)) v = ~0ull;
    store_line(out, i, n, v);
  }
}

// All-to-all of even parts: part d of x (`part` bytes, at x + d * part) to rank d, which
// stores what rank s sent at out + s * part. Lines are spread over the grid, peers first
// in peer() order so that the ranks' traffic spreads over the links.
template <int N, class Tp>
__device__ void ll_alltoall(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x, char* out, u64 part,
                            u64 sig, LaunchState* state) {
  const LLLaunch l = ll_begin<N>(state, set_off, slot_bytes);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u64 lines = (part + 7) / 8;
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)blockDim.x * gridDim.x;
  ll_push_signature<N>(tp, l, slot_bytes, sig);
  for (u64 i = first; i < N * lines; i += step) {
    const int d = tp.peer((int)(i / lines));
    const u64 li = i % lines;
    ll_store(tp.seg(d) + l.buf + (u64)tp.rank * slot_bytes + UB_HEADER_BYTES + 16 * li,
             load_line(x + (u64)d * part, li, part), l.flag);
  }
  const char* mine = tp.seg(tp.rank);
  const bool agreed = ll_agree<N>(mine, l, slot_bytes, sig, c);
  for (u64 i = first; i < N * lines; i += step) {
    const int s = tp.peer((int)(i / lines));
    const u64 li = i % lines;
    u64 v = ~0ull;
    if (agreed && !ll_wait(mine + l.buf + (u64)s * slot_bytes + UB_HEADER_BYTES + 16 * li, l.flag, v, c, s)) v = ~0ull;
    store_line(out + (u64)s * part, li, part, v);
  }
  finish_launch(c, l.s, 0u);
}

// Broadcast of the root's n bytes: the root pushes every line into slot [root] of every
// other rank's buffer and copies x to out itself (unless they are one array); the others
// receive. Every rank pushes its header to every rank and waits for every rank's, so that
// the root runs at most one launch ahead of the slowest rank (see the top).
template <int N, class Tp>
__device__ void ll_broadcast(const Tp& tp, u64 set_off, u64 slot_bytes, const char* x, char* out, u64 n,
                             int root, u64 sig, LaunchState* state) {
  const LLLaunch l = ll_begin<N>(state, set_off, slot_bytes);
  WaitCtx c = wait_ctx(state, tp.rank);
  const u64 lines = (n + 7) / 8;
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)blockDim.x * gridDim.x;
  ll_push_signature<N>(tp, l, slot_bytes, sig);
  if (tp.rank == root) {
    for (u64 i = first; i < (N - 1) * lines; i += step) {
      const int d = tp.peer(1 + (int)(i / lines));
      const u64 li = i % lines;
      ll_store(tp.seg(d) + l.buf + (u64)root * slot_bytes + UB_HEADER_BYTES + 16 * li, load_line(x, li, n), l.flag);
    }
  }
  const char* mine = tp.seg(tp.rank);
  const bool agreed = ll_agree<N>(mine, l, slot_bytes, sig, c);
  if (tp.rank == root) {
    if (x != out) {
      for (u64 i = first; i < lines; i += step) store_line(out, i, n, agreed ? load_line(x, i, n) : ~0ull);
    }
  } else if (agreed) {
    ll_receive(mine + l.buf + (u64)root * slot_bytes, l.flag, out, n, lines, first, step, c, root);
  } else {
    for (u64 i = first; i < lines; i += step) store_line(out, i, n, ~0ull);
  }
  finish_launch(c, l.s, 0u);
}

// ---- entry points -------------------------------------------------------------------
// Instantiated per (UB_NRANKS, UB_TRANSPORT): they move bytes, whatever the dtype.

extern "C" __global__ void __launch_bounds__(UB_LL_MOVE_THREADS)
ub_ll_alltoall(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 slot_bytes,
               const char* x, char* out, u64 part, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  ll_alltoall<UB_NRANKS>(tp, set_off, slot_bytes, x, out, part, sig, state);
}

extern "C" __global__ void __launch_bounds__(UB_LL_MOVE_THREADS)
ub_ll_broadcast(char* base, u64 stride, int rank, char* mc, u64 set_off, u64 slot_bytes,
                const char* x, char* out, u64 n, u64 root, u64 sig, LaunchState* state) {
  enter_launch(state);
  const UB_TRANSPORT<UB_NRANKS> tp{base, stride, rank, mc};
  ll_broadcast<UB_NRANKS>(tp, set_off, slot_bytes, x, out, n, (int)root, sig, state);
}
