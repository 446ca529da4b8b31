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
Wider steps run either a tiled GEMM (SWAP_CANDIDATES: the dequantized weight tile the tensor
cores' first operand) or dequantize the weight into a 16-bit buffer (one kernel, each byte read
once) and run cuBLAS on it, whichever was timed faster for the rows bucket; above
gemv_w4_tuning.MAX_TUNED_ROWS the latter, untimed: there the matmul is compute-bound, cuBLAS
runs it at ~1.7x the tiles' rate and the dequantization's extra traffic (2.5 bytes a weight)
is a small part of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import (INTERPRET, SPREAD_BYTES_PTX, dot_precision,
                                         l2_prefetch, mma, pair_sum_into_first, pdl_enter,
                                         pdl_launch, pdl_trigger, pdl_wait, prefetch_programs)
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
# one row, split-K (a seventh element: KSPLIT programs per N tile, each over K / KSPLIT, the
# last to finish adding their fp32 sums): N = 4096-6144 leaves the tiles above too few
# programs for ~130 SMs (H100 call 58: the HALF tiles 0.72-0.77x the SPLIT tiles there)
KSPLIT_CANDIDATES = ((64, 256, 4, 3, False, 2, 2), (64, 256, 4, 3, False, 2, 4),
                     (128, 256, 4, 3, False, 2, 4), (64, 256, 4, 3, False, 2, 8),
                     (32, 512, 4, 4, False, 2, 4), (32, 512, 4, 4, False, 2, 2),
                     (64, 256, 4, 3, False, 3, 2), (64, 128, 4, 3, False, 3, 4),
                     (64, 128, 4, 3, False, 3, 8), (64, 256, 4, 3, False, 3, 8),
                     (16, 1024, 4, 3, False, True, 2),
                     (32, 512, 4, 4, False, True, 4), (16, 512, 4, 4, False, True, 4))
