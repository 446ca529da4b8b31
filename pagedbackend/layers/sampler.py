"""Turns a step's last-position logits into token ids (and optional logprobs), vLLM semantics.

Everything runs on the logits' device with no host sync: the only device->host copies are the
runner's one `.tolist()` of the sampled ids and, when a row asked for logprobs, one more in
`LogprobsOutput.tolists()`. Per-row settings become tensors once per step in
`SamplingMetadata.build`; each stage is skipped when no row in the batch needs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pagedbackend.layers.norm import USE_KERNELS
from pagedbackend.layers.token_controls import (allowed_pairs, apply_logit_bias, apply_masks,
                                                banned_pairs, bias_triples, grammar_bitmask,
                                                token_lists, unpack_bitmask)
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


@dataclass
class LogprobsOutput:
    """Column 0 is the sampled token, columns 1..K the row-wise top-K (K = the batch's largest
    `logprobs`), best first, all from the raw log_softmax of the logits."""
    token_ids: torch.Tensor                   # [B, 1 + K] long
    logprobs: torch.Tensor                    # [B, 1 + K] float32
    num_logprobs: list[Optional[int]]

    def tolists(self) -> list[Optional[dict[int, float]]]:
        """Per row {token_id: logprob} (sampled token first, then its own top-k), None where the
        row did not ask; one device->host copy (float64 holds both ids and float32 values)."""
        packed = torch.cat([self.token_ids.double(), self.logprobs.double()], dim=1).cpu().tolist()
        width = self.token_ids.shape[1]
        rows: list[Optional[dict[int, float]]] = []
        for k, row in zip(self.num_logprobs, packed):
            if k is None:
                rows.append(None)
                continue
            rows.append({int(t): lp for t, lp in zip(row[:1 + k], row[width:width + 1 + k])})
        return rows


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor           # [B] long
    logprobs: Optional[LogprobsOutput]


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.shape != (meta.num_rows, meta.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match the sampling "
                             f"metadata ({meta.num_rows}, {meta.vocab_size})")
        if meta.all_greedy and meta.max_num_logprobs is None and meta.banned_rows is None \
                and meta.repetition_penalty is None and meta.frequency_penalty is None \
                and meta.bias_rows is None and meta.allowed_mask is None:
            # the common greedy step: the argmax of the logits as they are (widening is exact)
            return SamplerOutput(sampled_token_ids=argmax(logits), logprobs=None)
        raw = logits.float()
        # vLLM's order: logit_bias, the penalties, then the masks (all out of place: raw stays
        # the model's logits, for logprobs)
        logits = _apply_penalties(apply_logit_bias(raw, meta), meta)
        logits = apply_masks(logits, meta)

        if meta.all_greedy:
            sampled = argmax(logits)
        elif meta.random_rows is None:
            sampled = _sample(logits, meta)
        else:
            sampled = argmax(logits)
            sampled = sampled.index_copy(0, meta.random_rows,
                                         _sample(logits.index_select(0, meta.random_rows), meta))

        logprobs = None
        if meta.max_num_logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)
            top_lp, top_ids = lp.topk(meta.max_num_logprobs, dim=-1)
            logprobs = LogprobsOutput(
                token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
                logprobs=torch.cat([lp.gather(1, sampled[:, None]), top_lp], dim=1),
                num_logprobs=meta.num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] long, the first maximum of each row (a triton kernel on CUDA)."""
    if logits.is_cuda and USE_KERNELS and logits.stride(-1) == 1:
        from pagedbackend.kernels.argmax import argmax_rows
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


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


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    # vLLM's order: repetition (prompt + output), then frequency and presence (output only).
    if meta.repetition_penalty is not None:
        rep = meta.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(meta.seen_mask, penalised, logits)
    if meta.frequency_penalty is not None:
        counts = meta.output_counts
        logits = (logits - meta.frequency_penalty[:, None] * counts
                  - meta.presence_penalty[:, None] * (counts > 0).float())
    return logits


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sample one token per row of `logits` ([R, V], the rows that do not decode greedily)."""
    probs = torch.softmax(_sampling_logits(logits, meta), dim=-1)
    return probs.div_(_exponential_noise(probs, meta.generators)).argmax(dim=-1)


def _sampling_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then the top-k, top-p and min-p masks (-inf) of the sampled rows."""
    if meta.temperature is not None:
        logits = logits / meta.temperature[:, None]
    if meta.top_p is not None:
        logits = _top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        # Without top-p a partial top-k is enough: keep what reaches the row's k-th value.
        top = logits.topk(meta.max_top_k, dim=-1).values
        kth = top.gather(1, (meta.top_k.clamp(max=meta.max_top_k) - 1)[:, None])
        kth = kth.masked_fill((meta.top_k >= meta.vocab_size)[:, None], -math.inf)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if meta.min_p is not None:
        # probs >= min_p * max_prob, in logit space; renormalisation by top-k/top-p cancels out.
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(meta.min_p)[:, None]
        logits = logits.masked_fill(logits < floor, -math.inf)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                 top_p: torch.Tensor) -> torch.Tensor:
    values, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        pos = torch.arange(values.shape[1], device=values.device)
        values = values.masked_fill(pos[None, :] >= top_k[:, None], -math.inf)
    probs = torch.softmax(values, dim=-1)
    # Drop a token once the better tokens already hold top_p of the mass (the first always stays);
    # rows with top_p == 1 are exempt, as float rounding can push the running sum past 1.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    values = values.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, values)


def _exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]
                       ) -> torch.Tensor:
    """Exp(1) noise: argmax(p / E) draws from p (exponential race). Seeded rows draw a whole row
    from their own generator, so their samples do not depend on the batch around them."""
    R, V = probs.shape
    noise = torch.empty_like(probs)
    if len(generators) < R:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row] = torch.empty(V, dtype=probs.dtype, device=probs.device).exponential_(
            generator=gen)
    # An exact zero would turn the division into inf (or nan for a masked token).
    return noise.clamp_min_(torch.finfo(probs.dtype).tiny)
