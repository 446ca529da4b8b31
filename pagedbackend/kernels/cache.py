"""Scatter this step's K/V rows into the paged caches at slot_mapping (slot -1 = padding)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import next_pow2, to_cache


@triton.jit
def slot_address(cache_ptr, slot, stride_b, stride_s, BLOCK_SIZE: tl.constexpr):
    """Where slot (block id * BLOCK_SIZE + offset) of a [blocks, BLOCK_SIZE, heads, D] cache
    starts."""
    return cache_ptr + (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s


@triton.jit
def copy_heads(src, stride_h, dst, dst_stride_h, NUM_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's [heads, head_dim] row from src to dst, cast to dst's dtype (see to_cache)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(src + h[:, None] * stride_h + d[None, :], mask=mask)
    tl.store(dst + h[:, None] * dst_stride_h + d[None, :], to_cache(x, dst), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch,
                     stride_vcb, stride_vcs, stride_vch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    copy_heads(k_ptr + t * stride_kt, stride_kh,
               slot_address(k_cache_ptr, slot, stride_kcb, stride_kcs, BLOCK_SIZE), stride_kch,
               NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D)
    copy_heads(v_ptr + t * stride_vt, stride_vh,
               slot_address(v_cache_ptr, slot, stride_vcb, stride_vcs, BLOCK_SIZE), stride_vch,
               NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] (last dim contiguous; token/head strides free, e.g. views of a fused qkv)
    into caches [num_blocks, block_size, Hkv, D]. One program per token; no host sync."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 \
        and v_cache.stride(3) == 1, "store_kv_cache needs a contiguous head_dim"
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4 if hkv * d >= 1024 else 1)