# wider steps: swap-AB GEMM tiles ("t", BLOCK_N, BLOCK_M, SUB_K, num_warps, num_stages, SPLIT),
# timed per rows bucket against dequantize + cuBLAS. The weight tile is the dot's first operand,
# acc[BLOCK_N, BLOCK_M] = W x^T, so the dequantized codes feed the tensor cores from registers
# (wgmma's A) and the input tile, loaded as it is, is the one staged in shared memory. Programs
# that share a weight tile run side by side (the row tiles vary fastest), so its codes come from
# HBM about once. SPLIT (4-bit codes) takes the nibbles as _nibbles_piece gives them. On the
# H200 (call 70) they ran 1.1-1.3x the tiles that made the weight the second operand (removed)
# at every llama-3.1-8b shape at 512 and 8,192 rows, and triton's warp-specialized loop gave
# them nothing (removed); each tile below was the fastest somewhere (calls 70, 73).
# SPLIT 2 (16-bit inputs): the codes opened in PTX (_codes_pair_step), times s in 16 bits;
# compiled for sm_90 their loops issue 0.75-0.9x the instructions of the SPLIT ones.
SWAP_CANDIDATES = (("t", 64, 128, 64, 4, 3, False), ("t", 128, 256, 64, 8, 3, False),
                   ("t", 64, 256, 64, 4, 3, False), ("t", 128, 128, 128, 8, 3, True),
                   ("t", 64, 128, 128, 4, 3, True), ("t", 128, 64, 128, 4, 4, True),
                   ("t", 128, 256, 64, 8, 3, 2), ("t", 128, 128, 128, 8, 3, 2),
                   ("t", 256, 128, 64, 8, 3, 2), ("t", 64, 128, 128, 4, 3, 2))


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
def _codes_piece(q_rows, n_ok, k0, s_ptr, z_ptr, n, N, GROUP: tl.constexpr,
                 SUB_K: tl.constexpr):
    """(b, s, z): a 4-bit piece at input columns k0.. (a multiple of SUB_K, inside one group)
    as loaded: the code bytes b (uint8 [BLOCK_N, SUB_K / 2], low nibble first) and the rows'
    scales s and zero points z ([BLOCK_N] fp32)."""
    kb = tl.multiple_of(k0 // 2, SUB_K // 2) + tl.arange(0, SUB_K // 2)
    b = tl.load(q_rows + kb[None, :], mask=n_ok[:, None], other=0,
                eviction_policy="evict_first")
    g = k0 // GROUP
    s = tl.load(s_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + n, mask=n_ok, other=0).to(tl.float32)
    return b, s, z


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
    b, s, z = _codes_piece(q_rows, n_ok, k0, s_ptr, z_ptr, n, N, GROUP, SUB_K)
    b = b.to(tl.int32)
    lo = ((b & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True) - (z + MAGIC)[:, None]
    hi = ((b & 0xF0) | MAGIC_BITS).to(tl.float32, bitcast=True) * 0.0625 \
        - (z + MAGIC * 0.0625)[:, None]
    return lo, hi, s


# HALF tiles (SPLIT = 2; one row, 16-bit inputs, no prologue): the codes' dequantization and
# products in PTX on fp16 pairs, eight bytes (sixteen weights) of a row at a time (_half_step).
# Per 16 weights: 4 prmt, 8 lop3, 8 exact zero subtractions, 8 products, 3 adds, then one fp32
# FMA with the scale, where the fp32 SPLIT tiles issue ~6 instructions a weight.
# Compiled for sm_90 (group 128) the main loop issues 3.0-3.6 instructions a weight at BLOCK_N
# 64-128 and 4.1-4.9 at 16-32, where narrow tiles give N = 4096 enough programs.
HALF_CANDIDATES = ((128, 256, 4, 3, False, 2), (64, 256, 4, 3, False, 2),
                   (64, 512, 4, 3, False, 2), (32, 512, 4, 4, False, 2),
                   (32, 256, 4, 3, False, 2), (16, 1024, 4, 3, False, 2))
# WORDS tiles (SPLIT = 3; one row, 16-bit inputs, no prologue): the codes read as 32-bit words
# of eight weights, each opened in PTX by one shift and four lop3 into fp16 pairs of exact
# (q - z) / 128 against the input columns paired to match, (x0, x4), (x1, x5), ...: per word
# 13 instructions (shift, lop3 x 4, zero x 4, products x 4), then per four words one widening
# into fp32 with the scale (_words_step). The input is paired once per thread and column
# (_PAIRS_FROM_F16 / _BF16), shared by the thread's rows; each thread reads sixteen code
# bytes of a row (one scale and zero point for 32 weights, where HALF's threads take eight).
# A BLOCK_K of one piece (inside a group), or of two, loads each iteration's codes an
# iteration ahead (_words_sum). Two pieces (64, 256, 4) beat every other tile on an H100
# (call 85): at gate|up ×2 31.0-31.3 µs against HALF's 34.5-35.1 and one piece's 34.9-35.3,
# at down ×8 19.2-19.5 against 19.7-21.9. Four pieces loaded ahead (96 registers) ran
# 35.4-36.4 µs at gate|up, and the pieces as one [2, BLOCK_N, words] tile (54 registers)
# 39.6-45.6 (call 84): both removed. Measured on an H100
# (perf/RESULTS.md, call 78): with fp16 inputs the split-K forms of (64, 128, 4) beat the best
# HALF tile by 1.00-1.10x, with bf16 inputs 0.96-1.03x; whole-K tiles never win (few
# programs), and BLOCK_N 128 at 4 warps ran 2-3x slower than BLOCK_N 64 (95 registers; the
# carried tile went through shared memory): kept out.
WORDS_CANDIDATES = ((64, 256, 4, 3, False, 3), (64, 128, 4, 3, False, 3),
                    (128, 128, 8, 3, False, 3))
# the input times 2^-6 in fp16 (exact: a power of two), the scale times 2^6 to undo it: sixteen
# products summed in fp16 reach 8 * 15 * |x| / 64, so inputs up to ~35,000 stay finite
HALF_DOWN, HALF_UP = tl.constexpr(2.0 ** -6), tl.constexpr(2.0 ** 6)

# $8-$15 the accumulator (eight fp32), $16-$17 eight code bytes of one row (lo | hi << 4), $18-$21
# x_even and $22-$25 x_odd (fp16 pairs), $26-$29 1024 + z and $30-$33 -(64 + z) (fp16 pairs),
# $34 the row's scale. The bytes spread in pairs (SPREAD_BYTES_PTX); lop3 (a & b) | c
# puts a nibble into fp16 1024's mantissa: 1024 + q (low nibble), 1024 + 16 q (high), so
# subtracting 1024 + z, or scaling by 1/16 and adding -(64 + z), leaves q - z exactly. The
# sixteen products are summed in fp16 pairs, widened, and added to the first accumulator with
# the scale; the other seven pass through (they stay zero).
_HALF_ASM = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, l0, l1, l2, l3, h0, h1, h2, h3, c;
.reg .b16 u0, u1;
.reg .f32 f0, f1;
mov.b32 c, 0x2C002C00;
""" + SPREAD_BYTES_PTX + """lop3.b32 l0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l1, t1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l2, t2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l3, t3, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h0, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h1, t1, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h2, t2, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h3, t3, 0x00F000F0, 0x64006400, 0xEA;
sub.rn.f16x2 l0, l0, $26;
sub.rn.f16x2 l1, l1, $27;
sub.rn.f16x2 l2, l2, $28;
sub.rn.f16x2 l3, l3, $29;
fma.rn.f16x2 h0, h0, c, $30;
fma.rn.f16x2 h1, h1, c, $31;
fma.rn.f16x2 h2, h2, c, $32;
fma.rn.f16x2 h3, h3, c, $33;
mul.rn.f16x2 l0, $18, l0;
mul.rn.f16x2 l1, $19, l1;
mul.rn.f16x2 l2, $20, l2;
mul.rn.f16x2 l3, $21, l3;
fma.rn.f16x2 l0, $22, h0, l0;
fma.rn.f16x2 l1, $23, h1, l1;
fma.rn.f16x2 l2, $24, h2, l2;
fma.rn.f16x2 l3, $25, h3, l3;
add.rn.f16x2 l0, l0, l1;
add.rn.f16x2 l2, l2, l3;
add.rn.f16x2 l0, l0, l2;
""" + pair_sum_into_first("l0", "fma.rn.f32 $0, f0, $34, $8;"))

_HALF_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 34))


@triton.jit
def _half_step(acc, b, xe, xo, z, s):
    """acc [BLOCK_N, P] fp32 plus, per eight code bytes b (uint8 [BLOCK_N, P], P a multiple of 8,
    each thread holding eight consecutive bytes of a row) of a row with zero point z and scale s
    ([BLOCK_N, 1] fp32), s * sum(xe (lo - z) + xo (hi - z)) into the first of the eight
    accumulators; xe, xo [1, P] fp32 the input's even / odd columns times HALF_DOWN, s times
    HALF_UP. The sums are fp16 (_HALF_ASM): q - z exact, the products and their sums rounded.
    The CPU interpreter cannot run PTX: it adds each byte's two products in fp32 to its own
    accumulator (the same sum once the caller reduces the row)."""
    if INTERPRET:
        bi = b.to(tl.int32)
        out = acc + s * (xe * ((bi & 0xF).to(tl.float32) - z)
                         + xo * ((bi >> 4).to(tl.float32) - z))
    else:
        out = tl.inline_asm_elementwise(
            _HALF_ASM, _HALF_CONSTRAINTS,
            [acc, b, xe.to(tl.float16), xo.to(tl.float16), (z + 1024.0).to(tl.float16),
             (-64.0 - z).to(tl.float16), s], dtype=tl.float32, is_pure=True, pack=8)
    return out


# WORDS (pack=4: four code words of one row, 32 weights): $0-$3 the fp32 accumulators out,
# $4-$7 in, $8-$11 the code words (nibble i of a word = column i of its eight), $12-$27 the
# input pairs of each word: $12-$15 (x0, x4), $16-$19 (x1, x5), $20-$23 (x2, x6), $24-$27
# (x3, x7), as fp16 pairs, $28 the row's zero point z twice (fp16), $30 its scale.
# lop3 (w & 0x000F000F) | 1024 reads (1024 + q0, 1024 + q4), (w & 0x00F000F0) | 1024 reads
# (1024 + 16 q1, 1024 + 16 q5); the word shifted by 8 gives columns 2, 6 and 3, 7 the same way.
# Times 2^-7 (2^-11) plus -(8 + z / 128) (-(0.5 + z / 128)) is (q - z) / 128, exact in fp16;
# the products summed in two fp16 pairs (eight each), added, widened, added in fp32 and
# multiplied by the scale into the first accumulator (the caller multiplies the sum by 128).
_WORD_PTX = """lop3.b32 l, {w}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h, {w}, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, {w}, 8;
fma.rn.f16x2 l, l, cl, zl;
fma.rn.f16x2 h, h, ch, zh;
fma.rn.f16x2 a0, {p0}, l, a0;
fma.rn.f16x2 a1, {p1}, h, a1;
lop3.b32 l, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h, t, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 l, l, cl, zl;
fma.rn.f16x2 h, h, ch, zh;
fma.rn.f16x2 a0, {p2}, l, a0;
fma.rn.f16x2 a1, {p3}, h, a1;
"""
_WORDS_ASM = tl.constexpr("""{
.reg .b32 t, l, h, a0, a1, cl, ch, zl, zh, c;
.reg .b16 u0, u1;
.reg .f32 f0, f1;
mov.b32 a0, 0;
mov.b32 a1, 0;
mov.b32 cl, 0x20002000;
mov.b32 ch, 0x10001000;
mov.b32 c, 0xA000A000;
mov.b32 zl, 0xC800C800;
mov.b32 zh, 0xB800B800;
fma.rn.f16x2 zl, $28, c, zl;
fma.rn.f16x2 zh, $28, c, zh;
""" + "".join(_WORD_PTX.format(w=f"${8 + i}", p0=f"${12 + i}", p1=f"${16 + i}",
                               p2=f"${20 + i}", p3=f"${24 + i}") for i in range(4)) + """\
add.rn.f16x2 a0, a0, a1;
mov.b32 {u0, u1}, a0;
cvt.f32.f16 f0, u0;
cvt.f32.f16 f1, u1;
add.rn.f32 f0, f0, f1;
fma.rn.f32 $0, f0, $30, $4;
mov.b32 $1, $5;
mov.b32 $2, $6;
mov.b32 $3, $7;
}""")
_WORDS_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 30))
WORDS_UP = tl.constexpr(128.0)

# The input's pairs: $4 = x0..x3 and $5 = x4..x7 (16-bit, one 64-bit load each) -> $0 (x0, x4),
# $1 (x1, x5), $2 (x2, x6), $3 (x3, x7) as fp16 pairs: fp16 inputs by prmt alone, bf16 ones
# widened to fp32 (a shift or a mask) and rounded to fp16 in pairs
_PAIRS_FROM_F16 = tl.constexpr("""{
.reg .b32 a0, a1, b0, b1;
mov.b64 {a0, a1}, $4;
mov.b64 {b0, b1}, $5;
prmt.b32 $0, a0, b0, 0x5410;
prmt.b32 $1, a0, b0, 0x7632;
prmt.b32 $2, a1, b1, 0x5410;
prmt.b32 $3, a1, b1, 0x7632;
}""")
_PAIRS_FROM_BF16 = tl.constexpr("""{
.reg .b32 a0, a1, b0, b1, lo, hi;
mov.b64 {a0, a1}, $4;
mov.b64 {b0, b1}, $5;
""" + "".join(f"""shl.b32 lo, a{i}, 16;
shl.b32 hi, b{i}, 16;
cvt.rn.f16x2.f32 ${2 * i}, hi, lo;
and.b32 lo, a{i}, 0xFFFF0000;
and.b32 hi, b{i}, 0xFFFF0000;
cvt.rn.f16x2.f32 ${2 * i + 1}, hi, lo;
""" for i in range(2)) + "}")


@triton.jit
def _words_step(acc, w, x_ptr, kk, z, s, SUB_K: tl.constexpr, BF16: tl.constexpr):
    """acc [BLOCK_N, SUB_K / 8] fp32 plus, per code word w (int32 [BLOCK_N, SUB_K / 8], eight
    4-bit codes of a row, column i in nibble i) of the piece at input columns kk.. (inside one
    group), s * sum(x (q - z)) / 128 (z, s [BLOCK_N, 1] fp32: the rows' zero points and
    scales), x the one 16-bit input row: in PTX, four words of a row a call (_WORDS_ASM), into
    the first word's accumulator. The CPU interpreter cannot run PTX: it adds each word's
    eight products in fp32 to its own accumulator (the same sum once the caller reduces)."""
    wcol = tl.arange(0, SUB_K // 8)[None, :]
    if INTERPRET:
        out = acc
        for i in tl.static_range(8):
            xi = tl.load(x_ptr + kk + 8 * wcol + i).to(tl.float32)
            out += s * xi * (((w >> (4 * i)) & 0xF).to(tl.float32) - z) * (1.0 / WORDS_UP)
    else:
        xw = x_ptr.to(tl.pointer_type(tl.int64)) + 2 * (tl.multiple_of(kk >> 3, SUB_K // 8)
                                                        + wcol)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _PAIRS_FROM_BF16 if BF16 else _PAIRS_FROM_F16, "=r,=r,=r,=r,l,l",
            [tl.load(xw), tl.load(xw + 1)], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        out = tl.inline_asm_elementwise(
            _WORDS_ASM, _WORDS_CONSTRAINTS, [acc, w, p0, p1, p2, p3, z.to(tl.float16), s],
            dtype=tl.float32, is_pure=True, pack=4)
    return out


@triton.jit
def _words_load(q32_rows, s_ptr, z_ptr, n, ok, N, k0, k_end, GROUP: tl.constexpr,
                SUB_K: tl.constexpr, AHEAD: tl.constexpr):
    """WORDS: one iteration's code words at input columns k0.. ([BLOCK_N, SUB_K / 8] int32, a
    piece inside one group; with AHEAD none from k_end on) and the rows' scales and zero
    points ([BLOCK_N, 1] fp32). k0 >= 0: shifts and an unsigned division, not signed ones'
    fix-ups."""
    wcol = tl.arange(0, SUB_K // 8)[None, :]
    k0_rows = tl.zeros_like(n)[:, None] + k0
    wok, gok = ok, ok
    if AHEAD:       # the whole tile, or none of it
        wok = ok & ((tl.zeros_like(wcol) + k0) < k_end)
        gok = ok & (k0_rows < k_end)
    w = tl.load(q32_rows + tl.multiple_of(k0 >> 3, SUB_K // 8) + wcol, mask=wok, other=0,
                eviction_policy="evict_first")
    g = (k0_rows.to(tl.uint32) // GROUP).to(tl.int32)
    s = tl.load(s_ptr + g * N + n[:, None], mask=gok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + n[:, None], mask=gok, other=0).to(tl.float32)
    return w, s, z


@triton.jit
def _words_sum(x_ptr, q_rows, s_ptr, z_ptr, n, n_ok, N, k_lo, k_len, GROUP: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
               BF16: tl.constexpr):
    """WORDS: the [BLOCK_N] fp32 sums x . W over input columns k_lo .. k_lo + k_len of one
    16-bit input row, BLOCK_K columns (one piece of SUB_K, or two) an iteration. The code
    words, scales and zero points are loaded an iteration ahead (carried in registers): the
    compiler otherwise issues a piece's loads just before its products, and a program's warps
    then keep too few bytes in flight to cover the memory's latency (H100 calls 80-82 point
    at that, not at their instructions). Two pieces an iteration keep twice the bytes in
    flight a thread, and ran 1.10-1.12x HALF (call 85); four, at 96 registers, did not. The
    input (a few KB every program reads, from L2) is loaded in the iteration that uses it."""
    TWO: tl.constexpr = BLOCK_K == 2 * SUB_K
    q32 = q_rows.to(tl.pointer_type(tl.int32))
    ok = n_ok[:, None]
    k_end = k_lo + k_len
    acc = tl.zeros([BLOCK_N, SUB_K // 8], dtype=tl.float32)
    w, s, z = _words_load(q32, s_ptr, z_ptr, n, ok, N, k_lo, k_end, GROUP, SUB_K, True)
    if TWO:
        v, t, y = _words_load(q32, s_ptr, z_ptr, n, ok, N, k_lo + SUB_K, k_end, GROUP, SUB_K,
                              True)
    for k0 in range(k_lo, k_end, BLOCK_K):
        w1, s1, z1 = _words_load(q32, s_ptr, z_ptr, n, ok, N, k0 + BLOCK_K, k_end, GROUP,
                                 SUB_K, True)
        if TWO:
            v1, t1, y1 = _words_load(q32, s_ptr, z_ptr, n, ok, N, k0 + BLOCK_K + SUB_K,
                                     k_end, GROUP, SUB_K, True)
        acc = _words_step(acc, w, x_ptr, k0, z, s, SUB_K, BF16)
        w, s, z = w1, s1, z1
        if TWO:
            acc = _words_step(acc, v, x_ptr, k0 + SUB_K, y, t, SUB_K, BF16)
            v, t, y = v1, t1, y1
    return tl.sum(acc, axis=1) * WORDS_UP


@triton.jit
def split_k_sum(part, ws_ptr, cnt_ptr, tile, ks, mn, ok, MN, KSPLIT: tl.constexpr):
    """Split ks's fp32 sums `part` of output tile `tile` to the workspace [KSPLIT, MN] (at
    offsets mn, where ok); the tile's count of splits done, taken after a barrier (every
    thread's stores before the release), tells the last one, which adds the KSPLIT sums in
    split order (the same bits whichever ends last) and sets the count back to 0 for the next
    launch. Returns (the whole sums, valid in the last split only; whether this is it). Serves
    _packed_gemv_kernel's split-K tiles and fp8_mma's (the workspace: _split_k_buffers)."""
    tl.store(ws_ptr + ks * MN + mn, part, mask=ok)
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == KSPLIT - 1
    total = tl.zeros_like(part)
    if last:
        for j in tl.static_range(KSPLIT):
            total += tl.load(ws_ptr + j * MN + mn, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(cnt_ptr + tile, 0)
    return total, last


@triton.jit
def _split_input(x_rows, r_rows, r_out_rows, g_ptr, xs_rows, k_lo, k_len, store_ok, m_ok, K,
                 BLOCK_M: tl.constexpr, PROLOGUE: tl.constexpr, CHUNK: tl.constexpr):
    """A split-K program's prologue: its input columns k_lo .. k_lo + k_len through
    _input_tile (RMSNorm's weight, the residual sum, which the programs of N tile 0 write,
    or SiLU(gate) * up), rounded to the activation dtype into the scratch rows xs_rows.
    Returns the rows' sums of squares over those columns (the norms' share of this split).
    Each program writes rows of its own (call 86, H100: with one row that every program of a
    split wrote, the same values, gate|up's residual add + RMSNorm took 40.8 µs against the
    plain tile's 29.6; ~450 programs wrote each line)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_end = k_lo + k_len
    for c in range(k_lo, k_end, CHUNK):
        k = c + tl.arange(0, CHUNK)
        ok = m_ok & (k < k_end)[None, :]
        xf, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, ok, K, True,
                             PROLOGUE)
        ss += sq
        tl.store(xs_rows + k[None, :], xf.to(xs_rows.dtype.element_ty), mask=ok)
    return ss


