"""A step's per-row sampling settings as device tensors (SamplingMetadata.build, once per step),
for the sampler (sampler.py): only the settings some row uses become tensors, and host data goes
up through pinned memory, so building never waits for the GPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pagedbackend.layers.token_controls import (allowed_pairs, banned_pairs, bias_triples,
                                                grammar_bitmask, token_lists, unpack_bitmask)
from pagedbackend.sampling_params import SamplingParams

# Like vLLM: a temperature this small is treated as greedy (dividing by it would overflow).
_GREEDY_EPS = 1e-5


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    # Rows that sample (the others take the argmax). None when every row samples.
    random_rows: Optional[torch.Tensor]       # [R] long
    num_random: int
    # Per sampled row ([R]); None when no sampled row uses the setting.
    temperature: Optional[torch.Tensor]       # float32
    top_k: Optional[torch.Tensor]             # long; vocab_size where off
    max_top_k: int
    top_p: Optional[torch.Tensor]             # float32
    min_p: Optional[torch.Tensor]             # float32
    # Position among the sampled rows -> that request's own generator.
    generators: dict[int, torch.Generator]
    # Penalties over all rows ([B] / [B, V]); None when no row uses them.
    repetition_penalty: Optional[torch.Tensor]
    presence_penalty: Optional[torch.Tensor]
    frequency_penalty: Optional[torch.Tensor]
    seen_mask: Optional[torch.Tensor]         # [B, V] bool, token in prompt or output
    output_counts: Optional[torch.Tensor]     # [B, V] float32
    # (row, token) pairs forced to -inf: a stop token before min_tokens, a bad word's last
    # token where the output ends with the rest of it.
    banned_rows: Optional[torch.Tensor]
    banned_ids: Optional[torch.Tensor]
    # logit_bias as (row, token, bias) triples, added before the penalties.
    bias_rows: Optional[torch.Tensor]
    bias_ids: Optional[torch.Tensor]
    bias_values: Optional[torch.Tensor]
    # [B, V] bool, True where the token may be sampled (allowed_token_ids, a grammar's next
    # tokens; rows with neither allow all); None when no row has either.
    allowed_mask: Optional[torch.Tensor]
    num_logprobs: list[Optional[int]]         # host copy of each row's SamplingParams.logprobs
    max_num_logprobs: Optional[int]           # None: no row wants logprobs

    @property
    def all_greedy(self) -> bool:
        return self.num_random == 0

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
              output_token_ids: Sequence[Sequence[int]],
              generators: Sequence[Optional[torch.Generator]],
              min_tokens_stop_ids: Sequence[Sequence[int]], vocab_size: int,
              device: torch.device,
              bad_words: Optional[Sequence[Sequence[Sequence[int]]]] = None,
              grammars: Optional[Sequence[Any]] = None) -> "SamplingMetadata":
        """bad_words: per row, its bad words as token id sequences (Request.bad_words_token_ids);
        grammars: per row, a GrammarState (Request.grammar) or None. Either is None when no row
        has one."""
        n, V = len(params), vocab_size
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators)
                == len(min_tokens_stop_ids) == n) or any(
                    x is not None and len(x) != n for x in (bad_words, grammars)):
            raise ValueError("SamplingMetadata.build: every per-row list must have one entry "
                             f"per row ({n})")

        def floats(values: list[float]) -> torch.Tensor:
            return _to_device(values, torch.float32, device)

        rand = [i for i, p in enumerate(params) if not _is_greedy(p)]
        rp = [params[i] for i in rand]
        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        if any(p.temperature != 1.0 for p in rp):
            temperature = floats([p.temperature for p in rp])
        ks = [min(p.top_k, V) if p.top_k > 0 else V for p in rp]
        if any(k < V for k in ks):
            top_k = _to_device(ks, torch.long, device)
            max_top_k = max(k for k in ks if k < V)
        if any(p.top_p < 1.0 for p in rp):
            top_p = floats([p.top_p for p in rp])
        if any(p.min_p > 0.0 for p in rp):
            min_p = floats([p.min_p for p in rp])
        gens = {j: generators[i] for j, i in enumerate(rand) if generators[i] is not None}

        rep = pres = freq = seen = counts = None
        use_rep = [p.uses_repetition_penalty for p in params]
        use_out = [p.uses_output_penalties for p in params]
        if any(use_rep) or any(use_out):
            # Only rows that use a penalty contribute ids, so long prompts of others cost nothing.
            outs = [list(o) if r or u else [] for o, r, u in zip(output_token_ids, use_rep, use_out)]
            counts = _scatter_rows(outs, V, device, count=True)
            if any(use_rep):
                rep = floats([p.repetition_penalty for p in params])
                prompts = [list(t) if r else [] for t, r in zip(prompt_token_ids, use_rep)]
                seen = _scatter_rows(prompts, V, device, count=False) | (counts > 0)
            if any(use_out):
                pres = floats([p.presence_penalty for p in params])
                freq = floats([p.frequency_penalty for p in params])

        # (row, token) pairs to -inf, logit_bias triples, allowed tokens: token_controls.py
        bans = banned_pairs(params, output_token_ids, min_tokens_stop_ids, bad_words, V)
        ban_r, ban_i = (_to_device(list(x), torch.long, device) for x in bans) if bans[0] \
            else (None, None)
        bias_r = bias_i = bias_v = None
        lists = token_lists(params)
        triples = bias_triples(lists, V)
        if triples:
            bias_r, bias_i = (_to_device(list(x), torch.long, device) for x in triples[:2])
            bias_v = _to_device(list(triples[2]), torch.float32, device)
        allowed = None
        limited, pairs = allowed_pairs(lists, V)
        if limited:
            allowed = torch.ones(n, V, dtype=torch.bool, device=device)
            allowed[_to_device(limited, torch.long, device)] = False
            allowed[_to_device([i for i, _ in pairs], torch.long, device),
                    _to_device([t for _, t in pairs], torch.long, device)] = True
        rows_g, bitmask = grammar_bitmask(grammars, V)
        if rows_g:
            if allowed is None:
                allowed = torch.ones(n, V, dtype=torch.bool, device=device)
            allowed[_to_device(rows_g, torch.long, device)] &= unpack_bitmask(
                to_device_async(bitmask, device), V)

        num_logprobs = [p.logprobs for p in params]
        wanted = [k for k in num_logprobs if k is not None]
        return cls(
            num_rows=n, vocab_size=V,
            random_rows=(None if len(rand) == n
                         else _to_device(rand, torch.long, device)),
            num_random=len(rand), temperature=temperature, top_k=top_k, max_top_k=max_top_k,
            top_p=top_p, min_p=min_p, generators=gens, repetition_penalty=rep,
            presence_penalty=pres, frequency_penalty=freq, seen_mask=seen, output_counts=counts,
            banned_rows=ban_r, banned_ids=ban_i, bias_rows=bias_r, bias_ids=bias_i,
            bias_values=bias_v, allowed_mask=allowed, num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None)



def to_device_async(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device without a sync: through pinned memory on CUDA (a plain
    copy from pageable memory would wait for all queued GPU work)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def _is_greedy(p: SamplingParams) -> bool:
    return p.greedy or p.temperature < _GREEDY_EPS


def _scatter_rows(rows: list[list[int]], V: int, device: torch.device,
                  count: bool) -> torch.Tensor:
    """[B, V] token counts (float32) or presence (bool) of each row's ids."""
    width = max((len(r) for r in rows), default=0)
    # Pad with the out-of-vocabulary id V, written to a spare column that is then dropped.
    ids = _to_device([r + [V] * (width - len(r)) for r in rows], torch.long,
                     device).view(len(rows), width)
    if count:
        out = torch.zeros(len(rows), V + 1, dtype=torch.float32, device=device)
        out.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    else:
        out = torch.zeros(len(rows), V + 1, dtype=torch.bool, device=device)
        out.scatter_(1, ids, True)
    return out[:, :V]
