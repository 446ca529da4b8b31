"""OpenAI request bodies → one validated `GenerationRequest` (vLLM's SamplingParams names).

Validation reuses `pagedbackend.SamplingParams`, so the gateway and the engine agree on every range
and every 400 names the field the way the client spelled it. Unknown fields are ignored with a
warning, as vLLM's server does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedbackend.config import _is_int, check
from pagedbackend.sampling_params import STRUCTURED_KINDS, SamplingParams

from client.openai_gateway.errors import APIError, bad_request, from_value_error
from client.openai_gateway.tools import ToolChoice, parse_tools

log = logging.getLogger("openai_gateway")
Prompt = Union[str, list]          # text, or token ids the gateway decodes
ROLES = ("system", "developer", "user", "assistant", "tool")
# Body fields passed to the engine unchanged (OpenAI's and vLLM's sampling extras).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos",
                    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                    "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")


@dataclass
class GenerationRequest:
    kind: str                                  # "chat" | "completion"
    model: str
    prompts: list[Prompt]                      # chat: one templated prompt; completions: a batch
    params: dict                               # SamplingParams fields (n excluded: fanned out)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False             # vLLM's stream_options.continuous_usage_stats
    echo: bool = False
    logprobs: Optional[int] = None             # top alternatives per token; None: off
    priority: int = 0
    cache_salt: Optional[str] = None
    messages: list = field(default_factory=list)
    chat_template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False       # the last (assistant) message is continued
    # engine field names in errors -> the body's names (logprobs -> top_logprobs for chat, ...)
    renames: dict = field(default_factory=dict)
    tools: ToolChoice = field(default_factory=ToolChoice)     # chat's tools and tool_choice

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def parse_completion(body: Any, default_model: str) -> GenerationRequest:
    body = _object(body)
    prompts = _prompts(body.get("prompt"))
    logprobs = body.get("logprobs")
    req = _common(body, "completion", default_model, prompts, logprobs, renames={},
                  default_max_tokens=16)
    req.echo = _flag(body, "echo", False)
    if req.echo and logprobs is not None:
        # OpenAI's echo with logprobs scores the prompt's tokens too (what lm-eval's
        # loglikelihood requests read)
        req.params["prompt_logprobs"] = logprobs
    return req


def parse_chat(body: Any, default_model: str,
               tool_parser: Optional[str] = None) -> GenerationRequest:
    """tool_parser: the gateway's --tool-call-parser (tool_choice "auto" needs one)."""
    body = _object(body)
    messages = _messages(body.get("messages"))
    want = _flag(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not want:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    logprobs = (0 if top is None else top) if want else None
    tools = parse_tools(body, tool_parser)
    forced = tools.structured_outputs()
    if forced is not None:
        given = [k for k in ("response_format", "structured_outputs", *_GUIDED) if body.get(k)]
        if given:
            raise bad_request(f"{given[0]} cannot be combined with tool_choice={tools.mode}",
                              param=given[0])
        body = {**body, "structured_outputs": forced}
    req = _common(body, "chat", default_model, [], logprobs,
                  renames={"logprobs": "top_logprobs"}, default_max_tokens=None)
    if forced is not None:      # a grammar error is the tools' (e.g. a bad parameters schema)
        req.renames.update({k: "tools" for k in req.renames if k.startswith("structured")})
    req.tools = tools
    req.messages = messages
    req.continue_final_message = _flag(body, "continue_final_message", False)
    req.add_generation_prompt = _flag(body, "add_generation_prompt",
                                      not req.continue_final_message)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true", param="continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    req.chat_template_kwargs = kwargs
    return req


# Body fields read here, and OpenAI's that change nothing on this server; any other field is
# ignored with a warning naming it (not its value), as vLLM's server does.
_READ = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stop", "n",
         "stream", "stream_options", "priority", "cache_salt", "user", "logprobs", "top_logprobs",
         "echo", "response_format", "structured_outputs", "tools", "tool_choice",
         "continue_final_message", "add_generation_prompt", "chat_template_kwargs",
         "use_beam_search", *_SAMPLING_FIELDS}
_NO_EFFECT = {"metadata", "store", "parallel_tool_calls", "service_tier", "suffix", "best_of",
              "functions", "function_call", "modalities", "audio", "prediction",
              "reasoning_effort", "web_search_options", "request_id"}


