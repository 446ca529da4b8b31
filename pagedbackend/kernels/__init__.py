"""Triton-language kernels for CUDA: paged attention (decode with split-KV, chunked prefill),
KV-cache writes, RMSNorm, rotary embedding and the gated-MLP activation. Each has a plain-PyTorch reference in
pagedbackend.layers and a parity test in tests/test_kernels.py."""
from pagedbackend.kernels.activation import silu_and_mul
from pagedbackend.kernels.backend import TritonAttentionBackend
from pagedbackend.kernels.cache import store_kv_cache
from pagedbackend.kernels.decode import choose_num_splits, paged_decode_attention
from pagedbackend.kernels.norm import fused_add_rms_norm, rms_norm
from pagedbackend.kernels.prefill import paged_prefill_attention
from pagedbackend.kernels.rotary import apply_rotary

__all__ = ["TritonAttentionBackend", "apply_rotary", "choose_num_splits", "fused_add_rms_norm",
           "paged_decode_attention", "paged_prefill_attention", "rms_norm", "silu_and_mul",
           "store_kv_cache"]
