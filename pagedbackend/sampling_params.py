"""SamplingParams with vLLM's field names; every bad value raises ValueError(field, value, range)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedbackend.config import _is_int, check

MAX_LOGPROBS = 20
MAX_N = 16
# Largest per-request output length accepted before the model's context is known; the engine then
# checks prompt + max_tokens against max_model_len.
MAX_TOKENS_LIMIT = 1 << 20


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v,
                  name, v, "a number")
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
        check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
              "a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              self.stop_token_ids, "a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or _is_int(v) and 0 <= v <= MAX_LOGPROBS, name, v,
                  f"an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")

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
