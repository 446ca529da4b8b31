"""SpeculativeConfig: vLLM's `speculative_config` names, validated on creation (no torch here)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from pagedbackend.config import _is_int, check

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16     # k + 1 query rows per sequence; more never pays off
MAX_LOOKUP = 64


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
    check(ok, f"speculative_config.{field}", value, allowed)


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: `ngram` (drafts copied from the request's own tokens after the latest earlier
    occurrence of its last n tokens, n from prompt_lookup_max down to prompt_lookup_min) or
    `draft_model` (a smaller model in `model` proposes greedily). Both None: 5 and 5, as vLLM;
    one None takes the other's value. disable_by_batch_size: no drafts in a step while this
    many requests or more are queued or running (None: never off). backoff (not a vLLM
    field): a request whose drafts a verification rejects all of sits out 1, 2, 4 then 8
    proposal rounds (doubling with each such verification in a row, reset by one that accepts
    a draft), so text the proposer cannot predict costs few verifications (False: every
    round proposes)."""
    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None
    backoff: bool = True

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", self.method, f"one of {METHODS}")
        _check(_is_int(self.num_speculative_tokens)
               and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens", self.num_speculative_tokens,
               f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            _check(v is None or _is_int(v) and 1 <= v <= MAX_LOOKUP, name, v,
                   f"None or an integer in [1, {MAX_LOOKUP}]")
        lo, hi = (5, 5) if lo is hi is None else (lo or hi, hi or lo)
        _check(lo <= hi, "prompt_lookup_min", lo, f"<= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "draft_model":
            _check(isinstance(self.model, str) and self.model != "", "model", self.model,
                   "the draft model's directory (method='draft_model')")
        else:
            _check(self.model is None, "model", self.model, "None for method='ngram'")
        _check(self.disable_by_batch_size is None
               or _is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1,
               "disable_by_batch_size", self.disable_by_batch_size, "None or an integer >= 1")
        _check(isinstance(self.backoff, bool), "backoff", self.backoff, "true or false")

    @classmethod
    def make(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, a dict of its fields or that dict as JSON text."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"speculative_config={value!r} is invalid: must be a JSON "
                                 "object") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} is invalid: must be a dict, a "
                             "SpeculativeConfig or None")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is invalid: must be one of "
                             f"{sorted(names)}")
        return cls(**value)
