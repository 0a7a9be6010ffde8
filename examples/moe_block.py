"""A mixture-of-experts block over the GPUs of one node with ubnext.torch.moe: a router
(a Linear to the experts' logits, softmax, top-k), dispatch, the experts as per-expert
GEMMs over the padded [local experts, capacity, hidden] layout, combine. Each rank holds
its own experts; the router is replicated. Checks its forward and backward against a
single-process reference of the same model (``reference``: every expert on one process,
no communication), then times eager, torch.compile(fullgraph) and CUDA-graph steps.

    python examples/moe_block.py                     # 1 rank
    mpirun -n 4 python examples/moe_block.py         # or torchrun --nproc-per-node 4
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ubnext
import ubnext.torch as ut


def make_weights(num_experts: int, hidden: int, ffn: int, seed: int = 0) -> dict:
    """Every expert's weights and the router's, the same on every rank (seeded, float32 on
    the host): ``router`` [E, H], ``w1`` [E, H, F], ``w2`` [E, F, H]."""
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(num_experts, hidden, generator=g) / hidden ** 0.5,
            "w1": torch.randn(num_experts, hidden, ffn, generator=g) / hidden ** 0.5,
            "w2": torch.randn(num_experts, ffn, hidden, generator=g) / ffn ** 0.5}


def placed(weights: dict, dtype, device) -> dict:
    """Copies of ``weights`` on ``device``: the router in float32, the experts' in ``dtype``."""
    return {k: w.to(device, torch.float32 if k == "router" else dtype, copy=True) for k, w in weights.items()}


def route(x, router, top_k: int):
    """The router: fp32 logits, softmax over the experts, the top-k (ids as int32 and
    their probabilities as the weights, differentiable)."""
    probs = torch.softmax(x.float() @ router.t(), dim=-1)
    weights, idx = probs.topk(top_k, dim=-1)
    return idx.to(torch.int32), weights


def expert_mlp(x, w1, w2):
    """An expert: silu(x @ w1) @ w2 (batched over experts where x, w1, w2 are 3-D)."""
    return torch.matmul(F.silu(torch.matmul(x, w1)), w2)


class MoEBlock(nn.Module):
    """Router, dispatch, this rank's experts, combine: ``forward(x [T, H]) -> [T, H]``.

    Args:
        ep: the ``ubnext.ExpertParallel`` (framework="torch"): E, H, top-k, dtype.
        weights: ``make_weights``'s (this rank keeps its experts' ``w1``, ``w2``).
        device: its device (the communicator's).
    """

    def __init__(self, ep, weights: dict, device):
        super().__init__()
        s, rank = ep.shape, ep.comm.rank
        mine = slice(rank * s.local_experts, (rank + 1) * s.local_experts)
        self.ep, self.top_k = ep, s.top_k
        w = placed(weights, getattr(torch, s.dtype), device)
        self.router = nn.Parameter(w["router"])
        self.w1, self.w2 = nn.Parameter(w["w1"][mine].clone()), nn.Parameter(w["w2"][mine].clone())

    def experts(self, recv_x, recv_counts):
        """The local experts over their padded rows (one batched GEMM per layer), rows past
        each expert's count zero."""
        y = expert_mlp(recv_x, self.w1, self.w2)
        rows = torch.arange(y.shape[1], device=y.device) < recv_counts[:, None]
        return torch.where(rows[..., None], y, y.new_zeros(()))

    def forward(self, x):
        idx, weights = route(x, self.router, self.top_k)
        recv_x, recv_counts, handle = ut.moe.dispatch(x, idx, weights, self.ep)
        return ut.moe.combine(self.experts(recv_x, recv_counts), handle)


def reference(xs: list, router, w1, w2, top_k: int) -> list:
    """The same model on one process: every rank's tokens ``xs`` (each routed by the
    router alone, as on its rank), every expert's rows multiplied there, each token's
    experts' outputs summed in fp32 with its weights. Returns each rank's output."""
    outs = []
    for x in xs:
        idx, weights = route(x, router, top_k)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w1.shape[0]):
            t, k = (idx == e).nonzero(as_tuple=True)
            if len(t):
                out = out.index_add(0, t, weights[t, k, None] * expert_mlp(x[t], w1[e], w2[e]).float())
        outs.append(out.to(x.dtype))
    return outs


