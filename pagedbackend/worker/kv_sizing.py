"""How many KV blocks fit: explicit count, a byte budget, or what the GPU has left."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pagedbackend.config import EngineConfig

logger = logging.getLogger("pagedbackend")

DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_heads_and_dim(hf_config: dict) -> tuple[int, int]:
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    return kv_heads, head_dim


def kv_bytes_per_block(hf_config: dict, block_size: int, dtype: torch.dtype, tp_size: int) -> int:
    kv_heads, head_dim = kv_heads_and_dim(hf_config)
    per_rank = max(1, kv_heads // tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * int(hf_config["num_hidden_layers"]) * block_size * per_rank * head_dim * elem


def num_blocks_for_device(config: EngineConfig, device: torch.device, bytes_per_block: int,
                          profile: Callable[[], None]) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        return max(1, config.kv_cache_memory_bytes // bytes_per_block)
    if device.type != "cuda":
        return max(1, DEFAULT_CPU_KV_BYTES // bytes_per_block)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    # Memory held outside torch's allocator (CUDA context, NCCL, other processes).
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(total * config.gpu_memory_utilization) - peak - non_torch
    torch.cuda.empty_cache()
    logger.info("GPU memory: total %.1f GiB, weights+activation peak %.1f GiB, other %.1f GiB, "
                "KV budget %.1f GiB", total / 2**30, peak / 2**30, non_torch / 2**30,
                budget / 2**30)
    return max(0, budget // bytes_per_block)