def _common(body: dict, kind: str, default_model: str, prompts: list, logprobs: Any,
            renames: dict, default_max_tokens: Optional[int]) -> GenerationRequest:
    ignored = sorted(k for k in body if k not in _READ and k not in _NO_EFFECT
                     and k not in _GUIDED)
    if ignored:
        log.warning("fields present in the request but ignored: %s", ", ".join(ignored)[:500])
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise bad_request("model must be a non-empty string", param="model")
    # max_completion_tokens is OpenAI's newer name; it wins when both are given.
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(max_name, default_max_tokens)
    params = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    params["stop"] = _stop(body.get("stop"))
    params["max_tokens"] = max_tokens
    params["logprobs"] = logprobs
    structured, source = _structured_outputs(body)
    if structured is not None:
        params["structured_outputs"] = structured
        renames = {**renames, "structured_outputs": source,
                   **{f"structured_outputs.{k}": source for k in STRUCTURED_KINDS}}
    n = body.get("n", 1)
    if n is None:
        n = 1
    if body.get("use_beam_search"):
        # vLLM's extra field: its n choices are the n beams, which a Triton request (one
        # sequence, the best beam with beam_width) cannot return; refused, not sampled instead
        raise bad_request("use_beam_search=true is not supported: this server returns one "
                          "sequence per request (the Triton models take beam_width and return "
                          "the best beam)", param="use_beam_search")
    try:
        SamplingParams(n=n, **params)
    except (ValueError, TypeError) as e:
        raise from_value_error(ValueError(str(e)), {"max_tokens": max_name, **renames}) from None
    stream = _flag(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage", False)) and stream
    continuous = include_usage and bool(options.get("continuous_usage_stats", False))
    priority = body.get("priority", 0)
    _check(lambda: check(_is_int(priority) and -2**31 <= priority < 2**31, "priority", priority,
                         "a 32-bit integer"))
    salt = body.get("cache_salt")
    _check(lambda: check(salt is None or isinstance(salt, str) and salt != "", "cache_salt", salt,
                         "a non-empty string"))
    user = body.get("user")
    _check(lambda: check(user is None or isinstance(user, str), "user", user, "a string"))
    return GenerationRequest(kind=kind, model=model, prompts=prompts, params=params, n=n,
                             stream=stream, include_usage=include_usage,
                             continuous_usage=continuous, logprobs=logprobs,
                             priority=priority, cache_salt=salt, renames=renames)


# vLLM's older request fields for structured outputs -> the kind of SamplingParams'.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _structured_outputs(body: dict) -> tuple[Optional[dict], str]:
    """(SamplingParams.structured_outputs, the body field it came from) from OpenAI's
    response_format, vLLM's structured_outputs or its guided_* fields; (None, "") when none."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(({"json_object": True}, "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema is required: a JSON "
                                  "schema object", param="response_format")
            found.append(({"json": schema}, "response_format"))
        elif kind != "text":
            raise bad_request(f"response_format.type={kind!r} is invalid: must be text, "
                              "json_object or json_schema", param="response_format")
    if body.get("structured_outputs") is not None:
        found.append((body["structured_outputs"], "structured_outputs"))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append(({kind: body[name]}, name))
    if len(found) > 1:
        names = ", ".join(source for _, source in found)
        raise bad_request(f"{names}: at most one way of structuring the output may be given",
                          param=found[1][1])
    return found[0] if found else (None, "")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _check(fn) -> None:
    try:
        fn()
    except ValueError as e:
        raise from_value_error(e) from None


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    _check(lambda: check(isinstance(v, bool), name, v, "true or false"))
    return v


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    _check(lambda: check(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
                         "stop", stop, "a string or a list of non-empty strings"))
    return stop


def _prompts(prompt: Any) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and len(x) > 0 and all(_is_int(t) and t >= 0 for t in x)

    if prompt is None:
        raise bad_request("prompt is required", param="prompt")
    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    ok = isinstance(prompt, list) and len(prompt) > 0 and all(
        (isinstance(p, str) and p != "") or is_ids(p) for p in prompt)
    if not ok:
        raise bad_request("prompt is invalid: must be a non-empty string, a list of non-empty "
                          "strings, or (lists of) token ids", param="prompt")
    return prompt


def _messages(messages: Any) -> list[dict]:
    if messages is None:
        raise bad_request("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is invalid: must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"{where}.role is invalid: must be one of {list(ROLES)}",
                              param=f"{where}.role")
        out.append({**m, "content": _content(m.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    """Text content; a list of parts keeps its text parts (this server reads no images)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content is invalid: only text parts are supported",
                                  param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content is invalid: must be a string or a list of text parts",
                      param=f"{where}.content")


def unknown_model(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")
