"""Verification of draft tokens against the target's logits, exact (the output has the
distribution of sampling without drafts).

The step's forward gives every verifying row 1 + k logits rows (its last known token and each
draft). Greedy positions take the argmax of the processed logits and accept a draft while it
equals it. Random positions use the standard rule for a deterministic proposer (draft
probability 1): accept draft d with probability p(d), else sample from p with d removed and
renormalised; past the last accepted draft the first rejected position's sample (or, all
accepted, a sample at the bonus position) is the row's new token. Seeded requests draw their
uniforms and noise from their own generator, so they repeat."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pagedbackend.layers.sampler import (LogprobsOutput, _apply_penalties, _exponential_noise,
                                         _sampling_logits, argmax)
from pagedbackend.layers.sampling_metadata import SamplingMetadata, to_device_async
from pagedbackend.layers.token_controls import apply_logit_bias, apply_masks


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, draft_ids: torch.Tensor,
                     rows: torch.Tensor, pos: torch.Tensor, num_rows: int,
                     width: int) -> torch.Tensor:
    """logits [T, V] of T positions; draft_ids [T] the draft each position checks (-1: none,
    the bonus position); rows / pos [T] its row and place in it. Returns [num_rows, width]:
    each row's accepted drafts then its new token, -1 after."""
    raw = logits.float()
    proc = apply_masks(_apply_penalties(apply_logit_bias(raw, meta), meta), meta)
    target = argmax(proc)
    has = draft_ids >= 0
    d = draft_ids.clamp(min=0)
    match = has & (target == d)
    if meta.num_random:
        rr = meta.random_rows if meta.random_rows is not None \
            else torch.arange(len(target), device=target.device)
        probs = torch.softmax(_sampling_logits(proc.index_select(0, rr), meta), dim=-1)
        dr, hr = d.index_select(0, rr), has.index_select(0, rr)
        p_d = probs.gather(1, dr[:, None])[:, 0]
        accept = hr & (_uniform(p_d, meta.generators) < p_d)
        # the residual: p without the draft token (argmax(q / E) draws from q / sum(q))
        probs.scatter_(1, dr[:, None], torch.where(hr, 0.0, p_d)[:, None])
        new = probs.div_(_exponential_noise(probs, meta.generators)).argmax(dim=-1)
        target = target.index_copy(0, rr, torch.where(accept, dr, new))
        match = match.index_copy(0, rr, accept)
    ok = torch.zeros(num_rows, width, dtype=torch.bool, device=logits.device)
    ok[rows, pos] = match
    toks = torch.full((num_rows, width), -1, dtype=torch.long, device=logits.device)
    toks[rows, pos] = target
    num_accepted = ok.int().cumprod(dim=1).sum(dim=1)
    keep = torch.arange(width, device=logits.device)[None, :] <= num_accepted[:, None]
    return toks.masked_fill(~keep, -1)


def _uniform(like: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    u = torch.rand_like(like) if len(generators) < len(like) else torch.empty_like(like)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, device=like.device, dtype=like.dtype)[0]
    return u


