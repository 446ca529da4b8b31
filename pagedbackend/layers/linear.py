"""Tensor-parallel linear layers. Column-parallel layers split output rows across ranks (several
logical projections may be packed into one matmul, e.g. q|k|v or gate|up); row-parallel layers
split input columns and all-reduce the partial sums. With tp_size == 1 nothing is distributed.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the *full*
checkpoint tensor (or a lazy safetensors slice) and copies in only this rank's part.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedbackend.layers.activation import silu_and_mul
from pagedbackend.layers.fp8_inputs import fp8_norm_linear, fp8_silu_linear, fused_quant_active
from pagedbackend.layers.norm import USE_KERNELS
from pagedbackend.layers.quant_grouped import PackedWeight
from pagedbackend.layers.quantization import scaled_linear


def narrow(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start:start+size] along dim; works on tensors and on lazy safetensors slices, so a
    rank reads only its shard from disk."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * dim + [slice(start, start + size)]
    return loaded[tuple(index)]


def materialize(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Replicated parameter: the whole tensor on every rank."""
    src = materialize(loaded)
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor shape {tuple(src.shape)} does not match "
                         f"parameter shape {tuple(param.shape)}")
    param.data.copy_(src)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except for decode batches of a few rows on CUDA, where a triton kernel takes
    the shapes it was measured faster on (pagedbackend.kernels.gemv_tuning). With weight_scale
    the weight is float8 e4m3 or int8 with a scale per output channel (quantization="fp8" /
    "int8")."""
    if x.is_cuda and USE_KERNELS:
        from pagedbackend.kernels.gemv_tuning import maybe_skinny_linear
        y = maybe_skinny_linear(x, weight, bias, weight_scale)
        if y is not None:
            return y
    if weight_scale is not None:
        return scaled_linear(x, weight, weight_scale, bias)
    return F.linear(x, weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                proj: "ColumnParallelLinear") -> tuple[torch.Tensor, torch.Tensor]:
    """proj(norm(x + residual)) and the new residual (x + residual, or x when residual is None):
    the pre-norm block's entry. On CUDA, where the skinny matmul serves proj's shape, the norm
    runs inside it (one kernel instead of two); with fp8 weights elsewhere the norm writes the
    FP8 GEMM's quantized input (layers/fp8_inputs.py)."""
    if x.is_cuda and USE_KERNELS:
        if proj.quant is not None:
            from pagedbackend.kernels.gemv_w4_tuning import maybe_packed_norm_linear
            out = maybe_packed_norm_linear(x, residual, norm.weight, norm.eps, proj.quant,
                                           proj.bias)
        else:
            from pagedbackend.kernels.gemv_tuning import maybe_skinny_norm_linear
            out = maybe_skinny_norm_linear(x, residual, norm.weight, norm.eps, proj.weight,
                                           proj.bias, proj.weight_scale)
        if out is not None:
            return out
    if proj.weight_scale is not None and fused_quant_active(x, proj.weight, norm.weight):
        return fp8_norm_linear(x, residual, norm.weight, norm.eps, proj.weight,
                               proj.weight_scale, proj.bias)
    if residual is None:
        return proj(norm(x)), x
    h, residual = norm(x, residual)
    return proj(h), residual


def tp_all_reduce(x: torch.Tensor, tp_size: int, group) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x, group=group)
    return x


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              loader=default_weight_loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def check_divisible(what: str, value: int, tp_size: int) -> None:
    if value % tp_size:
        raise ValueError(f"{what}={value} is not divisible by tensor_parallel_size={tp_size}")


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T (+ b) where W packs len(output_sizes) projections, each split by rows."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        for size in output_sizes:
            check_divisible("output size", size, tp_size)
        self.tp_rank = tp_rank
        self.local_sizes = [s // tp_size for s in output_sizes]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(output_sizes))]
        out = sum(self.local_sizes)
        self.weight = new_param((out, input_size), dtype, device, self.weight_loader)
        self.bias = new_param((out,), dtype, device, self.weight_loader) if bias else None
        self.weight_scale: torch.Tensor | None = None    # fp8 / int8 weights: per output row
        self.quant: PackedWeight | None = None           # AWQ / GPTQ weights (then no .weight)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: int | None = None) -> None:
        i = shard_id or 0
        size = self.local_sizes[i]
        src = narrow(loaded, 0, self.tp_rank * size, size)
        param.data.narrow(0, self.offsets[i], size).copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x, self.bias)
        return linear(x, self.weight, self.bias, self.weight_scale)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard.T) (+ b): the input arrives already split by columns."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        super().__init__()
        check_divisible("input size", input_size, tp_size)
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.local_in = input_size // tp_size
        self.weight = new_param((output_size, self.local_in), dtype, device, self.weight_loader)
        # The bias is added once, after the reduction, so it is replicated.
        self.bias = new_param((output_size,), dtype, device) if bias else None
        self.weight_scale: torch.Tensor | None = None    # fp8 / int8 weights: per output row
        self.quant: PackedWeight | None = None           # AWQ / GPTQ weights (then no .weight)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        param.data.copy_(narrow(loaded, 1, self.tp_rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self._reduce(self.quant(x, None))
        return self._reduce(linear(x, self.weight, None, self.weight_scale))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) over gate_up = [..., 2 * local_in]; on CUDA, where the skinny
        matmul serves this shape, the activation runs inside it; with fp8 weights elsewhere
        it writes the FP8 GEMM's quantized input."""
        if gate_up.is_cuda and USE_KERNELS:
            if self.quant is not None:
                from pagedbackend.kernels.gemv_w4_tuning import maybe_packed_silu_linear
                y = maybe_packed_silu_linear(gate_up, self.quant)
            else:
                from pagedbackend.kernels.gemv_tuning import maybe_skinny_silu_linear
                y = maybe_skinny_silu_linear(gate_up, self.weight, self.weight_scale)
            if y is not None:
                return self._reduce(y)
        if self.weight_scale is not None and fused_quant_active(gate_up, self.weight):
            return self._reduce(fp8_silu_linear(gate_up, self.weight, self.weight_scale))
        return self.forward(silu_and_mul(gate_up))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(y, self.tp_size, self.tp_group)
        return y if self.bias is None else y + self.bias
