"""Tensor-parallel blocks of ubnext.torch.tp against a single-process emulation of their
shards (the same GEMMs per shard, the partial sums reduced by a given function: in the
kernels' order on GPUs, in rank order by the CPU tests' thread communicators) and against
the unsharded model in float64. Shared by the CPU and GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ubnext.torch as ut
from ubnext.torch import TensorParallelAttentionOutput, TensorParallelMLP, _rmsnorm, functional

EPS = 1e-5
#: the stated bound of a bf16 block against the unsharded float64 model: max |got - ref|
#: over max |ref|, for the outputs and every gradient (bf16 keeps 8 bits: 2^-8 per rounding,
#: a few roundings per path plus the shards' sums rounded separately)
BF16_BOUND = 2.0 ** -5


def gpu_communicator(nbytes: int, dtype: str):
    """A communicator for the GPU tests of ubnext.torch, on its device; skips where NCCL
    would reduce ``nbytes`` of ``dtype`` but cannot (ranks sharing a GPU). Collective."""
    from gpu_support import require_gpu_and_torch, skip_where_nccl_cannot_run

    import ubnext

    require_gpu_and_torch()
    c = ubnext.Communicator()
    torch.cuda.set_device(c.device)
    if c.select(nbytes, dtype) == "nccl":
        skip_where_nccl_cannot_run(c)
    return c


def quantized_pair(directory, threshold: int = 1024):
    """Two communicators of every rank, alike but for the opt-in: ``(plain, opted_in)``,
    the latter ``quantized="int8"`` with a tune file (in ``directory``, each rank its own
    copy) whose thresholds send every bfloat16 all-reduce and reduce-scatter of
    ``threshold`` bytes or more of any world size through the quantized two-shot
    (``precision="auto"``); torch's current device set to theirs. Skips where NCCL would
    reduce a test's sizes but cannot. Collective; the caller closes both."""
    import json

    from gpu_support import require_gpu_and_torch, skip_where_nccl_cannot_run

    import ubnext

    require_gpu_and_torch()
    thresholds = {"*": {"bfloat16": {"int8": threshold}}}
    path = directory / "tune.json"
    path.write_text(json.dumps({"format": 2, "entries": [
        {"gpu": "*", "link": "*", "placement": "*", "mode": "*",
         "tables": {"1024": {"bfloat16": [[None, "nccl"]]}},  # rows for no world size here: the shipped ones
         "quantized": {"tables": thresholds, "collectives": {"reduce_scatter": {"tables": thresholds}}}}]}))
    # the default pool: room for the overlapped ops' area beside the quantized receive areas
    pair = (ubnext.Communicator(tune_file=str(path)), ubnext.Communicator(quantized="int8", tune_file=str(path)))
    torch.cuda.set_device(pair[0].device)
    try:
        if any(c.select(1 << 16, "bfloat16", collective=k) == "nccl"
               for c in pair for k in ("all_reduce", "reduce_scatter", "all_gather")):
            skip_where_nccl_cannot_run(pair[0])
    except BaseException:  # the skip too
        for c in pair:
            c.close()
        raise
    return pair


def weights(hidden: int, intermediate: int, heads_features: int, dtype, device, seed: int = 0) -> dict:
    """The unsharded weights of an MLP and an attention output projection, the same on every rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return {"gate": rnd(intermediate, hidden, scale=hidden ** -0.5),
            "up": rnd(intermediate, hidden, scale=hidden ** -0.5),
            "down": rnd(hidden, intermediate, scale=intermediate ** -0.5), "down_bias": rnd(hidden, scale=0.1),
            "mlp_norm": 1 + rnd(hidden, scale=0.1), "o": rnd(hidden, heads_features, scale=heads_features ** -0.5),
            "o_bias": rnd(hidden, scale=0.1), "attn_norm": 1 + rnd(hidden, scale=0.1)}


def inputs(tokens: int, hidden: int, heads_features: int, dtype, device, seed: int = 1) -> dict:
    """The block inputs (replicated), and the gradients of its outputs (replicated)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return {"x": rnd(tokens, hidden), "residual": rnd(tokens, hidden), "attention": rnd(tokens, heads_features),
            "grad_normed": rnd(tokens, hidden), "grad_residual": rnd(tokens, hidden)}


