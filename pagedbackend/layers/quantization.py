"""quantization="fp8": the linear layers' weights in float8 e4m3, one scale per output channel,
quantized from the loaded weights when the engine starts (vLLM's dynamic FP8 for a checkpoint in
16-bit). Half the weight bytes of bf16, and on Hopper the FP8 tensor cores.

A matmul of more than a few rows quantizes its input too, one scale per row (token), and runs
torch._scaled_mm (cuBLASLt's FP8 GEMM on the GPU) with both scales applied to the fp32 result:
y[m, n] = sum_k xq[m, k] * wq[n, k] * sx[m] * sw[n]. Decode steps of 1-4 rows on CUDA take the
skinny kernel instead (kernels.gemv), which reads the fp8 weights and keeps the input in 16 bits
(W8A16), so a row's result differs slightly between the two paths; both sit within e4m3's
rounding of the bf16 matmul.

The embeddings and the LM head stay in the model's dtype, as in vLLM. With tensor parallelism
every rank quantizes its own shard: a row-parallel layer's scales come from its slice of each
weight row.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedbackend.layers.attention import FP8_MAX

FP8 = torch.float8_e4m3fn
# The smallest scale: an all-zero row (or weight row) quantizes to zeros instead of 0/0.
MIN_SCALE = 1e-12


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scale [M, 1] fp32) with x ~= xq * scale: each row scaled
    so that its largest magnitude lands on 448, e4m3's largest finite value."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (wq [N, K] e4m3, scale [N] fp32), one scale per output channel."""
    wq, scale = quantize_rows_fp8(w)
    return wq, scale.view(-1)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (wq * w_scale[:, None]).T (+ bias) in x's dtype, x quantized per row on the way in.

    On the GPU the FP8 GEMM with per-row and per-channel scales writes bf16 (cuBLASLt takes no
    other output type with these scales), so other activation dtypes are cast from it; the
    CPU's writes x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from pagedbackend.kernels.quant import quantize_rows_fp8 as quantize
    else:
        quantize = quantize_rows_fp8
    xq, sx = quantize(x2)
    y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=w_scale.view(1, -1),
                         out_dtype=torch.bfloat16 if x.is_cuda else x.dtype)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, wq.shape[0])


def dequantize(wq: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an fp8 layer stands for: wq * scale, in dtype (references and tests)."""
    return (wq.float() * w_scale.view(-1, 1)).to(dtype)


def quantize_model_fp8(model: nn.Module) -> int:
    """Replace every column- and row-parallel layer's weight by its e4m3 form and per-channel
    scale (`weight_scale`), freeing the 16-bit weight; returns the number of layers changed."""
    from pagedbackend.layers.linear import ColumnParallelLinear, RowParallelLinear
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            wq, scale = quantize_weight_fp8(module.weight)
            loader = module.weight.weight_loader
            module.weight = nn.Parameter(wq, requires_grad=False)
            module.weight.weight_loader = loader
            module.weight_scale = scale
            count += 1
    return count
