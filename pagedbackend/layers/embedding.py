"""Vocab-parallel token embedding and LM head: each rank holds vocab_size / tp_size rows.

The embedding zeroes ids outside its range and all-reduces; the LM head all-gathers its logit
columns so every rank ends with the full vocabulary.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedbackend.layers.linear import (check_divisible, linear, narrow, new_param,
                                        tp_all_reduce)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        super().__init__()
        check_divisible("vocab_size", vocab_size, tp_size)
        self.vocab_size = vocab_size
        self.tp_size, self.tp_group = tp_size, tp_group
        self.local_vocab = vocab_size // tp_size
        self.vocab_start = tp_rank * self.local_vocab
        self.weight = new_param((self.local_vocab, hidden_size), dtype, device, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        param.data.copy_(narrow(loaded, 0, self.vocab_start, self.local_vocab))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out, self.tp_size, self.tp_group)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharding as the embedding, so a tied head can simply share its weight."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the weights' dtype: the greedy argmax reads them as they are and the
        sampler widens them to fp32 where it computes with them (a fp32 copy here cost a
        [rows, vocab] read and a twice-as-large write every step)."""
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