def mlp(group, w: dict, dtype, device, plan=None, **kwargs) -> TensorParallelMLP:
    hidden, intermediate = w["down"].shape
    m = TensorParallelMLP(hidden, intermediate, group, bias=True, eps=EPS, plan=plan, dtype=dtype, device=device,
                          **kwargs)
    m.load_full(w["gate"], w["up"], w["down"], w["mlp_norm"], w["down_bias"])
    return m


def attention_output(group, w: dict, dtype, device, plan=None, **kwargs) -> TensorParallelAttentionOutput:
    hidden, heads_features = w["o"].shape
    m = TensorParallelAttentionOutput(hidden, heads_features, group, bias=True, eps=EPS, plan=plan, dtype=dtype,
                                      device=device, **kwargs)
    m.proj.load_full(w["o"], w["o_bias"])
    with torch.no_grad():
        m.norm.weight.copy_(w["attn_norm"])
    return m


def run_block(kind: str, module, rank: int, size: int, data: dict, backward: bool = True) -> dict:
    """One rank's forward (and backward from the replicated output gradients): outputs and gradients."""
    x = data["x"].detach().clone().requires_grad_(backward)
    residual = data["residual"].detach().clone().requires_grad_(backward)
    if kind == "mlp":
        normed, res = module(x, residual)
    else:  # this rank's heads
        cols = data["attention"].shape[1] // size
        x = data["attention"][:, rank * cols:(rank + 1) * cols].detach().clone(memory_format=torch.contiguous_format)
        x.requires_grad_(backward)
        normed, res = module(x, residual)
    out = {"normed": normed.detach(), "residual_out": res.detach()}
    if backward:
        torch.autograd.backward((normed, res), (data["grad_normed"], data["grad_residual"]))
        out.update(grad_x=x.grad, grad_residual=residual.grad,
                   **{f"grad:{n.removeprefix('_orig_mod.')}": p.grad for n, p in module.named_parameters()})
    return out


#: the replicated parameters of each block: with sequence parallelism, each rank's rows give a
#: part of their gradients
REPLICATED = {"mlp": ("norm.weight", "down.bias"), "attention": ("norm.weight", "proj.bias")}


def block(kind: str, group, w: dict, dtype, device, **kwargs):
    """The MLP (``kind="mlp"``) or the attention output projection of ``w``."""
    return (mlp if kind == "mlp" else attention_output)(group, w, dtype, device, **kwargs)


def _rows(t, rank: int, size: int):
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def train(kind: str, module, rank: int, size: int, batches: list, sequence_parallel: bool, lr: float = 0.25) -> list:
    """Steps of SGD on ``module``, each over its micro-batches (``batches[step]``: a list of
    ``inputs()``, the gradients accumulated over them: one backward each, one step):
    per step, what the last micro-batch gave (this rank's rows with ``sequence_parallel``:
    outputs, the gradients of x and the residual), every parameter's gradient before the
    step (``grad:name``) and every parameter after it (``param:name``)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    record = []
    for micro in batches:
        optimizer.zero_grad(set_to_none=True)
        for data in micro:
            def mine(t):
                return _rows(t, rank, size) if sequence_parallel else t

            if kind == "mlp":
                x = mine(data["x"])
            else:  # this rank's heads, every token
                cols = data["attention"].shape[1] // size
                x = data["attention"][:, rank * cols:(rank + 1) * cols]
            x = x.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
            residual = mine(data["residual"]).detach().clone().requires_grad_()
            normed, res = module(x, residual)
            torch.autograd.backward((normed, res), (mine(data["grad_normed"]), mine(data["grad_residual"])))
        got = {"normed": normed.detach(), "residual_out": res.detach(), "grad_x": x.grad,
               "grad_residual": residual.grad,
               **{f"grad:{n}": p.grad.clone() for n, p in module.named_parameters()}}
        optimizer.step()
        got.update({f"param:{n}": p.detach().clone() for n, p in module.named_parameters()})
        record.append(got)
    return record


def train_linears(comm, w: dict, batches: list, sequence_parallel: bool) -> list:
    """Two SGD steps of ColumnParallelLinear (gate, bias) then RowParallelLinear (down,
    bias): with ``sequence_parallel`` the gathered GEMM and the reduce-scatter; without, the
    input's gradient all-reduced and the output all-reduced."""
    from ubnext.torch import ColumnParallelLinear, RowParallelLinear

    hidden, intermediate = w["down"].shape
    like = {"dtype": w["down"].dtype, "device": w["down"].device, "sequence_parallel": sequence_parallel}
    col = ColumnParallelLinear(hidden, intermediate, comm, bias=True, **like)
    row = RowParallelLinear(intermediate, hidden, comm, bias=True, **like)
    col.load_full(w["gate"], w["up"][:, 0])
    row.load_full(w["down"], w["down_bias"])
    params = [*col.parameters(), *row.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.25)
    record = []
    for (data,) in batches:
        optimizer.zero_grad(set_to_none=True)
        x, grad = data["x"], data["grad_normed"]
        if sequence_parallel:
            x, grad = _rows(x, comm.rank, comm.size), _rows(grad, comm.rank, comm.size)
        x = x.clone().requires_grad_()
        y = row(col(x))
        y.backward(grad)
        got = {"y": y.detach(), "grad_x": x.grad, **{f"grad:{i}": p.grad.clone() for i, p in enumerate(params)}}
        optimizer.step()
        got.update({f"param:{i}": p.detach().clone() for i, p in enumerate(params)})
        record.append(got)
    return record


