"""The host tier's memory (`swap_space` GiB per GPU, pinned, allocated once at start) and each
step's copies between it and the KV cache; also the cost estimate behind preemption_mode auto.

Copies (`HostKVCache.swap`) run on a side stream before the step's forward: the side stream
first waits for everything queued on the compute stream (a swap-out reads KV the previous step
may still be writing; a swap-in may overwrite blocks it still reads), then the compute stream
waits for the copies (an event), so no block is read before its copy lands. Swap-outs go first:
a GPU block a swap-out reads may be a swap-in's target in the same step. Each direction is one
gather (or scatter) over every layer's K and V at once on the device, through a staging buffer
allocated before the KV cache is sized, and one host copy per run of consecutive host blocks
(the host pool hands out its lowest free ids, and the pairs are taken in host order, so a
step's blocks are mostly a few runs). With
tensor parallelism each rank copies its own shard. On the CPU the same copies run in place.
"""
from __future__ import annotations

import logging
from typing import Iterator, Optional

import torch

from pagedbackend.config import EngineConfig, check
from pagedbackend.core.host_tier import HostTier, PreemptionCost
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.layers.sampling_metadata import to_device_async
from pagedbackend.worker.host_memory import CUDA_ERROR_MEMORY_ALLOCATION, RegisteredHostMemory
from pagedbackend.worker.kv_sizing import kv_bytes_per_block, kv_heads_and_dim

logger = logging.getLogger("pagedbackend")

STAGING_BYTES = 256 << 20        # the device buffer a step's copies go through, in chunks
# Rates for the auto rule (core/host_tier.PreemptionCost): dense bf16 prefill as achieved on a
# Hopper GPU, pinned copies over PCIe (each way); on the CPU, rough rates of one socket.
RATES = {"cuda": {"flops": 5e14, "link_bytes_per_s": 2.5e10, "fixed_s": 2e-4},
         "cpu": {"flops": 1e11, "link_bytes_per_s": 1e10, "fixed_s": 1e-4}}


def num_host_blocks(swap_space_gib: float, bytes_per_block: int) -> int:
    n = int(swap_space_gib * (1 << 30)) // bytes_per_block
    check(n >= 1, "swap_space", swap_space_gib,
          f"0 or enough GiB for one KV block ({bytes_per_block} bytes per GPU)")
    return n


def check_host_memory(swap_space_gib: float, ranks: int, available: Optional[int] = None) -> None:
    """Refuse a host tier the host cannot hold (all ranks' tiers together), before pinning."""
    if available is None:
        available = _mem_available()
    if available is None:
        return
    limit = 0.8 * available / ranks / (1 << 30)
    check(swap_space_gib <= limit, "swap_space", swap_space_gib,
          f"at most {limit:.1f} GiB per GPU here (80% of the host's {available / (1 << 30):.1f}"
          f" GiB available, shared by {ranks} rank(s))")


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def preemption_cost(hf_config: dict, kv_bytes_per_token: int, device_type: str,
                    tp_size: int = 1) -> PreemptionCost:
    """The auto rule's estimate, per rank: recomputing n tokens costs the prefill's matmuls
    (2 FLOPs per weight per token, without the LM head: only the last token needs logits) and
    its causal attention (2 * n^2 * q_dim per layer); swapping them costs their KV over the
    host link out and back, plus a fixed cost."""
    rates = RATES["cuda" if device_type.startswith("cuda") else "cpu"]
    hidden = int(hf_config["hidden_size"])
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads, head_dim = kv_heads_and_dim(hf_config)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * int(hf_config["intermediate_size"])
    flops = rates["flops"] * tp_size          # each rank holds 1/tp of the work and the bytes
    return PreemptionCost(
        prefill_s_per_token=2 * layers * per_layer / flops,
        attention_s_per_token2=2 * layers * q_dim / flops,
        swap_s_per_token=2 * kv_bytes_per_token / rates["link_bytes_per_s"],
        swap_s_fixed=rates["fixed_s"])


def make_host_tier(config: EngineConfig, kv: KVCacheManager, num_host_blocks: int,
                   hf_config: dict, info) -> Optional[HostTier]:
    """The scheduler's side of the host tier (swap_space > 0), its auto rule fitted to the
    model and the device; None without a host tier."""
    if not config.swap_space:
        return None
    kv_dtype = getattr(torch, config.resolved_kv_cache_dtype(info.dtype))
    per_token = kv_bytes_per_block(hf_config, 1, kv_dtype, config.tensor_parallel_size)
    cost = preemption_cost(hf_config, per_token, str(info.device), config.tensor_parallel_size)
    mode = config.resolved_preemption_mode
    n = next((n for n in (2 ** i for i in range(25)) if cost.prefers_swap(n)), None)
    logger.info("host KV tier: preemption_mode=%s (auto would swap contexts from %s tokens)",
                mode, f"~{n}" if n else "never")
    return HostTier(kv, num_host_blocks, mode, cost)


