"""Read llama.cpp GGUF checkpoints: tensor names mapped to HF's, weights dequantized with the
`gguf` package (vectorized numpy), llama.cpp's Q/K rotary row permutation undone, and an HF-style
config dict rebuilt from the metadata for directories that hold only a .gguf file.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Iterator

import numpy as np
import torch

# llama.cpp per-block tensor name -> HF module path inside model.layers.N
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter interleaves the two rotary halves of Q/K rows for these architectures
# (its rope kernel is GPT-J style); the NeoX-style ones (qwen2/3) are stored unpermuted.
_PERMUTED_ARCHS = ("llama", "mistral")


def find_gguf(model_dir: str) -> str | None:
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".gguf"))
    return os.path.join(model_dir, names[0]) if names else None


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None   # e.g. rope_freqs: the rotary table is rebuilt from the config


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's per-head (2, d/2) -> (d/2, 2) row interleave of Q/K weights."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime: float):
    # Parsing the metadata (the whole tokenizer vocabulary) takes seconds; reading a config
    # and then the weights of the same file should pay for it once.
    from gguf import GGUFReader
    return GGUFReader(path)


def open_gguf(path: str):
    return _open(os.path.abspath(path), os.path.getmtime(path))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def iter_gguf_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every mapped tensor of the file."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    n_heads = _field(reader, f"{arch}.attention.head_count")
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_heads)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))   # GGUF lists dims fastest-first
        if arch in _PERMUTED_ARCHS and ".q_proj." in name:
            w = unpermute_rotary(w, n_heads)
        elif arch in _PERMUTED_ARCHS and ".k_proj." in name:
            w = unpermute_rotary(w, n_kv)
        with warnings.catch_warnings():
            # Unquantized tensors come back as read-only views of the mapped file; they are
            # only read (copied into parameters), so wrapping them without a copy is safe.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        yield name, tensor


def gguf_hf_config(path: str) -> dict:
    """An HF config.json-style dict from GGUF metadata (Llama-family architectures)."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"general.architecture={arch!r} is invalid: must be one of "
                         f"{tuple(_ARCHS)}")

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg = {
        "architectures": [_ARCHS[arch]], "model_type": arch,
        "vocab_size": int(vocab), "hidden_size": int(hidden),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[key] = int(value)
    return cfg
