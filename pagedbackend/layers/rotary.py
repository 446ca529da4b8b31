"""Rotary position embedding (NeoX / HF "rotate_half" layout) from a cos|sin cache indexed by
position, with the rope_scaling variants the Llama family uses (default, linear, llama3)."""
from __future__ import annotations

import math

import torch

from pagedbackend.layers.norm import USE_KERNELS

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, after rope_scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is invalid: "
                         f"must be one of {ROPE_TYPES}")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1 long-context rule: keep short wavelengths, divide long ones by `factor`,
    # and blend linearly between the two bands.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen < old_len / high, inv_freq, scaled)
    return torch.where(wavelen > old_len / low, inv_freq / factor, scaled)


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                        scaling: dict | None, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half of each row, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], positions [T] -> rotated (q, k), same shapes and dtype.

    On CUDA the triton kernel rotates q and k in place (they are views of this step's fused
    qkv output, used by nothing else)."""
    if q.is_cuda and USE_KERNELS:
        from pagedbackend.kernels.rotary import apply_rotary as kernel
        return kernel(q, k, positions, cos_sin_cache)
    return apply_rotary_torch(q, k, positions, cos_sin_cache)


def apply_rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)   # [T, 1, D/2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
