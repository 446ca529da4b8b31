"""Gated MLP activation: one function over the packed gate|up projection output."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedbackend.layers.norm import USE_KERNELS


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [..., 2 * I] holding gate | up; returns silu(gate) * up, [..., I]."""
    if x.is_cuda and USE_KERNELS:
        from pagedbackend.kernels.activation import silu_and_mul as kernel
        return kernel(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
