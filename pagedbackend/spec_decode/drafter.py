"""The engine's side of speculative decoding: which running requests get drafts this step, the
drafts themselves (from a proposer), and vLLM's acceptance counters.

A request speculates only while it decodes (its last token is the one to run) and when its
sampling reads nothing that a draft would change: no penalties, grammar, multi-token bad words
or prompt logprobs (Request.needs_all_tokens), min_tokens reached. The others run
as without speculation, in the same steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedbackend.core.request import Request
from pagedbackend.spec_decode.config import SpeculativeConfig
from pagedbackend.spec_decode.ngram import NgramProposer

# After a proposal round without drafts, the rounds that wait for a step in flight come
# this many steps apart.
PROBE_EVERY = 4
# The most proposal rounds a request sits out after verifications that accepted none of its
# drafts (SpeculativeConfig.backoff).
BACKOFF_MAX = 8


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters (cumulative)."""
    num_drafts: int = 0             # verification rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # by draft position

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else None


def speculates(req: Request) -> bool:
    """Whether drafts for this request can be verified exactly by verify.py."""
    p = req.sampling_params
    return not req.needs_all_tokens and req.num_output_tokens >= p.min_tokens


def make_drafter(engine_config: Any, engine: Any) -> "Drafter":
    config = engine_config.speculative_config
    if config.method == "draft_model":
        from pagedbackend.spec_decode.draft_model import DraftRunner
        return Drafter(config, draft_runner=DraftRunner(engine_config, engine))
    return Drafter(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))


class Drafter:
    """proposer: anything with propose(token_ids, k) -> drafts (n-gram), filled in before
    scheduling; or draft_runner (a draft model), whose drafts are computed after scheduling,
    into the verification step's own KV slots (fill)."""

    def __init__(self, config: SpeculativeConfig, proposer: Any = None,
                 draft_runner: Any = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.draft_runner = draft_runner
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.idle_rounds = 0        # rounds in a row whose requests could take drafts, got none
        self.waited = 0             # steps since the last round
        self.backoff = Backoff() if config.backoff else None

    def should_probe(self) -> bool:
        """With a step in flight, a proposal waits for it (no async overlap): after rounds
        that found no drafts, propose only every PROBE_EVERY steps, so a load the proposer
        cannot help keeps most of the overlap."""
        self.waited += 1
        if self.idle_rounds and self.waited < PROBE_EVERY:
            return False
        self.waited = 0
        return True

    def active(self, num_requests: int) -> bool:
        """disable_by_batch_size: no drafts while this many requests are queued or running."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_requests < limit

    def num_drafts(self, req: Request) -> int:
        """How many drafts req can use this step (0: none): not past max_tokens or
        max_model_len, and only for a decode with nothing in flight."""
        if req.num_pending or req.num_computed_tokens != req.num_tokens - 1 \
                or not speculates(req):
            return 0
        return max(0, min(self.k, req.max_tokens - req.num_output_tokens - 1,
                          req.max_model_len - req.num_tokens))

    def propose(self, running: list[Request]) -> None:
        """Set each running request's spec_token_ids for the next schedule() (a draft model
        reserves k slots with placeholders, filled in by fill())."""
        found = asked = False
        for req in running:
            k = self.num_drafts(req)
            asked = asked or k > 0
            if k and self.backoff is not None and self.backoff.sits_out(req):
                k = 0
            if not k:
                req.spec_token_ids = []
            elif self.proposer is not None:
                req.spec_token_ids = self.proposer.propose(req.all_token_ids, k)
            else:
                req.spec_token_ids = [0] * k
            found = found or bool(req.spec_token_ids)
        # a round where no request could take drafts (all prefilling, at max_tokens) says
        # nothing about the proposer: counting it made the first PROBE_EVERY decode steps after
        # every prefill run without drafts under async scheduling (on the GPU, 300 4-token
        # requests got none at all)
        if asked:
            self.idle_rounds = 0 if found else self.idle_rounds + 1

    def snapshot(self) -> SpecDecodeStats:
        """A copy of the counters (the metrics thread reads it later)."""
        st = self.stats
        return SpecDecodeStats(st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens,
                               list(st.accepted_per_pos))

    def clear(self, running: list[Request]) -> None:
        for req in running:
            req.spec_token_ids = []

    def fill(self, sched: Any) -> None:
        self.draft_runner.propose(sched)

    def record(self, sched: Any, accepted: dict[str, list[int]]) -> None:
        """Count a verified step's drafts and accepted tokens (finished rows too)."""
        st = self.stats
        for s in sched.scheduled:
            if not s.spec_token_ids:
                continue
            n = len(accepted.get(s.request.request_id, ()))
            if self.backoff is not None:
                self.backoff.verified(s.request, n)
            st.num_drafts += 1
            st.num_draft_tokens += len(s.spec_token_ids)
            st.num_accepted_tokens += n
            for i in range(n):
                st.accepted_per_pos[i] += 1
            if self.draft_runner is not None:
                self.draft_runner.verified(s.request, n, s.start)


class Backoff:
    """Per request: after a verification that accepted none of its drafts, the next 1, 2, 4,
    ... BACKOFF_MAX proposal rounds give it none (doubling while its verifications keep
    accepting nothing); one that accepts a draft ends it. At batch 1 on the H200 a
    verification of 1 + 5 tokens takes longer than the decode step it replaces, so drafts that
    are always rejected would slow a request down every step (perf/RESULTS.md)."""

    def __init__(self):
        # request id -> (the Request, verifications in a row that accepted nothing, rounds
        # still to sit out); ids can be reused, so the Request is kept to tell them apart
        self.state: dict[str, tuple[Request, int, int]] = {}

    def sits_out(self, req: Request) -> bool:
        entry = self.state.get(req.request_id)
        if entry is None or entry[0] is not req or not entry[2]:
            return False
        self.state[req.request_id] = (req, entry[1], entry[2] - 1)
        return True

    def verified(self, req: Request, num_accepted: int) -> None:
        if num_accepted:
            self.state.pop(req.request_id, None)
            return
        entry = self.state.get(req.request_id)
        misses = entry[1] + 1 if entry is not None and entry[0] is req else 1
        self.state[req.request_id] = (req, misses, min(1 << (misses - 1), BACKOFF_MAX))
        if len(self.state) > 4096:      # finished requests' entries: drop the oldest half
            for rid in list(self.state)[:2048]:
                del self.state[rid]
