"""One request's state on the engine loop's thread (engine_loop.py) while it runs: what it has
streamed, what it holds back under the response-rate budget, and its timings, which feed the
serving metrics (TTFT, inter-token latency, queue / prefill / decode phases)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedbackend.serving.request import ParsedRequest
from pagedbackend.serving.responses import Chunk, prompt_entries


@dataclass
class LiveRequest:
    handle: Any
    req: ParsedRequest
    key: str
    text_mode: bool
    arrival: float
    tail: list[int] = field(default_factory=list)
    prompt_len: int = 0
    started: bool = False
    ids: list[int] = field(default_factory=list)       # accumulated when not streaming
    text: list[str] = field(default_factory=list)
    held: Optional[Chunk] = None      # streamed steps not sent yet (response-rate budget)
    last_sent: float = 0.0
    num_out: int = 0
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    first_scheduled: Optional[float] = None     # the engine's clock (time.monotonic), as ours
    cancelled: bool = False
    last_probe: float = 0.0           # when the engine loop last sent it an empty response

    def prompt_logprobs(self, out: Any) -> Optional[list]:
        return prompt_entries(out.prompt_logprobs, out.prompt_token_ids, self.req.params)

    def echo(self, prompt_ids: list[int], tokenizer: Any) -> str:
        """The prompt's text when the output includes it (exclude_input_in_output false)."""
        if self.req.exclude_input_in_output:
            return ""
        if self.req.prompt is not None:
            return self.req.prompt
        return tokenizer.decode(prompt_ids, skip_special_tokens=True)

    def on_tokens(self, metrics: Any, out: Any, n: int, now: float) -> None:
        """n new tokens at `now`: the first one's latency, the gaps between later ones."""
        self.num_out += n
        if metrics is None:
            self.first_token = self.first_token or now
            self.last_token = now
            return
        if self.first_token is None:
            self.first_token = now
            self.first_scheduled = getattr(out, "first_scheduled_time", None)
            queued = None
            if getattr(out, "first_scheduled_time", None) and getattr(out, "arrival_time", None):
                queued = max(0.0, out.first_scheduled_time - out.arrival_time)
            metrics.on_first_token(now - self.arrival, queued, self.prompt_len)
            if n > 1:
                metrics.on_inter_token(0.0, n - 1)
        else:
            metrics.on_inter_token((now - self.last_token) / n, n)
        self.last_token = now
        metrics.on_generated(n)

    def on_finished(self, metrics: Any, reason: str, now: Optional[float] = None) -> None:
        phases = None
        if self.first_scheduled is not None and self.first_token is not None:
            phases = (max(0.0, self.first_token - self.first_scheduled),
                      self.last_token - self.first_token)
        metrics.on_finished(reason, (now or time.monotonic()) - self.arrival, self.prompt_len,
                            self.num_out, phases)
