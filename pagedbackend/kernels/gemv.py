"""Skinny matmul y = x @ W.T (+ b) for decode batches of 1-4 rows, where a step only streams
weights: every program owns BLOCK_N output columns over the whole K (no split-K, so no second
reduction kernel), keeping BLOCK_M x BLOCK_N x BLOCK_K fp32 partial products in registers and
reducing them once at the end.

Because no program splits K, each one sees whole input rows, so the op before the matmul can
run inside it: the RMSNorm (+ residual add) before q|k|v and gate|up, and SiLU(gate) * up before
down_proj. At one row each of those was a separate ~2 us kernel (a third of a layer's kernels).
The norm's 1/rms is a per-row scalar, so it multiplies the finished dot products: one pass over
the input, but the normalized activations are not rounded to bf16 on the way (the separate
kernel rounds them), so the fused result differs from norm-then-matmul by about one bf16
rounding (~1e-3 relative). A first version computed the mean square in a pass before the
matmul, rounding exactly as the separate kernel; that pass cost q|k|v ~3 us on the H200 and
gate|up more than the norm kernel it replaced.

Whether the kernel replaces cuBLAS for a shape is measured on the device: gemv_tuning.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import (INTERPRET, SPREAD_BYTES_PTX, dot_precision,
                                         l2_prefetch, mma, pair_sum_into_first, pdl_launch,
                                         pdl_trigger, pdl_wait, prefetch_programs)

MAX_ROWS = 4
# (BLOCK_N, BLOCK_K at one row, num_warps, num_stages); BLOCK_K shrinks as rows grow so the
# partial products stay at <= 64 fp32 registers per thread.
CANDIDATES = ((8, 1024, 4, 3), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4),
              (32, 512, 8, 3), (64, 128, 4, 5), (4, 1024, 2, 4))
# The same kernel with the products on the tensor cores (tl.dot of a 16-row input tile, rows
# past M masked to zero, against the weight tile), for 2-4 rows, where the fp32 broadcast
# products of a [rows, BLOCK_N, BLOCK_K] tile lost to cuBLAS on the H200 by 1.2-2x. The input
# tile is rounded to the weights' dtype on its way into the dot (after the norm's gain; 1/rms
# still scales the finished products). Marked by a fifth element.
DOT_CANDIDATES = ((16, 256, 4, 4, True), (32, 256, 4, 4, True), (64, 128, 4, 4, True),
                  (32, 128, 4, 6, True))
# Extra tiles tried for fp8 weights (quantization="fp8"), whose tiles carry half the bytes of
# bf16 ones: deeper pipelines, or tensor-core tiles twice as wide, keep as many bytes in flight.
# (Three more one-row tiles at 8 warps, (8, 2048), (16, 1024) and (4, 4096), were never chosen
# on the H200, call 42.)
FP8_CANDIDATES = ((8, 1024, 4, 5), (16, 512, 4, 6), (4, 2048, 4, 4), (8, 1024, 8, 4),
                  (32, 512, 4, 4, True), (64, 256, 4, 4, True), (16, 512, 4, 5, True))
# One-row tiles for fp8 weights that widen e4m3 to fp32 with integer ops instead of triton's
# conversion (e4m3 -> fp16 -> fp32), which left W1's fp8 step at 60% of HBM bandwidth where bf16
# reads at 85% (calls 41-42): a sixth element WIDEN, 1 in triton-language, 2 in PTX (see
# _widen_e4m3). Same sums, bit for bit, as the tile without it. The wider ones (32 or 16 rows
# of 1-byte weights per program) spread the fused prologue's input loads over more weights.
FP8_WIDEN_CANDIDATES = ((8, 1024, 4, 3, False, 1), (8, 1024, 4, 3, False, 2),
                        (16, 512, 4, 4, False, 1), (16, 512, 4, 4, False, 2),
                        (4, 2048, 4, 4, False, 2), (8, 1024, 4, 5, False, 2),
                        (32, 256, 4, 4, False, 2), (16, 1024, 8, 3, False, 2))
# One-row tiles for one-byte weights that multiply in fp16 pairs (WIDEN 3 for e4m3, 4 for int8;
# _byte_half_step): eight weights a thread at a time, widened two at a time (e4m3: one hardware
# cvt per pair; int8: prmt, lop3 and an exact subtraction per pair), multiplied by the input
# (times 2^-10 in fp16) in a chain of four fp16-pair FMAs, the chain's two sums widened and
# added to an fp32 accumulator: ~1.6 (e4m3) / ~2.4 (int8) instructions a weight where the fp32
# tiles above issue ~2.5 (triton's e4m3 cast), ~4 (WIDEN 2) or an I2F each (int8, quarter
# rate). The fp16 chain holds four products of at most 448 |x| / 1024: inputs up to ~37,000
# stay finite, and a tile whose sums came out inf or NaN redoes its columns with fp32 products
# (_skinny_row_fp32); an input below 2^-14 * 1024 loses bits to fp16's subnormals (about one
# bf16 rounding at 0.06). Tried against the others by the tuner, which keeps a tile only where it
# agrees with the reference.
FP8_HALF_CANDIDATES = ((8, 1024, 4, 3, False, 3), (16, 512, 4, 4, False, 3),
                       (4, 2048, 4, 4, False, 3), (8, 1024, 4, 5, False, 3),
                       (32, 256, 4, 4, False, 3), (16, 1024, 8, 3, False, 3))
INT8_HALF_CANDIDATES = tuple(c[:5] + (4,) for c in FP8_HALF_CANDIDATES)
# (Their split-K forms, K over 2 or 4 programs as gemv_w4's, were tried and removed: 0.76-0.95x
# the whole-K tile at every llama-3.1-8b shape, H100 call 64.)
# The tensor-core tiles compute any row count up to this (BLOCK_M = rows rounded up to a power
# of two, at least 16); the engine hands the kernel at most MAX_ROWS. perf/gemm_bench.py
# --triton times them against cuBLAS at wider steps, in bf16: in fp32 a 64-row input tile of
# several pipeline stages needs more shared memory than an H200 has (245,760 > 232,448 bytes).
MAX_DOT_ROWS = 64


# What the kernel does to its input on the way in (PROLOGUE): nothing; RMSNorm; residual add +
# RMSNorm (program 0 also writes the sum, the next residual); SiLU(gate) * up over gate|up.
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3


@triton.jit
def _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K,
                EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] fp32 input tile at columns k, and (for the norms) the rows' sums
    of squares over it. SiLU(gate) * up and the residual sum are rounded to the activation dtype
    exactly as the separate kernels round them; the RMSNorm's 1/rms is applied to the finished
    dot products instead (a scalar per row), so no pass over the row is needed first."""
    if EVEN_K:
        ok = m_ok
    else:
        ok = m_ok & (k < K)[None, :]
    x = tl.load(x_rows + k[None, :], mask=ok, other=0.0)
    dt = x.dtype
    if PROLOGUE == 3:
        up = tl.load(x_rows + K + k[None, :], mask=ok, other=0.0)
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
    if PROLOGUE == 2:
        r = tl.load(r_rows + k[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(r_out_rows + k[None, :], x, mask=ok & store_ok)
    xf = x.to(tl.float32)
    sq = tl.sum(xf * xf, axis=1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        xf = xf * g[None, :]
    return xf, sq


# 2^-120 (e4m3's bits as fp32) x 2^64 (the input) x 2^56 (the sums) == 1: exact powers of two
X_UP, Y_UP = tl.constexpr(2.0 ** 64), tl.constexpr(2.0 ** 56)
# fp32's sign bit and bits 20-26 (0x87F00000 as a signed int32)
E4M3_IN_FP32 = tl.constexpr(-2014314496)


@triton.jit
def _widen_e4m3(w, WIDEN: tl.constexpr):
    """e4m3 weights -> fp32 for the FMA tiles. WIDEN 0: triton's cast. 1 and 2: e4m3's sign to
    fp32's sign bit and its exponent|mantissa bits to bits 20-26, which is the value times
    2^-120 exactly, subnormals included (as fp32 denormals, which FFMA keeps); NaN (never in
    quantized weights) becomes a finite number. 1 writes it in triton-language (sign-extend,
    shift, mask); 2 in PTX on four packed bytes at a time (shl / shr.s32 / and per byte). The
    CPU interpreter cannot run PTX, so 2 runs 1 there: the PTX is tested on the GPU only."""
    # no early return: triton compiles the statements after a static if's return too, and the
    # 8-bit bitcast below does not compile for 16-bit weights (every bf16 FMA tile failed)
    if WIDEN == 0:
        out = w.to(tl.float32)
    else:
        b = w.to(tl.int8, bitcast=True)
        if WIDEN == 2 and not INTERPRET:
            bits = tl.inline_asm_elementwise(
                "{\n\t.reg .b32 t;\n\t"
                "shl.b32 t, $4, 24;\n\tshr.s32 t, t, 4;\n\tand.b32 $0, t, 0x87F00000;\n\t"
                "shl.b32 t, $4, 16;\n\tshr.s32 t, t, 4;\n\tand.b32 $1, t, 0x87F00000;\n\t"
                "shl.b32 t, $4, 8;\n\tshr.s32 t, t, 4;\n\tand.b32 $2, t, 0x87F00000;\n\t"
                "shr.s32 t, $4, 4;\n\tand.b32 $3, t, 0x87F00000;\n\t}",
                "=r,=r,=r,=r,r", [b], dtype=tl.int32, is_pure=True, pack=4)
        else:
            bits = (b.to(tl.int32) << 20) & E4M3_IN_FP32
        out = bits.to(tl.float32, bitcast=True)
    return out


# the fp16-pair tiles' input scale (exact: a power of two) and its inverse on the sums
BYTE_HALF_DOWN, BYTE_HALF_UP = tl.constexpr(2.0 ** -10), tl.constexpr(2.0 ** 10)

# $0-$7 out, $8-$15 the accumulator (eight fp32: the sum goes to the first, the rest pass
# through), $16-$17 eight weight bytes of one row, $18-$21 the input at their columns (fp16
# pairs). Each block widens the bytes into h0-h3 (fp16 pairs), then the chain below multiplies
# them by the input and adds the widened sum to the first accumulator.
_BYTE_HALF_CHAIN = """mul.rn.f16x2 p, $18, h0;
fma.rn.f16x2 p, $19, h1, p;
fma.rn.f16x2 p, $20, h2, p;
fma.rn.f16x2 p, $21, h3, p;
""" + pair_sum_into_first("p", "add.rn.f32 $0, $8, f0;")
# e4m3: cvt.rn.f16x2.e4m3x2 widens each 16-bit half (two weights, exact)
_E4M3_HALF_ASM = tl.constexpr("""{
.reg .b16 a0, a1, a2, a3, u0, u1;
.reg .b32 h0, h1, h2, h3, p;
.reg .f32 f0, f1;
mov.b32 {a0, a1}, $16;
mov.b32 {a2, a3}, $17;
cvt.rn.f16x2.e4m3x2 h0, a0;
cvt.rn.f16x2.e4m3x2 h1, a1;
cvt.rn.f16x2.e4m3x2 h2, a2;
cvt.rn.f16x2.e4m3x2 h3, a3;
""" + _BYTE_HALF_CHAIN)
# int8: the bytes spread in pairs (SPREAD_BYTES_PTX); lop3 (a ^ 0x80) | 0x6400 puts
# q + 128 into fp16 1024's mantissa (1024 + 128 + q), and subtracting 1152 leaves q exactly
_INT8_HALF_ASM = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, h0, h1, h2, h3, p, c;
.reg .b16 u0, u1;
.reg .f32 f0, f1;
mov.b32 c, 0x64806480;
""" + SPREAD_BYTES_PTX + """lop3.b32 t0, t0, 0x00800080, 0x64006400, 0xBE;
lop3.b32 t1, t1, 0x00800080, 0x64006400, 0xBE;
lop3.b32 t2, t2, 0x00800080, 0x64006400, 0xBE;
lop3.b32 t3, t3, 0x00800080, 0x64006400, 0xBE;
sub.rn.f16x2 h0, t0, c;
sub.rn.f16x2 h1, t1, c;
sub.rn.f16x2 h2, t2, c;
sub.rn.f16x2 h3, t3, c;
""" + _BYTE_HALF_CHAIN)
_BYTE_HALF_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 14))


@triton.jit
def _byte_half_step(acc, w, x, WIDEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] fp32 plus, per eight consecutive one-byte weights w of a row
    (e4m3 for WIDEN 3, int8 for 4; each thread holding eight consecutive bytes of a row or a
    multiple of it), the sum of their products with x ([1, BLOCK_K] fp32, times
    BYTE_HALF_DOWN) in fp16 pairs, into the first of the eight accumulators. The CPU
    interpreter cannot run PTX: it rounds each product to fp16 and adds it in fp32 to its own
    accumulator (the same sum, up to the chain's roundings, once the caller reduces the
    row)."""
    if INTERPRET:   # each product rounded to fp16 (no chain): an overflow shows as on the GPU
        out = acc + (x.to(tl.float16) * w.to(tl.float32).to(tl.float16)).to(tl.float32)
    else:
        b = w.to(tl.uint8, bitcast=True)
        xh = x.to(tl.float16)
        if WIDEN == 3:
            out = tl.inline_asm_elementwise(_E4M3_HALF_ASM, _BYTE_HALF_CONSTRAINTS,
                                            [acc, b, xh], dtype=tl.float32, is_pure=True,
                                            pack=8)
        else:
            out = tl.inline_asm_elementwise(_INT8_HALF_ASM, _BYTE_HALF_CONSTRAINTS,
                                            [acc, b, xh], dtype=tl.float32, is_pure=True,
                                            pack=8)
    return out


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, r_ptr, r_out_ptr, g_ptr, eps, M, N, K,
                   stride_xm, stride_wn, stride_ym, stride_rm, stride_rom, prefetch_programs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                   EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
                   USE_DOT: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    r_rows = r_ptr + m.to(tl.int64)[:, None] * stride_rm
    r_out_rows = r_out_ptr + m.to(tl.int64)[:, None] * stride_rom
    m_ok = (m < M)[:, None]
    n_ok = (n < N)[:, None]
    # program 0 alone writes the residual sum (rows M for it, none for the others)
    store_ok = (m < M - M * tl.minimum(pid, 1))[:, None]
    pdl_trigger(USE_PDL)
    if PREFETCH:        # the first programs' weight rows (contiguous) start towards L2 now
        if pid < prefetch_programs:
            l2_prefetch(w_ptr + pid * BLOCK_N * stride_wn,
                        BLOCK_N * K * w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    pdl_wait(USE_PDL)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_DOT:          # BLOCK_M >= 16, rows past M zero
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:   # one row: a plain 2-D tile, the layout triton handles best
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K, EVEN_K,
                            PROLOGUE)
        if PROLOGUE == 1 or PROLOGUE == 2:
            ss += sq
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok, other=0.0,
                            eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok & (k < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        if USE_DOT:
            if HAS_SCALE:   # fp8 / int8 weights: e4m3 widens to fp16 in one cvt, int8 exactly
                acc2 += mma(x.to(tl.float16), tl.trans(w.to(tl.float16)), PRECISION)
            else:
                acc2 += mma(x.to(w.dtype), tl.trans(w), PRECISION)
        elif WIDEN >= 3:    # one row, one-byte weights, fp16 pairs (FP8_HALF_CANDIDATES)
            acc1 = _byte_half_step(acc1, w, tl.sum(x, axis=0)[None, :] * BYTE_HALF_DOWN, WIDEN)
        else:
            if WIDEN:
                x = x * X_UP
            if BLOCK_M == 1:
                acc1 += tl.sum(x, axis=0)[None, :] * _widen_e4m3(w, WIDEN)
            else:
                acc += x[:, None, :] * _widen_e4m3(w, WIDEN)[None, :, :]
    if USE_DOT:
        y = acc2                                                        # [BLOCK_M, BLOCK_N]
    elif BLOCK_M == 1:
        y = tl.sum(acc1, axis=1)[None, :]                               # [1, BLOCK_N]
    else:
        y = tl.sum(acc, axis=2)                                         # [BLOCK_M, BLOCK_N]
    if WIDEN >= 3:
        y = y * BYTE_HALF_UP
        # an fp16 chain that overflowed (inputs past ~37,000 meeting large weights) leaves an
        # inf or NaN in its row's sum: the tile's columns again with fp32 products (rare, and
        # cheap when not taken: one reduction)
        if tl.sum(((y != y) | (tl.abs(y) > 3.0e38)).to(tl.int32)) > 0:
            y = _skinny_row_fp32(x_rows, r_rows, r_out_rows, g_ptr, w_rows, kk, store_ok, m_ok,
                                 n_ok, K, BLOCK_N, BLOCK_K, EVEN_K, PROLOGUE)
    elif WIDEN:
        y = y * Y_UP
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_SCALE:
        y = y * tl.load(s_ptr + n, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m_ok & (n < N)[None, :])


@triton.jit
def _skinny_row_fp32(x_rows, r_rows, r_out_rows, g_ptr, w_rows, kk, store_ok, m_ok, n_ok, K,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PROLOGUE: tl.constexpr):
    """One row's sums with fp32 products of the one-byte weights (triton's conversion),
    [1, BLOCK_N]: the fp16-pair tiles' way out of an overflow. The prologue runs again as it
    ran (the residual sum it stores is the same). Each iteration's products are summed at once
    into [BLOCK_N] sums: a [BLOCK_N, BLOCK_K] fp32 accumulator (64 registers a thread at
    8 x 1,024 over 4 warps) set the whole kernel's register count for this rarely taken path,
    121 instead of 64 compiled for sm_90, and so halved the programs a SM holds."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K, EVEN_K,
                            PROLOGUE)
        w = tl.load(w_rows + k[None, :], mask=n_ok & (k < K)[None, :], other=0.0)
        acc += tl.sum(tl.sum(x, axis=0)[None, :] * w.to(tl.float32), axis=1)
    return acc[None, :]


def byte_half_fits(config: tuple, k: int) -> bool:
    """Whether an fp16-pair tile (WIDEN 3 / 4) gives every thread eight consecutive bytes of a
    row (or a multiple) with no masked tail along K: _byte_half_step takes them eight at a
    time."""
    block_n, block_k, warps = config[:3]
    return k % block_k == 0 and block_k % 16 == 0 and block_n * block_k >= 8 * 32 * warps


def tile_block_k(block_k1: int, block_m: int, k: int, use_dot: bool = False) -> int:
    """The BLOCK_K a tile runs with: its one-row BLOCK_K, shrunk for more rows (FMA tiles), and
    at most K rounded up to a power of two (16 at least)."""
    return min(block_k1 if use_dot else max(block_k1 // block_m, 16),
               max(triton.next_power_of_2(k), 16))


def rows_bucket(m: int) -> int:
    return triton.next_power_of_2(m)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: tuple, prologue: int = PLAIN,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0, weight_scale: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= MAX_ROWS, or MAX_DOT_ROWS with a DOT_CANDIDATES tile; rows contiguous),
    weight [N, K] contiguous, bias [N] or None -> [M, N] in x's dtype, with one of CANDIDATES
    or DOT_CANDIDATES as the tile. With weight_scale [N] (fp32) the weight is float8 e4m3 (or
    int8, quantization="int8") and
    y = x @ (weight * weight_scale[:, None]).T: the input stays in 16 bits (the tensor-core
    tiles round it to fp16), the scale multiplies the finished products.

    prologue NORM: y = rms_norm(x, norm_weight, eps) @ W.T; ADD_NORM: the same over x + residual,
    returning (y, x + residual); SILU_MUL: x is [M, 2K] holding gate | up and
    y = (silu(gate) * up) @ W.T."""
    m = x.shape[0]
    n, k = weight.shape
    block_n, block_k1, warps, stages, *dot = config
    use_dot = bool(dot and dot[0])
    widen = dot[1] if len(dot) > 1 else 0
    assert not widen or not use_dot and (widen < 3 or m == 1) and weight.dtype == (
        torch.int8 if widen == 4 else torch.float8_e4m3fn), \
        f"tile {config} widens {'int8' if widen == 4 else 'e4m3'} weights" \
        f"{' of one row' if widen >= 3 else ''}, not {m} rows of {weight.dtype}"
    assert 1 <= m <= (MAX_DOT_ROWS if use_dot else MAX_ROWS) and x.stride(1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
    assert (weight_scale is not None) == (weight.dtype in (torch.float8_e4m3fn, torch.int8))
    assert weight_scale is None or weight_scale.shape == (n,) and weight_scale.is_contiguous()
    block_m = max(16, rows_bucket(m)) if use_dot else rows_bucket(m)
    block_k = tile_block_k(block_k1, block_m, k, use_dot)
    assert widen < 3 or byte_half_fits((block_n, block_k, warps), k), \
        f"fp16-pair tile {config} needs K {k} a multiple of its BLOCK_K and 8 bytes a thread"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r = r_out = x
    if prologue in (NORM, ADD_NORM):
        assert norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if prologue == ADD_NORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        r, r_out = residual, torch.empty_like(x)
    even_n = n % block_n == 0
    # a program's weight rows are contiguous: block_n * k elements (all in bounds if EVEN_N)
    pf = prefetch_programs(weight, block_n * k * weight.element_size(), prologue == PLAIN) \
        if even_n else 0
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, y, r, r_out,
        norm_weight if norm_weight is not None else weight, eps, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), r.stride(0), r_out.stride(0), pf,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None, EVEN_N=even_n, EVEN_K=k % block_k == 0,
        PROLOGUE=prologue, PREFETCH=pf > 0,
        USE_DOT=use_dot, PRECISION=dot_precision(x.dtype), WIDEN=widen, num_warps=warps,
        num_stages=stages, **pdl_launch(x))
    return (y, r_out) if prologue == ADD_NORM else y
