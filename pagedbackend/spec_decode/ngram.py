"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of
the request's last n tokens, trying n from prompt_lookup_max down to prompt_lookup_min.

Costs no model: useful where the output repeats its input (editing, extraction, code)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens following token_ids (empty when no n-gram recurs)."""
        size = len(token_ids)
        if k <= 0 or size <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # windows starting at 0 .. size - n - 1: every occurrence before the suffix itself
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
