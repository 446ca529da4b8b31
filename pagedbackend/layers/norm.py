"""RMSNorm as plain functions (the seams a triton kernel replaces) and a thin module around them."""
from __future__ import annotations

import os

import torch
from torch import nn

# On CUDA the triton kernels (pagedbackend.kernels.norm) replace these; =0 keeps torch (A/B).
USE_KERNELS = os.environ.get("PAGEDBACKEND_FUSED_KERNELS", "1") != "0"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and USE_KERNELS:
        from pagedbackend.kernels.norm import rms_norm as kernel
        return kernel(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, reduced in float32, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Cast before the weight multiply, as HF does, so bf16 results match it bit for bit.
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add of a pre-norm block and the next
    norm in one call, so a kernel can do both in one pass over memory."""
    if x.is_cuda and USE_KERNELS:
        from pagedbackend.kernels.norm import fused_add_rms_norm as kernel
        return kernel(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: the normed x. With one: (normed x + residual, x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
