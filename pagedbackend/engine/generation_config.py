"""The model's generation_config.json sampling values as request defaults (vLLM's
`--generation-config auto`): a field a request leaves unset takes the model's value.

EngineConfig.generation_config: "auto" reads the model folder's file, "vllm" uses none
(SamplingParams' own defaults, as vLLM's opt-out), any other value is a folder holding one.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from pagedbackend.config import check
from pagedbackend.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field: vLLM's list. `do_sample` is not read (as in
# vLLM): a temperature in the file is what the model's authors sample at.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def load_sampling_defaults(setting: str, model_dir: str) -> dict[str, Any]:
    """{SamplingParams field: value} from generation_config.json; {} for "vllm" or a model
    folder without the file. Values are checked as a request's would be."""
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        check(setting == "auto", "generation_config", setting,
              "auto, vllm, or a folder holding generation_config.json")
        return {}
    with open(path) as f:
        raw = json.load(f)
    out = {}
    for key, name in GENERATION_CONFIG_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        if name == "top_k" and isinstance(value, int) and value <= 0:
            value = -1                          # transformers: 0 means no top-k
        out[name] = value
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"generation_config.json of {folder}: {e}") from None
    return out


def apply_defaults(fields: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A request's SamplingParams fields (only those it set) with the model's defaults filled
    in. max_new_tokens is not copied as a number: max_tokens becomes None (up to the context),
    which the engine caps at min(context room, max_new_tokens), as vLLM does."""
    out = dict(fields)
    for name, value in defaults.items():
        if name not in out:
            out[name] = None if name == "max_tokens" else value
    return out


def default_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams for a request that gives none (LLM.generate(prompts))."""
    return SamplingParams(**apply_defaults({}, defaults))
