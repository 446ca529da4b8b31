"""Turns a step's last-position logits into token ids (and optional logprobs), vLLM semantics.

Everything runs on the logits' device with no host sync: the only device->host copies are the
runner's one `.tolist()` of the sampled ids and, when a row asked for logprobs, one more in
`LogprobsOutput.tolists()`. Per-row settings become tensors once per step in
`SamplingMetadata.build` (sampling_metadata.py); each stage is skipped when no row in the batch
needs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pagedbackend.layers.norm import USE_KERNELS
from pagedbackend.layers.sampling_metadata import SamplingMetadata
from pagedbackend.layers.token_controls import apply_logit_bias, apply_masks


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
