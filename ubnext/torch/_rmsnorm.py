"""Residual add + RMSNorm in torch: the single-process reference of the fused op's
forward and the fused op's backward (fp32 arithmetic, results in the inputs' dtype)."""

from __future__ import annotations

import torch


def add_rmsnorm(x, residual, weight, bias, eps: float):
    """``(normed, residual_out)`` of ``x`` (already all-reduced) as the fused op defines
    them: ``residual_out = x + bias + residual`` rounded to x's dtype, ``normed =
    residual_out * rsqrt(mean(residual_out ** 2) + eps) * weight`` in fp32, rounded once."""
    r = x.float()
    if bias is not None:
        r = r + bias.float()
    if residual is not None:
        r = r + residual.float()
    res = r.to(x.dtype)
    r = res.float()
    normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), res


def backward(grad_normed, grad_residual, residual_out, weight, eps: float):
    """Gradients of ``add_rmsnorm`` from its saved ``residual_out``: ``(d_sum, d_weight)``,
    ``d_sum`` being the gradient of ``residual_out`` in total (that of x, the residual and,
    summed over rows, the bias), fp32; ``d_weight`` fp32."""
    r = residual_out.float()
    rstd = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    d_sum = torch.zeros_like(r)
    d_weight = None
    if grad_normed is not None:
        gn = grad_normed.float()
        gw = gn * weight.float()
        d_sum = rstd * (gw - r * (rstd * rstd) * (gw * r).mean(-1, keepdim=True))
        d_weight = (gn * r * rstd).sum(0)
    if grad_residual is not None:
        d_sum = d_sum + grad_residual.float()
    return d_sum, d_weight
