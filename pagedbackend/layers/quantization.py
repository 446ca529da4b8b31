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

Checkpoints already in FP8 are read as they are (their `quantization_config` says so: vLLM's
quant_method "fp8", or "compressed-tensors" with 8-bit float weights): the e4m3 weights are
copied unchanged and their scales, per tensor or per output channel, become the per-channel
scales here (a per-tensor scale fills its projection's rows of a packed q|k|v or gate|up).
Their activation scales are not used: inputs are always quantized per token, at run time.

quantization="int8" (W8A16) is the same at start with int8 weights (|w| / scale rounded to
the nearest integer in [-127, 127], one scale per output channel) and 16-bit inputs: the skinny
kernel reads the int8 weights as it reads e4m3 ones, wider matmuls multiply by the int8 weight
widened to the activations' dtype (exact: integers up to 256 fit bf16) and scale the result.
AWQ and GPTQ checkpoints (group-wise 4/8-bit) are quant_formats.py and quant_grouped.py.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.layers.attention import FP8_MAX

FP8 = torch.float8_e4m3fn
INT8_MAX = 127.0
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
    return fp8_gemm(xq, sx, wq, w_scale, bias, x.dtype).reshape(*lead, wq.shape[0])


def fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 GEMM on an input already quantized per row (xq [M, K] e4m3, sx [M, 1]): [M, N]
    in dtype. Steps of 1-64 rows on CUDA run kernels/fp8_mma.py's tensor-core kernel where it
    was timed faster for the shape (unless PAGEDBACKEND_FP8_DECODE=cublas); the rest
    torch._scaled_mm (fp8_gemm_cublas)."""
    if xq.is_cuda:
        from pagedbackend.kernels.fp8_mma import maybe_fp8_mma_gemm
        y = maybe_fp8_mma_gemm(xq, sx, wq, w_scale, bias, dtype)
        if y is not None:
            return y
    return fp8_gemm_cublas(xq, sx, wq, w_scale, bias, dtype)


def fp8_gemm_cublas(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor,
                    w_scale: torch.Tensor, bias: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """fp8_gemm with torch._scaled_mm (cuBLASLt on the GPU: through bf16, see fp8_linear)."""
    y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=w_scale.view(1, -1),
                         out_dtype=torch.bfloat16 if xq.is_cuda else dtype)
    if y.dtype != dtype:
        y = y.to(dtype)
    if bias is not None:
        y = y + bias
    return y


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (wq [N, K] int8, scale [N] fp32): each row's largest magnitude on 127,
    the others rounded to the nearest step (symmetric, per output channel)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(min=MIN_SCALE)
    return torch.round(wf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale.view(-1)


def int8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x @ wq.T) * w_scale (+ bias) in x's dtype, wq int8 widened to x's dtype (W8A16).

    On the GPU the weight is dequantized in one kernel (wq * scale, rounded once to x's dtype)
    and the matmul writes the result: the form here widens the weight in torch and passes
    over the [M, N] output three times more (fp32, scale, cast), which cost int8 W1's TTFT
    4.8x fp8's (H100 call 66)."""
    if x.is_cuda:
        from pagedbackend.kernels.quant import dequantize_rows
        return F.linear(x, dequantize_rows(wq, w_scale, x.dtype), bias)
    y = (F.linear(x, wq.to(x.dtype)).float() * w_scale).to(x.dtype)
    return y if bias is None else y + bias


def scaled_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The matmul of a layer holding wq with per-channel scales: fp8 or int8."""
    if wq.dtype == torch.int8:
        return int8_linear(x, wq, w_scale, bias)
    return fp8_linear(x, wq, w_scale, bias)


def dequantize(wq: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an fp8 or int8 layer stands for: wq * scale, in dtype (references, tests)."""
    return (wq.float() * w_scale.view(-1, 1)).to(dtype)


def quantize_model_fp8(model: nn.Module, dtype: torch.dtype = FP8) -> int:
    """Replace every column- and row-parallel layer's weight by its e4m3 (or int8) form and
    per-channel scale (`weight_scale`), freeing the 16-bit weight; returns the number of layers
    changed."""
    quantize = quantize_weight_int8 if dtype == torch.int8 else quantize_weight_fp8
    count = 0
    with torch.no_grad():
        for module in _linear_layers(model):
            wq, scale = quantize(module.weight)
            _set_weight(module, wq)
            module.weight_scale = scale
            count += 1
    return count


def _linear_layers(model: nn.Module) -> list[nn.Module]:
    """The layers fp8 applies to: every column- and row-parallel linear layer."""
    from pagedbackend.layers.linear import ColumnParallelLinear, RowParallelLinear
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _set_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """module.weight becomes `weight`, keeping the old parameter's checkpoint loader."""
    loader = module.weight.weight_loader
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.weight.weight_loader = loader


def checkpoint_quantization(hf_config: dict, model_dir: str) -> Optional[str]:
    """What config.json's quantization_config describes: "fp8" (float8 weights), "awq" or
    "gptq" (group-wise integer weights, their fields checked: quant_formats.GroupQuantSpec),
    None without one; anything else is a ValueError naming what it found."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    why = None
    if method in ("awq", "gptq"):
        from pagedbackend.layers.quant_formats import GroupQuantSpec
        GroupQuantSpec.from_config(qc)
        return method
    if method == "fp8":
        if qc.get("weight_block_size"):
            why = f"fp8 with block-wise scales (weight_block_size {qc['weight_block_size']})"
    elif method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8 \
                    or w.get("strategy") not in ("tensor", "channel"):
                why = (f"compressed-tensors weights of type {w.get('type')!r}, "
                       f"{w.get('num_bits')} bits, strategy {w.get('strategy')!r}")
    else:
        why = repr(method)
    if why is not None:
        raise ValueError(f"model={model_dir!r} is invalid: its checkpoint is quantized with {why}; "
                         "must be 16-bit, FP8 (quant_method 'fp8' or compressed-tensors "
                         "float8 weights, per-tensor or per-channel scales), AWQ (GEMM) or GPTQ")
    return "fp8"


def check_quantization_agrees(quantization: Optional[str], found: Optional[str],
                              load_format: str) -> None:
    """An explicit `quantization` must fit the checkpoint: its own method (or None) for a
    quantized one; None, fp8 or int8 (quantized at start) for a 16-bit one. AWQ / GPTQ over
    dummy weights (benchmarks) need no checkpoint: 4-bit codes are generated."""
    if quantization is None or quantization == found:
        return
    if found is None:
        if quantization in ("fp8", "int8") or load_format == "dummy":
            return
        raise ValueError(f"quantization={quantization!r} is invalid: the checkpoint has no "
                         "quantization_config (16-bit weights), so it must be None, 'fp8' or "
                         "'int8' (scripts/quantize.py writes AWQ / GPTQ checkpoints)")
    raise ValueError(f"quantization={quantization!r} is invalid: must be None or {found!r}, "
                     "as the checkpoint's quantization_config says")


def prepare_fp8_checkpoint(model: nn.Module) -> None:
    """Before loading an FP8 checkpoint: every column- and row-parallel layer gets an e4m3
    weight and a `weight_scale` parameter [N], each with a loader for the checkpoint's tensors
    (`*.weight` in e4m3, `*.weight_scale` a scalar or one value per output row)."""
    for module in _linear_layers(model):
        old = module.weight
        _set_weight(module, torch.empty(old.shape, dtype=FP8, device=old.device))
        scale = torch.empty(old.shape[0], dtype=torch.float32, device=old.device)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        module.weight_scale.weight_loader = _scale_loader(module)


def _scale_loader(module: nn.Module):
    from pagedbackend.layers.linear import ColumnParallelLinear, materialize

    def load(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        src = materialize(loaded).float().reshape(-1)
        if isinstance(module, ColumnParallelLinear):
            i = shard_id or 0
            size, offset = module.local_sizes[i], module.offsets[i]
            rows = param.data.narrow(0, offset, size)
            if src.numel() > 1:     # per channel: this rank's rows of the projection
                src = src.narrow(0, module.tp_rank * size, size)
        else:                       # row-parallel: every rank holds all output rows
            rows = param.data
        if src.numel() == 1:
            rows.fill_(src.item())
        elif src.numel() == rows.numel():
            rows.copy_(src)
        else:
            raise ValueError(f"checkpoint weight_scale of {src.numel()} values does not match "
                             f"{rows.numel()} output rows (expected 1 or one per row)")
    return load


def is_fp8(loaded: Any) -> bool:
    """Whether a checkpoint tensor (or a lazy safetensors slice) holds float8 e4m3."""
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype == FP8
    get_dtype = getattr(loaded, "get_dtype", None)
    return get_dtype is not None and get_dtype() == "F8_E4M3"
