"""Matmuls on AWQ / GPTQ weights in the layout quant_grouped.PackedWeight repacks them into at
load (uint8 [N, K * bits / 8] codes, low nibble first; scales and zeros [G, N]), so one kernel
serves both formats.

Decode steps of 1-8 rows: a skinny W4A16 (or W8A16) matmul. Each program owns BLOCK_N output
rows over the whole K and reads each weight byte once: a piece of a row's codes lies inside one
group (an iteration takes several pieces), so its scale and zero are one load per row, the
codes are unpacked and dequantized in registers ((q - z) * s in fp32, exact) and multiplied by
the 16-bit input: broadcast products at one row (SPLIT_CANDIDATES: 4-bit codes as two nibble
tiles, _nibbles_piece), tensor-core dots (input tile padded to 16 rows) at more. The tile, and
whether the prologue below runs inside it, are timed on the device per shape at first use
(gemv_w4_tuning.py), as gemv_tuning does for the 16-bit kernel. Like that kernel it can take
the prologue of the op before it (RMSNorm, residual add + RMSNorm, SiLU * up), is launched with
programmatic dependent launch, and its first programs prefetch their codes into L2 before
waiting.
Wider steps run either the same kernel as a tiled GEMM (row tiles of 64-128, the dequantized
weight tile fed to the tensor cores) or dequantize the weight into a 16-bit buffer (one kernel,
each byte read once) and run cuBLAS on it, whichever was timed faster for the rows bucket: at
hundreds of rows the matmul is compute-bound and the dequantization's extra traffic (2.5 bytes
per weight) is a small part of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import (dot_precision, l2_prefetch, mma, pdl_launch,
                                         pdl_trigger, pdl_wait, prefetch_programs)
from pagedbackend.kernels.gemv import ADD_NORM, NORM, PLAIN, SILU_MUL, _input_tile

MAX_ROWS = 8
# (BLOCK_N, BLOCK_K, num_warps, num_stages[, dot[, BLOCK_M]]); BLOCK_K spans whole groups
# (pieces of one group each, _tile_k). Narrow tiles give the ~130 SMs enough programs on
# llama-3.1-8b's o_proj / down_proj (N = 4096); wide BLOCK_K keeps each program's bytes in flight.
CANDIDATES = ((16, 1024, 4, 3), (8, 1024, 4, 4), (32, 512, 4, 4), (16, 512, 4, 4),
              (64, 128, 4, 4), (32, 256, 4, 3), (8, 2048, 4, 3), (64, 256, 8, 3))
DOT_CANDIDATES = ((32, 512, 4, 3, True), (64, 128, 4, 4, True), (16, 512, 4, 4, True))
# 4-bit FMA tiles (1-8 rows) that keep a byte's low and high nibbles as two tiles against the
# input's even and odd columns (SPLIT, a sixth element after USE_DOT=False; the GEMM tiles'
# sixth is BLOCK_M): no interleave, no int-to-float conversion, no layout change of the weight
# tile, the scale once per pair (_nibbles_piece). Compiled for sm_90 at one row they issue
# 6.0-7.0 instructions a weight in the main loop where the byte tiles above issue 7.2-7.8.
SPLIT_CANDIDATES = ((16, 1024, 4, 3, False, True), (32, 512, 4, 4, False, True),
                    (64, 256, 4, 3, False, True), (32, 1024, 4, 3, False, True),
                    (8, 1024, 4, 4, False, True), (8, 2048, 4, 3, False, True),
                    (32, 256, 4, 4, False, True), (64, 512, 8, 3, False, True))
# wider steps: the same kernel as a tiled GEMM (a grid over row tiles of BLOCK_M), timed per
# rows bucket against dequantize + cuBLAS
GEMM_CANDIDATES = ((128, 64, 8, 3, True, 128), (128, 64, 4, 4, True, 64),
                   (64, 128, 4, 4, True, 64), (128, 128, 8, 3, True, 64))
MAX_GEMM_ROWS = 16384


@triton.jit
def _codes_tile(q_rows, n_ok, k0, s_ptr, z_ptr, n, N, GROUP: tl.constexpr, BITS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] fp32 weights at input columns k0.. (one group): (q - z) * s."""
    PER: tl.constexpr = 8 // BITS
    kb = k0 // PER + tl.arange(0, BLOCK_K // PER)
    b = tl.load(q_rows + kb[None, :], mask=n_ok[:, None], other=0,
                eviction_policy="evict_first")
    if BITS == 4:      # byte j holds codes 2j (low nibble) and 2j + 1
        codes = tl.join(b & 0xF, b >> 4).reshape(BLOCK_N, BLOCK_K)
    else:
        codes = b
    g = k0 // GROUP
    s = tl.load(s_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + n, mask=n_ok, other=0).to(tl.int32)
    return (codes.to(tl.int32) - z[:, None]).to(tl.float32) * s[:, None]


