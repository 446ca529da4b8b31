"""Fill a built model's parameters from a model directory: safetensors (one file or sharded with
model.safetensors.index.json), GGUF, or deterministic dummy values from config.json alone.
Each rank reads only its shard: safetensors tensors are opened as lazy slices and the
parameters' weight loaders narrow them before anything is copied.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from pagedbackend.layers.norm import RMSNorm
from pagedbackend.layers.quant_formats import METHODS, GroupQuantSpec
from pagedbackend.layers.quant_grouped import (fill_dummy_grouped, finalize_grouped,
                                               prepare_grouped)
from pagedbackend.layers.quantization import (checkpoint_quantization, prepare_fp8_checkpoint,
                                              quantize_model_fp8)
from pagedbackend.models import gguf as gguf_io

logger = logging.getLogger("pagedbackend")

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SAFETENSORS_INDEX = "model.safetensors.index.json"
DUMMY_RANGE = 1e-3


def load_hf_config(model_dir: str) -> dict:
    """config.json of the directory, or one rebuilt from its .gguf file."""
    path = os.path.join(model_dir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    gguf_path = gguf_io.find_gguf(model_dir) if os.path.isdir(model_dir) else None
    if gguf_path is None:
        raise ValueError(f"model={model_dir!r} is invalid: must be a directory with config.json "
                         f"or a .gguf file")
    return gguf_io.gguf_hf_config(gguf_path)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    return [os.path.join(model_dir, n) for n in names]


def resolve_load_format(model_dir: str, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is invalid: must be one of {LOAD_FORMATS}")
    if load_format != "auto":
        return load_format
    if safetensors_files(model_dir):
        return "safetensors"
    if gguf_io.find_gguf(model_dir):
        return "gguf"
    raise ValueError("load_format='auto' is invalid for this model directory: it holds "
                     "neither *.safetensors nor a .gguf file")


def _iter_safetensors(model_dir: str) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, model_dir: str, load_format: str = "auto", seed: int = 0,
                 quantization: Optional[str] = None, hf_config: Optional[dict] = None) -> None:
    """Load every parameter of `model` (built by build_model) from `model_dir`, then quantize
    its weights to fp8 / int8 if `quantization` asks for it. An FP8, AWQ or GPTQ checkpoint
    (hf_config's quantization_config) is read as it is (load_model_files checked that
    `quantization` agrees); dummy weights for an FP8 model's config.json are generated in 16
    bits and quantized, for an AWQ / GPTQ one (or quantization="awq" / "gptq" over any
    config.json: 4 bits, groups of 128) as random codes.

    Raises ValueError naming the parameters the checkpoint did not provide."""
    fmt = resolve_load_format(model_dir, load_format)
    found = checkpoint_quantization(hf_config, model_dir) if hf_config is not None else None
    if found in METHODS or quantization in METHODS:
        spec = GroupQuantSpec.from_config(hf_config["quantization_config"]) if found in METHODS \
            else GroupQuantSpec(quantization, 4, _dummy_group(hf_config or {}))
        _load_grouped(model, model_dir, fmt, spec, seed)
        return
    fp8_checkpoint = found == "fp8"
    if fp8_checkpoint and fmt != "dummy":
        prepare_fp8_checkpoint(model)
        _load_checkpoint(model, model_dir, fmt)
        logger.info("quantization fp8: float8 e4m3 weights and scales from the checkpoint")
        return
    if fmt == "dummy":
        init_dummy_weights(model, seed)
    else:
        _load_checkpoint(model, model_dir, fmt)
    if quantization == "fp8" or fp8_checkpoint:
        layers = quantize_model_fp8(model)
        logger.info("quantization fp8: %d linear layers in float8 e4m3 (per-channel scales)",
                    layers)
    elif quantization == "int8":
        layers = quantize_model_fp8(model, torch.int8)
        logger.info("quantization int8: %d linear layers in int8 (per-channel scales)", layers)


def _dummy_group(hf_config: dict) -> int:
    """Dummy AWQ / GPTQ weights: groups of 128, or the largest smaller power of two dividing
    every layer's input (tiny test models)."""
    heads = hf_config.get("num_attention_heads", 1)
    head_dim = hf_config.get("head_dim") or hf_config.get("hidden_size", 128) // heads
    sizes = [hf_config.get("hidden_size", 128), hf_config.get("intermediate_size", 128),
             heads * head_dim]
    return next((g for g in (128, 64, 32, 16, 8) if all(k % g == 0 for k in sizes)), -1)


def _load_grouped(model: nn.Module, model_dir: str, fmt: str, spec: GroupQuantSpec,
                  seed: int) -> None:
    """An AWQ / GPTQ checkpoint: staging parameters named as its tensors, filled, repacked."""
    prepare_grouped(model, spec)
    if fmt == "dummy":
        init_dummy_weights(model, seed)
        fill_dummy_grouped(model, seed)
    else:
        _load_checkpoint(model, model_dir, fmt)
    layers = finalize_grouped(model)
    logger.info("quantization %s: %d linear layers in %d bits, groups of %d%s", spec.method,
                layers, spec.bits, spec.group_size, " (act order)" if spec.desc_act else "")


def _load_checkpoint(model: nn.Module, model_dir: str, fmt: str) -> None:
    if fmt == "safetensors":
        if not safetensors_files(model_dir):
            raise ValueError("load_format='safetensors' is invalid for this model directory: "
                             "it holds no *.safetensors file")
        tensors = _iter_safetensors(model_dir)
    else:
        path = gguf_io.find_gguf(model_dir)
        if path is None:
            raise ValueError("load_format='gguf' is invalid for this model directory: "
                             "it holds no .gguf file")
        tensors = gguf_io.iter_gguf_tensors(path)
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for name, loaded in tensors:
            target = model.load_weight(name, loaded, params)
            if target is not None:
                filled.add(target)
    missing = sorted(model.required_weight_keys() - filled)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ValueError(f"the {fmt} checkpoint lacks weights for: {shown}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small uniform values in [-1e-3, 1e-3] (norm weights 1), generated on the parameters' own
    device and shard by shard, deterministic for a seed and a rank."""
    rank = getattr(model, "tp_rank", 0)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():       # AWQ / GPTQ codes: fill_dummy_grouped
                continue
            if id(p) in norm_weights:
                p.fill_(1.0)
                continue
            g = generators.get(p.device)
            if g is None:
                g = generators[p.device] = torch.Generator(device=p.device)
                g.manual_seed(seed * 1009 + rank)
            p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g)