def check(block, xs: list, grads: list, weights: dict, rank: int) -> dict:
    """Forward and backward of ``block`` on this rank's tokens (``xs[rank]``, output
    gradient ``grads[rank]``), compared by ``compare``."""
    x = xs[rank].clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    out = block(x)
    out.backward(grads[rank])
    return compare(block, out, x.grad, xs, grads, weights, rank)


def compare(block, out, x_grad, xs: list, grads: list, weights: dict, rank: int) -> dict:
    """``block``'s output ``out``, x's gradient ``x_grad`` and its weights' gradients
    against ``reference`` on every rank's tokens: the largest difference of each (the
    router's gradient summed over the ranks), relative to the reference's largest
    magnitude. Collective (the router's gradient is all-reduced)."""
    s = block.ep.shape
    router_grad = block.ep.comm.all_reduce(block.router.grad.contiguous())
    leaves = {k: w.requires_grad_() for k, w in placed(weights, xs[0].dtype, xs[0].device).items()}
    ref_xs = [t.clone().requires_grad_() for t in xs]
    ref_outs = reference(ref_xs, leaves["router"], leaves["w1"], leaves["w2"], s.top_k)
    live = [(o, g) for o, g in zip(ref_outs, grads) if o.requires_grad]  # a rank without tokens has no graph
    torch.autograd.backward([o for o, _ in live], [g for _, g in live])
    mine = slice(rank * s.local_experts, (rank + 1) * s.local_experts)
    pairs = {"out": (out, ref_outs[rank]), "x.grad": (x_grad, ref_xs[rank].grad),
             "w1.grad": (block.w1.grad, leaves["w1"].grad[mine]), "w2.grad": (block.w2.grad, leaves["w2"].grad[mine]),
             "router.grad": (router_grad, leaves["router"].grad)}
    return {k: relative_error(got, want) for k, (got, want) in pairs.items()}


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (a reference without elements, or None: 0 where got
    has none either)."""
    if want is None or want.numel() == 0:  # a rank without tokens
        return 0.0 if got is None or got.numel() == 0 else float("inf")
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() / scale if scale else (got.float().abs().max().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (max_tokens)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    comm = ubnext.Communicator()
    torch.cuda.set_device(comm.device)
    device, dtype, rank = torch.device("cuda", comm.device), getattr(torch, args.dtype), comm.rank
    ep = ubnext.ExpertParallel(comm, args.experts_per_rank * comm.size, args.hidden, args.tokens, args.top_k,
                               args.dtype, framework="torch")
    weights = make_weights(ep.shape.num_experts, args.hidden, args.ffn)
    block = MoEBlock(ep, weights, device)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype) for _ in range(comm.size)]
    grads = [torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype) for _ in range(comm.size)]
    errors = check(block, xs, grads, weights, rank)
    x, grad = xs[rank].clone().requires_grad_(), grads[rank]
    compiled = torch.compile(block, fullgraph=True)

    def step(fn):
        fn(x).backward(grad)

    def timed(run) -> float:
        """Microseconds per call of ``run``, after one call (which compiles or captures)."""
        run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            run()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps * 1e6

    times = {"eager": timed(lambda: step(block)), "compiled": timed(lambda: step(compiled))}
    side = torch.cuda.Stream()  # the graph's warm-up, on a side stream as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(block)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(block)
    times["cuda graph"] = timed(graph.replay)
    if rank == 0:
        print(f"moe_block: {comm.size} ranks, {ep.shape.num_experts} experts, top-{args.top_k}, hidden {args.hidden}, "
              f"{args.tokens} tokens per rank, {args.dtype}")
        print("  rank 0 against the single-process reference (max |diff| / max |ref|): "
              + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        print("  forward + backward per step: " + ", ".join(f"{k} {v:.0f} us" for k, v in times.items()))
    comm.close()


if __name__ == "__main__":
    main()
