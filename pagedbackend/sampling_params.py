"""SamplingParams with vLLM's field names; every bad value raises ValueError(field, value, range)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedbackend.config import _is_int, check

# SamplingParams.structured_outputs holds exactly one of these (engine/structured_outputs.py).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")

MAX_LOGPROBS = 20
MAX_N = 16
# Largest per-request output length accepted before the model's context is known; the engine then
# checks prompt + max_tokens against max_model_len.
MAX_TOKENS_LIMIT = 1 << 20
# Bounds on the lists checked at every step (stop strings, bad words, stop token ids): each entry
# costs every step of the request, and bad words are tokenized on the engine's thread, so an
# unbounded list from one client (20,000 bad words took 12 s) would stall every request.
MAX_STOP_ENTRIES = 256
MAX_STOP_CHARS = 1024
# Bounds on structured outputs: xgrammar's compile time grows steeply with a schema's nesting
# (200 levels of arrays: 1.8 s, 900: minutes) and a regex's alternations ((a|b)* x 80: 2.7 s),
# and a compile cannot be interrupted. These keep known-pathological specs out; real schemas
# nest far less than 32 levels of JSON (16 of schema).
MAX_SCHEMA_DEPTH = 32
MAX_REGEX_CHARS = 512
MAX_GRAMMAR_CHARS = 65536          # EBNF, JSON schema text, all choices together
MAX_CHOICES = 1024


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, -100..100);
    # JSON keys may be the ids as strings. Token ids are checked against the model's vocabulary
    # when the engine takes the request.
    logit_bias: Optional[dict[int, float]] = None
    # Only these token ids may be generated (vLLM's allowed_token_ids).
    allowed_token_ids: Optional[list[int]] = None
    # Words never generated (vLLM's bad_words): each word's tokens, with and without a leading
    # space; its last token is banned wherever the output already ends with the others.
    bad_words: list[str] = field(default_factory=list)
    # Output held to a grammar (vLLM's structured_outputs / guided_decoding): one of
    # {"json": schema}, {"json_object": true}, {"regex": str}, {"choice": [str, ...]},
    # {"grammar": EBNF str}.
    structured_outputs: Optional[dict] = None
    # Keep only the prompt's last k tokens (vLLM's truncate_prompt_tokens), e.g. so that a long
    # conversation fits max_model_len.
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                  name, v, "a finite number")
            setattr(self, name, float(v))
        check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n, f"an integer in [1, {MAX_N}]")
        check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
              "-1 (disabled) or an integer >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
              self.repetition_penalty, "in (0, 2]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
              "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              self.frequency_penalty, "in [-2, 2]")
        check(self.seed is None or _is_int(self.seed) and 0 <= self.seed < 2**64, "seed",
              self.seed, "an integer in [0, 2^64)")
        check(self.max_tokens is None or _is_int(self.max_tokens)
              and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT, "max_tokens", self.max_tokens,
              f"an integer in [1, {MAX_TOKENS_LIMIT}]")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
              "an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check_words("stop", self.stop, blank_ok=True)   # "\n" is a common stop string
        check(len(self.stop_token_ids) <= MAX_STOP_ENTRIES
              and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              self.stop_token_ids, f"a list of at most {MAX_STOP_ENTRIES} token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or _is_int(v) and 0 <= v <= MAX_LOGPROBS, name, v,
                  f"an integer in [0, {MAX_LOGPROBS}]")
        check(self.truncate_prompt_tokens is None or _is_int(self.truncate_prompt_tokens)
              and self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
              self.truncate_prompt_tokens, "an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        self._check_token_controls()

    def _check_token_controls(self) -> None:
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
                  "an object mapping token ids to numbers in [-100, 100]")
            bias = {}
            for key, value in self.logit_bias.items():
                tok = _token_id(key)
                check(tok is not None, "logit_bias", key, "token ids (integers >= 0) as keys")
                check(isinstance(value, (int, float)) and not isinstance(value, bool)
                      and -100.0 <= value <= 100.0, f"logit_bias[{tok}]", value,
                      "a number in [-100, 100]")
                bias[tok] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            check(isinstance(ids, (list, tuple)) and len(ids) > 0
                  and all(_is_int(t) and t >= 0 for t in ids), "allowed_token_ids", ids,
                  "a non-empty list of token ids >= 0")
            self.allowed_token_ids = sorted(set(ids))
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        _check_words("bad_words", self.bad_words, blank_ok=False)
        self.structured_outputs = check_structured_outputs(self.structured_outputs)

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id of logit_bias and allowed_token_ids in [0, vocab_size)."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            check(not bad, name, bad[:8], f"token ids in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        """Presence or frequency penalty: they read the tokens generated so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _check_words(name: str, words: list, blank_ok: bool) -> None:
    """stop / bad_words: at most MAX_STOP_ENTRIES non-empty strings (non-blank unless blank_ok)
    of at most MAX_STOP_CHARS characters."""
    check(len(words) <= MAX_STOP_ENTRIES and all(
        isinstance(w, str) and (w if blank_ok else w.strip()) and len(w) <= MAX_STOP_CHARS
        for w in words), name, words, f"a list of at most {MAX_STOP_ENTRIES} non-empty strings "
        f"of at most {MAX_STOP_CHARS} characters")


