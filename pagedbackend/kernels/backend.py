"""TritonAttentionBackend: the CUDA implementation of layers.attention.AttentionBackend."""
from __future__ import annotations

import torch

from pagedbackend.kernels import decode, prefill
from pagedbackend.kernels.cache import store_kv_cache
from pagedbackend.kernels.common import num_sms
from pagedbackend.kernels.decode import choose_num_splits, max_split_rows, paged_decode_attention
from pagedbackend.kernels.prefill import paged_prefill_attention
from pagedbackend.kernels.rotary import rotary_store_kv
from pagedbackend.layers.norm import USE_KERNELS
from pagedbackend.layers.rotary import apply_rotary


class TritonAttentionBackend:
    """Writes K/V, then runs the decode kernel when every sequence has one query
    (meta.max_query_len == 1), and otherwise the prefill kernel, plus the decode kernel for the
    single-query sequences of a mixed batch (both select their sequences on the device). In a
    narrow decode step the decode kernel applies the rotary embedding and writes K/V itself
    (decode.rope_in_decode). With more than one sequence the decode kernel starts the longest
    sequences' programs first (decode.LONGEST_FIRST).

    Decode is CUDA-graph safe: it reads only host fields of meta (shapes, max_seq_len), launches
    grids that depend on the batch size and the split count alone, and uses split-KV scratch
    allocated once per (device, Hq, Hkv, D) at the first call (size bounded over every batch
    size): the partial outputs and their log-sum-exps.
    The split count follows meta.max_seq_len, so capture graphs with meta.max_seq_len set to the
    longest context they will replay (e.g. max_model_len); any shorter context stays correct.
    One instance can serve every layer: the scratch is reused stream-ordered.
    """

    def __init__(self, num_splits: int | None = None, decode_config: dict | None = None,
                 prefill_config: dict | None = None):
        self.num_splits = num_splits     # fixed split count (tests, tuning); None = heuristic
        self.decode_config = decode_config      # tile overrides, see decode.decode_config
        self.prefill_config = prefill_config    # and prefill.prefill_config
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _split_scratch(self, q: torch.Tensor, hkv: int, splits: int, b: int):
        hq, d = q.shape[1], q.shape[2]
        key = (q.device, hq, hkv, d)
        need = b * splits
        buf = self._scratch.get(key)
        if buf is None or buf[1].numel() < need * hq:
            rows = max(need, max_split_rows(hkv, num_sms(q.device.index)))
            if buf is not None and torch.cuda.is_available() \
                    and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split-KV scratch must grow during CUDA graph capture; "
                                   "run an eager step of the largest batch first")
            buf = (torch.empty(rows * hq * d, dtype=torch.float32, device=q.device),
                   torch.empty(rows * hq, dtype=torch.float32, device=q.device))
            self._scratch[key] = buf
        return buf

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, rope=None):
        if rope is not None and not USE_KERNELS:       # the torch-rotary A/B
            q, k = apply_rotary(q, k, *rope)
            rope = None
        b = meta.seq_lens.shape[0]
        decode_only = meta.max_query_len == 1
        rope_store = None
        # the prefill kernel reads the step's keys and values from k / v, not from the cache
        contig = prefill.CONTIG_KV and not decode_only and k_cache.dtype == k.dtype
        if rope is not None and decode_only and rope[1].shape[-1] == q.shape[-1] \
                and decode.rope_in_decode(b, k_cache.shape[2], num_sms(q.device.index)):
            # the decode kernel rotates q and k and writes k and v itself
            rope_store = (k[:b], v[:b], rope[0][:b], rope[1], meta.slot_mapping[:b])
        elif rope is None:
            store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        else:   # one kernel: q rotated in place, k rotated on its way into the cache
            q = rotary_store_kv(q, k, v, *rope, k_cache, v_cache, meta.slot_mapping,
                                rotate_k=contig)
        out = torch.zeros_like(q) if meta.padded else torch.empty_like(q)
        # Single-query sequences (all of them in a decode step, some in a mixed chunked-prefill
        # step) go to the GQA-packed split-KV decode kernel; 128-row prefill tiles would waste
        # 127 rows on each and read its context once per query head instead of per KV head.
        singles = decode_only or meta.has_single_queries
        if singles:
            hkv = k_cache.shape[2]
            splits = self.num_splits or choose_num_splits(
                b, hkv, meta.max_seq_len, num_sms(q.device.index))
            part_out = part_lse = None
            if splits > 1:
                part_out, part_lse = self._split_scratch(q, hkv, splits, b)
            order = meta.longest_first if decode.LONGEST_FIRST and b > 1 else None
            if decode_only:
                paged_decode_attention(q[:b], k_cache, v_cache, meta.block_tables,
                                       meta.seq_lens, scale, out[:b], splits, part_out,
                                       part_lse, self.decode_config, rope_store=rope_store,
                                       order=order)
            else:
                paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       scale, out, splits, part_out, part_lse,
                                       self.decode_config, meta.query_start_loc, order=order)
        if not decode_only:
            paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, scale, out, self.prefill_config,
                                    skip_single=singles, k_new=k if contig else None,
                                    v_new=v if contig else None)
        n_real = b if decode_only else meta.num_tokens
        if n_real < q.shape[0]:
            out[n_real:].zero_()     # padding rows: defined values, never NaN
        return out
