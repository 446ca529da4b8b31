"""The sampler's per-request token controls: stop tokens held back by min_tokens, bad_words,
logit_bias, allowed_token_ids and structured-output grammars. The host side finds, per step,
which (row, token) pairs each one touches (only for rows that use it); sampler.py uploads them
and applies them in vLLM's order with the functions below."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch


def banned_pairs(params: Sequence, output_token_ids: Sequence[Sequence[int]],
                 min_tokens_stop_ids: Sequence[Sequence[int]],
                 bad_words: Optional[Sequence[Sequence[Sequence[int]]]],
                 V: int) -> tuple[list[int], list[int]]:
    """(rows, tokens) that may not be sampled next: a stop token while the row is short of
    min_tokens, and a bad word's last token where the output ends with the rest of it."""
    rows, ids = [], []
    for i, (p, stop) in enumerate(zip(params, min_tokens_stop_ids)):
        if stop and len(output_token_ids[i]) < p.min_tokens:
            valid = [t for t in stop if 0 <= t < V]
            rows += [i] * len(valid)
            ids += valid
    for i, words in enumerate(bad_words or ()):
        for t in bad_word_bans(words, output_token_ids[i], V):
            rows.append(i)
            ids.append(t)
    return rows, ids


def bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int], V: int) -> list[int]:
    """The tokens a row may not sample next: the last token of each bad word whose other tokens
    end the output (a one-token word: always)."""
    bans = []
    for word in words:
        k = len(word) - 1
        if 0 <= word[-1] < V and (k == 0 or len(output) >= k
                                  and list(output[len(output) - k:]) == list(word[:-1])):
            bans.append(word[-1])
    return bans


def token_lists(params: Sequence) -> list[tuple[int, Any]]:
    """(row, params) of the rows with a logit_bias or allowed_token_ids (one pass)."""
    return [(i, p) for i, p in enumerate(params)
            if p.logit_bias is not None or p.allowed_token_ids is not None]


def bias_triples(rows: list[tuple[int, Any]], V: int) -> Optional[tuple]:
    """logit_bias of token_lists' rows as (rows, tokens, biases), or None when none has one."""
    triples = [(i, t, b) for i, p in rows if p.logit_bias
               for t, b in p.logit_bias.items() if 0 <= t < V]
    return tuple(zip(*triples)) if triples else None


def allowed_pairs(rows: list[tuple[int, Any]], V: int) -> tuple[list[int], list[tuple]]:
    """(the rows with allowed_token_ids among token_lists' rows, their (row, token) pairs)."""
    lists = [(i, p.allowed_token_ids) for i, p in rows if p.allowed_token_ids]
    return [i for i, _ in lists], [(i, t) for i, ids in lists for t in ids if 0 <= t < V]


def grammar_bitmask(grammars: Optional[Sequence[Any]], V: int) -> tuple[list[int], Any]:
    """(rows with a grammar, their next tokens as an int32 [rows, ceil(V / 32)] host bitmask,
    32 tokens per word, bit set = allowed), filled by each GrammarState."""
    rows = [i for i, g in enumerate(grammars or ()) if g is not None]
    if not rows:
        return [], None
    bitmask = torch.full((len(rows), (V + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(rows):
        grammars[i].fill_bitmask(bitmask, j)
    return rows, bitmask


def unpack_bitmask(bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] (bit b of word w: token 32 w + b) -> bool [R, V]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :V].bool()


def apply_logit_bias(logits: torch.Tensor, meta: Any) -> torch.Tensor:
    if meta.bias_rows is None:
        return logits
    return logits.index_put((meta.bias_rows, meta.bias_ids), meta.bias_values, accumulate=True)


def apply_masks(logits: torch.Tensor, meta: Any) -> torch.Tensor:
    """-inf at the banned (row, token) pairs and wherever allowed_mask is False."""
    if meta.banned_rows is not None:
        logits = logits.index_put((meta.banned_rows, meta.banned_ids),
                                  logits.new_full((), -math.inf))
    if meta.allowed_mask is not None:
        logits = logits.masked_fill(~meta.allowed_mask, -math.inf)
    return logits