def _token_id(key: Any) -> Optional[int]:
    """A token id given as an int or, from JSON, as a decimal string; None if it is neither."""
    if _is_int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.strip().isdigit():
        return int(key.strip())
    return None


def check_structured_outputs(spec: Any) -> Optional[dict]:
    """SamplingParams.structured_outputs validated: exactly one of STRUCTURED_KINDS with a value
    of its kind; returned with a `json` schema as canonical JSON text (an object is accepted)."""
    if spec is None:
        return None
    one_of = f"an object with exactly one of {', '.join(STRUCTURED_KINDS)}"
    check(isinstance(spec, dict), "structured_outputs", spec, one_of)
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    check(set(given) <= set(STRUCTURED_KINDS) and len(given) == 1, "structured_outputs", spec,
          one_of)
    (kind, value), = given.items()
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                check(False, where, value, "a JSON schema (an object, or its JSON text)")
        check(isinstance(value, dict), where, value, "a JSON schema (an object)")
        check(_depth(value) <= MAX_SCHEMA_DEPTH, where, value,
              f"a JSON schema nested at most {MAX_SCHEMA_DEPTH} levels deep")
        value = json.dumps(value)             # property order kept: it is the output order
    elif kind == "json_object":
        check(value is True, where, value, "true")
    elif kind == "choice":
        check(isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
              and all(isinstance(c, str) and c for c in value), where, value,
              f"a list of 1 to {MAX_CHOICES} non-empty strings")
        value = list(value)
    else:
        check(isinstance(value, str) and value.strip() != "", where, value,
              "a non-empty string" + (" (EBNF)" if kind == "grammar" else ""))
    limit = MAX_REGEX_CHARS if kind == "regex" else MAX_GRAMMAR_CHARS
    size = len(value) if isinstance(value, str) else len(json.dumps(value))
    check(size <= limit, where, value, f"at most {limit} characters")
    return {kind: value}


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a schema may be nested thousands
    deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_SCHEMA_DEPTH:
                todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


@dataclass
class BeamSearchParams:
    """LLM.beam_search's settings, vLLM's names. Each step scores every live beam's top
    2 x beam_width next tokens (hence beam_width <= MAX_LOGPROBS / 2)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False    # accepted for vLLM's callers; no stop strings

    def __post_init__(self) -> None:
        check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_LOGPROBS // 2,
              "beam_width", self.beam_width, f"an integer in [1, {MAX_LOGPROBS // 2}]")
        check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT,
              "max_tokens", self.max_tokens, f"an integer in [1, {MAX_TOKENS_LIMIT}]")
        check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
              and self.temperature >= 0, "temperature", self.temperature, "a number >= 0")
        check(isinstance(self.length_penalty, (int, float))
              and not isinstance(self.length_penalty, bool), "length_penalty",
              self.length_penalty, "a number")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
