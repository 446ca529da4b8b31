"""Causal (chunked-)prefill attention over the paged cache, all sequences in one launch.

A program owns (query tile, query head). Query tiles are numbered so that sequence i's tiles
start at query_start_loc[i] // BLOCK_M + i; this never overlaps the previous sequence's tiles, so
T // BLOCK_M + B programs cover any batch and each finds its sequence by a binary search over
query_start_loc, on the device, without host data. A sequence's queries are the last q_len of its
seq_len positions, so cached prefix blocks are read like any other context. Keys wholly before
the tile's first query need no mask; only the diagonal band is masked.

With the step's own keys and values given (k_new / v_new, rotated, in the cache's dtype), only
the cached prefix is gathered block by block from the cache; the step's keys are read as
contiguous rows, as FlashAttention's variable-length prefill reads them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import dot_precision, mma, next_pow2

LOG2E = 1.4426950408889634
# The backend hands the prefill kernel the step's keys and values (prefill.py's docstring);
# PAGEDBACKEND_PREFILL_CONTIG=0 gathers them from the cache like the prefix (A/B).
CONTIG_KV = os.environ.get("PAGEDBACKEND_PREFILL_CONTIG", "1") != "0"


def prefill_config(head_dim: int) -> dict:
    # Hopper: Q + 3 stages of K/V 64-token tiles fit in shared memory at D=128. At D=128,
    # 64-row query tiles with 4 warps beat 128 rows with 8 on the H200 (kernels_bench --sweep,
    # 2026-12-03: a 2048-token prefill 142.8 vs 158.4 us, after a 2048 cached prefix 342 vs
    # 373, 4 x 512 tokens 57.5 vs 66.2): twice the programs, two per SM.
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_base, v_base, table, start, n_end, qpos,
                  stride_kb, stride_ks, stride_vb, stride_vs, d, d_mask, scale_log2,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr):
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = n < n_end
        blk = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        blk = tl.load(table + n // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    tok = n % BLOCK_SIZE
    # an fp8 cache is widened to q's dtype here (a no-op otherwise)
    k = tl.load(k_base + (blk * stride_kb + tok * stride_ks)[:, None] + d[None, :],
                mask=kv_mask, other=0.0).to(q.dtype)
    s = mma(q, tl.trans(k), PRECISION) * scale_log2                     # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((n[None, :] <= qpos[:, None]) & n_mask[None, :], s, float("-inf"))
    v_ptrs = v_base + (blk * stride_vb + tok * stride_vs)[:, None] + d[None, :]
    return _softmax_pv(acc, m_i, l_i, s, v_ptrs, kv_mask, q.dtype, PRECISION)


@triton.jit
def _attend_new(acc, m_i, l_i, q, k_rows, v_rows, j0, j_end, rows, stride_kt, stride_vt, d,
                d_mask, scale_log2, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                PRECISION: tl.constexpr):
    """The step's own keys j0.. (rows of k_new / v_new from the sequence's first), seen by the
    queries at rows >= j."""
    j = j0 + tl.arange(0, BLOCK_N)
    if MASKED:
        j_mask = j < j_end
        kv_mask = j_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    jt = j.to(tl.int64)
    k = tl.load(k_rows + (jt * stride_kt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = mma(q, tl.trans(k), PRECISION) * scale_log2                     # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((j[None, :] <= rows[:, None]) & j_mask[None, :], s, float("-inf"))
    v_ptrs = v_rows + (jt * stride_vt)[:, None] + d[None, :]
    return _softmax_pv(acc, m_i, l_i, s, v_ptrs, kv_mask, q.dtype, PRECISION)


@triton.jit
def _softmax_pv(acc, m_i, l_i, s, v_ptrs, kv_mask, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax's update by one tile of scores s (log2 units), and P @ V."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(dtype)
    acc = acc * alpha[:, None] + mma(p.to(dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])   # both change every step
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, num_seqs, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_bt, k_new_ptr, v_new_ptr, stride_nkt, stride_nkh, stride_nvt,
                    stride_nvh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, SKIP_SINGLE: tl.constexpr, CONTIG: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    # Last sequence whose first tile index is <= tile.
    lo = tile * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_lo = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    if q_lo >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:      # left to the decode kernel (GQA-packed, split-KV)
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = q_lo + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok_idx = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok_idx[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    qpos = ctx + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kvh = head // GROUP
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    if CONTIG:
        # the cached prefix [0, ctx) from the cache (only its last tile masked, by ctx) ...
        full_end = (ctx // BLOCK_N) * BLOCK_N
        kv_end = ctx
    else:
        # ... else all keys; those before the tile's first query are seen by every row
        full_end = ((ctx + q_lo) // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(seq_len, ctx + q_lo + BLOCK_M)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, table, start, kv_end,
                                      qpos, stride_kb, stride_ks, stride_vb, stride_vs, d,
                                      d_mask, scale_log2, BLOCK_N, BLOCK_SIZE, False, PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base, v_base, table, start, kv_end,
                                      qpos, stride_kb, stride_ks, stride_vb, stride_vs, d,
                                      d_mask, scale_log2, BLOCK_N, BLOCK_SIZE, True, PRECISION)
    if CONTIG:
        # ... then the step's own keys, rows of k_new / v_new
        k_rows = k_new_ptr + q_start.to(tl.int64) * stride_nkt + kvh * stride_nkh
        v_rows = v_new_ptr + q_start.to(tl.int64) * stride_nvt + kvh * stride_nvh
        new_full = (q_lo // BLOCK_N) * BLOCK_N
        new_end = tl.minimum(q_len, q_lo + BLOCK_M)
        for j0 in range(0, new_full, BLOCK_N):
            acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_rows, v_rows, j0, new_end, rows,
                                        stride_nkt, stride_nvt, d, d_mask, scale_log2, BLOCK_N,
                                        False, PRECISION)
        for j0 in range(new_full, new_end, BLOCK_N):
            acc, m_i, l_i = _attend_new(acc, m_i, l_i, q, k_rows, v_rows, j0, new_end, rows,
                                        stride_nkt, stride_nvt, d, d_mask, scale_log2, BLOCK_N,
                                        True, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok_idx[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, out: torch.Tensor,
                            config: dict | None = None, skip_single: bool = False,
                            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """q/out [T, Hq, D]: rows query_start_loc[i]:query_start_loc[i+1] are sequence i's last
    queries; any mix of query lengths (1 included). Rows past query_start_loc[-1] are untouched,
    and so are the single-query sequences' rows with skip_single (run the decode kernel on them).
    k_new / v_new [T, Hkv, D]: the step's keys (rotated) and values, row for row with q, in the
    cache's dtype, already written to the cache: read from there instead of the cache."""
    t, hq, d = q.shape
    b = seq_lens.shape[0]
    hkv = k_cache.shape[2]
    assert hq % hkv == 0 and q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn), \
        "the caches must be in q's dtype or float8_e4m3fn"
    if t == 0 or b == 0:
        return out
    contig = k_new is not None
    if contig:
        assert v_new is not None and k_new.shape[0] >= t and k_new.shape[1:] == (hkv, d)
        assert k_new.dtype == v_new.dtype == k_cache.dtype and v_new.shape == k_new.shape
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1
    else:
        k_new = v_new = q            # unused
    cfg = {**prefill_config(d), **(config or {})}
    grid = (t // cfg["BLOCK_M"] + b, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, b, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), k_new, v_new, k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=next_pow2(d, 16), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], PRECISION=dot_precision(q.dtype),
        SKIP_SINGLE=skip_single, CONTIG=contig, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out
