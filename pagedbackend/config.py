"""Engine configuration: one frozen dataclass with vLLM's argument names, validated on creation.

Values discovered while starting (number of KV blocks, resolved max_model_len) are not stored
here; they live in `pagedbackend.engine.llm_engine.EngineInfo`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

DTYPES = ("auto", "float32", "float16", "bfloat16")
# auto: the model's dtype; fp8 (= fp8_e4m3): the KV cache in float8 e4m3 with a scale of 1
# (vLLM's names and default scaling), half the bytes per token
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# fp8 / int8: the linear layers' weights quantized to float8 e4m3 / int8 at start, one scale
# per output channel (layers/quantization.py); awq / gptq: a checkpoint of group-wise 4-bit
# (GPTQ: or 8-bit) weights (layers/quant_grouped.py), found from config.json without it too;
# None: the weights as loaded
QUANTIZATIONS = ("fp8", "int8", "awq", "gptq")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority")
# How a preempted request gets its KV back (core/host_tier.py): recompute (free it, prefill again),
# swap (copy it to the host tier and back), auto (by estimated cost: recompute short contexts,
# swap long ones). None: auto when swap_space > 0, else recompute.
PREEMPTION_MODES = ("recompute", "swap", "auto")
MAX_SWAP_SPACE_GIB = 4096.0                 # per GPU; more is a typo (MiB meant?), not a host


# Longest value an error echoes: a client's 10 MB stop list must not come back in the error.
MAX_SHOWN_CHARS = 200


def check(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise the one error shape used for every bad setting: field, value, allowed range."""
    if not ok:
        raise ValueError(f"{field}={shown(value)} is invalid: must be {allowed}")


def shown(value: Any) -> str:
    """repr(value), cut to MAX_SHOWN_CHARS (the cut says how long it was)."""
    text = repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}...<{len(text)} chars>"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: Optional[str] = None          # defaults to `model`
    # auto: on cuda the checkpoint's fp16 / bf16 (else bf16); on CPUs bf16 where native, else f32
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"             # see KV_CACHE_DTYPES
    quantization: Optional[str] = None       # see QUANTIZATIONS
    device: str = "auto"                     # auto: cuda if available, else cpu
    max_model_len: Optional[int] = None      # defaults to the model's max_position_embeddings
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None      # explicit pool size; overrides memory sizing
    kv_cache_memory_bytes: Optional[int] = None  # CPU (or explicit) KV budget in bytes
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # default: 8192 (cuda) / 2048 (cpu)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    # Launch step N+1 before step N's sampled ids reach the host, so scheduling and output
    # processing overlap the GPU. None: on for a single CUDA device, off otherwise.
    async_scheduling: Optional[bool] = None
    max_n: int = 16                          # cap on SamplingParams.n
    # Defaults of the sampling fields a request leaves unset: "auto" the model's
    # generation_config.json, "vllm" none, or a folder holding one (vLLM's --generation-config)
    generation_config: str = "auto"
    distributed_backend: Optional[str] = None  # TP: nccl on cuda, gloo on cpu
    # vLLM's speculative_config: a dict (or JSON text) of spec_decode.config.SpeculativeConfig
    # fields, stored as that dataclass; None: no speculative decoding
    speculative_config: Any = None
    # The host-memory KV tier, GiB per GPU (vLLM's swap_space): swapped-out requests and
    # prefix-cache blocks evicted from the GPU pool (worker/host_kv.py, core/host_tier.py)
    swap_space: float = 0.0
    preemption_mode: Optional[str] = None    # see PREEMPTION_MODES

    def __post_init__(self) -> None:
        check(isinstance(self.model, str) and self.model != "", "model", self.model,
              "a non-empty path to a model directory")
        check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
              f"one of {KV_CACHE_DTYPES}")
        check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
              self.quantization, f"None or one of {QUANTIZATIONS}")
        check(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        check(self.max_model_len is None or _is_int(self.max_model_len) and self.max_model_len >= 1,
              "max_model_len", self.max_model_len, "an integer >= 1")
        check(_is_int(self.block_size) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
              "block_size", self.block_size, "a power of two in [1, 128]")
        check(isinstance(self.gpu_memory_utilization, (int, float))
              and 0.0 < self.gpu_memory_utilization <= 1.0,
              "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        check(self.num_kv_blocks is None or _is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1,
              "num_kv_blocks", self.num_kv_blocks, "an integer >= 1")
        check(self.kv_cache_memory_bytes is None
              or _is_int(self.kv_cache_memory_bytes) and self.kv_cache_memory_bytes >= 1,
              "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "an integer >= 1")
        check(_is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 65536,
              "max_num_seqs", self.max_num_seqs, "an integer in [1, 65536]")
        check(self.max_num_batched_tokens is None
              or _is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
              "max_num_batched_tokens", self.max_num_batched_tokens, "an integer >= 1")
        check(self.scheduling_policy in POLICIES, "scheduling_policy", self.scheduling_policy,
              f"one of {POLICIES}")
        check(_is_int(self.tensor_parallel_size) and 1 <= self.tensor_parallel_size <= 64,
              "tensor_parallel_size", self.tensor_parallel_size, "an integer in [1, 64]")
        check(self.load_format in LOAD_FORMATS, "load_format", self.load_format,
              f"one of {LOAD_FORMATS}")
        check(_is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an integer >= 0")
        check(_is_int(self.max_n) and self.max_n >= 1, "max_n", self.max_n, "an integer >= 1")
        check(isinstance(self.generation_config, str) and self.generation_config != "",
              "generation_config", self.generation_config,
              "auto, vllm, or a folder holding generation_config.json")
        check(self.distributed_backend in (None, "gloo", "nccl"), "distributed_backend",
              self.distributed_backend, "None, 'gloo' or 'nccl'")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        check(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
              "async_scheduling", self.async_scheduling, "true, false or None (auto)")
        check(not (self.async_scheduling and self.tensor_parallel_size > 1), "async_scheduling",
              self.async_scheduling, "off (false or None) with tensor_parallel_size > 1")
        if self.speculative_config is not None:
            from pagedbackend.spec_decode.config import SpeculativeConfig
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.make(self.speculative_config))
            check(self.tensor_parallel_size == 1, "speculative_config", self.speculative_config,
                  "None with tensor_parallel_size > 1 (not supported yet)")
        self._check_swap()

    def _check_swap(self) -> None:
        check(isinstance(self.swap_space, (int, float)) and not isinstance(self.swap_space, bool)
              and 0 <= self.swap_space <= MAX_SWAP_SPACE_GIB, "swap_space", self.swap_space,
              f"a number of GiB in [0, {MAX_SWAP_SPACE_GIB:g}] (per GPU)")
        check(self.preemption_mode is None or self.preemption_mode in PREEMPTION_MODES,
              "preemption_mode", self.preemption_mode, f"None or one of {PREEMPTION_MODES}")
        if self.preemption_mode in ("swap", "auto") and self.swap_space == 0:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is invalid with "
                             "swap_space=0: must be 'recompute' (or None), or set swap_space "
                             "> 0 GiB for the host tier it swaps to")

    @property
    def resolved_preemption_mode(self) -> str:
        if self.preemption_mode is not None:
            return self.preemption_mode
        return "auto" if self.swap_space > 0 else "recompute"

    def resolved_kv_cache_dtype(self, model_dtype: str) -> str:
        """The KV cache's element type (a torch dtype's name): the model's, or float8_e4m3fn."""
        return model_dtype if self.kv_cache_dtype == "auto" else "float8_e4m3fn"

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