def staging_buffer(block_shape: tuple, bytes_per_block: int, num_blocks: int,
                   device: torch.device) -> torch.Tensor:
    """The device buffer for a step's copies (uint8: copies are dtype-blind), made before the
    KV cache is sized so that its memory is not counted twice."""
    n = max(1, min(num_blocks, STAGING_BYTES // bytes_per_block))
    return torch.empty((n, *block_shape), dtype=torch.uint8, device=device)


class HostKVCache:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int, staging: torch.Tensor,
                 swap_space_gib: float):
        """kv_cache: the runner's [2, layers, blocks, block_size, kv_heads, head_dim] tensor."""
        # copies are dtype-blind: the widest integer that tiles a head's bytes (a gather of
        # single bytes would move a byte per thread)
        wide = _widest(kv_cache.shape[-1] * kv_cache.element_size())
        raw = kv_cache.view(torch.uint8).view(wide)
        self.device_blocks = raw.permute(2, 0, 1, 3, 4, 5)    # [blocks, 2, layers, ...], a view
        self.device = kv_cache.device
        cuda = self.device.type == "cuda"
        shape = self.host_shape = (num_blocks, *self.device_blocks.shape[1:])
        self.swap_space = swap_space_gib
        try:
            self.memory = RegisteredHostMemory(self.nbytes(shape), self.device)
        except RuntimeError as e:
            code = getattr(e, "code", CUDA_ERROR_MEMORY_ALLOCATION)
            if code != CUDA_ERROR_MEMORY_ALLOCATION:
                raise                       # not a matter of size: CUDA's error, explained
            raise self._too_big(f"{e}") from None
        self.host = self.memory.bytes.view(wide).view(shape)
        self.staging = staging.view(wide)
        assert self.staging.shape[1:] == self.device_blocks.shape[1:], (staging.shape, shape)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.num_blocks = num_blocks
        logger.info("host KV tier: %d blocks (%.2f GiB%s)", num_blocks,
                    self.nbytes(shape) / (1 << 30), ", pinned" if cuda else "")

    def _too_big(self, why: str) -> ValueError:
        return ValueError(f"swap_space={self.swap_space!r} is invalid: the host could not "
                          f"pin {self.nbytes(self.host_shape) / (1 << 30):.3g} GiB ({why}); "
                          "must be less")

    def close(self) -> None:
        """Unpin the tier (the engine's shutdown; else when it is garbage-collected)."""
        self.memory.close()

    def nbytes(self, shape: tuple) -> int:
        n = self.device_blocks.element_size()
        for s in shape:
            n *= s
        return n

    def swap(self, swap_out: list, swap_in: list) -> None:
        """Queue a step's copies ((GPU block, host block) pairs) ahead of its forward."""
        if not swap_out and not swap_in:
            return
        if self.stream is None:
            self._copies(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copies(swap_out, swap_in)
        compute.wait_stream(self.stream)

    def _copies(self, swap_out: list, swap_in: list) -> None:
        # In host order (stable: a host block written twice keeps its last write), so the host
        # side moves runs of consecutive blocks: a request's blocks are freed last first, so
        # their offloads take host ids in the reverse of their GPU order.
        swap_out = sorted(swap_out, key=lambda p: p[1])
        swap_in = sorted(swap_in, key=lambda p: p[1])
        size = self.staging.shape[0]
        for i in range(0, len(swap_out), size):
            chunk = swap_out[i:i + size]
            staged = self.staging[:len(chunk)]
            torch.index_select(self.device_blocks, 0, self._ids(g for g, _ in chunk), out=staged)
            for host0, at, n in _runs([h for _, h in chunk]):
                self.host[host0:host0 + n].copy_(staged[at:at + n], non_blocking=True)
        for i in range(0, len(swap_in), size):
            chunk = swap_in[i:i + size]
            staged = self.staging[:len(chunk)]
            for host0, at, n in _runs([h for _, h in chunk]):
                staged[at:at + n].copy_(self.host[host0:host0 + n], non_blocking=True)
            self.device_blocks.index_copy_(0, self._ids(g for g, _ in chunk), staged)

    def _ids(self, ids) -> torch.Tensor:
        return to_device_async(torch.tensor(list(ids), dtype=torch.long), self.device)


def _widest(nbytes: int) -> torch.dtype:
    return next(d for d, n in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2),
                               (torch.uint8, 1)) if nbytes % n == 0)


def _runs(ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(first id, index in ids, length) of each run of consecutive ids, in order."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield ids[start], start, i - start
            start = i
