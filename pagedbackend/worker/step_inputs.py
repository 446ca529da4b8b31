"""A step's inputs: flattened on the host from a SchedulerOutput, then copied to the device once.

Also the scratch steps the runner warms up with at start (every kernel variant a serving step
can need, compiled before the first request instead of in the middle of one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from pagedbackend.layers.attention import AttentionMetadata
from pagedbackend.layers.sampling_metadata import to_device_async


class HostInputs:
    """A step's flattened inputs as numpy arrays (built on the host, copied once).

    ph_dst/ph_src: token positions whose id is still in flight (async scheduling): the
    previous step's sampled id of row ph_src[i] goes to token ph_dst[i], on the device.
    plp_idx/plp_target/plp_row: prompt logprobs to compute: the logits of token plp_idx[i]
    score prompt token plp_target[i] for row plp_row[i]; plp_first[row] is the prompt index of
    that row's first target."""

    def __init__(self, tokens, positions, q_lens, starts, table, sample_rows, block_size,
                 ph_dst=None, ph_src=None, plp=None, num_drafts=None):
        self.tokens, self.positions, self.q_lens, self.table = tokens, positions, q_lens, table
        self.sample_rows = sample_rows
        self.cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        ends = self.cu[1:][sample_rows]
        # the logits wanted: each sampling row's last token, and before it one per draft token
        # it verifies (num_drafts[row], speculative decoding)
        self.num_drafts = 0 if num_drafts is None else int(num_drafts.sum())
        if self.num_drafts:
            ks = num_drafts[sample_rows]
            self.logits_idx = np.concatenate([np.arange(e - 1 - k, e) for e, k in zip(ends, ks)])
        else:
            self.logits_idx = ends - 1
        self.seq_lens = (starts + q_lens).astype(np.int32)
        row_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        self.slots = (table[row_of_token, positions // block_size].astype(np.int64) * block_size
                      + positions % block_size)
        self.decode_only = len(tokens) == len(q_lens)
        empty = np.zeros(0, np.int64)
        self.ph_dst = empty if ph_dst is None else ph_dst
        self.ph_src = empty if ph_src is None else ph_src
        self.plp_idx, self.plp_target, self.plp_row, self.plp_first = \
            plp if plp is not None else (empty, empty, empty, {})
        # (swap-out pairs, swap-in pairs) of (GPU block, host block) to copy before the
        # forward (worker/host_kv.py); None: none
        self.swaps = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[int]          # indices into sched.scheduled of the rows that sample


def host_inputs(rows: list, block_size: int, prev_rows: dict[str, int]) -> HostInputs:
    """The HostInputs of a SchedulerOutput's rows. prev_rows maps a request id to its row in
    the sampled ids of the step still in flight, for rows whose last token is one of them."""
    q_lens = np.fromiter((s.num_new_tokens for s in rows), np.int64, len(rows))
    starts = np.fromiter((s.start for s in rows), np.int64, len(rows))
    tokens: list[int] = []
    ph_dst, ph_src = [], []
    num_drafts = None
    for i, s in enumerate(rows):
        ids = s.request.all_token_ids
        end = s.start + s.num_new_tokens
        if s.spec_token_ids:
            # verification: the known tokens, then the drafts (no sample in flight)
            if num_drafts is None:
                num_drafts = np.zeros(len(rows), np.int64)
            num_drafts[i] = len(s.spec_token_ids)
            tokens.extend(ids[s.start:])
            tokens.extend(s.spec_token_ids)
        elif end > len(ids):
            # The last token was sampled by the step still in flight (async scheduling).
            tokens.extend(ids[s.start:])
            if end != len(ids) + 1 or s.request.request_id not in prev_rows:
                raise RuntimeError(f"request {s.request.request_id!r} is scheduled past "
                                   "its known tokens without a sample in flight")
            ph_dst.append(len(tokens))
            ph_src.append(prev_rows[s.request.request_id])
            tokens.append(0)
        else:
            tokens.extend(ids[s.start:end])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    positions = np.arange(len(tokens)) - np.repeat(cu[:-1] - starts, q_lens)
    n_blocks = [-(-(st + q) // block_size) for st, q in zip(starts.tolist(), q_lens.tolist())]
    table = np.zeros((len(rows), max(n_blocks)), dtype=np.int32)
    for i, (s, nb) in enumerate(zip(rows, n_blocks)):
        table[i, :nb] = s.block_ids[:nb]
    sample_rows = [i for i, s in enumerate(rows) if s.samples]
    return HostInputs(np.array(tokens, np.int64), positions, q_lens, starts, table,
                      sample_rows, block_size, np.array(ph_dst, np.int64),
                      np.array(ph_src, np.int64), _prompt_logprob_positions(rows, cu),
                      num_drafts)


def _prompt_logprob_positions(rows: list, cu) -> tuple:
    """(token index, target prompt token, row) of each prompt logprob this step computes, and
    each such row's first target: position p scores prompt token p + 1, for the positions
    computed now whose target has no entry yet (a recomputed prefix repeats none)."""
    idx, target, row, first = [], [], [], {}
    for i, s in enumerate(rows):
        got = s.request.prompt_logprobs
        if got is None:
            continue
        prompt = s.request.prompt_token_ids
        lo = max(s.start, len(got) - 1)
        hi = min(s.start + s.num_new_tokens, len(prompt) - 1)
        if lo >= hi:
            continue
        first[i] = lo + 1
        idx.extend(range(int(cu[i]) + lo - s.start, int(cu[i]) + hi - s.start))
        target.extend(prompt[lo + 1:hi + 1])
        row.extend([i] * (hi - lo))
    return np.array(idx, np.int64), np.array(target, np.int64), np.array(row, np.int64), first


def upload(arrays: list, device: torch.device) -> list[torch.Tensor]:
    """Integer numpy arrays -> int64 device tensors (same shapes) in one copy; from pinned
    memory on CUDA, so it neither blocks the host nor waits for earlier GPU work."""
    # Every array starts on a 16-byte boundary: triton specializes kernels on pointer
    # alignment, and views at odd offsets would compile new variants in mid-serving.
    sizes = [int(np.size(a)) for a in arrays]
    starts = np.concatenate([[0], np.cumsum([n + n % 2 for n in sizes])])
    flat = np.zeros(int(starts[-1]), dtype=np.int64)
    for a, o, n in zip(arrays, starts, sizes):
        flat[o:o + n] = np.asarray(a, dtype=np.int64).ravel()
    dev = to_device_async(torch.from_numpy(flat), device)
    return [dev[o:o + n].view(np.shape(a)) for a, o, n in zip(arrays, starts, sizes)]


def warmup_inputs(block_size: int, num_kv_blocks: int, max_model_len: int,
                  wide: int) -> Iterator[HostInputs]:
    """Scratch steps of every shape class, so each triton kernel variant is compiled at start:
    a first compile in the middle of serving stalls every request for about a second.

    The classes: decode rows alone, prefill alone, both mixed; token counts of 1, a multiple of
    16 and neither; short contexts and ~300-token ones (where decode rows of a small batch split
    the KV); one decode row (no program order, see decode.LONGEST_FIRST) and `wide` decode rows,
    more than one (sequence, kv head) per SM (rotary + KV write in their own kernel, see
    decode.rope_in_decode); the skinny matmul's row-count buckets (1, 2 and 4). Their K/V goes
    to blocks no request owns yet."""
    bs = block_size
    longest = min(300, max_model_len - 20, num_kv_blocks * bs // 4 - 20)
    for start in sorted({3, max(3, longest)}):
        for q_lens in ([1], [1, 1], [1] * wide, [17], [16], [1, 17], [1, 1, 16], [3, 1]):
            n = len(q_lens)
            starts = np.full(n, start, dtype=np.int64)
            q = np.array(q_lens, dtype=np.int64)
            per_row = -(-(start + max(q_lens)) // bs)
            table = (np.arange(n * per_row) % num_kv_blocks).astype(np.int32)
            positions = np.concatenate([np.arange(start, start + k) for k in q_lens])
            yield HostInputs(np.zeros(int(q.sum()), np.int64), positions, q, starts,
                             table.reshape(n, per_row), list(range(n)), bs)
