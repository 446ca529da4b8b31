"""Random paged batches for the kernel parity tests and perf/kernels_bench.py."""
from __future__ import annotations

import torch

from pagedbackend.layers.attention import AttentionMetadata


def random_paged_batch(query_lens: list[int], seq_lens: list[int], block_size: int, hq: int,
                       hkv: int, head_dim: int, dtype: torch.dtype, device,
                       spare_blocks: int = 3, pad: int = 0):
    """One step's q/k/v (strided views of a fused qkv, as models produce them), random caches
    standing in for the cached prefixes, block tables drawn from a shuffled pool (row padding 0),
    and the new tokens' slot mapping, plus `pad` trailing padding tokens with slot -1.
    Returns (q, k, v, k_cache, v_cache, meta)."""
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    pool = torch.randperm(num_blocks)
    width = max(need) + 2
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots, used = [], 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        tables[i, :need[i]] = pool[used:used + need[i]].to(torch.int32)
        used += need[i]
        pos = torch.arange(sl - ql, sl)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, dtype=torch.long)])
    t = slot_mapping.numel()

    def rand(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    q, k, v = rand(t, hq + 2 * hkv, head_dim).split([hq, hkv, hkv], dim=1)
    k_cache = rand(num_blocks, block_size, hkv, head_dim)
    v_cache = rand(num_blocks, block_size, hkv, head_dim)
    qsl = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device), query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return q, k, v, k_cache, v_cache, meta
