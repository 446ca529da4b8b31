"""Output types, shaped like vLLM's RequestOutput / CompletionOutput, plus per-step deltas."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

# One position's logprobs: {token_id: logprob} holding the sampled token and the top-k.
Logprobs = list[dict[int, float]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[Logprobs]
    finish_reason: Optional[str] = None       # "stop" | "length" | "abort" | None while running
    stop_reason: Union[int, str, None] = None  # the stop string or stop token that ended it
    # What this engine step added: the Triton engine model streams these.
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Timing (time.monotonic seconds), for metrics: arrival, first scheduled, first token.
    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (the prompt's token
    # first, then the top-k), None for the first token; None when not asked for
    prompt_logprobs: Optional[Logprobs] = None


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: `tokens` include the prompt, `text` decodes them all (prompt too);
    `logprobs` holds each generated position's candidates {token_id: logprob};
    finish_reason "stop" (it ended with an EOS token) or "length"."""
    tokens: list[int]
    logprobs: Logprobs
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first (by cum_logprob / length ** length_penalty)."""
    sequences: list[BeamSearchSequence]
