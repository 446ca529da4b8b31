"""vLLM's speculative-decoding counters on Triton's /metrics, published from the engine's
cumulative SpecDecodeStats (spec_decode/drafter.py) as growth since the last pass:
vllm:spec_decode_num_drafts_total, ..._num_draft_tokens_total, ..._num_accepted_tokens_total
and ..._num_accepted_tokens_per_pos_total{position="0".."k-1"} (acceptance by draft
position). The acceptance rate is accepted / draft tokens; the mean accepted length per
verification is 1 + accepted / drafts."""
from __future__ import annotations

from typing import Any, Callable


class SpecDecodeMetrics:
    def __init__(self, counter: Callable[..., Any], num_speculative_tokens: int):
        """counter(name, doc, **labels) -> a counter metric (ServingMetrics' helper)."""
        self.drafts = counter("vllm:spec_decode_num_drafts_total",
                              "Verifications of draft tokens (one per request and step).")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens_total",
                                    "Draft tokens proposed and verified.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens_total",
                                "Draft tokens accepted.")
        self.per_pos = [counter("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                "Draft tokens accepted, by position in the draft.",
                                position=str(i)) for i in range(num_speculative_tokens)]
        self._seen: dict[int, float] = {}

    def apply(self, stats: Any) -> None:
        """Publish the growth of the cumulative counters in `stats` (a SpecDecodeStats)."""
        pairs = [(self.drafts, stats.num_drafts), (self.draft_tokens, stats.num_draft_tokens),
                 (self.accepted, stats.num_accepted_tokens)]
        pairs += list(zip(self.per_pos, stats.accepted_per_pos))
        for metric, total in pairs:
            grown = total - self._seen.get(id(metric), 0)
            if grown > 0:
                metric.increment(grown)
                self._seen[id(metric)] = total
