"""What the engine model sends: one response's content (`Chunk`), a queued response
(`Outgoing`), and how a sender that fell behind merges a request's queued chunks into one
response (`coalesce`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class Chunk:
    """What one engine-model response carries (the detokenizer turns it into text)."""
    token_ids: list[int]
    context_ids: list[int]            # ids just before token_ids, for stateless detokenization
    text: Optional[str]               # set when the engine made the text itself (stop strings)
    finish_reason: Optional[str]
    num_input_tokens: int
    num_output_tokens: int            # tokens in this response (the whole output if not streaming)
    prefix: str = ""                  # the prompt text, first response only, when echoing it
    request_key: str = ""             # names the request in a later `stop` request
    # Per token in token_ids, when the request asked for logprobs: (sampled id, its logprob,
    # [(id, logprob), ...] the top-k best first).
    logprobs: Optional[list] = None
    # The first response of a request that asked for prompt_logprobs: per prompt token the same
    # (id, logprob, top-k) triple, the first token's logprob None (nothing predicts it).
    prompt_logprobs: Optional[list] = None

    @property
    def empty(self) -> bool:
        """Nothing for the client: no token, text, echo, finish or logprobs (a queued request's
        cancel probe, engine_loop.py)."""
        return not (self.token_ids or self.text or self.prefix or self.finish_reason
                    or self.logprobs or self.prompt_logprobs)

    def logprobs_json(self) -> str:
        """JSON for the `logprobs` output: [{"token_id", "logprob", "top_logprobs":
        [[id, logprob], ...]}, ...], or "" when not asked for."""
        return _entries_json(self.logprobs)

    def prompt_logprobs_json(self) -> str:
        """JSON for the `prompt_logprobs` output: as `logprobs`, one entry per prompt token,
        the first one's logprob null; "" when not asked for or not in this response."""
        return _entries_json(self.prompt_logprobs)


def _entries_json(entries: Optional[list]) -> str:
    if entries is None:
        return ""
    return json.dumps([{"token_id": t, "logprob": lp, "top_logprobs": top}
                       for t, lp, top in entries])


@dataclass
class Outgoing:
    handle: Any
    chunk: Optional[Chunk] = None
    error: Optional[str] = None
    error_kind: str = "internal"      # "invalid" | "cancelled" | "unavailable" | "internal"
    final: bool = False


def coalesce(items: list[Outgoing]) -> list[Outgoing]:
    """Merge the queued streaming chunks of each request into one response, in order.

    Each response costs an IPC round trip in every Python-backend model of the ensemble, so when
    the sender falls behind the engine (hundreds of streams), sending one response per request
    per engine step caps the server far below the engine; vLLM's stream interval does the same
    trade. When the sender keeps up, nothing is queued and every step still streams alone.
    Errors and bare finals are never merged; a request's items keep their order."""
    out: list[Outgoing] = []
    open_at: dict[int, int] = {}        # id(handle) -> index in out of its mergeable chunk
    for item in items:
        key = id(item.handle)
        if item.chunk is None or item.error is not None:
            open_at.pop(key, None)
            out.append(item)
            continue
        i = open_at.get(key)
        if i is None:
            out.append(item)
        else:
            out[i] = Outgoing(item.handle, merge_chunks(out[i].chunk, item.chunk), final=item.final)
        if item.final:
            open_at.pop(key, None)
        else:
            open_at[key] = i if i is not None else len(out) - 1
    return out


def merge_chunks(a: Chunk, b: Chunk) -> Chunk:
    """a then b as one chunk: a's context (the detokenizer decodes from it over both), b's end.
    An empty `a` (a probe) gives b unchanged: its context is the one that decodes b."""
    if a.empty:
        return b
    text = a.text + b.text if a.text is not None and b.text is not None else None
    logprobs = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None \
        else None
    return Chunk(a.token_ids + b.token_ids, a.context_ids, text, b.finish_reason,
                 b.num_input_tokens, a.num_output_tokens + b.num_output_tokens,
                 prefix=a.prefix, request_key=b.request_key or a.request_key, logprobs=logprobs,
                 prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None
                 else b.prompt_logprobs)


def prompt_entries(entries: Optional[list], prompt_ids: list, params: Any) -> Optional[list]:
    """RequestOutput.prompt_logprobs as (prompt token id, logprob, top-k best first) per
    token; the first token, which nothing predicts, as (its id, None, [])."""
    if entries is None or params.prompt_logprobs is None:
        return None
    out: list = []
    for i, d in enumerate(entries):
        if d is None:
            out.append((prompt_ids[i], None, []))
            continue
        tok, lp = next(iter(d.items()))        # the prompt's token comes first
        top = sorted(d.items(), key=lambda kv: -kv[1])[:params.prompt_logprobs]
        out.append((tok, lp, [[t, v] for t, v in top]))
    return out


def last_logprobs(entries: Optional[list], n: int, params: Any) -> Optional[list]:
    """The last n positions' logprobs as (sampled id, logprob, top-k best first)."""
    if entries is None or params.logprobs is None:
        return None
    out = []
    for d in entries[len(entries) - n:] if n else []:
        tok, lp = next(iter(d.items()))        # the sampled token comes first
        top = sorted(d.items(), key=lambda kv: -kv[1])[:params.logprobs]
        out.append((tok, lp, [[t, v] for t, v in top]))
    return out
