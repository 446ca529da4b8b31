"""Turn one Triton request (input tensors as numpy arrays, request parameters as a dict) into
the prompt, SamplingParams and serving flags; every problem is a RequestError naming the field.

Accepts both Triton LLM dialects: TensorRT-LLM's separate tensors (with the aliases min_length and
random_seed) and vLLM's `sampling_parameters` JSON / request parameters (values may be strings).
Precedence, lowest first: request parameters, sampling_parameters JSON, separate tensors.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from pagedbackend.engine.generation_config import apply_defaults
from pagedbackend.sampling_params import MAX_LOGPROBS, SamplingParams


class RequestError(ValueError):
    """A client mistake; the message names the field and is safe to return as INVALID_ARG."""


# Tensor name -> (SamplingParams field, kind). Kinds: "f" float, "i" int, "b" bool.
SAMPLING_TENSORS = {
    "max_tokens": ("max_tokens", "i"),
    "temperature": ("temperature", "f"),
    "top_k": ("top_k", "i"),
    "top_p": ("top_p", "f"),
    "min_p": ("min_p", "f"),
    "repetition_penalty": ("repetition_penalty", "f"),
    "presence_penalty": ("presence_penalty", "f"),
    "frequency_penalty": ("frequency_penalty", "f"),
    "min_tokens": ("min_tokens", "i"),
    "min_length": ("min_tokens", "i"),      # TensorRT-LLM / genai-perf name
    "seed": ("seed", "i"),
    "random_seed": ("seed", "i"),           # older TensorRT-LLM configs
    "ignore_eos": ("ignore_eos", "b"),
}
# Serving flags (not sampling): name -> (kind, default).
FLAG_TENSORS = {
    "stream": ("b", False),
    "exclude_input_in_output": ("b", True),
    "priority": ("i", 0),
}
SAMPLING_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(SamplingParams)}
# Older vLLM names of SamplingParams fields, accepted in sampling_parameters and as parameters.
FIELD_ALIASES = {"guided_decoding": "structured_outputs"}
# A Triton request is one sequence; n > 1 would interleave several streams in one response stream.
SERVING_FIXED = {"n": 1}


@dataclass
class ParsedRequest:
    prompt: Optional[str]                    # text (ensemble path) ...
    prompt_token_ids: Optional[list[int]]    # ... or token ids (input_ids / tokenizer model)
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    priority: int = 0
    cache_salt: Optional[str] = None
    beam_width: int = 1                      # > 1: beam search (serving/beam_requests.py)
    length_penalty: float = 1.0              # the beams' score: cum_logprob / len ** this

    def engine_prompt(self) -> Any:
        return self.prompt_token_ids if self.prompt_token_ids is not None else self.prompt


def parse_request(inputs: Mapping[str, Optional[np.ndarray]],
                  parameters: Optional[Mapping[str, Any]] = None,
                  defaults: Optional[Mapping[str, Any]] = None) -> ParsedRequest:
    """`inputs`: tensor name -> array (absent tensors missing or None). Shapes may carry a leading
    batch dimension of 1. `parameters`: Triton request parameters (already JSON-decoded).
    `defaults`: the model's generation_config.json values (LLMEngine.default_sampling_fields)
    for the sampling fields the request does not set in any of its forms."""
    inputs = {k: v for k, v in inputs.items() if v is not None}
    fields: dict[str, Any] = {}
    flags: dict[str, Any] = {name: default for name, (_, default) in FLAG_TENSORS.items()}
    cache_salt: Optional[str] = None

    for key, value in (parameters or {}).items():
        key = FIELD_ALIASES.get(key, key)
        if key in SAMPLING_FIELD_TYPES:
            fields[key] = _coerce_field(key, value, f"parameter {key}")
        elif key in SAMPLING_TENSORS:
            fields[SAMPLING_TENSORS[key][0]] = _coerce_field(SAMPLING_TENSORS[key][0], value,
                                                             f"parameter {key}")
        elif key in FLAG_TENSORS:
            flags[key] = _coerce_kind(FLAG_TENSORS[key][0], value, key)
        elif key == "cache_salt":
            cache_salt = str(value)
        # Other keys belong to Triton or to other tools (e.g. triton_enable_empty_final_response).

    if "sampling_parameters" in inputs:
        for key, value in _json_object(inputs["sampling_parameters"]).items():
            key = FIELD_ALIASES.get(key, key)
            if key not in SAMPLING_FIELD_TYPES:
                raise RequestError(f"sampling_parameters.{key} is not a known field: must be one "
                                   f"of {', '.join(sorted(SAMPLING_FIELD_TYPES))}")
            fields[key] = _coerce_field(key, value, f"sampling_parameters.{key}")

    for name, (field, kind) in SAMPLING_TENSORS.items():
        if name in inputs:
            fields[field] = _scalar(inputs[name], name, kind)
    for name, (kind, _) in FLAG_TENSORS.items():
        if name in inputs:
            flags[name] = _scalar(inputs[name], name, kind)
    if "stop_words" in inputs:
        fields["stop"] = [s for s in _strings(inputs["stop_words"], "stop_words") if s]
    if "bad_words" in inputs:
        fields["bad_words"] = [s for s in _strings(inputs["bad_words"], "bad_words") if s]
    beam_width, length_penalty = _trtllm_extras(inputs, fields)
    if "cache_salt" in inputs:
        cache_salt = one_string(inputs["cache_salt"], "cache_salt") or None

    for key, required in SERVING_FIXED.items():
        if fields.get(key, required) != required:
            raise RequestError(f"{key}={fields[key]!r} is invalid: must be {required} "
                               f"(one sequence per Triton request)")
    if defaults and beam_width == 1:     # beam search samples nothing: no sampling defaults
        fields = apply_defaults(fields, defaults)
    try:
        params = SamplingParams(**fields)
    except ValueError as e:          # already "<field>=<value> is invalid: must be <range>"
        raise RequestError(str(e)) from None
    except TypeError as e:
        raise RequestError(f"sampling parameters are invalid: {e}") from None

    prompt, ids = _prompt(inputs)
    return ParsedRequest(prompt=prompt, prompt_token_ids=ids, params=params,
                         stream=bool(flags["stream"]),
                         exclude_input_in_output=bool(flags["exclude_input_in_output"]),
                         priority=int(flags["priority"]), cache_salt=cache_salt,
                         beam_width=beam_width, length_penalty=length_penalty)


# TensorRT-LLM's guided decoding types -> SamplingParams.structured_outputs kinds.
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex",
               "ebnf_grammar": "grammar"}


def _trtllm_extras(inputs: Mapping[str, np.ndarray], fields: dict) -> tuple[int, float]:
    """TensorRT-LLM's other client tensors, so its clients' requests work as they are:
    `end_id` (one more stop token, kept in the output as vLLM's stop_token_ids are unless it is
    a special token such as the EOS; < 0: none), `return_log_probs` (each token's logprob in the
    `logprobs` output), `guided_decoding_guide_type` + `guided_decoding_guide`, `beam_width`
    (> 1: beam search, the best beam returned, so `num_return_sequences` must be 1) and
    `length_penalty` (the beams' score); `pad_id` is accepted and changes nothing. Returns
    (beam_width, length_penalty)."""
    if "end_id" in inputs:
        end = _scalar(inputs["end_id"], "end_id", "i")
        if end >= 0:
            fields["stop_token_ids"] = [*fields.get("stop_token_ids", []), end]
    if "num_return_sequences" in inputs:
        count = _scalar(inputs["num_return_sequences"], "num_return_sequences", "i")
        if count != 1:
            raise RequestError(f"num_return_sequences={count} is invalid: must be 1 (one "
                               "sequence per request; with beam_width > 1, the best beam)")
    beam_width = _scalar(inputs["beam_width"], "beam_width", "i") if "beam_width" in inputs else 1
    if not 1 <= beam_width <= MAX_LOGPROBS // 2:
        raise RequestError(f"beam_width={beam_width} is invalid: must be an integer in "
                           f"[1, {MAX_LOGPROBS // 2}]")
    if "pad_id" in inputs:
        _scalar(inputs["pad_id"], "pad_id", "i")
    length_penalty = float(_scalar(inputs["length_penalty"], "length_penalty", "f")) \
        if "length_penalty" in inputs else 1.0
    if "return_log_probs" in inputs and _scalar(inputs["return_log_probs"], "return_log_probs",
                                                "b"):
        fields.setdefault("logprobs", 0)
    kind = one_string(inputs["guided_decoding_guide_type"], "guided_decoding_guide_type") \
        if "guided_decoding_guide_type" in inputs else ""
    if kind:
        if kind not in GUIDE_TYPES:
            raise RequestError(f"guided_decoding_guide_type={kind!r} is invalid: must be one of "
                               f"{', '.join(GUIDE_TYPES)}")
        guide = one_string(inputs["guided_decoding_guide"], "guided_decoding_guide") \
            if "guided_decoding_guide" in inputs else ""
        if kind != "json" and not guide:
            raise RequestError(f"guided_decoding_guide is missing: guided_decoding_guide_type="
                               f"{kind!r} needs one")
        fields["structured_outputs"] = {GUIDE_TYPES[kind]: True if kind == "json" else guide}
    return beam_width, length_penalty


def max_prompt_chars(tokenizer: Any, max_tokens: int) -> int:
    """Characters beyond which a text cannot tokenize to max_tokens tokens or fewer: no token's
    string is longer than the vocabulary's longest (byte-level BPE: one character per byte), so
    such a text is refused before the tokenizer spends seconds on it (10 MB: 44 s)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_tokens * max(1, longest)


def check_single_batch(inputs: Mapping[str, Optional[np.ndarray]]) -> None:
    """Inputs of a batching model carry a leading batch dimension; one request is one prompt."""
    for name, arr in inputs.items():
        if arr is not None and np.ndim(arr) >= 1 and np.shape(arr)[0] != 1:
            raise RequestError(f"{name} has batch size {np.shape(arr)[0]}: must be 1 (send one "
                               f"prompt per request)")


def _prompt(inputs: Mapping[str, np.ndarray]) -> tuple[Optional[str], Optional[list[int]]]:
    """Token ids win when both are given (the ensemble sends the tokenizer's ids and the text,
    the text only to echo it when exclude_input_in_output is false)."""
    text = None
    if "text_input" in inputs:
        text = one_string(inputs["text_input"], "text_input")
        if not text:
            raise RequestError("text_input is empty: must be a non-empty string")
    if "input_ids" in inputs:
        arr = np.asarray(inputs["input_ids"])
        if arr.dtype.kind not in "iu":
            raise RequestError(f"input_ids has type {arr.dtype}: must be integer token ids")
        ids = arr.reshape(-1).astype(np.int64)
        if ids.size == 0:
            raise RequestError("input_ids is empty: must hold at least one token id")
        if (ids < 0).any():
            raise RequestError(f"input_ids={int(ids.min())} is invalid: must be token ids >= 0")
        return text, ids.tolist()
    if text is not None:
        return text, None
    raise RequestError("text_input is missing: a prompt is required (text_input, or input_ids "
                       "for the engine model)")


def _scalar(arr: Any, name: str, kind: str) -> Any:
    arr = np.asarray(arr)
    if arr.size != 1:
        raise RequestError(f"{name} has shape {list(arr.shape)}: must hold exactly one value")
    value = arr.reshape(-1)[0]
    ok = {"f": "fiu", "i": "iu", "b": "b"}[kind]
    if arr.dtype.kind not in ok:
        want = {"f": "FP32", "i": "an integer type", "b": "BOOL"}[kind]
        raise RequestError(f"{name} has type {arr.dtype}: must be {want}")
    return {"f": float, "i": int, "b": bool}[kind](value)


def _strings(arr: Any, name: str) -> list[str]:
    arr = np.asarray(arr)
    out = []
    for v in arr.reshape(-1):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"{name} is not valid UTF-8") from None
        if not isinstance(v, str):
            raise RequestError(f"{name} has type {arr.dtype}: must be STRING (BYTES)")
        out.append(v)
    return out


