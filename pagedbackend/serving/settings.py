"""Model-config `parameters` (all strings in config.pbtxt) -> typed settings.

Engine settings are EngineConfig fields; a value that is empty or an unfilled `${...}` template
placeholder means "use the default", so configs filled by template tools work unchanged.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from pagedbackend.config import EngineConfig


def parameters_of(model_config: Mapping[str, Any]) -> dict[str, str]:
    """{key: string_value} of a Triton model config (the dict Triton passes to initialize)."""
    out = {}
    for key, value in (model_config.get("parameters") or {}).items():
        text = value.get("string_value", "") if isinstance(value, dict) else str(value)
        if text.strip() and not text.strip().startswith("${"):
            out[key] = text.strip()
    return out


def resolve_path(path: str, root: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (root / p).resolve())


def engine_config(params: Mapping[str, str], root: Path) -> EngineConfig:
    """Build the EngineConfig from the engine model's parameters; unknown keys are not engine
    settings (e.g. served_model_name) and are left to the caller."""
    kwargs: dict[str, Any] = {}
    types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    for key, text in params.items():
        if key not in types:
            continue
        kwargs[key] = convert_parameter(key, text, types[key])
    if "model" not in kwargs:
        raise ValueError("parameter model is missing: must be a model directory")
    kwargs["model"] = resolve_path(kwargs["model"], root)
    if kwargs.get("tokenizer"):
        kwargs["tokenizer"] = resolve_path(kwargs["tokenizer"], root)
    if "speculative_config" in kwargs:       # JSON; a draft model's path as `model`'s
        from pagedbackend.spec_decode.config import SpeculativeConfig
        spec = SpeculativeConfig.make(kwargs["speculative_config"])
        if spec.model:
            spec = dataclasses.replace(spec, model=resolve_path(spec.model, root))
        kwargs["speculative_config"] = spec
    return EngineConfig(**kwargs)


def streaming_options(params: Mapping[str, str]) -> dict[str, Any]:
    """The engine model's streaming parameters, typed and checked (see docs/SERVING.md):
    {"coalesce": stream_coalesce, "max_responses_per_s": max_responses_per_s,
    "queued_probe_s": queued_probe_ms / 1000}."""
    coalesce = convert_parameter("stream_coalesce", params.get("stream_coalesce", "true"), "bool")
    rate = convert_parameter("max_responses_per_s", params.get("max_responses_per_s", "0"), "float")
    if rate < 0:
        raise ValueError(f"parameter max_responses_per_s={rate!r} is invalid: must be a number "
                         ">= 0 (0: one response per engine step)")
    probe = convert_parameter("queued_probe_ms", params.get("queued_probe_ms", "1000"), "float")
    if probe < 0:
        raise ValueError(f"parameter queued_probe_ms={probe!r} is invalid: must be a number "
                         ">= 0 (0: off)")
    return {"coalesce": coalesce, "max_responses_per_s": rate, "queued_probe_s": probe / 1000}


def convert_parameter(key: str, text: str, hint: str) -> Any:
    try:
        if "bool" in hint:
            low = text.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return low in ("true", "1", "yes")
        if "int" in hint:
            return int(text)
        if "float" in hint:
            return float(text)
    except ValueError:
        want = "true or false" if "bool" in hint else "an integer" if "int" in hint else "a number"
        raise ValueError(f"parameter {key}={text!r} is invalid: must be {want}") from None
    return text
