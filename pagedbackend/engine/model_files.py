"""Reads a model directory (config.json, tokenizer, generation_config.json) into EngineInfo."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from pagedbackend.config import EngineConfig, check
from pagedbackend.layers.quantization import check_quantization_agrees, checkpoint_quantization

DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}


@dataclass(frozen=True)
class EngineInfo:
    """What the engine found out while starting (the config itself stays as given)."""
    model_type: str
    architecture: str
    device: str
    dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int = 0
    block_size: int = 16

    def with_blocks(self, num_blocks: int) -> "EngineInfo":
        return dataclasses.replace(self, num_kv_blocks=num_blocks)


@dataclass
class ModelFiles:
    hf_config: dict
    tokenizer: Optional[Any]
    info: EngineInfo


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None = None) -> str:
    """auto: on GPUs the checkpoint's own 16-bit type (config.json's torch_dtype / dtype), as
    vLLM's auto: AWQ checkpoints are fp16 and AWQ kernels are written for it), else bf16; bf16
    on CPUs with native bf16 matmul (as vLLM's CPU backend), float32 on CPUs without it, where
    bf16 would be emulated and slow."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
    import torch
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def _eos_ids(model_dir: str, hf_config: dict, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(x for x in v if isinstance(x, int))

    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    add(hf_config.get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def load_tokenizer(path: str) -> Optional[Any]:
    has_files = any(os.path.exists(os.path.join(path, f))
                    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if not has_files:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_model_files(config: EngineConfig) -> ModelFiles:
    cfg_path = os.path.join(config.model, "config.json")
    check(os.path.isfile(cfg_path), "model", config.model,
          "a directory holding config.json (run scripts/prepare_model.py)")
    with open(cfg_path) as f:
        hf_config = json.load(f)
    tokenizer = load_tokenizer(config.tokenizer_path)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device,
                          hf_config.get("torch_dtype") or hf_config.get("dtype"))
    limit = int(hf_config.get("max_position_embeddings", 2048))
    max_model_len = config.max_model_len or limit
    check(max_model_len <= limit, "max_model_len", config.max_model_len,
          f"at most the model's max_position_embeddings ({limit})")
    batched = config.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS[device]
    check(config.enable_chunked_prefill or batched >= max_model_len, "max_num_batched_tokens",
          batched, f">= max_model_len ({max_model_len}) when enable_chunked_prefill is off")
    # a quantization it cannot read, or one other than `quantization` asks for: refused
    check_quantization_agrees(config.quantization,
                              checkpoint_quantization(hf_config, config.model), config.load_format)
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    info = EngineInfo(
        model_type=hf_config.get("model_type", "llama"), architecture=archs[0], device=device,
        dtype=dtype, max_model_len=max_model_len, max_num_batched_tokens=batched,
        vocab_size=int(hf_config["vocab_size"]), eos_token_ids=_eos_ids(config.model, hf_config,
                                                                        tokenizer),
        block_size=config.block_size)
    return ModelFiles(hf_config, tokenizer, info)