# fp32 2^23 and its bits: a code c (< 2^23) OR-ed into the mantissa reads as 2^23 + c, exactly
MAGIC, MAGIC_BITS = tl.constexpr(8388608.0), tl.constexpr(0x4B000000)


@triton.jit
def _nibbles_piece(q_rows, n_ok, k0, s_ptr, z_ptr, n, N, GROUP: tl.constexpr,
                   BLOCK_N: tl.constexpr, SUB_K: tl.constexpr):
    """SPLIT's 4-bit piece at input columns k0.. (one group): (lo, hi, s), lo and hi the
    [BLOCK_N, SUB_K / 2] fp32 q - z of the even and odd columns (the bytes' low and high
    nibbles, never interleaved) and s the [BLOCK_N] scales. No int-to-float conversion: a
    nibble OR-ed into 2^23's mantissa reads as 2^23 + q (the high one, left in bits 4-7, as
    2^23 + 16 q: times 1/16 in the same FMA), and subtracting 2^23 + z leaves q - z exactly
    (every value an integer below 2^24, or that over 16), so w = (q - z) * s as in _codes_tile.
    The caller multiplies by s after summing a pair's products, x_even (q - z) + x_odd (q - z):
    one rounding more or less than x * w per weight, fp32 sums within the fp32 test's 1e-5."""
    kb = k0 // 2 + tl.arange(0, SUB_K // 2)
    b = tl.load(q_rows + kb[None, :], mask=n_ok[:, None], other=0,
                eviction_policy="evict_first").to(tl.int32)
    g = k0 // GROUP
    s = tl.load(s_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + n, mask=n_ok, other=0).to(tl.float32)
    lo = ((b & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True) - (z + MAGIC)[:, None]
    hi = ((b & 0xF0) | MAGIC_BITS).to(tl.float32, bitcast=True) * 0.0625 \
        - (z + MAGIC * 0.0625)[:, None]
    return lo, hi, s


@triton.jit
def _packed_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, r_ptr, r_out_ptr, g_ptr, eps,
                        M, N, K, stride_xm, stride_ym, stride_rm, stride_rom,
                        GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                        USE_DOT: tl.constexpr, PRECISION: tl.constexpr, PROLOGUE: tl.constexpr,
                        prefetch_programs, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = (m < M)[:, None]
    q_rows = q_ptr + n.to(tl.int64)[:, None] * (K * BITS // 8)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    # the prologues of gemv.py's kernel (RMSNorm, residual add + RMSNorm, SiLU * up), by its
    # _input_tile; program 0 of the N axis alone writes the residual sum
    r_rows = r_ptr + m.to(tl.int64)[:, None] * stride_rm
    r_out_rows = r_out_ptr + m.to(tl.int64)[:, None] * stride_rom
    store_ok = (m < M - M * tl.minimum(pid, 1))[:, None]
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    # as gemv.py: the next kernel may start now; the first programs' codes (contiguous rows,
    # written by no kernel) start towards L2 before the wait for the previous kernel's output
    pdl_trigger(USE_PDL)
    if PREFETCH:
        if pid < prefetch_programs:
            l2_prefetch(q_ptr + pid * BLOCK_N * (K * BITS // 8), BLOCK_N * (K * BITS // 8))
    pdl_wait(USE_PDL)
    if USE_DOT:
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc1 = tl.zeros([BLOCK_N, SUB_K // (1 + SPLIT)], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, SUB_K // (1 + SPLIT)], dtype=tl.float32)
    # BLOCK_K columns per iteration in pieces of SUB_K, each inside one group: several groups'
    # loads in flight per program without a scale per column
    for k0 in range(0, K, BLOCK_K):
        for i in tl.static_range(BLOCK_K // SUB_K):
            kk = k0 + i * SUB_K
            if SPLIT:
                lo, hi, s = _nibbles_piece(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP,
                                           BLOCK_N, SUB_K)
                # the input's even and odd columns (the bytes' low and high nibbles): loaded
                # whole and split in registers, which compiled to fewer instructions than two
                # loads of stride 2 (one load instruction a column)
                k = kk + 2 * tl.arange(0, SUB_K // 2)
                if PROLOGUE == 0:
                    xc = tl.load(x_rows + kk + tl.arange(0, SUB_K)[None, :], mask=m_ok,
                                 other=0.0)
                    xe, xo = xc.to(tl.float32).reshape(BLOCK_M, SUB_K // 2, 2).split()
                else:
                    xe, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok,
                                         K, True, PROLOGUE)
                    xo, sq1 = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k + 1, store_ok,
                                          m_ok, K, True, PROLOGUE)
                    if PROLOGUE == 1 or PROLOGUE == 2:
                        ss += sq + sq1
                # the scale once per pair of weights: (x_even (q - z) + x_odd (q - z)) * s
                if BLOCK_M == 1:
                    acc1 += (xe * lo + xo * hi) * s[:, None]
                else:
                    acc3 += (xe[:, None, :] * lo[None, :, :] + xo[:, None, :] * hi[None, :, :]) \
                        * s[None, :, None]
            else:
                w = _codes_tile(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP, BITS, BLOCK_N, SUB_K)
                k = kk + tl.arange(0, SUB_K)
                if PROLOGUE == 0:
                    x = tl.load(x_rows + k[None, :], mask=m_ok, other=0.0)
                else:
                    x, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K,
                                        True, PROLOGUE)
                    if PROLOGUE == 1 or PROLOGUE == 2:
                        ss += sq
                if USE_DOT:
                    xd = x.to(y_ptr.dtype.element_ty)
                    acc2 += mma(xd, tl.trans(w.to(xd.dtype)), PRECISION)
                elif BLOCK_M == 1:
                    acc1 += x.to(tl.float32) * w
                else:
                    acc3 += x.to(tl.float32)[:, None, :] * w[None, :, :]
    if USE_DOT:
        y = acc2
    elif BLOCK_M == 1:
        y = tl.sum(acc1, axis=1)[None, :]
    else:
        y = tl.sum(acc3, axis=2)
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok[None, :])


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr, BITS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k0 = tl.program_id(1) * BLOCK_K
    q_rows = q_ptr + n.to(tl.int64)[:, None] * (K * BITS // 8)
    w = _codes_tile(q_rows, n_ok, k0, s_ptr, z_ptr, n, N, GROUP, BITS, BLOCK_N, BLOCK_K)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_ok[:, None])


def _tile_k(want: int, group: int, k: int) -> tuple[int, int]:
    """(SUB_K, BLOCK_K): pieces inside one group, as many per iteration as `want` allows
    while BLOCK_K divides K (no masked tail)."""
    sub = _block_k(want, group)
    pieces = max(want // sub, 1)
    while k % (sub * pieces):
        pieces -= 1
    return sub, sub * pieces


def _block_k(want: int, group: int) -> int:
    """The largest power of two <= want dividing the group size (a tile stays in one group)."""
    b = 1
    while b * 2 <= want and group % (b * 2) == 0:
        b *= 2
    return b


def dequantize_packed(pw, dtype: torch.dtype) -> torch.Tensor:
    """PackedWeight (even groups) -> W [N, K] in dtype: (q - z) * s, rounded once."""
    n, k = pw.shape
    w = torch.empty((n, k), dtype=dtype, device=pw.qweight.device)
    block_n, block_k = 32, _block_k(128, pw.group_size)
    _dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        pw.qweight, pw.scales, pw.zeros, w, n, k, GROUP=pw.group_size, BITS=pw.bits,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return w


def packed_gemv(x: torch.Tensor, pw, bias: torch.Tensor | None, config: tuple,
                prologue: int = PLAIN, residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """x [M, K] (rows contiguous) @ W.T (+ bias) -> [M, N] in x's dtype, W the PackedWeight
    (even groups), with one of CANDIDATES / DOT_CANDIDATES (M <= MAX_ROWS) or
    GEMM_CANDIDATES (any M: row tiles of BLOCK_M) as the tile. The prologues are gemv.py's:
    NORM, ADD_NORM (returning (y, x + residual)) and SILU_MUL (x = gate | up, [M, 2K])."""
    m = x.shape[0]
    n, k = pw.shape
    block_n, block_k, warps, stages, *dot = config
    use_dot = bool(dot and dot[0])
    split = not use_dot and len(dot) > 1 and bool(dot[1])     # SPLIT_CANDIDATES
    assert m >= 1 and x.stride(1) == 1 and pw.g_idx is None
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    assert not split or pw.bits == 4, f"SPLIT tiles read 4-bit codes, not {pw.bits}-bit"
    if use_dot and len(dot) > 1:
        block_m = dot[1]
    else:
        assert m <= MAX_ROWS
        block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r = r_out = x
    if prologue == ADD_NORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        r, r_out = residual, torch.empty_like(x)
    if prologue in (NORM, ADD_NORM):
        assert norm_weight is not None and norm_weight.shape == (k,)
    sub_k, block_k = _tile_k(block_k, pw.group_size, k)
    row_tiles = triton.cdiv(m, block_m)
    pf = prefetch_programs(pw.qweight, block_n * pw.qweight.shape[1], prologue == PLAIN) \
        if n % block_n == 0 and row_tiles == 1 else 0
    _packed_gemv_kernel[(triton.cdiv(n, block_n), row_tiles)](
        x, pw.qweight, pw.scales, pw.zeros, bias if bias is not None else y, y, r, r_out,
        norm_weight if norm_weight is not None else y, eps, m, n, k,
        x.stride(0), y.stride(0), r.stride(0), r_out.stride(0), GROUP=pw.group_size,
        BITS=pw.bits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SUB_K=sub_k, HAS_BIAS=bias is not None, SPLIT=split,
        USE_DOT=use_dot,
        PRECISION=dot_precision(x.dtype), PROLOGUE=prologue, prefetch_programs=pf,
        PREFETCH=pf > 0, num_warps=warps, num_stages=stages, **pdl_launch(x))
    return (y, r_out) if prologue == ADD_NORM else y
