"""Tensor-parallel layers in the op-fusion shape: linear -> (add + norm, the residual an
extra output) -> linear.

A column-parallel linear holds a slice of the output features (its input replicated:
identity forward, gradient all-reduced backward); a row-parallel linear holds a slice of
the input features and yields a partial sum, which the epilogue all-reduces together with
the bias, the residual add and the RMSNorm in one kernel, returning ``(normed,
residual)`` for the next block. Every rank holds the same residual, norm weight and bias.

With ``sequence_parallel=True`` the activations between blocks are split by rows (tokens)
over the ranks instead of replicated: a column-parallel layer multiplies every rank's rows
as they arrive (``all_gather_matmul``) and a row-parallel one reduce-scatters its product
by rows as it computes (``matmul_reduce_scatter``), the communication under the GEMMs; the
blocks reduce-scatter theirs together with the bias + residual add and the RMSNorm of
this rank's rows, in the reduction's pass (``matmul_reduce_scatter_add_rmsnorm``).
The parameters every rank holds alike whose gradients then come from this rank's rows
(the norm weight, a row-parallel bias) have them summed over the ranks in backward, as
they arrive (``functional.sum_gradients``: one all-reduce per block, each micro-batch
counted once), so ``.grad`` is complete and the same on every rank; with
``reduce_replicated_grads=False`` they keep this rank's partial sums and carry
``sequence_parallel = True``, Megatron-LM's mark for the gradients that a framework sums
over the tensor-parallel group itself.

The layers never quantize unless given ``precision=`` (RowParallelLinear's all-reduce): a
communicator's opt-in to the quantized collectives (``UBNEXT_QUANTIZED``) serves its own
calls, not these.

Shards are rows (column-parallel) or columns (row-parallel) ``[rank * n / size, (rank + 1)
* n / size)`` of the full weight; ``load_full`` takes them from the unsharded weights.

Every layer holds its communicator (``layer.comm``; ``layer.group`` is the int handle its
ops take) and, where it has one, its ``BufferPlan``: a model built in a function works
after the function's own reference to the communicator is gone. ``copy.deepcopy`` of a
layer copies its parameters and shares the communicator and the buffer plan (resources,
not state); pickling a layer (``torch.save(model)``) raises TypeError: save its
``state_dict()`` instead, and build the layers again around a communicator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ubnext._protocol.errors import UbnextError
from ubnext._protocol.quant import EXACT

from . import functional
from ._registry import handle, lookup


def _ranks(layer, group) -> tuple[int, int, int]:
    """(handle, rank, ranks) of a communicator, which ``layer`` holds (``_hold``)."""
    h = _hold(layer, group)
    return h, layer.comm.rank, layer.comm.size


def _hold(layer, group) -> int:
    """The handle of ``group`` (the ops take it); ``layer.comm`` holds the communicator
    itself, so that a model keeps its communicator alive (the registry of handles is weak)."""
    h = handle(group)
    layer.comm = lookup(h)
    return h


def _mark_partial(sequence_parallel: bool, reduce_replicated_grads: bool, *params) -> None:
    """Marks ``params`` (replicated; their gradients from this rank's rows under sequence
    parallelism) with Megatron-LM's ``sequence_parallel = True`` where their gradients are
    left partial, for the framework that sums them (None: no parameter)."""
    if sequence_parallel and not reduce_replicated_grads:
        for p in params:
            if p is not None:
                p.sequence_parallel = True


def _shard(n: int, size: int, what: str) -> int:
    if n % size:
        raise UbnextError(f"ubnext.torch.tp: {what}={n} is not a multiple of the {size} ranks")
    return n // size


class ColumnParallelLinear(nn.Module):
    """``y_rank = x @ W[rank rows].T + b[rank rows]``, x replicated; or, with
    ``sequence_parallel``, x this rank's rows and ``y_rank = all_gather(x) @ W[rank rows].T
    + b[rank rows]`` by ``functional.all_gather_matmul``.

    Collective: yes: in backward (the input's gradient is all-reduced, or reduce-scattered
    with ``sequence_parallel``), and in forward with ``sequence_parallel``.
    Graph-capturable: yes (after a first eager call with ``sequence_parallel``).

    Args:
        in_features: input features (all of them, on every rank).
        out_features: output features of the full layer (a multiple of the ranks).
        group: the ``ubnext.Communicator``.
        bias: whether the layer has a bias.
        dtype, device: of the parameters.
        sequence_parallel: the input is this rank's rows (tokens), gathered under the GEMM.

    Raises:
        UbnextError: out_features not a multiple of the ranks.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = False, dtype=None, device=None,
                 *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)
        self.group, self.rank, self.size = _ranks(self, group)
        local = _shard(out_features, self.size, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(local, dtype=dtype, device=device)) if bias else None

    def forward(self, x):
        if self.sequence_parallel:
            y = functional.all_gather_matmul(x, self.weight.t(), group=self.group)[1]
            return y if self.bias is None else y + self.bias
        return F.linear(functional.copy_to_group(x, self.group), self.weight, self.bias)

    @torch.no_grad()
    def load_full(self, weight, bias=None) -> None:
        """Copies this rank's rows of the unsharded ``weight`` (and ``bias``).

        Collective: no.
        Graph-capturable: yes (device copies).

        Args:
            weight: out_features x in_features.
            bias: out_features elements, or None.

        Raises:
            RuntimeError: shapes that do not fit the shards (torch's copy).
        """
        n = self.weight.shape[0]
        self.weight.copy_(weight[self.rank * n:(self.rank + 1) * n])
        if self.bias is not None:
            self.bias.copy_(bias[self.rank * n:(self.rank + 1) * n])


