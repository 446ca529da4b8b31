"""Tiny random checkpoints of each supported architecture, for tests and GPU correctness runs."""
from __future__ import annotations

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
               rms_norm_eps=1e-5)
TINY_CONFIGS = {
    "llama": dict(_COMMON, rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(_COMMON, num_key_value_heads=1, sliding_window=None, rope_theta=10000.0),
    "qwen2": dict(_COMMON, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(_COMMON, head_dim=24, tie_word_embeddings=True, rope_theta=1e6),
}
ARCHS = tuple(TINY_CONFIGS)


def make_hf_checkpoint(arch: str, out_dir, seed: int = 0, max_shard_size=None,
                       std: float = 0.08, **overrides):
    """A randomly initialised transformers model saved as safetensors; returns the model.

    Weights are drawn with a larger spread than HF's init (and norms away from 1) so greedy
    choices are well separated and a mis-loaded tensor shows up in the logits."""
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cls(**{**TINY_CONFIGS[arch], **overrides}), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.generation_config.eos_token_id = None
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out_dir), **kwargs)
    return model


def drain(engine, on_step=None):
    """Step an LLMEngine until it has nothing left; returns (concatenated delta token ids,
    final RequestOutput) per request id. on_step(engine, steps_done) runs after each step."""
    deltas, finals, steps = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if on_step is not None:
            on_step(engine, steps)
    return deltas, finals
