"""Paged decode attention: one query token per sequence, split-KV over long contexts.

A program owns (sequence, kv head, split): the GQA group's query heads form the M side of
tl.dot (padded to 16 rows), the split's keys are visited BLOCK_N tokens (several cache blocks) at
a time through the block table, with an fp32 online softmax. With more than one split each
program writes a normalized partial output and its log-sum-exp (base 2), and a second kernel
merges them. The grid depends only on the batch size and the split count, never on data, so a
decode step can be captured in a CUDA graph. The split count is a runtime argument (only
split / not split is compiled in), so batches of every size share two compiled variants instead
of compiling one per split count in the middle of serving.

The merge stays a kernel of its own: a version where the last split program of each
(sequence, kv head) merged the partials (an atomic counter) made W1 4% slower on the H200 (the
merge became a serial tail of the attention kernel, and every program paid a GPU-wide fence).

In a decode step the kernel also applies the rotary embedding to q and the new k and writes
the new k and v into the cache (rope_store), which was a kernel of its own before it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.cache import slot_address
from pagedbackend.kernels.common import (dot_precision, mma, next_pow2, pdl_enter, pdl_launch,
                                         to_cache)

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 128
# The backend hands a decode step's rotary embedding and KV write to this kernel (one launch
# per layer fewer) while the step has at most one (sequence, kv head) per SM: the work before
# the context loop then runs once per SM. In a wide step it runs wave after wave instead, and
# costs more than the launch it saves (W2 128/128, 512 rows, H200: the kernel 130 us a layer
# against 118 + 7.6 us for it and rotary_store_kv). See rope_in_decode.
# PAGEDBACKEND_ROPE_IN_DECODE=0 keeps them in rotary_store_kv always (A/B).
ROPE_IN_DECODE = os.environ.get("PAGEDBACKEND_ROPE_IN_DECODE", "1") != "0"


# A decode step lasts as long as its slowest program. The GPU starts a kernel's programs in grid
# order, so with contexts of mixed length (W5: 100 to 2,048 tokens) a long sequence whose
# programs start in the last wave keeps the step going after the rest of the GPU has drained.
# With LONGEST_FIRST the programs of the longest sequences start first (a sort of seq_lens once
# per step, AttentionMetadata.longest_first), and short ones fill the tail.
# PAGEDBACKEND_LONGEST_FIRST=0 keeps the plain order (A/B).
LONGEST_FIRST = os.environ.get("PAGEDBACKEND_LONGEST_FIRST", "1") != "0"


def rope_in_decode(num_seqs: int, num_kv_heads: int, sms: int) -> bool:
    """Whether a decode step of num_seqs sequences rotates and writes K/V in the attention
    kernel (rope_store) rather than in rotary_store_kv first."""
    return ROPE_IN_DECODE and num_seqs * num_kv_heads <= sms


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """Enough (seq, kv head, split) programs to give every SM about two, but no split shorter
    than MIN_TOKENS_PER_SPLIT tokens (merging costs more than it saves there)."""
    work = num_seqs * num_kv_heads
    if work >= sms:
        return 1
    by_sms = triton.cdiv(2 * sms, work)
    by_len = triton.cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_sms, by_len, MAX_SPLITS))


def max_split_rows(num_kv_heads: int, sms: int) -> int:
    """Upper bound of num_seqs * num_splits over every batch size with num_splits > 1: the
    split-KV scratch can be sized once, before any CUDA graph capture."""
    best, b = 0, 1
    while b * num_kv_heads < sms:
        best = max(best, b * choose_num_splits(b, num_kv_heads, 1 << 30, sms))
        b += 1
    return best


# An fp8 cache (kv_cache_dtype fp8) halves a tile's bytes, and with 64-token tiles W5 and W2
# ran no faster than with bf16 (H200, perf/RESULTS.md call 33): the context loop is bound by
# its iterations there, not by bytes. Its tiles take twice the tokens, the bytes in flight per
# iteration of a bf16 tile: 6-31% faster than bf16 at W5's widths, but 25% slower at W2
# 128/128's 192-token contexts, where most of a 128-token tile is past the end (call 35).
FP8_BLOCK_N = 128
# Over an fp8 cache the kernel computes in fp16 (q, the widened K/V and the probabilities;
# fp32 accumulation): e4m3 widens to fp16 in one conversion, to bf16 only through fp32.
FP8_F16 = True


def decode_config(head_dim: int, kv_element_size: int = 2) -> dict:
    # 64 tokens (4 blocks of 16) per iteration keeps enough bytes in flight per program;
    # K+V tiles are 32 KiB at D=128, so two stages leave room for 3 CTAs per SM. Three stages
    # were 3-8% faster alone at 2048-token contexts (kernels_bench --sweep) but no W2 run was
    # measurably faster with them (H200, 2026-12-03; perf/RESULTS.md, calls 17 to 21).
    # An fp8 cache (kv_element_size 1) takes FP8_BLOCK_N tiles and computes in fp16 (F16).
    fp8 = kv_element_size == 1
    cfg = dict(BLOCK_N=32, num_warps=4, num_stages=2, F16=fp8 and FP8_F16)
    if head_dim <= 128:
        cfg["BLOCK_N"] = FP8_BLOCK_N if fp8 else 64
    return cfg


@triton.jit
def _rope_and_store(q, q_at, k_new, v_new, pos, cos_sin_ptr, stride_c, slot, k_base, v_base,
                    stride_kb, stride_ks, stride_vb, stride_vs, holds_new, d, g_mask, d_mask,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The rotary embedding and KV write of a decode row's new token (position pos, the
    context's last), done by the attention kernel: returns q [BLOCK_G, BLOCK_D] rotated (NeoX
    halves, fp32, rounded to q's dtype as the separate kernel rounds it); the one split whose
    range holds the new position (holds_new) writes the rotated k and v at slot (-1: none)
    before it reads that position back, and no other split reads it."""
    HALF: tl.constexpr = HEAD_DIM // 2
    partner = (d + HALF) % HEAD_DIM                  # the other half's element
    sign = tl.where(d < HALF, -1.0, 1.0)
    cs = cos_sin_ptr + pos * stride_c + d % HALF
    cos = tl.load(cs, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=d_mask, other=0.0).to(tl.float32)
    q_p = tl.load(q_at + partner[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q_rot = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_p.to(tl.float32) * sin[None, :])
    if holds_new & (slot >= 0):
        k = tl.load(k_new + d, mask=d_mask, other=0.0).to(tl.float32)
        k_p = tl.load(k_new + partner, mask=d_mask, other=0.0).to(tl.float32)
        kc = slot_address(k_base, slot, stride_kb, stride_ks, BLOCK_SIZE)
        tl.store(kc + d, to_cache(k * cos + sign * k_p * sin, kc), mask=d_mask)
        vc = slot_address(v_base, slot, stride_vb, stride_vs, BLOCK_SIZE)
        tl.store(vc + d, to_cache(tl.load(v_new + d, mask=d_mask, other=0.0), vc),
                 mask=d_mask)
    tl.debug_barrier()          # the program's own stores before its loads of that position
    return q_rot.to(q.dtype)


# stride_bt is the block-table width of this step: unspecialized, or every width that is 1 or a
# multiple of 16 would compile a variant of its own in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                   query_start_loc_ptr, order_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   new_k_ptr, new_v_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
                   scale_log2, num_splits, stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_bt, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_c,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                   MIXED: tl.constexpr, ROPE: tl.constexpr, ORDERED: tl.constexpr,
                   F16: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    if ORDERED:
        # the GPU starts programs in grid order: the KV heads of order[0] (the longest
        # sequence) first, then order[1]'s, ... so the longest programs do not start last
        lin = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        seq = tl.load(order_ptr + lin // (NUM_Q_HEADS // GROUP))
        kvh = lin % (NUM_Q_HEADS // GROUP)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = seq.to(tl.int64)
    if MIXED:
        # A mixed batch: this kernel takes the single-query sequences, the prefill kernel the rest.
        q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    # Split boundaries are multiples of BLOCK_N; trailing splits of short sequences are empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q_at = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_at + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if ROPE:
        q = _rope_and_store(q, q_at, new_k_ptr + q_row * stride_nkt + kvh * stride_nkh,
                            new_v_ptr + q_row * stride_nvt + kvh * stride_nvh,
                            tl.load(pos_ptr + q_row).to(tl.int64), cos_sin_ptr, stride_c,
                            tl.load(slot_ptr + q_row).to(tl.int64),
                            k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh,
                            stride_kb, stride_ks, stride_vb, stride_vs,
                            (lo <= seq_len - 1) & (seq_len - 1 < hi), d, g_mask, d_mask,
                            HEAD_DIM, BLOCK_SIZE)

    if F16:     # an fp8 cache: compute in fp16 (FP8_F16), q clamped to its range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        blk = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # an fp8 cache is widened to q's (compute) dtype here (a no-op otherwise)
        k = tl.load(k_base + (blk * stride_kb + tok * stride_ks)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        s = mma(q, tl.trans(k), PRECISION) * scale_log2                 # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (blk * stride_vb + tok * stride_vs)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    # l_i == 0 only for an empty range (a padded batch row with seq_len 0, or an empty split):
    # emit zeros and a -inf log-sum-exp rather than NaN.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        row = (seq.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split   # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_splits,
                         stride_ot, stride_oh,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, MIXED: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    q_row = seq
    if MIXED:
        q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        if tl.load(query_start_loc_ptr + seq + 1) - q_row != 1:
            return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (seq * NUM_Q_HEADS + head) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)                                            # 0 for empty splits
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, num_splits: int = 1,
                           part_out: torch.Tensor | None = None,
                           part_lse: torch.Tensor | None = None,
                           config: dict | None = None,
                           query_start_loc: torch.Tensor | None = None,
                           rope_store: tuple | None = None,
                           order: torch.Tensor | None = None) -> torch.Tensor:
    """q/out [B, Hq, D] (row b is sequence b's single query); caches [N, block_size, Hkv, D].

    With query_start_loc (a mixed batch, q/out [T, Hq, D]) only sequences with exactly one query
    are computed, at row query_start_loc[b]; the others are left to the prefill kernel.

    With num_splits > 1, part_out (>= B*Hq*num_splits*D fp32) and part_lse (>= B*Hq*num_splits
    fp32) are the caller's scratch, so nothing here allocates.

    rope_store = (k, v, positions, cos_sin_cache, slot_mapping) (not with query_start_loc): q
    and k [B, Hkv, D] are this step's, before the rotary embedding (full head_dim, NeoX); the
    kernel rotates q in registers (q itself is left as it was) and writes rotated k and v at
    slot_mapping (-1: nowhere) before reading them back: the work of rotary_store_kv without
    its launch (see ROPE_IN_DECODE).

    order ([B] int32/int64, a permutation of the sequences, e.g. meta.longest_first): the
    programs of order[0] are started first, then order[1]'s, ... (see LONGEST_FIRST). The
    result is the same in any order.
    """
    hq, d = q.shape[1:]
    b = seq_lens.shape[0]
    hkv = k_cache.shape[2]
    mixed = query_start_loc is not None
    assert hq % hkv == 0 and q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn), \
        "the caches must be in q's dtype or float8_e4m3fn"
    group = hq // hkv
    cfg = {**decode_config(d, k_cache.element_size()), **(config or {})}
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits={num_splits} must be in [1, {MAX_SPLITS}]"
    if num_splits > 1:
        assert part_out is not None and part_lse is not None
        assert part_out.numel() >= b * hq * num_splits * d and part_lse.numel() >= b * hq * num_splits
    else:
        part_out = part_lse = out           # unused by the kernel
    if rope_store is not None:
        new_k, new_v, positions, cos_sin, slots = rope_store
        assert not mixed and cos_sin.shape[-1] == d and d % 2 == 0
        assert new_k.shape == new_v.shape == (b, hkv, d) and new_k.stride(2) == 1 \
            and new_v.stride(2) == 1 and cos_sin.stride(-1) == 1 and k_cache.stride(3) == 1
        rope_args = (new_k, new_v, positions, cos_sin, slots)
        rope_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
                        cos_sin.stride(0))
    else:
        rope_args, rope_strides = (seq_lens,) * 5, (0,) * 5
    if order is not None:
        assert order.shape == (b,) and order.dtype in (torch.int32, torch.int64)
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc if mixed else seq_lens,
        order if order is not None else seq_lens, out, part_out, part_lse, *rope_args,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *rope_strides,
        NUM_Q_HEADS=hq, GROUP=group, BLOCK_G=next_pow2(group, 16),
        HEAD_DIM=d, BLOCK_D=next_pow2(d, 16), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=cfg["BLOCK_N"], SPLIT=num_splits > 1, PRECISION=dot_precision(q.dtype),
        MIXED=mixed, ROPE=rope_store is not None, ORDERED=order is not None,
        F16=cfg["F16"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_launch(q))
    if num_splits > 1:
        _merge_splits_kernel[(b, hq)](
            part_out, part_lse, out, query_start_loc if mixed else seq_lens, num_splits,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=d, BLOCK_D=next_pow2(d, 16),
            BLOCK_S=next_pow2(MAX_SPLITS, 2), MIXED=mixed, num_warps=1 if d <= 64 else 2,
            **pdl_launch(q))
    return out
