"""NeoX-style rotary embedding, drop-in for pagedbackend.layers.rotary.apply_rotary, applied in
place: one program per token rotates all its q and k heads with one cos/sin row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.cache import copy_heads, slot_address, store_kv_cache
from pagedbackend.kernels.common import next_pow2, pdl_enter, pdl_launch, to_cache


@triton.jit
def _rotate_heads(src, stride_h, dst, dst_stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, ALSO_SRC: tl.constexpr):
    """Rotate one token's heads read at src (head stride stride_h) and write them at dst
    (src itself for in place, or a KV-cache slot); with ALSO_SRC, at src as well."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < NUM_HEADS)[:, None] & (i < HALF)[None, :]
    p1 = src + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    d1 = dst + h[:, None] * dst_stride_h + i[None, :]
    tl.store(d1, to_cache(y1, dst), mask=mask)
    tl.store(d1 + HALF, to_cache(y2, dst), mask=mask)
    if ALSO_SRC:
        tl.store(p1, to_cache(y1, src), mask=mask)
        tl.store(p1 + HALF, to_cache(y2, src), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cs = cache_ptr + pos * stride_c + i
    cos = tl.load(cs, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs + HALF, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF, BLOCK_HALF)
    q = q_ptr + t * stride_qt
    k = k_ptr + t * stride_kt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_HQ, HALF, BLOCK_HALF,
                  False)
    _rotate_heads(k, stride_kh, k, stride_kh, cos, sin, NUM_KV_HEADS, BLOCK_HKV, HALF,
                  BLOCK_HALF, False)


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


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, slot_ptr,
                         k_cache_ptr, v_cache_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_c, stride_kcb, stride_kcs, stride_kch,
                         stride_vcb, stride_vcs, stride_vch,
                         NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, WRITE_K: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_c, HALF, BLOCK_HALF)
    q = q_ptr + t * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_HQ, HALF, BLOCK_HALF,
                  False)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:                    # -1: a padding row, nothing to cache
        kc = slot_address(k_cache_ptr, slot, stride_kcb, stride_kcs, BLOCK_SIZE)
        # with WRITE_K, k is rotated in place too
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, kc, stride_kch, cos, sin, NUM_KV_HEADS,
                      BLOCK_HKV, HALF, BLOCK_HALF, WRITE_K)
        copy_heads(v_ptr + t * stride_vt, stride_vh,
                   slot_address(v_cache_ptr, slot, stride_vcb, stride_vcs, BLOCK_SIZE),
                   stride_vch, NUM_KV_HEADS, HEAD_DIM, BLOCK_HKV, BLOCK_D)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, rotate_k: bool = False) -> torch.Tensor:
    """apply_rotary + store_kv_cache in one pass: q is rotated in place (and returned), k is
    rotated on its way into k_cache (k itself is left as it was unless rotate_k: then it is
    rotated in place too, for attention that reads the step's keys from k), v is copied into
    v_cache. Rotary over part of the head (R < D) takes the two-kernel path, which always
    rotates k in place."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if cos_sin_cache.shape[-1] != d:
        q, k = apply_rotary(q, k, positions, cos_sin_cache)
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return q
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert cos_sin_cache.stride(-1) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if t == 0:
        return q
    half = d // 2
    _rotary_store_kernel[(t,)](
        q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv),
        HALF=half, BLOCK_HALF=next_pow2(half), HEAD_DIM=d, BLOCK_D=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1], WRITE_K=rotate_k,
        num_warps=4 if hq * half >= 1024 else 1, **pdl_launch(q))
    return q