def differentiable_forms(comm, x, w) -> list:
    """Every form of ``ubnext.torch.functional`` whose forward or backward reduces, and
    the in-place forms, on ``x`` (this rank's, rows a multiple of the ranks) and ``w``
    (x.shape[1] x n, shared), with their defaults: outputs, and the gradients of x and w
    from random output gradients (the same on every run)."""
    rows = x.shape[0] // comm.size
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    lx, lw = leaves
    outs = [functional.all_reduce(lx, group=comm), functional.reduce_scatter(lx, group=comm),
            functional.all_gather(lx[:rows], group=comm),  # backward: the reduce-scatter
            functional.copy_to_group(lx, comm) @ lw,  # backward: the all-reduce
            *functional.all_gather_matmul(lx[:rows], lw, group=comm),  # gathered output's gradient reduce-scattered
            functional.matmul_reduce_scatter(lx, lw, group=comm), *functional.sum_gradients(lx, lw, group=comm)]
    g = torch.Generator().manual_seed(comm.rank)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype).to(o.device) for o in outs])
    in_place, into = x.clone(), x.new_empty(rows * x.shape[1])
    ut.all_reduce(in_place, group=comm)
    ut.reduce_scatter_tensor(into, x, group=comm)
    return [o.detach() for o in outs] + [lx.grad, lw.grad, in_place, into]


def rows_of_plain(kind: str, got: dict, rank: int, size: int) -> dict:
    """A block's record without sequence parallelism (``train``), cut to what the
    sequence-parallel block's record holds: this rank's rows of the outputs and of the
    gradients of the residual (and of x in the MLP; the attention's x is this rank's heads)."""
    rows = ("normed", "residual_out", "grad_residual") + (("grad_x",) if kind == "mlp" else ())
    return {k: _rows(v, rank, size) if k in rows else v for k, v in got.items()}


def assert_replicated_alike(records: list, kind: str) -> None:
    """Every replicated parameter (``REPLICATED``) and its gradient bit for bit the same on
    every rank after every step (``records[rank][step]``, ``train``'s)."""
    for step in range(len(records[0])):
        for name in REPLICATED[kind]:
            for what in ("param", "grad"):
                key = f"{what}:{name}"
                first = records[0][step][key]
                for r, rec in enumerate(records[1:], 1):
                    assert torch.equal(bits(rec[step][key]), bits(first)), (
                        f"step {step}: {key} of rank {r} differs from rank 0's in "
                        f"{int((rec[step][key] != first).sum())} elements")