class RowParallelLinear(nn.Module):
    """``partial_rank = x_rank @ W[:, rank columns].T``, all-reduced (plus the bias) by
    ``forward`` or by an ``AddRMSNormEpilogue``.

    With a ``BufferPlan``, an eager call without gradient writes its partial sums straight
    into the planned symmetric buffer of ``key`` (no staging copy before the all-reduce); a
    call larger than planned, one that needs a gradient, or one traced by torch.compile
    (which plans its own memory) takes an ordinary tensor (the all-reduce then stages it).
    ``forward`` returns a tensor of its own, which later calls leave alone: on the planned
    path without a bias that is a copy of the reduced buffer (with a bias, the sum with
    the bias is new anyway). ``reuse_output=True`` saves that copy: a bias-less planned
    call then returns a view of the planned buffer itself, which the layer's next planned
    call overwrites (and so does the call of any layer whose key shares the buffer: the
    plan's buffers alternate between keys); use such a result before the next call, or
    clone it.

    With ``sequence_parallel``, ``forward`` returns this rank's rows (tokens) of the sum,
    reduce-scattered under the GEMMs by ``functional.matmul_reduce_scatter`` (plus the
    bias, whose gradient, from this rank's rows, is summed over the ranks in backward
    unless ``reduce_replicated_grads=False``); ``plan`` and ``precision`` are not used there.

    Collective: yes: ``forward`` (an all-reduce, or the reduce-scatter; with
    ``sequence_parallel`` and a bias, an all-reduce of its gradient in backward);
    ``partial`` is local.
    Graph-capturable: yes.

    Args:
        in_features: input features of the full layer (a multiple of the ranks).
        out_features: output features (all of them, on every rank).
        group: the ``ubnext.Communicator``.
        bias: whether the layer has a bias (added once, after the reduction).
        plan: a ``BufferPlan``, or None.
        key: this layer's key in ``plan`` (every rank the same); default: the layer's id.
        dtype, device: of the parameters.
        reuse_output: with ``plan`` and no bias, ``forward`` returns the planned buffer's
            view (no copy), overwritten by the layer's next planned call; default False:
            a tensor of its own.
        sequence_parallel: ``forward`` reduce-scatters by rows (tokens) instead of all-reducing.
        reduce_replicated_grads: with ``sequence_parallel``, the bias's gradient is summed
            over the ranks in backward (default); False: it stays this rank's rows' partial
            sum and the bias carries ``sequence_parallel = True`` (for a framework that sums
            such gradients itself, as Megatron-LM does).
        precision: of the all-reduce of ``forward``: ``"exact"`` (default), whatever the
            communicator opted in to; ``"auto"``: the communicator's choice (its quantized
            opt-in from the measured size); or a format (``Communicator.all_reduce``'s).

    Raises:
        UbnextError: in_features not a multiple of the ranks.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = False, plan=None, key=None,
                 dtype=None, device=None, *, reuse_output: bool = False, sequence_parallel: bool = False,
                 reduce_replicated_grads: bool = True, precision: str = EXACT):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)
        self.group, self.rank, self.size = _ranks(self, group)
        local = _shard(in_features, self.size, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.reduce_replicated_grads, self.precision = bool(reduce_replicated_grads), precision
        _mark_partial(self.sequence_parallel, self.reduce_replicated_grads, self.bias)
        self.plan = plan
        self.reuse_output = bool(reuse_output)
        self.key = key if key is not None else f"row-parallel-{id(self)}"
        if plan is not None:
            plan.assign(self.key)  # assigned at construction: the same order on every rank

    def partial(self, x):
        """This rank's partial sums, in the planned buffer where one fits.

        Collective: no.
        Graph-capturable: yes.

        Args:
            x: (..., in_features / ranks), this rank's slice of the input features.

        Returns:
            (tokens, out_features) partial sums: on the planned path a view of the planned
            buffer, which the next planned call on that buffer overwrites (the layers
            consume it at once; clone it to keep it).

        Raises:
            RuntimeError: shapes that do not fit (torch's GEMM).
        """
        x2 = x.reshape(-1, x.shape[-1])
        # the planned path: eager code (and CUDA graphs of it) without gradient; torch.compile
        # plans its own memory (a write into a buffer outside the graph would be copied back)
        if (self.plan is not None and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            out = self.plan.view(self.key, x2.shape[0], self.weight.shape[0], x.dtype)
            if out is not None:
                return torch.matmul(x2, self.weight.t(), out=out)
        return F.linear(x2, self.weight)

    def forward(self, x):
        """The all-reduced output (plus the bias). On the planned path the reduction runs in
        place in the planned buffer (no staging copy), and the result is a new tensor (the
        sum with the bias, or without one a copy of the buffer), except with
        ``reuse_output=True`` and no bias: then it is a view of that buffer, valid until the
        next planned call that uses the same buffer (this layer's next call, or that of a
        layer whose key shares the buffer: the plan's buffers alternate between keys).

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call.

        Args:
            x: (..., in_features / ranks), this rank's slice of the input features.

        Returns:
            (..., out_features), the same on every rank (the planned buffer's view only with
            ``reuse_output=True`` and no bias); with ``sequence_parallel``, x.shape[0] / ranks
            rows: this rank's.

        Raises:
            UbnextError: what ``Communicator.all_reduce`` raises.
        """
        if self.sequence_parallel:
            y = self.scattered(x)
            if self.bias is None:
                return y
            bias = self.bias
            if self.reduce_replicated_grads:  # its gradient: this rank's rows'
                (bias,) = functional.sum_gradients(bias, group=self.group)
            return y + bias
        partial = self.partial(x)
        if self.plan is not None and not torch.compiler.is_compiling() and self._planned(partial):
            torch.ops.ubnext.all_reduce_(partial, "sum", self.precision, self.group)
            # the buffer is the plan's: the next planned call overwrites it, so the caller
            # gets a copy unless it opted in to the view (the bias sum below is new anyway)
            y = partial if self.reuse_output or self.bias is not None else partial.clone()
        else:
            y = functional.all_reduce(partial, "sum", self.group, self.precision)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def scattered(self, x):
        """This rank's rows of the sum of every rank's ``partial(x)``, reduce-scattered under
        the GEMMs (``functional.matmul_reduce_scatter``), without the bias.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call.

        Args:
            x: (tokens, ..., in_features / ranks), tokens a multiple of the ranks.

        Returns:
            (tokens / ranks, ..., out_features).

        Raises:
            UbnextError: what ``functional.matmul_reduce_scatter`` raises.
        """
        return functional.matmul_reduce_scatter(x, self.weight.t(), group=self.group)

    def _planned(self, t) -> bool:
        return t._base is self.plan.buffers[self.plan.assign(self.key)]

    @torch.no_grad()
    def load_full(self, weight, bias=None) -> None:
        """Copies this rank's columns of the unsharded weight and the whole bias.

        Collective: no.
        Graph-capturable: yes (device copies).

        Args:
            weight: the unsharded weight (out_features x in_features); this rank's columns are copied.
            bias: all out_features elements (every rank holds the bias), or None.

        Raises:
            RuntimeError: a weight or bias of another shape (torch's copy).
        """
        n = self.weight.shape[1]
        self.weight.copy_(weight[:, self.rank * n:(self.rank + 1) * n])
        if self.bias is not None:
            self.bias.copy_(bias)


class AddRMSNormEpilogue(nn.Module):
    """The row-parallel all-reduce fused with bias + residual add + RMSNorm:
    ``(normed, residual)`` from a partial sum; with sequence parallelism (``scattered``),
    the row-parallel GEMMs' reduce-scatter fused with them.

    Collective: yes (one fused kernel; ``scattered``: one overlapped op, and in backward an
    all-reduce of the norm weight's and bias's gradients).
    Graph-capturable: yes, after a first eager call of the same shape.

    Args:
        hidden: features per token.
        group: the ``ubnext.Communicator``.
        eps: the RMSNorm epsilon.
        dtype, device: of the norm weight.
        sequence_parallel: the layer is used through ``scattered`` (marks the weight where
            ``reduce_replicated_grads`` is False).
        reduce_replicated_grads: ``scattered`` sums the gradients of the weight and the
            bias (this rank's rows') over the ranks in backward (default); False: they stay
            partial, and with ``sequence_parallel`` the weight carries ``sequence_parallel =
            True`` (for a framework that sums such gradients itself, as Megatron-LM does).

    Raises:
        UbnextError: ``group`` is not a live communicator.
    """

    def __init__(self, hidden: int, group, eps: float = 1e-6, dtype=None, device=None, *,
                 sequence_parallel: bool = False, reduce_replicated_grads: bool = True):
        super().__init__()
        self.group = _hold(self, group)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.reduce_replicated_grads = bool(reduce_replicated_grads)
        _mark_partial(sequence_parallel, self.reduce_replicated_grads, self.weight)

    def forward(self, partial, residual, bias=None):
        return functional.all_reduce_add_rmsnorm(partial, residual, self.weight, bias, self.eps, self.group)

    def scattered(self, x, weight, residual, bias=None):
        """``(normed, residual)`` of this rank's rows of ``x @ weight.T`` summed over the
        ranks (a row-parallel layer's product, reduce-scattered by rows under its GEMMs),
        plus ``bias`` and ``residual``, normalized: one op,
        ``functional.matmul_reduce_scatter_add_rmsnorm``, the add + RMSNorm in the
        reduction's pass. The sequence-parallel blocks' epilogue. The norm weight's and
        ``bias``'s gradients come from this rank's rows: summed over the ranks as they
        arrive in backward (one all-reduce of both), unless ``reduce_replicated_grads`` is
        False (then partial sums).

        Collective: yes: every rank calls it, in the same order (its backward too).
        Graph-capturable: yes, after a first eager call.

        Args:
            x: (tokens, ..., in_features / ranks), tokens a multiple of the ranks.
            weight: the row-parallel layer's shard (hidden x in_features / ranks).
            residual: (tokens / ranks, ..., hidden), x's dtype, this rank's rows; or None.
            bias: hidden elements, or None.

        Returns:
            ``(normed, residual_out)``, (tokens / ranks, ..., hidden) each.

        Raises:
            UbnextError: what ``functional.matmul_reduce_scatter_add_rmsnorm`` raises.
        """
        norm_weight = self.weight
        if self.reduce_replicated_grads:
            norm_weight, bias = functional.sum_gradients(norm_weight, bias, group=self.group)
        return functional.matmul_reduce_scatter_add_rmsnorm(x, weight.t(), residual, norm_weight, bias, self.eps,
                                                            self.group)


class TensorParallelAttentionOutput(nn.Module):
    """The attention output projection: row-parallel over the heads, then the fused
    all-reduce + bias + residual add + RMSNorm (the next block's input norm); with
    ``sequence_parallel``, the projection's reduce-scatter under its GEMMs fused with them.

    Collective: yes (one fused kernel forward, none backward; with ``sequence_parallel``
    one overlapped op forward, the projection's backward its transpose and the all-reduce
    of the norm weight's and bias's gradients).
    Graph-capturable: yes.

    Args:
        hidden: model features.
        heads_features: heads x head_dim of the full attention (a multiple of the ranks).
        group, bias, eps, plan, key, dtype, device, sequence_parallel, reduce_replicated_grads:
            as for ``TensorParallelMLP`` (``bias``: the projection's).

    Raises:
        UbnextError: heads_features not a multiple of the ranks.
    """

    def __init__(self, hidden: int, heads_features: int, group, bias: bool = False, eps: float = 1e-6, plan=None,
                 key="attention-output", dtype=None, device=None, *, sequence_parallel: bool = False,
                 reduce_replicated_grads: bool = True):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)
        sp = {"sequence_parallel": sequence_parallel, "reduce_replicated_grads": reduce_replicated_grads}
        self.proj = RowParallelLinear(heads_features, hidden, group, bias, plan, key, dtype, device, **sp)
        self.norm = AddRMSNormEpilogue(hidden, group, eps, dtype, device, **sp)

    def forward(self, attention, residual):
        """``(normed, residual)`` from this rank's heads' outputs.

        Collective: yes: every rank calls it, in the same order.
        Graph-capturable: yes, after a first eager call of the same shape.

        Args:
            attention: tokens x (heads_features / ranks), this rank's heads.
            residual: tokens x hidden, the same on every rank; with ``sequence_parallel``,
                this rank's tokens / ranks rows.

        Returns:
            ``(normed, residual)``, tokens x hidden each, the same on every rank; with
            ``sequence_parallel``, this rank's rows.

        Raises:
            UbnextError: what ``Communicator.all_reduce_add_rmsnorm`` raises (with
                ``sequence_parallel``: ``functional.matmul_reduce_scatter_add_rmsnorm``).
        """
        if self.sequence_parallel:
            return self.norm.scattered(attention, self.proj.weight, residual, self.proj.bias)
        return self.norm(self.proj.partial(attention), residual, self.proj.bias)


class TensorParallelMLP(nn.Module):
    """The Llama MLP, tensor parallel: gate and up column-parallel (one GEMM of both
    shards), SiLU(gate) * up, down row-parallel, then the fused all-reduce + bias +
    residual add + RMSNorm.

    Collective: yes (one fused kernel forward; one all-reduce backward, of the input's
    gradient; with ``sequence_parallel``: the overlapped ops, and in backward one
    all-reduce of the norm weight's and bias's gradients).
    Graph-capturable: yes.

    Args:
        hidden: model features.
        intermediate: the MLP's features (a multiple of the ranks).
        group: the ``ubnext.Communicator``.
        bias: whether down has a bias.
        eps: the RMSNorm epsilon.
        plan, key: as for ``RowParallelLinear``.
        dtype, device: of the parameters.
        sequence_parallel: inputs and outputs are this rank's rows (tokens): gate and up
            all-gather their input under the GEMM, down reduce-scatters its product under
            its GEMMs with the add + RMSNorm of this rank's rows (``AddRMSNormEpilogue.scattered``).
        reduce_replicated_grads: with ``sequence_parallel``, the gradients of the norm
            weight and down's bias (this rank's rows') are summed over the ranks in backward,
            as they arrive (default: one all-reduce, each micro-batch counted once), so
            every rank's ``.grad`` is complete and alike; False: they stay partial and those
            parameters carry ``sequence_parallel = True`` (Megatron-LM's mark, for a
            framework that sums such gradients itself).

    Raises:
        UbnextError: intermediate not a multiple of the ranks.
    """

    def __init__(self, hidden: int, intermediate: int, group, bias: bool = False, eps: float = 1e-6, plan=None,
                 key="mlp", dtype=None, device=None, *, sequence_parallel: bool = False,
                 reduce_replicated_grads: bool = True):
        super().__init__()
        self.sequence_parallel = bool(sequence_parallel)
        self.gate_up = ColumnParallelLinear(hidden, 2 * intermediate, group, False, dtype, device,
                                            sequence_parallel=sequence_parallel)
        sp = {"sequence_parallel": sequence_parallel, "reduce_replicated_grads": reduce_replicated_grads}
        self.down = RowParallelLinear(intermediate, hidden, group, bias, plan, key, dtype, device, **sp)
        self.norm = AddRMSNormEpilogue(hidden, group, eps, dtype, device, **sp)

    def forward(self, x, residual):
        """``(normed, residual)`` from the block's input and residual.

        Collective: yes: every rank calls it, in the same order (one all-reduce more in backward).
        Graph-capturable: yes, after a first eager call of the same shape.

        Args:
            x: tokens x hidden, the (normed) block input, the same on every rank; with
                ``sequence_parallel``, this rank's tokens / ranks rows.
            residual: x's shape, the same on every rank (or this rank's rows).

        Returns:
            ``(normed, residual)``, x's shape each, the same on every rank (or this rank's rows).

        Raises:
            UbnextError: what ``Communicator.all_reduce_add_rmsnorm`` raises (with
                ``sequence_parallel``: ``functional.matmul_reduce_scatter_add_rmsnorm``).
        """
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if self.sequence_parallel:
            return self.norm.scattered(F.silu(gate) * up, self.down.weight, residual, self.down.bias)
        return self.norm(self.down.partial(F.silu(gate) * up), residual, self.down.bias)

    @torch.no_grad()
    def load_full(self, gate, up, down, norm_weight, down_bias=None) -> None:
        """Copies this rank's shards of the unsharded weights.

        Collective: no.
        Graph-capturable: yes (device copies).

        Args:
            gate: intermediate x hidden.
            up: intermediate x hidden.
            down: hidden x intermediate.
            norm_weight: hidden elements.
            down_bias: hidden elements, or None.

        Raises:
            RuntimeError: shapes that do not fit the shards (torch's copy).
        """
        n = self.gate_up.weight.shape[0] // 2
        r = self.gate_up.rank
        self.gate_up.weight.copy_(torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]))
        self.down.load_full(down, down_bias)
        self.norm.weight.copy_(norm_weight)