def one_string(arr: Any, name: str) -> str:
    values = _strings(arr, name)
    if len(values) != 1:
        raise RequestError(f"{name} has {len(values)} strings: must hold exactly one")
    return values[0]


def _json_object(arr: Any) -> dict:
    text = one_string(arr, "sampling_parameters")
    if not text.strip():
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"sampling_parameters is not valid JSON: {e.msg} at "
                           f"position {e.pos}") from None
    except RecursionError:
        raise RequestError("sampling_parameters is nested too deeply: must be a JSON object "
                           "of sampling fields") from None
    if not isinstance(obj, dict):
        raise RequestError("sampling_parameters must be a JSON object")
    return obj


def _coerce_field(field: str, value: Any, where: str) -> Any:
    """vLLM clients send numbers as strings ("16"); convert by the SamplingParams annotation."""
    hint = SAMPLING_FIELD_TYPES[field]
    hint = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    if value is None:
        return None
    if hint.startswith(("dict", "Optional[dict")):       # logit_bias: an object, or its JSON
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                pass
        if not isinstance(value, dict):
            raise RequestError(f"{where}={value!r} is invalid: must be a JSON object")
        return value
    if "list" in hint:
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
                value = parsed if isinstance(parsed, list) else [value]
            except (json.JSONDecodeError, RecursionError):
                value = [value]
        if not isinstance(value, list):
            raise RequestError(f"{where}={value!r} is invalid: must be a list")
        if "int" in hint:
            return [_coerce_kind("i", v, where) for v in value]
        return value
    if "bool" in hint:
        return _coerce_kind("b", value, where)
    if "int" in hint:
        return _coerce_kind("i", value, where)
    if "float" in hint:
        return _coerce_kind("f", value, where)
    return value


def _coerce_kind(kind: str, value: Any, where: str) -> Any:
    try:
        if kind == "b":
            if isinstance(value, str):
                if value.strip().lower() in ("true", "1", "yes"):
                    return True
                if value.strip().lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            if isinstance(value, (bool, int)) and value in (0, 1):
                return bool(value)
            raise ValueError
        if kind == "i":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError, OverflowError):
        want = {"b": "true or false", "i": "an integer", "f": "a number"}[kind]
        raise RequestError(f"{where}={value!r} is invalid: must be {want}") from None


__all__ = ["ParsedRequest", "RequestError", "check_single_batch", "max_prompt_chars",
           "parse_request"]
