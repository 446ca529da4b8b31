"""Paged attention interface and its plain-PyTorch implementation.

A step's tokens are flattened: request i owns query rows query_start_loc[i]:query_start_loc[i+1];
those rows are the *last* q_len_i positions of a context of seq_lens[i] tokens, whose K/V live in
the blocks block_tables[i, :ceil(seq_lens[i] / block_size)]. A query at position p attends to
keys 0..p (causal). slot_mapping[t] = block_id * block_size + offset says where token t's new K/V
are written; -1 means "padding, do not write".

Metadata is passed explicitly to every call (never through a global), so two engines can share a
process and kernels can be tested alone. GPU kernels (pagedbackend.kernels) implement the same
`AttentionBackend` protocol.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pagedbackend.layers.rotary import apply_rotary


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [B+1] int32
    seq_lens: torch.Tensor          # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32 (rows padded with 0)
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU path never reads device tensors back.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # A CUDA-graph step padded past its real tokens, whose number only the device knows (the
    # host fields describe the padded shape): the attention output's padding rows are zeroed.
    padded: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    # Once per step, not once per layer (a 512-sequence step has 512-entry lists).
    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @functools.cached_property
    def has_single_queries(self) -> bool:
        return 1 in self.query_lens_cpu

    @functools.cached_property
    def longest_first(self) -> torch.Tensor:
        """The sequences' indices by context length, longest first (int64, on seq_lens'
        device): the decode kernel's program order (kernels.decode.LONGEST_FIRST)."""
        return torch.sort(self.seq_lens, descending=True).indices

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D];
        rope = (positions [T], cos_sin_cache) when q and k still need the rotary embedding
        (so a backend can rotate them on the way into the cache).

        Writes k/v into the caches at meta.slot_mapping, then returns attention output [T, Hq, D].
        """
        ...


FP8_MAX = 448.0     # float8 e4m3's largest finite value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV cache of this dtype stores it: into float8 e4m3 (kv_cache_dtype fp8, scale 1)
    values saturate at +-448 rather than overflow to NaN (kernels.common.to_cache)."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Reference KV write: scatter each token's k/v into its slot; slot -1 is skipped. Every
    reader widens the cache to q's dtype, so an fp8 cache works with every backend."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc[slots] = to_cache_dtype(k[keep], kc.dtype)
    vc[slots] = to_cache_dtype(v[keep], vc.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference attention over the paged cache, one sequence at a time (fp32 softmax)."""
    out = torch.empty_like(q)
    hq = q.shape[1]
    start = 0
    for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        qi = q[start:start + ql]                                  # [ql, Hq, D]
        ki = gather_kv(k_cache, meta.block_tables[i], sl)         # [sl, Hkv, D]
        vi = gather_kv(v_cache, meta.block_tables[i], sl)
        rep = hq // ki.shape[1]
        ki = ki.repeat_interleave(rep, dim=1)
        vi = vi.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * scale
        qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
        kpos = torch.arange(sl, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", probs, vi.float()).to(q.dtype)
        start += ql
    return out


class TorchAttentionBackend:
    """CPU / fallback backend: SDPA per prefill sequence, one padded batched SDPA for decode."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, rope=None):
        if rope is not None:
            q, k = apply_rotary(q, k, *rope)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            qi = q[start:start + ql].transpose(0, 1)                              # [Hq, ql, D]
            ki = gather_kv(k_cache, meta.block_tables[i], sl).transpose(0, 1)     # [Hkv, sl, D]
            vi = gather_kv(v_cache, meta.block_tables[i], sl).transpose(0, 1)
            mask = None
            if ql > 1:
                qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
                mask = torch.arange(sl, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qi, ki.to(qi.dtype), vi.to(qi.dtype),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:start + ql] = o.transpose(0, 1)
            start += ql
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale):
        # One query per sequence: gather every sequence's blocks into a padded [B, Hkv, L, D]
        # batch and run a single masked SDPA instead of B small ones. index_select is several
        # times faster than advanced indexing here.
        b = meta.num_seqs
        block_size = k_cache.shape[1]
        n_blocks = (meta.max_seq_len + block_size - 1) // block_size
        idx = meta.block_tables[:, :n_blocks].reshape(-1).long()
        length = n_blocks * block_size
        shape = (b, length) + tuple(k_cache.shape[2:])
        ks = k_cache.index_select(0, idx).view(shape)                     # [B, L, Hkv, D]
        vs = v_cache.index_select(0, idx).view(shape)
        hkv, d = ks.shape[2], ks.shape[3]
        qg = q.view(b, hkv, -1, d)                                         # [B, Hkv, G, D]
        # Plain matmuls over the GQA groups: on CPUs they beat SDPA with a mask at these sizes.
        scores = torch.matmul(qg, ks.permute(0, 2, 3, 1).to(q.dtype)).float() * scale
        pad = (torch.arange(length, device=q.device)[None, :]
               >= meta.seq_lens[:, None].to(q.device))                    # [B, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vs.transpose(1, 2).to(q.dtype)).view(b, -1, d)
