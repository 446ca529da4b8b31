"""One decoder-only implementation for the Llama family: LlamaForCausalLM (incl. llama3 rope
scaling), MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (per-head q/k
RMSNorm). Parameter names follow HF's, except that q|k|v and gate|up are packed into one matmul
each (`qkv_proj`, `gate_up_proj`); `load_weight` maps HF names onto them.
Not supported: sliding-window attention (Mistral's `sliding_window` is not applied, so outputs
are exact only for contexts up to the window), rope types other than default/linear/llama3.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedbackend.layers.attention import AttentionMetadata
from pagedbackend.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedbackend.layers.linear import (ColumnParallelLinear, RowParallelLinear,
                                        default_weight_loader, norm_linear)
from pagedbackend.layers.norm import RMSNorm
from pagedbackend.layers.quantization import is_fp8
from pagedbackend.layers.rotary import build_cos_sin_cache

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# HF checkpoint name piece -> (our packed parameter piece, shard index inside it).
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class LlamaArgs:
    """The architecture knobs read from an HF config.json (HF key names)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaArgs":
        arch = (cfg.get("architectures") or [None])[0] or _MODEL_TYPES.get(cfg.get("model_type"))
        if arch not in ARCHITECTURES:
            raise ValueError(f"architectures={cfg.get('architectures')!r} is invalid: must be "
                             f"one of {ARCHITECTURES}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is invalid: must be 'silu'")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is invalid: must be False")
        # transformers 5 folds rope_theta/rope_scaling into `rope_parameters`; accept both.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def check_tp(self, tp_size: int) -> None:
        """Refuse shardings that would split a head or a vocab row, naming the counts."""
        bad = [f"{name}={n}" for name, n in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
            ("intermediate_size", self.intermediate_size)) if n % tp_size]
        if tp_size < 1 or bad:
            raise ValueError(
                f"tensor_parallel_size={tp_size} is invalid: must divide num_attention_heads="
                f"{self.num_attention_heads}, num_key_value_heads={self.num_key_value_heads}, "
                f"vocab_size={self.vocab_size} and intermediate_size={self.intermediate_size} "
                f"(not divisible: {', '.join(bad) or 'tp_size < 1'})")


