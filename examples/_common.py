"""What the examples share: the launcher's environment as torch.distributed expects it,
a small Llama-style model, synthetic batches, and the loss / step-time report.

Launch any example with torchrun (``torchrun --nproc-per-node N examples/ddp.py``),
mpirun (``mpirun -n N python examples/ddp.py``), srun, or plainly at 1 rank; pick the
backend with ``--backend ubnext`` (default), ``nccl`` or ``gloo``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# launcher variables -> (rank, size, local rank)
_LAUNCHERS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
              ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


def launcher_env() -> tuple[int, int, int]:
    """Sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from mpirun's or srun's
    variables where torchrun's are missing (one node: the store on 127.0.0.1; several:
    export MASTER_ADDR/MASTER_PORT), as init_process_group(env://) reads them."""
    if "RANK" not in os.environ:
        rank, size, local = next(((os.environ[r], os.environ[s], os.environ.get(lo, os.environ[r]))
                                  for r, s, lo in _LAUNCHERS if r in os.environ), ("0", "1", "0"))
        os.environ.update(RANK=rank, WORLD_SIZE=size, LOCAL_RANK=local)
        if size == "1" and "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def arguments(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", default="ubnext", help="ubnext (default), nccl or gloo")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    return p.parse_args()


def setup(args) -> tuple[int, int, torch.device]:
    """init_process_group with the backend asked for; (rank, size, this rank's device)."""
    import torch.distributed as dist

    if args.backend == "ubnext":
        import ubnext.torch  # noqa: F401 (registers the "ubnext" backend)
    rank, size, local = launcher_env()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", local % torch.cuda.device_count())  # ranks may share a GPU
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=size)
    return rank, size, device


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads  # under tensor parallelism each rank holds some of the heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        hidden = 4 * dim
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A small Llama-style decoder (RMSNorm, causal attention, SwiGLU), the same weights on
    every rank (seeded)."""

    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 2, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def batch(step: int, rank: int, device, vocab: int = 512, batch_size: int = 4, seq: int = 64):
    """This rank's batch of step ``step``: tokens and next-token targets, the same for a
    given (step, rank) on any backend and device."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class Report:
    """Prints each step's loss (averaged over the ranks) and time on rank 0, then the
    median step time; synchronizes the device before reading the clock."""

    def __init__(self, name: str, args, rank: int, size: int, device):
        self.name, self.args, self.rank, self.size, self.device = name, args, rank, size, device
        self.times: list[float] = []
        self._t0 = None
        if rank == 0:
            print(f"{name}: backend {args.backend}, {size} ranks, device {device.type}, "
                  f"torch {torch.__version__}", flush=True)

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def step(self, step: int, loss) -> None:
        import torch.distributed as dist

        self._sync()
        self.times.append(time.perf_counter() - self._t0)
        mean = loss.detach().float().reshape(1).clone()
        dist.all_reduce(mean)  # the ranks' losses, averaged (also on the backend under test)
        if self.rank == 0:
            print(f"step {step:3d}  loss {mean.item() / self.size:.6f}  {self.times[-1] * 1e3:8.2f} ms", flush=True)

    def done(self) -> None:
        if self.rank == 0 and self.times:
            warm = sorted(self.times[min(3, len(self.times) - 1):])
            print(f"{self.name}: median step {warm[len(warm) // 2] * 1e3:.2f} ms over {len(warm)} steps "
                  f"(backend {self.args.backend})", flush=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def train(name: str, args, rank: int, size: int, device, model, same_batch: bool = False,
          after_backward=None) -> None:
    """``args.steps`` AdamW steps of ``model`` on this rank's batches (every rank rank 0's
    with ``same_batch``), ``after_backward()`` between backward and the optimizer step;
    reports each step, then destroys the process group."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    report = Report(name, args, rank, size, device)
    for step in range(args.steps):
        report.start()
        tokens, targets = batch(step, 0 if same_batch else rank, device)
        loss = loss_of(model(tokens), targets)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        report.step(step, loss)
    report.done()
    dist.destroy_process_group()
