"""The Llama-family model against transformers on tiny random checkpoints of each architecture,
through a paged KV cache (block_size 4, shuffled blocks, mixed prefill/chunk/decode steps), and
its tensor-parallel sharding."""
from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from model_fixtures import (ARCHS, PROMPTS, TINY_CONFIGS, hf_logits, load_ours,
                            make_hf_checkpoint, run_paged, tp_worker)
from pagedbackend.layers.attention import TorchAttentionBackend
from pagedbackend.layers.rotary import rope_inv_freq
from pagedbackend.models import build_model, load_weights

ATOL = 2e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (transformers model, its safetensors directory)."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = make_hf_checkpoint(arch, path), path
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_forward_matches_transformers(checkpoints, arch):
    hf, path = checkpoints[arch]
    model = load_ours(path)
    seqs = run_paged(model, PROMPTS, decode_steps=3)
    for seq in seqs:
        ours = torch.stack(seq.logits)
        assert ours.dtype == torch.float32 and ours.shape == (len(seq.tokens), 160)
        torch.testing.assert_close(ours, hf_logits(hf, seq.tokens), atol=ATOL, rtol=1e-4)


def test_tied_and_untied_heads(checkpoints):
    tied, untied = load_ours(checkpoints["qwen3"][1]), load_ours(checkpoints["llama"][1])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert tied.head_dim == 24 and tied.num_kv_heads == 2   # head_dim from config, not 64 / 4


def test_llama3_rope_scaling_changes_only_long_wavelengths():
    s = TINY_CONFIGS["llama"]["rope_scaling"]
    plain, scaled = rope_inv_freq(16, 5e5, None), rope_inv_freq(16, 5e5, s)
    assert scaled[0] == plain[0]                                   # short wavelength kept
    torch.testing.assert_close(scaled[-1], plain[-1] / s["factor"])  # long one divided
    with pytest.raises(ValueError, match="rope_type"):
        rope_inv_freq(16, 1e4, {"rope_type": "yarn", "factor": 4.0})


def test_tensor_parallel_two_ranks_match_one(checkpoints, tmp_path):
    """Two gloo ranks each load only their shard; their logits equal the single-rank ones."""
    for arch in ("llama", "qwen2"):       # untied + GQA; tied + qkv bias
        _, path = checkpoints[arch]
        out = tmp_path / arch
        out.mkdir()
        mp.spawn(tp_worker, args=(2, str(path), str(out / "init"), str(out)), nprocs=2)
        single = [torch.stack(s.logits) for s in run_paged(load_ours(path), PROMPTS, 2)]
        for rank in range(2):
            for ours, ref in zip(torch.load(out / f"{rank}.pt"), single):
                torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


def test_shards_hold_only_their_slice(checkpoints):
    _, path = checkpoints["llama"]
    full = load_ours(path)
    r1 = build_model(json.loads((path / "config.json").read_text()), torch.float32,
                     torch.device("cpu"), TorchAttentionBackend(), tp_rank=1, tp_size=2)
    load_weights(r1, str(path), "safetensors")
    attn_full, attn_r1 = full.model.layers[0].self_attn, r1.model.layers[0].self_attn
    q, kv = 4 * 16, 2 * 16
    w = attn_full.qkv_proj.weight
    expect = torch.cat([w[q // 2:q], w[q + kv // 2:q + kv], w[q + kv + kv // 2:]])
    assert torch.equal(attn_r1.qkv_proj.weight, expect)
    assert torch.equal(attn_r1.o_proj.weight, attn_full.o_proj.weight[:, q // 2:])
    assert torch.equal(r1.lm_head.weight, full.lm_head.weight[80:])


SMOLLM2_SHAPE = dict(TINY_CONFIGS["llama"], architectures=["LlamaForCausalLM"], hidden_size=72,
                     num_attention_heads=9, num_key_value_heads=3, vocab_size=48,
                     intermediate_size=96)


def test_tp_size_must_divide_heads():
    with pytest.raises(ValueError) as err:
        build_model(SMOLLM2_SHAPE, torch.float32, torch.device("cpu"), TorchAttentionBackend(),
                    tp_rank=0, tp_size=2)
    msg = str(err.value)
    assert "tensor_parallel_size=2" in msg and "num_attention_heads=9" in msg
    assert "num_key_value_heads=3" in msg
    model = build_model(SMOLLM2_SHAPE, torch.float32, torch.device("cpu"),
                        TorchAttentionBackend(), tp_rank=2, tp_size=3)
    assert model.num_kv_heads == 1 and model.model.layers[0].self_attn.num_heads == 3
    with pytest.raises(ValueError, match="vocab_size=50"):
        build_model(dict(TINY_CONFIGS["qwen2"], vocab_size=50, architectures=["Qwen2ForCausalLM"]),
                    torch.float32, torch.device("cpu"), None, tp_size=4)


def test_unknown_architecture_is_refused():
    with pytest.raises(ValueError, match="architectures"):
        build_model(dict(TINY_CONFIGS["llama"], architectures=["GPT2LMHeadModel"]),
                    torch.float32, torch.device("cpu"), None)