@dataclass
class _Parallel:
    rank: int
    size: int
    group: Any


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, tp: _Parallel, attn_backend, cos_sin_cache: torch.Tensor,
                 dtype, device):
        super().__init__()
        self.num_heads = a.num_attention_heads // tp.size
        self.num_kv_heads = a.num_key_value_heads // tp.size
        self.head_dim = a.head_dim
        self.q_size = self.num_heads * a.head_dim
        self.kv_size = self.num_kv_heads * a.head_dim
        self.scale = a.head_dim ** -0.5
        self.backend = attn_backend
        self.cos_sin_cache = cos_sin_cache   # shared by all layers; a plain attribute, not a buffer
        kv = a.num_key_value_heads * a.head_dim
        self.qkv_proj = ColumnParallelLinear(a.hidden_size, [a.num_attention_heads * a.head_dim,
                                                             kv, kv], a.qkv_bias, dtype, device,
                                             tp.rank, tp.size)
        self.o_proj = RowParallelLinear(a.num_attention_heads * a.head_dim, a.hidden_size, False,
                                        dtype, device, tp.rank, tp.size, tp.group)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, qkv, meta: AttentionMetadata, k_cache, v_cache):
        """qkv: the q|k|v projection of the normed hidden states (the decoder layer computes it,
        so the norm can run inside the matmul)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale,
                                 rope=(positions, self.cos_sin_cache))
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs, tp: _Parallel, dtype, device):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(a.hidden_size, [a.intermediate_size] * 2, False,
                                                 dtype, device, tp.rank, tp.size)
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, False, dtype,
                                           device, tp.rank, tp.size, tp.group)

    def forward(self, gate_up):
        """gate_up: the gate|up projection of the normed hidden states (computed by the decoder
        layer, like q|k|v)."""
        return self.down_proj.forward_silu_mul(gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, tp: _Parallel, attn_backend, cos_sin_cache, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(a, tp, attn_backend, cos_sin_cache, dtype, device)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(a, tp, dtype, device)

    def forward(self, positions, x, residual, meta, k_cache, v_cache):
        # The residual stream is carried separately so each norm can fuse the add before it,
        # and the norm itself can run inside the projection after it (norm_linear).
        qkv, residual = norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj)
        x = self.self_attn(positions, qkv, meta, k_cache, v_cache)
        gate_up, residual = norm_linear(x, residual, self.post_attention_layernorm,
                                        self.mlp.gate_up_proj)
        return self.mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs, tp: _Parallel, attn_backend, dtype, device):
        super().__init__()
        cos_sin = build_cos_sin_cache(a.head_dim, a.max_position_embeddings, a.rope_theta,
                                      a.rope_scaling, dtype, device)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype, device,
                                                   tp.rank, tp.size, tp.group)
        self.layers = nn.ModuleList(LlamaDecoderLayer(a, tp, attn_backend, cos_sin, dtype, device)
                                    for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype, device)

    def forward(self, input_ids, positions, meta, kv_caches):
        x, residual = self.embed_tokens(input_ids), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, meta, k_cache, v_cache)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config: dict, dtype: torch.dtype, device: torch.device, attn_backend,
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        super().__init__()
        self.args = a = LlamaArgs.from_hf(hf_config)
        a.check_tp(tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        tp = _Parallel(tp_rank, tp_size, tp_group)
        self.num_kv_heads = a.num_key_value_heads // tp_size   # per rank, for sizing KV caches
        self.head_dim = a.head_dim
        self.model = LlamaModel(a, tp, attn_backend, dtype, device)
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, dtype, device,
                                      tp_rank, tp_size, tp_group)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weight(self, hf_name: str, loaded: Any, params: dict[str, torch.Tensor]) -> str | None:
        """Copy one HF-named checkpoint tensor into its (packed, sharded) parameter.

        Returns the key it filled (`name`, or `name[i]` for part i of a packed parameter), or
        None when the tensor has no place here (rotary inv_freq, the lm_head of a tied model)."""
        pieces = hf_name.split(".")
        shard_id = None
        for i, piece in enumerate(pieces):
            if piece in PACKED:
                pieces[i], shard_id = PACKED[piece]
                break
        name = ".".join(pieces)
        if name == "lm_head.weight" and self.args.tie_word_embeddings:
            return None
        param = params.get(name)
        if param is None:
            return None
        if is_fp8(loaded) != (param.dtype == torch.float8_e4m3fn):
            # an e4m3 tensor copied into a 16-bit parameter (or the reverse) would load without
            # its scale, i.e. a wrong model that still runs
            raise ValueError(f"checkpoint tensor {hf_name} is "
                             f"{'float8' if is_fp8(loaded) else 'not float8'} but its parameter "
                             f"is {str(param.dtype).replace('torch.', '')}: a checkpoint with "
                             "some layers quantized and some not is not supported, and FP8 "
                             "weights need a quantization_config in config.json")
        getattr(param, "weight_loader", default_weight_loader)(param, loaded, shard_id)
        return name if shard_id is None else f"{name}[{shard_id}]"

    def required_weight_keys(self) -> set[str]:
        """Every key load_weight must report for the model to be fully loaded."""
        keys = {name for name, _ in self.named_parameters()}
        for prefix, mod in self.named_modules():
            if isinstance(mod, ColumnParallelLinear) and len(mod.local_sizes) > 1:
                for pname, _ in mod.named_parameters(recurse=False):
                    keys.discard(f"{prefix}.{pname}")
                    keys.update(f"{prefix}.{pname}[{i}]" for i in range(len(mod.local_sizes)))
        return keys
