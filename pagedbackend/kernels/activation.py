"""SiLU(gate) * up over the packed gate|up projection in one pass: the torch version runs two
elementwise kernels over strided halves (silu into a temporary, then the multiply), reading and
writing the [T, I] activations five times; this reads each half once and writes once.

Before an FP8 down_proj, `silu_and_mul_quant_fp8` also quantizes the result per row (vLLM's
fused quant epilogue): one program per row holds the whole row in registers (up to
ONE_PASS_COLS columns: llama-3.1-8b's 14,336 in 16 warps), takes its largest magnitude and
writes e4m3, so the 16-bit activations are never written and no quantization kernel runs after
it. Wider rows take two passes over gate|up, the second mostly from L2."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import next_pow2, pdl_enter, pdl_launch
from pagedbackend.kernels.quant import empty_fp8_rows, row_scale, to_e4m3
from pagedbackend.layers.attention import FP8_MAX
from pagedbackend.layers.quantization import MIN_SCALE

BLOCK = 1024
ONE_PASS_COLS = 16384   # a row in registers: 32 columns per thread at 16 warps
QUANT_BLOCK = 2048      # columns per iteration of the two-pass form (16 per thread, 4 warps)


@triton.jit
def _silu_mul(x_rows, cols, mask, n_cols):
    """silu(gate) * up at cols, in fp32, rounded as torch's two kernels round: silu(gate) to the
    activation dtype before the multiply (the product is rounded by the caller)."""
    gate = tl.load(x_rows + cols, mask=mask, other=0.0)
    up = tl.load(x_rows + n_cols + cols, mask=mask, other=0.0)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = _silu_mul(x_ptr + row * stride_x, cols, mask, n_cols)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, min_scale,
                               fp8_max, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                               USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_rows = x_ptr + row * stride_x
    dt = x_ptr.dtype.element_ty
    if ONE_PASS:        # BLOCK >= n_cols
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _silu_mul(x_rows, cols, mask, n_cols).to(dt).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0), min_scale, fp8_max)
        tl.store(q_ptr + row * stride_q + cols, to_e4m3(y, scale, fp8_max, q_ptr), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            y = _silu_mul(x_rows, cols, cols < n_cols, n_cols).to(dt).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = row_scale(tl.max(amax, 0), min_scale, fp8_max)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            y = _silu_mul(x_rows, cols, mask, n_cols).to(dt).to(tl.float32)
            tl.store(q_ptr + row * stride_q + cols, to_e4m3(y, scale, fp8_max, q_ptr), mask=mask)
    tl.store(s_ptr + row, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] holding gate | up -> silu(gate) * up [..., I]."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0 and x.stride(-1) == 1
    n = two_i // 2
    x2 = x.reshape(-1, two_i)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, BLOCK))](
            x2, o2, n, x2.stride(0), o2.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_launch(x2))
    return out


def silu_and_mul_quant_fp8(x: torch.Tensor, block: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2 * I] holding gate | up -> (xq [M, I] e4m3, scale [M, 1] fp32), bit for bit
    kernels.quant.quantize_rows_fp8(silu_and_mul(x)) over x's rows, in one kernel. block: the
    columns per iteration of the two-pass form (None: one pass where I <= ONE_PASS_COLS)."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0 and x.stride(-1) == 1
    n = two_i // 2
    x2 = x.reshape(-1, two_i)
    q, scale = empty_fp8_rows(x2.shape[0], n, x.device)
    one_pass = block is None and next_pow2(n) <= ONE_PASS_COLS
    if one_pass:
        block, warps = next_pow2(n), min(max(next_pow2(n) // 512, 1), 16)
    else:
        block, warps = block or QUANT_BLOCK, 4
    if x2.shape[0]:
        _silu_and_mul_quant_kernel[(x2.shape[0],)](
            x2, q, scale, n, x2.stride(0), q.stride(0), MIN_SCALE, FP8_MAX, BLOCK=block,
            ONE_PASS=one_pass, num_warps=warps, **pdl_launch(x2))
    return q, scale
