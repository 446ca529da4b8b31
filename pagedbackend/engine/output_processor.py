"""Turns scheduler progress into RequestOutputs: detokenization, stop strings, deltas, n > 1.

A user request owns n child `Request`s (ids "<id>#<i>" when n > 1). Text is built only when
asked for (detokenize=True) or needed (stop strings). While a stop string could still be
completing, its possible prefix is held back from streamed deltas, as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedbackend.core.request import Request
from pagedbackend.engine.detokenizer import context_for, decode_delta
from pagedbackend.outputs import CompletionOutput, RequestOutput
from pagedbackend.sampling_params import SamplingParams


@dataclass
class _Seq:
    req: Request
    index: int
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    num_decoded: int = 0        # output tokens already in text
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Any = None


@dataclass
class _Group:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    build_text: bool
    arrival_time: float
    first_token_time: Optional[float] = None
    dirty: bool = False
    holdback: int = 0
    final_only: bool = False    # offline generate: no per-step outputs, only the final one

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self.seq_of: dict[str, tuple[_Group, _Seq]] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self.groups

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def child_ids(self, request_id: str) -> list[str]:
        g = self.groups.get(request_id)
        return [s.req.request_id for s in g.seqs] if g else []

    def add(self, request_id: str, prompt: Optional[str], prompt_ids: list[int],
            params: SamplingParams, children: list[Request], detokenize: bool,
            arrival_time: float, final_only: bool = False) -> None:
        want_logprobs = params.logprobs is not None
        seqs = [_Seq(c, i, logprobs=[] if want_logprobs else None,
                     cumulative_logprob=0.0 if want_logprobs else None)
                for i, c in enumerate(children)]
        holdback = 0
        if params.stop and not params.include_stop_str_in_output:
            holdback = max(len(s) for s in params.stop) - 1
        g = _Group(request_id, prompt, prompt_ids, params, seqs,
                   build_text=detokenize or bool(params.stop), arrival_time=arrival_time,
                   holdback=holdback, final_only=final_only)
        self.groups[request_id] = g
        for s in seqs:
            self.seq_of[s.req.request_id] = (g, s)

    def on_tokens(self, progressed: list[Request], logprobs: dict[str, Any],
                  now: float) -> list[str]:
        """Record each request's new tokens (several after a speculative step); returns ids of
        children that hit a stop string (their tokens after it are dropped)."""
        stopped = []
        for req in progressed:
            g, s = self.seq_of[req.request_id]
            g.dirty = True
            if g.first_token_time is None:
                g.first_token_time = now
            if s.logprobs is not None and req.request_id in logprobs:
                got = logprobs[req.request_id]
                # several tokens after a speculative step (a list; the request may have kept
                # fewer: a stop token), else one
                got = got if isinstance(got, list) else [got]
                for sampled_lp, top in got[:req.num_output_tokens - len(s.logprobs)]:
                    s.logprobs.append(top)
                    s.cumulative_logprob += sampled_lp
            if not g.build_text:
                continue
            ids = req.all_token_ids
            end = len(ids)
            for i in range(end - (req.num_output_tokens - s.num_decoded), end):
                s.num_decoded += 1
                delta = decode_delta(self.tokenizer, context_for(self.tokenizer, ids, i),
                                     ids[i:i + 1], g.params.skip_special_tokens)
                s.text += delta
                if delta and g.params.stop and s.num_decoded >= g.params.min_tokens \
                        and self._apply_stop_strings(g, s, len(delta)):
                    self._drop_tokens(s, req, end - i - 1)
                    stopped.append(req.request_id)
                    break
        return stopped

    @staticmethod
    def _drop_tokens(s: _Seq, req: Request, n: int) -> None:
        """A stop string ended n tokens before the newest (a speculative step's): forget
        them, with their logprobs."""
        if n <= 0:
            return
        if s.logprobs is not None:
            for tok, entry in zip(req.output_token_ids[-n:], s.logprobs[-n:]):
                s.cumulative_logprob -= entry[tok]
            del s.logprobs[-n:]
        req.drop_last_tokens(n)

    def _apply_stop_strings(self, g: _Group, s: _Seq, delta_len: int) -> bool:
        # A new match must end inside the newest delta, so only that tail needs searching.
        start = max(0, len(s.text) - delta_len - max(len(x) for x in g.params.stop) + 1)
        best = None
        for stop in g.params.stop:
            i = s.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        s.text = s.text[:i + len(stop)] if g.params.include_stop_str_in_output else s.text[:i]
        s.stop_reason = stop
        return True

    def on_finished(self, finished: list[Request]) -> None:
        for req in finished:
            entry = self.seq_of.get(req.request_id)
            if entry is None:
                continue
            g, s = entry
            s.finish_reason = req.status.value
            if s.stop_reason is None:
                s.stop_reason = req.stop_reason
            g.dirty = True

    def collect(self) -> list[RequestOutput]:
        out = []
        for rid in [r for r, g in self.groups.items() if g.dirty]:
            g = self.groups[rid]
            g.dirty = False
            finished = g.finished
            if g.final_only and not finished:
                continue
            outputs = []
            for s in g.seqs:
                ids = s.req.output_token_ids
                done = s.finish_reason is not None
                limit = len(s.text) if done else max(s.emitted_chars, len(s.text) - g.holdback)
                # token_ids is a copy once finished; while running, the live list (no O(n) copy
                # per step; callers that keep an unfinished output must copy it).
                outputs.append(CompletionOutput(
                    index=s.index, text=s.text[:limit] if not done else s.text,
                    token_ids=list(ids) if done else ids,
                    cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                    delta_token_ids=ids[s.emitted_tokens:],
                    delta_text=s.text[s.emitted_chars:limit]))
                s.emitted_tokens = len(ids)
                s.emitted_chars = limit
            first = g.seqs[0].req
            out.append(RequestOutput(
                request_id=rid, prompt=g.prompt, prompt_token_ids=g.prompt_ids, outputs=outputs,
                finished=finished, arrival_time=g.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=g.first_token_time,
                num_cached_tokens=max(0, first.num_cached_tokens),
                prompt_logprobs=(first.prompt_logprobs if first.prompt_logprobs is not None
                                 and not first.skip_prefix_cache else None)))
            if finished:
                del self.groups[rid]
                for s in g.seqs:
                    self.seq_of.pop(s.req.request_id, None)
        return out
