"""Requests with beam_width > 1 (TensorRT-LLM's tensor) on the engine loop's thread. Each is one
engine/beam_search.BeamSearch whose rounds run as one-token sub-requests among the other
requests' steps, as vLLM's server runs beam search; the best beam goes out as the request's one
final response (streaming or not)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from pagedbackend.engine.beam_search import BeamSearch, round_params
from pagedbackend.engine.detokenizer import context_for
from pagedbackend.sampling_params import BeamSearchParams, SamplingParams
from pagedbackend.serving.request import ParsedRequest
from pagedbackend.serving.responses import Chunk

# What beam search takes from a request besides beam_width and length_penalty: max_tokens,
# temperature (the beams' logprobs are of the tempered distribution), ignore_eos. Fields that
# sample, constrain or stop otherwise are refused rather than silently dropped.
UNSUPPORTED = ("n", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "min_tokens", "stop", "stop_token_ids", "bad_words",
               "logit_bias", "allowed_token_ids", "logprobs", "prompt_logprobs",
               "structured_outputs", "truncate_prompt_tokens")
_DEFAULTS = SamplingParams()


class BeamRequest:
    def __init__(self, rid: str, req: ParsedRequest, engine: Any):
        """Raises ValueError naming the field when the request cannot run as beam search."""
        width = req.beam_width
        for name in UNSUPPORTED:
            value = getattr(req.params, name)
            if value != getattr(_DEFAULTS, name):
                raise ValueError(f"{name}={value!r} is invalid with beam_width={width}: beam "
                                 "search takes max_tokens, temperature, ignore_eos and "
                                 "length_penalty only")
        self.prompt_ids = engine.tokenize_prompt(req.engine_prompt())[1]
        info = engine.info
        room = info.max_model_len - len(self.prompt_ids)
        max_tokens = room if req.params.max_tokens is None else req.params.max_tokens
        if not 1 <= max_tokens <= room:
            raise ValueError(f"max_tokens={max_tokens} is invalid: must be in [1, {room}] for "
                             f"this {len(self.prompt_ids)}-token prompt (prompt + max_tokens <= "
                             f"max_model_len={info.max_model_len})")
        self.params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                       ignore_eos=req.params.ignore_eos,
                                       temperature=req.params.temperature,
                                       length_penalty=req.length_penalty)
        self.search = BeamSearch(self.prompt_ids, self.params, set(info.eos_token_ids))
        self.rid, self.req = rid, req
        self._step = round_params(self.params)
        self.pending: dict[str, int] = {}           # sub-request id -> its live beam's index
        self._tops: list[Optional[dict]] = []

    def submit_round(self, engine: Any) -> list[str]:
        """Every live beam as a one-token request; returns their ids."""
        self._tops = [None] * len(self.search.live)
        for j, beam in enumerate(self.search.live):
            sub = f"{self.rid}/beam{self.search.rounds}.{j}"
            engine.add_request(sub, list(beam.tokens), self._step, priority=self.req.priority,
                               cache_salt=self.req.cache_salt, detokenize=False)
            self.pending[sub] = j
        return list(self.pending)

    def on_output(self, out: Any) -> bool:
        """A sub-request's finished output: True when it was the round's last, and the search
        has advanced by the round."""
        self._tops[self.pending.pop(out.request_id)] = out.outputs[0].logprobs[0]
        if self.pending:
            return False
        self.search.advance(self._tops)
        return True

    def final_chunk(self, tokenizer: Any, live: Any) -> Chunk:
        """The best beam's tokens after the prompt, as the request's final response."""
        best, prompt = self.search.best()[0], self.prompt_ids
        ids = best.tokens[len(prompt):]
        return Chunk(ids, context_for(tokenizer, prompt, len(prompt)), None, best.finish_reason,
                     len(prompt), len(ids), prefix=live.echo(prompt, tokenizer),
                     request_key=live.key)


class BeamRequests:
    """The loop's beam searches by request id, and the sub-requests of their current rounds."""

    def __init__(self, engine: Any, log: Callable[[str], None]):
        self.engine, self._log = engine, log
        self._by_rid: dict[str, BeamRequest] = {}
        self._subs: dict[str, str] = {}             # sub-request id -> request id

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def owns(self, request_id: str) -> bool:
        return request_id in self._subs

    def add(self, rid: str, req: ParsedRequest) -> None:
        """Starts its first round; raises ValueError naming a field it cannot take."""
        beam = BeamRequest(rid, req, self.engine)
        self._subs.update((sub, rid) for sub in beam.submit_round(self.engine))
        self._by_rid[rid] = beam

    def on_output(self, out: Any) -> Optional[tuple[str, Optional[BeamRequest]]]:
        """A sub-request's output. (request id, its BeamRequest) when the search has ended
        (final_chunk is its answer), (request id, None) when the next round could not start
        (logged); None while the search goes on."""
        if not (out.finished or out.outputs[0].finish_reason is not None):
            return None
        rid = self._subs.pop(out.request_id)
        beam = self._by_rid[rid]
        if not beam.on_output(out):
            return None
        if beam.search.finished:
            return rid, beam
        try:
            self._subs.update((sub, rid) for sub in beam.submit_round(self.engine))
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            self._log(f"beam search round failed: {type(e).__name__}: {e}")
            return rid, None
        return None

    def drop(self, rid: str) -> None:
        """Forget the request; its round's sub-requests are aborted (their final outputs then
        find no request and are dropped)."""
        beam = self._by_rid.pop(rid, None)
        if beam is None:
            return
        subs = list(beam.pending)
        for sub in subs:
            self._subs.pop(sub, None)
        if subs:
            try:
                self.engine.abort(subs)
            except Exception as e:  # noqa: BLE001 - a failed engine (the loop is dying)
                self._log(f"aborting beam search rounds failed: {type(e).__name__}: {e}")
