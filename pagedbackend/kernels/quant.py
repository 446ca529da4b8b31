"""Per-row (per-token) dynamic quantization to float8 e4m3 in one kernel: the input of an FP8
matmul (layers/quantization.py). The torch version takes five passes over the activations
(abs, amax, divide, clamp, cast); this reads each row once from HBM and writes its bytes once.

`row_scale` and `to_e4m3` are the same steps for the kernels that quantize their own output on
the way out (the RMSNorm and SiLU·mul before an FP8 matmul: kernels/norm.py, activation.py), so
every path rounds alike."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import next_pow2, pdl_enter, pdl_launch
from pagedbackend.layers.attention import FP8_MAX
from pagedbackend.layers.quantization import FP8, MIN_SCALE


@triton.jit
def row_scale(amax, min_scale, fp8_max):
    """The scale of a row whose largest magnitude is amax: that value lands on 448."""
    return tl.maximum(amax / fp8_max, min_scale)


@triton.jit
def to_e4m3(x, scale, fp8_max, q_ptr):
    """x (fp32) / scale, clamped to e4m3's finite range, cast to q_ptr's element type."""
    q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
    return q.to(q_ptr.dtype.element_ty)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, min_scale, fp8_max,
                          N: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), 0), min_scale, fp8_max)
    tl.store(q_ptr + row * stride_q + cols, to_e4m3(x, scale, fp8_max, q_ptr), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scale [M, 1] fp32): layers.quantization.quantize_rows_fp8
    in one launch."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, n = x.shape
    q, scale = empty_fp8_rows(m, n, x.device)
    if m:
        block = next_pow2(n)
        _quantize_rows_kernel[(m,)](x, q, scale, x.stride(0), q.stride(0), MIN_SCALE, FP8_MAX,
                                    N=n, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
                                    **pdl_launch(x))
    return q, scale


def empty_fp8_rows(m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a per-row quantization: xq [m, n] e4m3 and scale [m, 1] fp32."""
    return (torch.empty((m, n), dtype=FP8, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


@triton.jit
def _dequantize_rows_kernel(q_ptr, s_ptr, w_ptr, N, K, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    offs = n.to(tl.int64)[:, None] * K + k[None, :]
    q = tl.load(q_ptr + offs, mask=ok).to(tl.float32)     # masked lanes are never stored
    s = tl.load(s_ptr + n, mask=n < N, other=0.0)
    tl.store(w_ptr + offs, (q * s[:, None]).to(w_ptr.dtype.element_ty), mask=ok)


def dequantize_rows(wq: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """wq [N, K] (int8 or e4m3, contiguous) with per-row scales [N] fp32 -> wq * scale in dtype,
    each weight rounded once from its fp32 product (layers.quantization.dequantize), in one
    pass: one byte read and two written a weight."""
    assert wq.dim() == 2 and wq.is_contiguous() and w_scale.numel() == wq.shape[0]
    n, k = wq.shape
    w = torch.empty((n, k), dtype=dtype, device=wq.device)
    block_n, block_k = 16, 256
    _dequantize_rows_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        wq, w_scale.reshape(-1), w, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return w
