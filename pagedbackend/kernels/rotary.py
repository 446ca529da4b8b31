"""NeoX-style rotary embedding, drop-in for pagedbackend.layers.rotary.apply_rotary, applied in
place: one program per token rotates all its q and k heads with one cos/sin row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import next_pow2


@triton.jit
def _rotate_heads(x_ptr, t, stride_t, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < NUM_HEADS)[:, None] & (i < HALF)[None, :]
    p1 = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cs = cache_ptr + pos * stride_c + i
    cos = tl.load(cs, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs + HALF, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_HQ, HALF,
                  BLOCK_HALF)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, BLOCK_HKV, HALF,
                  BLOCK_HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (views of a fused qkv are fine), positions [T],
    cos_sin_cache [max_pos, R] (cos | sin halves, R <= D rotated dims). Rotates q and k in
    place, computing in fp32, and returns them."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= d and q.stride(2) == 1 and k.stride(2) == 1
    assert cos_sin_cache.stride(-1) == 1
    if t == 0:
        return q, k
    half = rot // 2
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv),
        HALF=half, BLOCK_HALF=next_pow2(half), num_warps=4 if hq * half >= 1024 else 1)
    return q, k