def bits(t):
    """``t``'s bits as integers (NaN and -0.0 compared bitwise)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def emulate(kind: str, w: dict, data: dict, rank: int, size: int, fused, all_reduce, backward: bool = True) -> dict:
    """What ``run_block`` gives on ``rank`` of ``size``, from every shard's GEMMs in one
    process: ``fused(partials, residual, weight, bias, eps) -> (normed, residual_out)``
    and ``all_reduce(partials) -> sum`` reduce them as the communicator does."""
    def leaf(t):  # contiguous, as the layers' parameters and inputs are
        return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(backward)

    shards = []
    for r in range(size):
        if kind == "mlp":
            n = w["gate"].shape[0] // size
            x = leaf(data["x"])
            gate_up = leaf(torch.cat([w["gate"][r * n:(r + 1) * n], w["up"][r * n:(r + 1) * n]]))
            down = leaf(w["down"][:, r * n:(r + 1) * n])
            gate, up = F.linear(x.view_as(x), gate_up).chunk(2, dim=-1)
            partial = F.linear(F.silu(gate) * up, down)
            shards.append((partial, x, {"gate_up.weight": gate_up, "down.weight": down}))
        else:
            cols = w["o"].shape[1] // size
            x = leaf(data["attention"][:, r * cols:(r + 1) * cols])
            o = leaf(w["o"][:, r * cols:(r + 1) * cols])
            shards.append((F.linear(x, o), x, {"proj.weight": o}))
    norm_w, bias = (w["mlp_norm"], w["down_bias"]) if kind == "mlp" else (w["attn_norm"], w["o_bias"])
    normed, res = fused([s[0].detach() for s in shards], data["residual"], norm_w, bias, EPS)
    out = {"normed": normed, "residual_out": res}
    if not backward:
        return out
    d_sum, d_norm = _rmsnorm.backward(data["grad_normed"], data["grad_residual"], res, norm_w, EPS)
    d = d_sum.to(res.dtype)
    grads = [torch.autograd.grad(s[0], [s[1], *s[2].values()], d) for s in shards]
    bias_name = "down.bias" if kind == "mlp" else "proj.bias"
    out.update({"grad_residual": d, "grad:norm.weight": d_norm.to(norm_w.dtype),
                f"grad:{bias_name}": d_sum.sum(0).to(bias.dtype)})
    out.update({f"grad:{name}": g for name, g in zip(shards[rank][2], grads[rank][1:])})
    out["grad_x"] = all_reduce([g[0] for g in grads]) if kind == "mlp" else grads[rank][0]
    return out


def unsharded(kind: str, w: dict, data: dict, rank: int, size: int) -> dict:
    """The unsharded block in float64 (its parameters' gradients sliced as rank's shards)."""
    f64 = {k: v.detach().double().requires_grad_() for k, v in w.items()}
    x = data["x"].detach().double().requires_grad_()
    attention = data["attention"].detach().double().requires_grad_()
    residual = data["residual"].detach().double().requires_grad_()
    if kind == "mlp":
        y = F.linear(F.silu(F.linear(x, f64["gate"])) * F.linear(x, f64["up"]), f64["down"], f64["down_bias"])
        norm_w = f64["mlp_norm"]
    else:
        y = F.linear(attention, f64["o"], f64["o_bias"])
        norm_w = f64["attn_norm"]
    res = y + residual
    normed = res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + EPS) * norm_w
    torch.autograd.backward((normed, res), (data["grad_normed"].double(), data["grad_residual"].double()))
    out = {"normed": normed.detach(), "residual_out": res.detach(), "grad_residual": residual.grad}
    if kind == "mlp":
        n = w["gate"].shape[0] // size
        rows = slice(rank * n, (rank + 1) * n)
        out.update({"grad_x": x.grad, "grad:gate_up.weight": torch.cat([f64["gate"].grad[rows], f64["up"].grad[rows]]),
                    "grad:down.weight": f64["down"].grad[:, rows], "grad:down.bias": f64["down_bias"].grad,
                    "grad:norm.weight": f64["mlp_norm"].grad})
    else:
        cols = w["o"].shape[1] // size
        c = slice(rank * cols, (rank + 1) * cols)
        out.update({"grad_x": attention.grad[:, c], "grad:proj.weight": f64["o"].grad[:, c],
                    "grad:proj.bias": f64["o_bias"].grad, "grad:norm.weight": f64["attn_norm"].grad})
    return out


def assert_equal_bits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), f"{sorted(got)} != {sorted(want)}"
    for name in got:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{name}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}")
        same = torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32))
        assert same, f"{name}: differs from the emulation of the shards in {int((a != b).sum())} elements"


def assert_close_to(got: dict, want: dict, bound: float = BF16_BOUND) -> dict:
    """max |got - want| / max |want| <= bound for every entry; returns the ratios."""
    ratios = {}
    for name, ref in want.items():
        err = (got[name].double() - ref).abs().max().item()
        ratios[name] = err / ref.abs().max().item()
        assert ratios[name] <= bound, f"{name}: max error {err:.3g} is {ratios[name]:.3g} of max |ref| > {bound}"
    return ratios