@triton.jit
def _packed_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, r_ptr, r_out_ptr, g_ptr, eps,
                        ws_ptr, cnt_ptr, xs_ptr, ss_ptr, M, N, K, stride_q, stride_xm, stride_ym,
                        stride_rm, stride_rom, GROUP: tl.constexpr, BITS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SUB_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, KSPLIT: tl.constexpr,
                        USE_DOT: tl.constexpr, PRECISION: tl.constexpr, PROLOGUE: tl.constexpr,
                        prefetch_programs, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
                        IN_CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    # split-K (KSPLIT > 1): program (pid, ks) sums K / KSPLIT columns, from ks * K / KSPLIT
    ks = tl.program_id(2)
    k_len = K // KSPLIT
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)       # every row of the step (M <= MAX_ROWS)
    m_ok = (m < M)[:, None]
    # stride_q (the codes' bytes a row, K * BITS / 8) an argument: a multiple of 16 where it is
    # one, which lets the code loads take 16 bytes a thread
    q_rows = q_ptr + n.to(tl.int64)[:, None] * stride_q
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
        if pid < prefetch_programs and ks == 0:
            l2_prefetch(q_ptr + pid * BLOCK_N * stride_q, BLOCK_N * stride_q)
    pdl_wait(USE_PDL)
    if USE_DOT:
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc1 = tl.zeros([BLOCK_N, SUB_K // (8 if SPLIT == 3 else 1 + (SPLIT > 0))],
                        dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, SUB_K // (1 + (SPLIT > 0))], dtype=tl.float32)
    # BLOCK_K columns per iteration in pieces of SUB_K, each inside one group: several groups'
    # loads in flight per program without a scale per column
    # (the hints keep a split's first column provably a multiple of SUB_K, as k0 = 0 was: the
    # loads stay vectorized, and the HALF tiles' PTX takes eight consecutive code bytes of a
    # row per thread, which an unvectorized load's layout does not give: GPU call 60 got
    # relative errors of 1.0-1.3 from them without the hints)
    if KSPLIT > 1:
        k_lo = tl.multiple_of(ks * k_len, BLOCK_K)
    else:
        k_lo = 0
    # split-K with a prologue: each program first turns its own K / KSPLIT input columns into
    # the matmul's input (_split_input) in scratch rows of its own (xs, [tiles x M, K]), which
    # the loop below then reads as it reads a plain input; the norms' 1/rms waits for the last
    # split (the tile's splits' sums of squares). The loop's own prologue serves the tiles over
    # the whole K.
    SPLIT_IN: tl.constexpr = KSPLIT > 1 and PROLOGUE != 0
    if SPLIT_IN:
        # the program's rows, as x_ptr / x_rows are the input's: the WORDS tiles read their one
        # row from x_ptr (with xs_ptr, program 0's rows, they read rows not yet written: H100
        # call 87)
        xs_own = xs_ptr + pid.to(tl.int64) * M * K
        xs_rows = xs_own + m.to(tl.int64)[:, None] * K
        ss = _split_input(x_rows, r_rows, r_out_rows, g_ptr, xs_rows, k_lo, k_len, store_ok,
                          m_ok, K, BLOCK_M, PROLOGUE, IN_CHUNK)
        tl.debug_barrier()      # the program's own scratch writes, before any thread reads
        x_ptr, x_rows = xs_own, xs_rows
    LOOP_PROLOGUE: tl.constexpr = 0 if SPLIT_IN else PROLOGUE
    # WORDS of one or two pieces an iteration: loads ahead
    WORDS_AHEAD: tl.constexpr = SPLIT == 3 and BLOCK_K <= 2 * SUB_K
    if WORDS_AHEAD:
        yw = _words_sum(x_ptr, q_rows, s_ptr, z_ptr, n, n_ok, N, k_lo, k_len, GROUP,
                        BLOCK_N, BLOCK_K, SUB_K, x_ptr.dtype.element_ty == tl.bfloat16)
    else:
        # (the launch's num_stages pipelines the loads of the tensor-core tiles' dots through
        # shared memory, and no other tile's; sm_90, triton 3.9: an explicit num_stages=1 on
        # this loop would take the dots' cp.async away. One-row tiles whose loop was
        # tl.range(num_stages=...), cp.async for their codes, ran 0.6-5 µs slower than the
        # WORDS tiles loaded ahead in registers and were removed: call 86)
        for k0 in range(k_lo, k_lo + k_len, BLOCK_K):
            for i in tl.static_range(BLOCK_K // SUB_K):
                kk = tl.multiple_of(k0 + i * SUB_K, SUB_K)
                if SPLIT == 3:     # WORDS: one row, no prologue in the loop (WORDS_CANDIDATES)
                    w, s, z = _words_load(q_rows.to(tl.pointer_type(tl.int32)), s_ptr, z_ptr,
                                          n, n_ok[:, None], N, kk, K, GROUP, SUB_K,
                                          False)
                    acc1 = _words_step(acc1, w, x_ptr, kk, z, s, SUB_K,
                                       x_ptr.dtype.element_ty == tl.bfloat16)
                elif SPLIT == 2:     # HALF: the same (HALF_CANDIDATES)
                    b, s, z = _codes_piece(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP, SUB_K)
                    xc = tl.load(x_rows + kk + tl.arange(0, SUB_K)[None, :], mask=m_ok, other=0.0)
                    xe, xo = (xc.to(tl.float32) * HALF_DOWN).reshape(BLOCK_M, SUB_K // 2, 2).split()
                    acc1 = _half_step(acc1, b, xe, xo, z[:, None], (s * HALF_UP)[:, None])
                elif SPLIT:
                    lo, hi, s = _nibbles_piece(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP,
                                               BLOCK_N, SUB_K)
                    # the input's even and odd columns (the bytes' low and high nibbles): loaded
                    # whole and split in registers, which compiled to fewer instructions than two
                    # loads of stride 2 (one load instruction a column)
                    k = kk + 2 * tl.arange(0, SUB_K // 2)
                    if LOOP_PROLOGUE == 0:
                        xc = tl.load(x_rows + kk + tl.arange(0, SUB_K)[None, :], mask=m_ok,
                                     other=0.0)
                        xe, xo = xc.to(tl.float32).reshape(BLOCK_M, SUB_K // 2, 2).split()
                    else:
                        xe, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok,
                                             K, True, LOOP_PROLOGUE)
                        xo, sq1 = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k + 1, store_ok,
                                              m_ok, K, True, LOOP_PROLOGUE)
                        if LOOP_PROLOGUE == 1 or LOOP_PROLOGUE == 2:
                            ss += sq + sq1
                    # the scale once per pair of weights: (x_even (q - z) + x_odd (q - z)) * s
                    if BLOCK_M == 1:
                        acc1 += (xe * lo + xo * hi) * s[:, None]
                    else:
                        acc3 += (xe[:, None, :] * lo[None, :, :]
                                 + xo[:, None, :] * hi[None, :, :]) * s[None, :, None]
                else:
                    w = _codes_tile(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP, BITS, BLOCK_N,
                                    SUB_K)
                    k = kk + tl.arange(0, SUB_K)
                    if LOOP_PROLOGUE == 0:
                        x = tl.load(x_rows + k[None, :], mask=m_ok, other=0.0)
                    else:
                        x, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K,
                                            True, LOOP_PROLOGUE)
                        if LOOP_PROLOGUE == 1 or LOOP_PROLOGUE == 2:
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
    elif WORDS_AHEAD:
        y = yw[None, :]
    elif SPLIT == 3:
        y = tl.sum(acc1, axis=1)[None, :] * WORDS_UP
    elif BLOCK_M == 1:
        y = tl.sum(acc1, axis=1)[None, :]
    else:
        y = tl.sum(acc3, axis=2)
    NORMED: tl.constexpr = PROLOGUE == 1 or PROLOGUE == 2
    if NORMED and KSPLIT == 1:
        y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    ok = m_ok & n_ok[None, :]
    last = True
    if KSPLIT > 1:
        if NORMED:      # the split's sum of squares, in the tile's place
            tl.store(ss_ptr + (pid * KSPLIT + ks) * BLOCK_M + m, ss)
        y, last = split_k_sum(y, ws_ptr, cnt_ptr, pid, ks, m[:, None] * N + n[None, :], ok,
                              M * N, KSPLIT)
    if last:
        if NORMED and KSPLIT > 1:       # every split's share, written before its release
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(KSPLIT):
                ss += tl.load(ss_ptr + (pid * KSPLIT + j) * BLOCK_M + m, cache_modifier=".cg")
            y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=ok)


# The swap-AB pair tiles' codes opened in PTX: $0-$1 the low nibbles' q - z and $2-$3 the high
# ones' (16-bit pairs), $4 four code bytes, $5-$6 (and for fp16 $7-$8) the constants that turn
# the magic values into q - z (16-bit pairs, one per code byte). fp16: OR-ed into 1024's
# mantissa a low nibble reads 1024 + q, a high one (left in bits 4-7) 1024 + 16 q: minus
# 1024 + z, or times 1/16 plus -(64 + z). bf16 (7 mantissa bits): both nibbles into 128's
# mantissa, the high ones shifted down first (the word shifted by 4 puts each byte's high
# nibble in its low bits; the mask drops the next byte's), plus -(128 + z).
_PAIRS_F16 = tl.constexpr("""{
.reg .b32 t0, t1, l0, l1, h0, h1, c;
mov.b32 c, 0x2C002C00;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 l0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 l1, t1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h0, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 h1, t1, 0x00F000F0, 0x64006400, 0xEA;
sub.rn.f16x2 $0, l0, $5;
sub.rn.f16x2 $1, l1, $6;
fma.rn.f16x2 $2, h0, c, $7;
fma.rn.f16x2 $3, h1, c, $8;
}""")
_PAIRS_BF16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, u, l0, l1, h0, h1, c;
mov.b32 c, 0x3F803F80;
shr.u32 u, $4, 4;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
prmt.b32 t2, u, 0, 0x4140;
prmt.b32 t3, u, 0, 0x4342;
lop3.b32 l0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 l1, t1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 h0, t2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 h1, t3, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $0, l0, c, $5;
fma.rn.bf16x2 $1, l1, c, $6;
fma.rn.bf16x2 $2, h0, c, $5;
fma.rn.bf16x2 $3, h1, c, $6;
}""")


@triton.jit
def _codes_pair_step(b, z, DT: tl.constexpr):
    """(lo, hi): the q - z of code bytes b's low and high nibbles (uint8 [BLOCK_N, P], zero
    points z [BLOCK_N, 1] fp32) in DT (fp16 or bf16), exact (|q - z| < 16). Element by element,
    so it holds whatever the layout of b (_PAIRS_F16 / _PAIRS_BF16 on the GPU)."""
    if INTERPRET:
        bi = b.to(tl.int32)
        lo = ((bi & 0xF).to(tl.float32) - z).to(DT)
        hi = ((bi >> 4).to(tl.float32) - z).to(DT)
    elif DT == tl.float16:
        lo, hi = tl.inline_asm_elementwise(
            _PAIRS_F16, "=r,=r,=r,=r,r,r,r,r,r",
            [b, (z + 1024.0).to(tl.float16), (-64.0 - z).to(tl.float16)],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(
            _PAIRS_BF16, "=r,=r,=r,=r,r,r,r", [b, (-128.0 - z).to(tl.bfloat16)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _swap_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                      m_tiles, GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_M: tl.constexpr, SUB_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """SWAP_CANDIDATES' tiles: y[m, n] for BLOCK_M rows and BLOCK_N outputs as (W x^T)^T."""
    pid = tl.program_id(0)
    pid_m = pid % m_tiles
    n = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = (m < M)[:, None]
    q_rows = q_ptr + n.to(tl.int64)[:, None] * (K * BITS // 8)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    wt = y_ptr.dtype.element_ty
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, SUB_K):
        kk = tl.multiple_of(k0, SUB_K)
        xc = tl.load(x_rows + kk + tl.arange(0, SUB_K)[None, :], mask=m_ok, other=0.0)
        if SPLIT == 2:      # 16-bit inputs: q - z opened in PTX, times s in 16 bits
            b, s, z = _codes_piece(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP, SUB_K)
            s = s.to(wt)[:, None]
            lo, hi = _codes_pair_step(b, z[:, None], wt)
            if INTERPRET:   # its 16-bit products are wrong (bf16 as raw bits): fp32, rounded
                lo = (lo.to(tl.float32) * s.to(tl.float32)).to(wt)
                hi = (hi.to(tl.float32) * s.to(tl.float32)).to(wt)
            else:
                lo = lo * s
                hi = hi * s
            xe, xo = xc.reshape(BLOCK_M, SUB_K // 2, 2).split()
            acc += mma(lo, tl.trans(xe), PRECISION)
            acc += mma(hi, tl.trans(xo), PRECISION)
        elif SPLIT:
            lo, hi, s = _nibbles_piece(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP, BLOCK_N,
                                       SUB_K)
            xe, xo = xc.reshape(BLOCK_M, SUB_K // 2, 2).split()
            acc += mma((lo * s[:, None]).to(wt), tl.trans(xe.to(wt)), PRECISION)
            acc += mma((hi * s[:, None]).to(wt), tl.trans(xo.to(wt)), PRECISION)
        else:
            w = _codes_tile(q_rows, n_ok, kk, s_ptr, z_ptr, n, N, GROUP, BITS, BLOCK_N, SUB_K)
            acc += mma(w.to(wt), tl.trans(xc.to(wt)), PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None], acc.to(wt),
             mask=n_ok[:, None] & (m < M)[None, :])


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


def half_fits(config: tuple, group: int, row_bytes: int = 0) -> bool:
    """Whether a HALF tile (SPLIT 2) gives each thread eight code bytes (or more) of a piece
    (_half_step takes eight consecutive bytes of one row at a time), or a WORDS tile (SPLIT 3)
    sixteen in one 16-byte load (_words_step takes four words of one row: rows of codes
    `row_bytes` long, a multiple of 16, pieces of 32 columns or more)."""
    block_n, block_k, warps, _, _, split = config[:6]
    sub_k = _block_k(block_k, group)
    if split == 3:
        return row_bytes % 16 == 0 and sub_k >= 32 and block_n * sub_k // 2 >= 16 * 32 * warps
    return block_n * sub_k // 2 >= 8 * 32 * warps


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


# (BLOCK_N, BLOCK_K at most, num_warps) of _dequant_pairs_kernel; BLOCK_K stays in one group
DEQUANT_PAIRS_TILE = (64, 128, 4)


@triton.jit
def _dequant_pairs_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """4-bit codes -> 16-bit weights, one 32-bit word (two weights) per code byte: the exact
    q - z of the low and high nibbles from _nibbles_piece (no int-to-float conversion), times s
    in fp32, rounded once to the output's type, the pair packed low-first and stored as a word
    (no interleaving of the two halves in registers)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k0 = tl.program_id(1) * BLOCK_K
    word_rows = n.to(tl.int64)[:, None] * (K // 2)      # a code byte and its output word
    lo, hi, s = _nibbles_piece(q_ptr + word_rows, n_ok, k0, s_ptr, z_ptr, n, N, GROUP, BLOCK_N,
                               BLOCK_K)
    dt = w_ptr.dtype.element_ty
    lo16 = (lo * s[:, None]).to(dt).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi16 = (hi * s[:, None]).to(dt).to(tl.uint16, bitcast=True).to(tl.uint32)
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    tl.store(w_ptr.to(tl.pointer_type(tl.uint32)) + word_rows + kb[None, :],
             lo16 | (hi16 << 16), mask=n_ok[:, None])


def dequantize_packed(pw, dtype: torch.dtype) -> torch.Tensor:
    """PackedWeight (even groups) -> W [N, K] in dtype: (q - z) * s, rounded once."""
    n, k = pw.shape
    w = torch.empty((n, k), dtype=dtype, device=pw.qweight.device)
    if pw.bits == 4 and dtype in (torch.bfloat16, torch.float16):
        block_n, want_k, warps = DEQUANT_PAIRS_TILE
        block_k = _block_k(want_k, pw.group_size)
        _dequant_pairs_kernel[(triton.cdiv(n, block_n), k // block_k)](
            pw.qweight, pw.scales, pw.zeros, w, n, k, GROUP=pw.group_size, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps)
        return w
    block_n, block_k = 32, _block_k(128, pw.group_size)
    _dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        pw.qweight, pw.scales, pw.zeros, w, n, k, GROUP=pw.group_size, BITS=pw.bits,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return w


# (device, what) -> a 1-D scratch tensor shared by every launch on the device (launches on one
# stream run one after another; under programmatic dependent launch a kernel touches it only
# after its wait for the previous one), grown as needed. A tensor that was outgrown is kept:
# CUDA graphs captured with it still point at it.
_SPLIT_K: dict[tuple[torch.device, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
_PROLOGUE_KEY = "prologue"      # the key of the split-K prologue's scratch in _SPLIT_K


def _scratch(device: torch.device, what: str, numel: int, dtype: torch.dtype,
             zeroed: bool = False) -> torch.Tensor:
    """_SPLIT_K[(device, what)], at least numel elements (a new one zeroed where asked)."""
    have = _SPLIT_K.get((device, what))
    if have is None or have.numel() < numel:
        if have is not None:
            _OUTGROWN.append(have)
        have = _SPLIT_K[(device, what)] = (torch.zeros if zeroed else torch.empty)(
            numel, dtype=dtype, device=device)
    return have


def _split_k_buffers(device: torch.device, sums: int, tiles: int):
    """The split-K workspace: fp32 partial sums and the int32 count of finished splits per N
    tile, 0 between launches (the last split of a tile resets its own)."""
    return (_scratch(device, "sums", sums, torch.float32),
            _scratch(device, "counts", tiles, torch.int32, zeroed=True))


def _prologue_buffers(device: torch.device, dtype: torch.dtype, squares: int, inputs: int):
    """(the 16-bit scratch rows, the fp32 sums of squares) for a split-K tile's prologue
    (_split_input): one fp32 tensor, the sums first, the rows from a 16-byte boundary."""
    start = -(-squares // 4) * 4
    have = _scratch(device, _PROLOGUE_KEY, start + (inputs + 1) // 2, torch.float32)
    return have[start:].view(dtype), have[:squares]


def poison_prologue_scratch(device: torch.device) -> None:
    """Fill the split-K prologue's scratch (if there is one yet) with NaN in fp32, fp16 and
    bf16 alike (0x7FC0 in every half word): a launch that reads rows it did not write
    comes out NaN."""
    have = _SPLIT_K.get((device, _PROLOGUE_KEY))
    if have is not None:
        have.view(torch.int32).fill_(0x7FC07FC0)


def packed_gemv(x: torch.Tensor, pw, bias: torch.Tensor | None, config: tuple,
                prologue: int = PLAIN, residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """x [M, K] (rows contiguous) @ W.T (+ bias) -> [M, N] in x's dtype, W the PackedWeight
    (even groups), with one of CANDIDATES / DOT_CANDIDATES / SPLIT_CANDIDATES /
    HALF_CANDIDATES / KSPLIT_CANDIDATES (M <= MAX_ROWS) or SWAP_CANDIDATES (any M: row tiles
    of BLOCK_M) as the tile. The prologues (not for SWAP_CANDIDATES) are gemv.py's: NORM,
    ADD_NORM (returning (y, x + residual)) and SILU_MUL (x = gate | up, [M, 2K])."""
    m = x.shape[0]
    n, k = pw.shape
    if config[0] == "t":
        return _swap_gemm(x, pw, bias, config, prologue)
    block_n, block_k, warps, stages, *dot = config
    use_dot = bool(dot and dot[0])
    # SPLIT_CANDIDATES (1), HALF_CANDIDATES (2), WORDS_CANDIDATES (3); a seventh element
    # splits K (KSPLIT_CANDIDATES)
    split = int(dot[1]) if not use_dot and len(dot) > 1 else 0
    ksplit = int(dot[2]) if not use_dot and len(dot) > 2 else 1
    assert ksplit == 1 or k % (ksplit * pw.group_size) == 0, f"split-K tile {config} takes " \
        f"whole groups per split, not K {k} of group {pw.group_size}"
    assert 1 <= m <= MAX_ROWS and x.stride(1) == 1 and pw.g_idx is None
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    assert not split or pw.bits == 4, f"SPLIT tiles read 4-bit codes, not {pw.bits}-bit"
    # (a split-K tile runs its prologue before its loop, _split_input; the others in it)
    assert split < 2 or m == 1 and (prologue == PLAIN or ksplit > 1) \
        and x.dtype != torch.float32 and half_fits(config, pw.group_size, pw.qweight.stride(0)), \
        f"HALF / WORDS tile {config} takes one 16-bit row, a prologue only when it splits K " \
        f"and 8 / 16 code bytes a thread, not {m} rows of {x.dtype}, prologue {prologue}, " \
        f"group {pw.group_size}, {pw.qweight.stride(0)} code bytes a row"
    if split == 3 and prologue == PLAIN and x.data_ptr() % 16:
        x = x.clone()       # WORDS reads the input in 8-byte loads (with a prologue, xs)
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r = r_out = x
    if prologue == ADD_NORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        r, r_out = residual, torch.empty_like(x)
    if prologue in (NORM, ADD_NORM):
        assert norm_weight is not None and norm_weight.shape == (k,)
    sub_k, block_k = _tile_k(block_k, pw.group_size, k // ksplit)
    pf = prefetch_programs(pw.qweight, block_n * pw.qweight.shape[1], prologue == PLAIN) \
        if n % block_n == 0 else 0
    tiles = triton.cdiv(n, block_n)
    # sized for MAX_ROWS at once: a graph captured later at more rows needs no new buffer
    ws, counts = _split_k_buffers(x.device, ksplit * MAX_ROWS * n, tiles) if ksplit > 1 \
        else (y, y)
    xs, ss, chunk = y, ws, 1
    if ksplit > 1 and prologue != PLAIN:
        xs, ss = _prologue_buffers(x.device, x.dtype, tiles * ksplit * block_m, tiles * m * k)
        chunk = min(triton.next_power_of_2(k // ksplit), 2048 // block_m)
    _packed_gemv_kernel[(tiles, 1, ksplit)](
        x, pw.qweight, pw.scales, pw.zeros, bias if bias is not None else y, y, r, r_out,
        norm_weight if norm_weight is not None else y, eps, ws, counts, xs, ss, m, n, k,
        pw.qweight.stride(0), x.stride(0), y.stride(0), r.stride(0), r_out.stride(0),
        GROUP=pw.group_size,
        BITS=pw.bits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SUB_K=sub_k, HAS_BIAS=bias is not None, SPLIT=split, KSPLIT=ksplit,
        USE_DOT=use_dot,
        PRECISION=dot_precision(x.dtype), PROLOGUE=prologue, prefetch_programs=pf,
        PREFETCH=pf > 0, IN_CHUNK=chunk, num_warps=warps, num_stages=stages,
        **pdl_launch(x))
    return (y, r_out) if prologue == ADD_NORM else y


def _swap_gemm(x: torch.Tensor, pw, bias: torch.Tensor | None, config: tuple, prologue: int):
    """packed_gemv with a SWAP_CANDIDATES tile (no prologue; SPLIT for 4-bit codes)."""
    _, block_n, block_m, sub_k, warps, stages, split = config
    assert prologue == PLAIN, f"swap-AB tile {config} takes no prologue, not {prologue}"
    assert not split or pw.bits == 4, f"SPLIT tiles read 4-bit codes, not {pw.bits}-bit"
    assert split != 2 or x.dtype in (torch.float16, torch.bfloat16), \
        f"swap-AB pair tile {config} takes a 16-bit input, not {x.dtype}"
    assert x.stride(1) == 1 and pw.g_idx is None and x.shape[1] == pw.shape[1]
    m, (n, k) = x.shape[0], pw.shape
    sub_k = _block_k(sub_k, pw.group_size)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    m_tiles = triton.cdiv(m, block_m)
    _swap_gemm_kernel[(m_tiles * triton.cdiv(n, block_n),)](
        x, pw.qweight, pw.scales, pw.zeros, bias if bias is not None else y, y, m, n, k,
        x.stride(0), y.stride(0), m_tiles, GROUP=pw.group_size, BITS=pw.bits, BLOCK_N=block_n,
        BLOCK_M=block_m, SUB_K=sub_k, HAS_BIAS=bias is not None, SPLIT=int(split),
        PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages, **pdl_launch(x))
    return y