def launch_verification(runner: Any, sched: Any, h: Any, logits: torch.Tensor, start: Any,
                        plp: Any) -> Any:
    """ModelRunner._sample_async for a step with drafts: rows without drafts sample as usual,
    rows with drafts go through rejection_sample; returns a Launched whose ids are
    [R, 1 + max k] (rows without drafts first, in their order, then the verifying rows)."""
    from pagedbackend.worker.model_runner import Launched

    scheduled = [sched.scheduled[i] for i in h.sample_rows]
    ks = [len(s.spec_token_ids) for s in scheduled]
    offsets = np.concatenate([[0], np.cumsum(np.array(ks) + 1)])
    plain = [i for i, k in enumerate(ks) if not k]
    spec = [i for i, k in enumerate(ks) if k]
    width = 1 + max(ks)
    device = runner.device
    parts, logprobs = [], None
    if plain:
        reqs = [scheduled[i].request for i in plain]
        idx = to_device_async(torch.tensor(offsets[plain], dtype=torch.long), device)
        out = runner.sampler(logits.index_select(0, idx), _metadata(runner, reqs, [0] * len(reqs),
                                                                    logits.shape[-1]))
        logprobs = out.logprobs
        pad = torch.full((len(reqs), width - 1), -1, dtype=torch.long, device=device)
        parts.append(torch.cat([out.sampled_token_ids[:, None], pad], dim=1))
    reqs_s = [scheduled[i].request for i in spec]
    ks_s = [ks[i] for i in spec]
    idx = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in spec])
    drafts = np.concatenate([scheduled[i].spec_token_ids + [-1] for i in spec])
    rows = np.repeat(np.arange(len(spec)), np.array(ks_s) + 1)
    pos = np.concatenate([np.arange(k + 1) for k in ks_s])
    idx_d, drafts_d, rows_d, pos_d = (to_device_async(torch.from_numpy(np.asarray(a, np.int64)),
                                                      device) for a in (idx, drafts, rows, pos))
    meta = _metadata(runner, reqs_s, ks_s, logits.shape[-1])
    spec_logits = logits.index_select(0, idx_d)
    toks = rejection_sample(spec_logits, meta, drafts_d, rows_d, pos_d, len(spec), width)
    parts.append(toks)
    ids = torch.cat(parts) if len(parts) > 1 else parts[0]
    reqs = [scheduled[i].request for i in plain] + reqs_s
    verified = Verification(len(plain), ks_s)
    if meta.max_num_logprobs is not None:
        verified.logprobs = _logprobs(spec_logits, toks[rows_d, pos_d].clamp(min=0), meta)
    if device.type != "cuda":
        return Launched(reqs, ids, logprobs=logprobs, prompt_logprobs=plp, verified=verified)
    host = torch.empty(ids.shape, dtype=torch.long, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    done = torch.cuda.Event(enable_timing=start is not None)
    done.record()
    return Launched(reqs, host, done, start, logprobs, plp, verified=verified)


@dataclass
class Verification:
    """What finish() needs of a verification step: where its verifying rows start among the
    Launched's reqs, their draft counts, and (when a row asked) every position's logprobs."""
    first: int
    ks: list[int]
    logprobs: Optional[LogprobsOutput] = None


def _logprobs(logits: torch.Tensor, chosen: torch.Tensor, meta: SamplingMetadata
              ) -> LogprobsOutput:
    """The sampler's logprobs (raw log_softmax: the chosen token, then the top-k) at every
    verified position, for the tokens the verification kept there."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = lp.topk(meta.max_num_logprobs, dim=-1)
    return LogprobsOutput(token_ids=torch.cat([chosen[:, None], top_ids], dim=1),
                          logprobs=torch.cat([lp.gather(1, chosen[:, None]), top_lp], dim=1),
                          num_logprobs=meta.num_logprobs)


def finish_verification(v: Verification, reqs: list, rows: list[list[int]]
                        ) -> tuple[list[int], dict[str, list[int]], dict[str, list]]:
    """A verification step's token rows -> (each row's new token, request id -> the drafts it
    accepted, request id -> [(logprob, entry)] of each token it got, for rows that asked)."""
    last, accepted, logprobs = split_rows(reqs, rows)
    if v.logprobs is None:
        return last, accepted, logprobs
    entries, at = v.logprobs.tolists(), 0
    for r, row, k in zip(reqs[v.first:], rows[v.first:], v.ks):
        toks = [t for t in row if t >= 0]
        got = entries[at:at + len(toks)]
        if got and got[0] is not None:
            logprobs[r.request_id] = [(e[t], e) for t, e in zip(toks, got)]
        at += k + 1
    return last, accepted, logprobs


def _metadata(runner: Any, reqs: list, ks: list[int], vocab_size: int) -> SamplingMetadata:
    """Sampling metadata with each request repeated 1 + k times (its verified positions)."""
    rep = lambda values: [v for v, k in zip(values, ks) for _ in range(k + 1)]  # noqa: E731
    return SamplingMetadata.build(
        params=rep([r.sampling_params for r in reqs]),
        prompt_token_ids=rep([r.prompt_token_ids for r in reqs]),
        output_token_ids=rep([r.output_token_ids for r in reqs]),
        generators=rep([runner._generator(r) for r in reqs]),
        min_tokens_stop_ids=rep([runner._min_tokens_stop_ids(r) for r in reqs]),
        vocab_size=vocab_size, device=runner.device,
        bad_words=(rep([r.bad_words_token_ids for r in reqs])
                   if any(r.bad_words_token_ids for r in reqs) else None),
        grammars=(rep([r.grammar for r in reqs])
                  if any(r.grammar is not None for r in reqs) else None))


def split_rows(reqs: list, rows: list[list[int]]) -> tuple[list[int], dict[str, list[int]],
                                                           dict]:
    last, accepted = [], {}
    for r, row in zip(reqs, rows):
        toks = [t for t in row if t >= 0]
        last.append(toks[-1])
        if len(toks) > 1:
            accepted[r.request_id] = toks[:-1]
    return last, accepted, {}
