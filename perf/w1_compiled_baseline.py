"""W1's peer on the same machine: gpt-fast-style batch-1 decoding of the same llama model in
plain PyTorch, the one-token decode step compiled with torch.compile(mode="reduce-overhead")
(inductor's kernels inside CUDA graphs) over a static KV cache; random bf16 weights.

The model: fused q|k|v and gate|up weights, a [layers, 1, kv heads, max_len, head_dim] cache
written with index_copy_ at the step's position, attention by scaled_dot_product_attention over
the whole static cache under a mask, greedy argmax inside the compiled step, no host sync
between steps. The prompt is prefilled without compiling (not part of decode tokens/s).

Alone: python perf/w1_compiled_baseline.py [--model llama-3.1-8b]; w1_decode.py
--compiled-baseline runs it in the same process after our engine. Prints tokens/s and MBU.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from common import H200_BW, HERE, print_table, random_prompts, write_result


class StaticLlama(nn.Module):
    """A llama decoder (HF config dict) with a static KV cache for one sequence of max_len."""

    def __init__(self, cfg: dict, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        from pagedbackend.layers.rotary import build_cos_sin_cache
        from pagedbackend.models.llama import LlamaArgs
        a = LlamaArgs.from_hf(cfg)      # the engine's reading of config.json (rope included)
        h, self.n_layers = a.hidden_size, a.num_hidden_layers
        self.hq, self.hkv, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.eps, inter, vocab = a.rms_norm_eps, a.intermediate_size, a.vocab_size

        def w(*shape):      # random, scaled so activations stay O(1) through the layers
            return nn.Parameter(torch.randn(*shape, dtype=dtype, device=device) * shape[-1] ** -0.5,
                                requires_grad=False)

        def ones(n):
            return nn.Parameter(torch.ones(n, dtype=dtype, device=device), requires_grad=False)
        self.embed = w(vocab, h)
        self.wqkv = nn.ParameterList(w((self.hq + 2 * self.hkv) * self.d, h)
                                     for _ in range(self.n_layers))
        self.wo = nn.ParameterList(w(h, self.hq * self.d) for _ in range(self.n_layers))
        self.w13 = nn.ParameterList(w(2 * inter, h) for _ in range(self.n_layers))
        self.w2 = nn.ParameterList(w(h, inter) for _ in range(self.n_layers))
        self.attn_norm = nn.ParameterList(ones(h) for _ in range(self.n_layers))
        self.mlp_norm = nn.ParameterList(ones(h) for _ in range(self.n_layers))
        self.norm = ones(h)
        self.lm_head = self.embed if a.tie_word_embeddings else w(vocab, h)
        cache = (self.n_layers, 1, self.hkv, max_len, self.d)
        self.register_buffer("k_cache", torch.zeros(cache, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(cache, dtype=dtype, device=device))
        self.register_buffer("cos_sin", build_cos_sin_cache(
            self.d, max_len, a.rope_theta, a.rope_scaling, torch.float32, device))
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool,
                                                  device=device).tril())

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every weight but the (untied) embedding table."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total if self.lm_head is self.embed else total - self.embed.numel() \
            * self.embed.element_size()

    def load_hf_state_dict(self, sd: dict) -> None:
        """Copy a transformers LlamaForCausalLM's weights in (the tests' reference model)."""
        with torch.no_grad():
            self.embed.copy_(sd["model.embed_tokens.weight"])
            for i in range(self.n_layers):
                p = f"model.layers.{i}."
                self.wqkv[i].copy_(torch.cat([sd[p + f"self_attn.{x}_proj.weight"]
                                              for x in "qkv"]))
                self.wo[i].copy_(sd[p + "self_attn.o_proj.weight"])
                self.w13[i].copy_(torch.cat([sd[p + "mlp.gate_proj.weight"],
                                             sd[p + "mlp.up_proj.weight"]]))
                self.w2[i].copy_(sd[p + "mlp.down_proj.weight"])
                self.attn_norm[i].copy_(sd[p + "input_layernorm.weight"])
                self.mlp_norm[i].copy_(sd[p + "post_attention_layernorm.weight"])
            self.norm.copy_(sd["model.norm.weight"])
            if self.lm_head is not self.embed:
                self.lm_head.copy_(sd["lm_head.weight"])

    def _rms(self, x, weight):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x, pos):
        cos, sin = self.cos_sin[pos].chunk(2, dim=-1)        # [T, D/2] each
        cos, sin = cos[None, None], sin[None, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [1, T] at positions pos [T] -> logits [1, T, vocab]; writes the cache."""
        t = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        mask = self.causal[pos][None, None]                  # [1, 1, T, max_len]
        q_size, kv_size = self.hq * self.d, self.hkv * self.d
        for i in range(self.n_layers):
            qkv = F.linear(self._rms(x, self.attn_norm[i]), self.wqkv[i])
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(1, t, self.hq, self.d).transpose(1, 2), pos)
            k = self._rope(k.view(1, t, self.hkv, self.d).transpose(1, 2), pos)
            v = v.view(1, t, self.hkv, self.d).transpose(1, 2)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            rep = self.hq // self.hkv
            o = F.scaled_dot_product_attention(q, kc.repeat_interleave(rep, dim=1),
                                               vc.repeat_interleave(rep, dim=1), attn_mask=mask)
            x = x + F.linear(o.transpose(1, 2).reshape(1, t, q_size), self.wo[i])
            gate, up = F.linear(self._rms(x, self.mlp_norm[i]), self.w13[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.w2[i])
        return F.linear(self._rms(x, self.norm), self.lm_head)


def decode_one(model: StaticLlama, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One greedy step: token [1, 1] at pos [1] -> the next token [1, 1]."""
    return model(token, pos)[:, -1].argmax(dim=-1, keepdim=True)


def generate(model: StaticLlama, step, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy: prefill the prompt (eager), then n - 1 decode steps with step(); returns the n
    tokens and the seconds the decode steps took (one sync at the end)."""
    dev = model.embed.device
    prompt_t = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        tok = model(prompt_t, torch.arange(len(prompt), device=dev))[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([len(prompt)], device=dev)
        out = [tok]
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            tok = step(model, tok, pos).clone()     # a CUDA graph's output is overwritten next
            pos += 1
            out.append(tok)
        sync(dev)
        secs = time.perf_counter() - t0
    return torch.cat(out, dim=1)[0].tolist(), secs


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_baseline(model_name: str = "llama-3.1-8b", prompt_len: int = 128, output_len: int = 128,
                 repeats: int = 3, compile_step: bool = True, cd_tuning: bool = False,
                 cfg: dict | None = None) -> dict:
    """Build the model (random bf16 weights on CUDA, fp32 on the CPU), compile its decode step,
    warm it up on one prompt, then `repeats` prompts of W1's shape; the median by decode
    tokens/s is reported (and written as W1-<model>-<gpu>-compiled.json)."""
    if cfg is None:
        with open(os.path.join(HERE, "configs", model_name, "config.json")) as f:
            cfg = json.load(f)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = StaticLlama(cfg, prompt_len + output_len, dtype, dev).eval()
    step = decode_one
    t0 = time.perf_counter()
    if compile_step:
        import torch._inductor.config as inductor
        inductor.coordinate_descent_tuning = cd_tuning      # gpt-fast turns it on
        step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    # W1's prompts (ids < 10,000: inside a real vocabulary; a tiny test model's wraps them)
    prompts = [[t % cfg["vocab_size"] for t in p]
               for p in random_prompts(repeats + 1, prompt_len, seed=11)]
    generate(model, step, prompts[0], min(8, output_len))   # compiles, records the graphs
    compile_s = time.perf_counter() - t0
    runs = []
    for p in prompts[1:]:
        _, secs = generate(model, step, p, output_len)
        runs.append({"decode_tokens_per_s": (output_len - 1) / secs, "decode_seconds": secs})
    med = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
    wb = model.weight_bytes()
    res = {**med, "weight_bytes_per_step": wb, "mbu": wb * med["decode_tokens_per_s"] / H200_BW,
           "compiled": compile_step, "dtype": str(dtype).replace("torch.", ""),
           "coordinate_descent_tuning": cd_tuning,
           "compile_and_warmup_s": compile_s, "torch": torch.__version__, "runs": runs}
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (a check, not a peer)")
    ap.add_argument("--cd-tuning", action="store_true",
                    help="inductor's coordinate-descent tuning, as gpt-fast (longer compile)")
    a = ap.parse_args()
    res = run_baseline(a.model, compile_step=not a.eager, cd_tuning=a.cd_tuning)
    write_result("W1", a.model, res, "compiled" if not a.eager else "eager-torch")
    print_table([{"workload": "W1", "impl": "torch.compile" if not a.eager else "torch eager",
                  "decode_tokens_per_s": res["decode_tokens_per_s"], "mbu": res["mbu"],
                  "compile_s": res["compile_and_warmup_s"]}], f"W1 baseline {a.model}")


if __name__ == "__main__":
    main()
