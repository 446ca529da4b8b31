"""RMSNorm and residual-add + RMSNorm kernels, drop-in for pagedbackend.layers.norm's functions
(same signatures, same rounding: normalize in fp32, cast to x's dtype, then scale by weight).

Before an FP8 matmul the same kernel also quantizes its output per row (vLLM's fused quant
epilogue, `rms_norm_quant_fp8`): the normed row, rounded to x's dtype as the plain kernel stores
it, is scaled and cast to e4m3 in registers, so the matmul's input needs no kernel of its own and
the 16-bit normed activations are never written."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import next_pow2, pdl_enter, pdl_launch
from pagedbackend.kernels.quant import empty_fp8_rows, row_scale, to_e4m3
from pagedbackend.layers.attention import FP8_MAX
from pagedbackend.layers.quantization import MIN_SCALE


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, eps, min_scale, fp8_max,
                     stride_x, stride_r, stride_o, stride_ro,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     QUANT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, as `x + residual` in torch does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:   # the normed row in x's dtype (as the plain kernel writes it), then per-row e4m3
        h = (y * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(h), 0), min_scale, fp8_max)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(h, scale, fp8_max, out_ptr), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, quant=False):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    if quant:
        assert weight.dtype == x.dtype, "the quantized norm rounds to x's dtype (== weight's)"
        o2, scale = empty_fp8_rows(x2.shape[0], n, x.device)
        out = (o2, scale)
    else:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                          device=x.device)
        o2 = out.view(-1, n)
        scale = o2
    if residual is not None:
        r2 = residual.reshape(-1, n)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        nr2 = new_res.view(-1, n)
    else:
        r2 = nr2 = x2
        new_res = None
    if x2.shape[0]:
        block = next_pow2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, o2, nr2, scale, eps, MIN_SCALE, FP8_MAX,
            x2.stride(0), r2.stride(0), o2.stride(0), nr2.stride(0),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, QUANT=quant,
            num_warps=min(max(block // 512, 1), 16), **pdl_launch(x2))
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * (x * rsqrt(mean(x^2) + eps)), one program per row."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory."""
    assert residual.dtype == x.dtype and residual.shape == x.shape
    return _launch(x, residual, weight, eps)


def rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., N] (+ residual) -> (xq [M, N] e4m3, scale [M, 1] fp32, x + residual or None):
    quantize_rows_fp8(rms_norm(x [+ residual])) flattened to rows, in one kernel, bit for bit
    the plain norm kernel followed by kernels.quant.quantize_rows_fp8."""
    assert residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)
    (q, scale), new_res = _launch(x, residual, weight, eps, quant=True)
    return q, scale, new_res
