"""SamplingParams.prompt_logprobs: how likely the model found each prompt token, as vLLM reports
it (per prompt token, {token id: logprob} with the prompt's own token first, then the top-k of
that position; None for the first token, which nothing predicts).

The runner computes the LM head at the prompt positions a step runs (step_inputs'
`_prompt_logprob_positions`), in the eager path only; the log-softmax, the prompt tokens'
values and the top-k stay on the device until the step's one sync, in `finish`. Requests that
ask for them read no cached prefix (`Request.skip_prefix_cache`) and run without a step in
flight (`needs_all_tokens`), so every position is computed once, in order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedbackend.layers.sampling_metadata import to_device_async


@dataclass
class PromptLogprobs:
    """One step's prompt logprobs, still on the device."""
    target_lp: torch.Tensor          # [N] the prompt tokens' logprobs
    top_ids: torch.Tensor            # [N, K] the top-K ids of each position (K: the step's max)
    top_lp: torch.Tensor             # [N, K]
    targets: np.ndarray              # [N] the prompt tokens
    rows: np.ndarray                 # [N] the row of each position
    first: dict                      # row -> prompt index of its first target
    request_ids: list                # row -> request id
    ks: list                         # row -> that request's prompt_logprobs

    def tolists(self) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """request id -> (prompt index of the first entry, the entries); one device->host copy."""
        packed = torch.cat([self.target_lp[:, None].double(), self.top_ids.double(),
                            self.top_lp.double()], dim=1).cpu().tolist()
        width = self.top_ids.shape[1]
        out: dict[str, tuple[int, list]] = {}
        for row_vals, tok, row in zip(packed, self.targets.tolist(), self.rows.tolist()):
            k = self.ks[row]
            entry = {int(tok): row_vals[0]}
            for t, lp in zip(row_vals[1:1 + k], row_vals[1 + width:1 + width + k]):
                entry.setdefault(int(t), lp)
            rid = self.request_ids[row]
            out.setdefault(rid, (self.first[row], []))[1].append(entry)
        return out


def prompt_logprobs(logits: torch.Tensor, h, rows: list) -> PromptLogprobs:
    """logits [N, V] at h.plp_idx (HostInputs) -> their PromptLogprobs; rows: the step's
    scheduled rows (ScheduledRequest), indexed by h.plp_row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = to_device_async(torch.from_numpy(h.plp_target), lp.device)
    ks = [r.request.sampling_params.prompt_logprobs or 0 for r in rows]
    k = max(ks[i] for i in set(h.plp_row.tolist()))
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return PromptLogprobs(target_lp=lp.gather(1, targets[:, None])[:, 0], top_ids=top_ids,
                          top_lp=top_lp, targets=h.plp_target, rows=h.plp_row,
                          first=h.plp_first, request_ids=[r.request.request_id for r in rows],
                          ks=ks)
