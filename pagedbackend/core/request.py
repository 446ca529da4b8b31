"""A request as the scheduler sees it: token ids, progress, and its token-level stop rules."""
from __future__ import annotations

import enum
from typing import Any, Optional, Sequence


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"         # preempted, its KV in the host tier (core/host_tier.py)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """Mutable per-request state owned by the scheduler.

    `sampling_params` only needs max_tokens, min_tokens, ignore_eos and stop_token_ids, so the
    scheduler tests can pass a plain namespace. `max_tokens` here is already resolved (an int).
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any,
                 max_tokens: int, eos_token_ids: Sequence[int] = (), arrival_time: float = 0.0,
                 priority: int = 0, cache_salt: Optional[str] = None, max_model_len: int = 1 << 30):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.max_model_len = max_model_len
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Sampled tokens already scheduled (their step is in flight) but not yet known: with
        # async scheduling the next step is launched before the previous one's ids come back.
        self.num_pending = 0
        # Its sampling reads all earlier tokens (penalties): never launched with one in flight.
        self.needs_all_tokens = False
        # Draft tokens proposed for this step (speculative decoding); the scheduler may keep
        # fewer, and the verification step appends the accepted ones.
        self.spec_token_ids: list[int] = []
        # bad_words as token id sequences (the engine tokenizes them once)
        self.bad_words_token_ids: list[list[int]] = []
        # structured outputs: anything with accept(token_id), `done` and fill_bitmask(mask, row)
        # (engine/structured_outputs.GrammarState); None for free text
        self.grammar: Any = None
        # prompt_logprobs: the entries so far, one per prompt token (the first is None, as
        # nothing predicts it); None when not asked for
        self.prompt_logprobs: Optional[list] = None
        self.num_cached_tokens = -1          # prefix-cache hit on first admission; -1 = not yet
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.block_hashes: list[bytes] = []  # hashes of this request's full blocks, in order
        self.num_preemptions = 0
        self.first_scheduled_time: Optional[float] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The live list of generated ids (no copy: it grows while the request runs)."""
        return self._output_token_ids

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs still to compute need every prompt position run, not read from
        cached blocks."""
        return self.prompt_logprobs is not None \
            and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def will_finish_by_length(self) -> bool:
        """The pending tokens alone reach max_tokens or max_model_len: nothing to schedule."""
        return (self.num_output_tokens + self.num_pending >= self.max_tokens
                or self.num_tokens + self.num_pending >= self.max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        if self.num_pending:
            self.num_pending -= 1
        self.all_token_ids.append(token_id)
        self._output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def drop_last_tokens(self, n: int) -> None:
        """Forget the newest n output tokens (a stop string ended before them); the request
        is finishing."""
        if n > 0:
            del self.all_token_ids[-n:]
            del self._output_token_ids[-n:]

    def check_stop(self) -> Optional[RequestStatus]:
        """Token-level stop rules, applied after each new token (stop strings live upstream)."""
        n_out = self.num_output_tokens
        last = self.all_token_ids[-1]
        params = self.sampling_params
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.done:     # the structure is complete
            return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
