"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of
the request's last n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that
occurs. Where that continuation reaches the request's end before k tokens (the match is less
than k tokens back: a loop, a list, a line repeated), the copy goes on over the drafts
themselves, as an overlapping LZ77 copy does: the text is guessed to keep repeating with that
period instead of the drafts stopping short.

Costs no model: useful where the output repeats its input (editing, extraction, code)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens following token_ids (empty when no n-gram recurs)."""
        size = len(token_ids)
        if k <= 0 or size <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        # ends of earlier occurrences of the last token, narrowed one token further back at a
        # time to the ends of occurrences of the last n tokens
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        best = ends[-1] if len(ends) and self.min_n == 1 else None
        for n in range(2, min(self.max_n, size - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[ids[ends - (n - 1)] == ids[-n]]
            if not len(ends):
                break
            if n >= self.min_n:
                best = ends[-1]
        if best is None:
            return []
        # ids[best + 1:] has size - 1 - best >= 1 tokens; np.resize repeats it to k
        return np.resize(ids[best + 1:best + 1 + k], k).tolist()
