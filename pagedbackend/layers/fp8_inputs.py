"""The inputs of the FP8 GEMMs (quantization="fp8", matmuls of more than a few rows) quantized by
the op before them: the RMSNorm (+ residual add) before q|k|v and gate|up, and SiLU(gate) * up
before down_proj, each write e4m3 rows and their per-row scales instead of 16-bit activations
(vLLM's fused quant epilogues). The numbers are those of the separate path, bit for bit: the
normed (or activated) row rounded to the model's dtype, then quantized per row
(quantization.quantize_rows_fp8).

On CUDA the kernels do it in one launch each (kernels/norm.py, kernels/activation.py);
elsewhere the plain functions below compose the same steps.
PAGEDBACKEND_FP8_FUSED_QUANT=0 (or FUSED_QUANT = False) keeps the separate quantization kernel
(A/B: perf's `fp8nofuse` variant)."""
from __future__ import annotations

import os

import torch

from pagedbackend.layers.activation import silu_and_mul_torch
from pagedbackend.layers.norm import USE_KERNELS, fused_add_rms_norm_torch, rms_norm_torch
from pagedbackend.layers.quantization import FP8, fp8_gemm, quantize_rows_fp8

FUSED_QUANT = os.environ.get("PAGEDBACKEND_FP8_FUSED_QUANT", "1") != "0"


def fused_quant_active(x: torch.Tensor, weight: torch.Tensor,
                       norm_weight: torch.Tensor | None = None) -> bool:
    """Whether a matmul of x by `weight` takes the fused path: e4m3 weights, on CUDA with the
    kernels on (the CPU keeps the separate path; the numbers are the same either way)."""
    return FUSED_QUANT and USE_KERNELS and x.is_cuda and weight.dtype == FP8 \
        and (norm_weight is None or norm_weight.dtype == x.dtype)


def rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(xq [M, N] e4m3, scale [M, 1], x + residual or None) for h = rms_norm(x [+ residual])
    over x's rows: quantize_rows_fp8(h), h in x's dtype."""
    if x.is_cuda:
        from pagedbackend.kernels.norm import rms_norm_quant_fp8 as kernel
        return kernel(x, residual, weight, eps)
    if residual is None:
        h, new_res = rms_norm_torch(x, weight, eps), None
    else:
        h, new_res = fused_add_rms_norm_torch(x, residual, weight, eps)
    xq, scale = quantize_rows_fp8(h.reshape(-1, x.shape[-1]))
    return xq, scale, new_res


def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, I] e4m3, scale [M, 1]) for silu(gate) * up over x = gate | up [..., 2I]."""
    if x.is_cuda:
        from pagedbackend.kernels.activation import silu_and_mul_quant_fp8 as kernel
        return kernel(x)
    return quantize_rows_fp8(silu_and_mul_torch(x).reshape(-1, x.shape[-1] // 2))


def fp8_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, wq: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_linear(rms_norm(x + residual)), x + residual) with the norm quantizing its output;
    without residual the new residual is x (linear.norm_linear's contract)."""
    xq, sx, new_res = rms_norm_quant_fp8(x, residual, norm_weight, eps)
    y = fp8_gemm(xq, sx, wq, w_scale, bias, x.dtype).reshape(*x.shape[:-1], wq.shape[0])
    return y, (x if new_res is None else new_res)


def fp8_silu_linear(gate_up: torch.Tensor, wq: torch.Tensor,
                    w_scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear(silu(gate) * up) with the activation quantizing its output."""
    xq, sx = silu_and_mul_quant_fp8(gate_up)
    y = fp8_gemm(xq, sx, wq, w_scale, None, gate_up.dtype)
    return y.reshape(*gate_up.shape[:-1], wq.shape[0])
