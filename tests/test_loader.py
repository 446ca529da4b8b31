"""Weight loading: sharded safetensors, dummy weights, format resolution and errors, the perf
configs, and the real SmolLM2-135M GGUF through our own GGUF reader."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from model_fixtures import (PROMPTS, TINY_CONFIGS, hf_logits, load_ours, make_hf_checkpoint,
                            run_paged)
from pagedbackend.layers.attention import TorchAttentionBackend
from pagedbackend.models import build_model, load_hf_config, load_weights
from pagedbackend.models.gguf import unpermute_rotary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_DIR = os.path.join(REPO, "models", "smollm2-135m-instruct")


def test_sharded_safetensors_with_index(tmp_path):
    hf = make_hf_checkpoint("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    seq = run_paged(load_ours(tmp_path), PROMPTS[:1], decode_steps=1)[0]
    torch.testing.assert_close(torch.stack(seq.logits), hf_logits(hf, seq.tokens),
                               atol=2e-5, rtol=1e-4)


def test_missing_tensor_and_bad_formats(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_checkpoint("qwen2", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.self_attn\.qkv"):
        load_ours(tmp_path)
    with pytest.raises(ValueError, match="load_format='pt' is invalid"):
        load_ours(tmp_path, "pt")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tmp_path / "config.json", empty)
    for fmt in ("auto", "safetensors", "gguf"):
        with pytest.raises(ValueError, match=f"load_format='{fmt}' is invalid"):
            load_ours(empty, fmt)


def test_dummy_weights_from_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        dict(TINY_CONFIGS["qwen3"], architectures=["Qwen3ForCausalLM"])))
    a, b = load_ours(tmp_path, "dummy"), load_ours(tmp_path, "dummy")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name                          # deterministic
        if "norm" in name:
            assert torch.all(pa == 1), name
        else:
            assert 0 < pa.abs().max() <= 1e-3, name
    seq = run_paged(a, PROMPTS[:2], decode_steps=1)[0]
    assert torch.isfinite(torch.stack(seq.logits)).all()


@pytest.mark.parametrize("name,params", [("llama-3.1-8b", 8_030_261_248),
                                         ("qwen2.5-7b", 7_615_616_512),
                                         ("qwen3-0.6b", 596_049_920)])
def test_perf_configs_have_the_public_shapes(name, params):
    with open(os.path.join(REPO, "perf", "configs", name, "config.json")) as f:
        cfg = json.load(f)
    model = build_model(cfg, torch.bfloat16, torch.device("meta"), TorchAttentionBackend())
    assert sum(p.numel() for p in model.parameters()) == params


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(3 * 8, 5).numpy()
    # llama.cpp stores each head's rows as (2, d/2) transposed to (d/2, 2).
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert (unpermute_rotary(permuted, 3) == w).all()


# --- the real SmolLM2-135M-Instruct (slow: prepare ~30 s once, then a few forward passes) ---

@pytest.fixture(scope="module")
def smollm2():
    """(prepared safetensors dir, a dir holding only the shipped GGUF)."""
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_model.py"),
                    "--out", SMOLLM2_DIR], check=True, cwd=REPO)
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        from prepare_model import smollm2_gguf_path
    finally:
        sys.path.pop(0)
    return SMOLLM2_DIR, smollm2_gguf_path()


@pytest.mark.slow
def test_smollm2_gguf_matches_safetensors_and_transformers(smollm2, tmp_path):
    import transformers

    prepared, gguf_path = smollm2
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    os.symlink(gguf_path, gguf_dir / os.path.basename(gguf_path))

    cfg = load_hf_config(str(gguf_dir))            # rebuilt from GGUF metadata
    with open(os.path.join(prepared, "config.json")) as f:
        ref_cfg = json.load(f)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "tie_word_embeddings", "rms_norm_eps", "intermediate_size"):
        assert cfg[key] == ref_cfg[key], key

    ours_gguf = build_model(cfg, torch.float32, torch.device("cpu"), TorchAttentionBackend())
    load_weights(ours_gguf, str(gguf_dir), "auto")
    ours_st = load_ours(prepared)
    for (name, a), b in zip(ours_gguf.named_parameters(), ours_st.parameters()):
        assert torch.equal(a, b), name      # same dequantized values, same Q/K row order

    tok = transformers.AutoTokenizer.from_pretrained(prepared)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    seq = run_paged(ours_gguf, [prompt[:9], prompt], decode_steps=6)[1]
    answer = tok.decode(seq.tokens[len(prompt):])
    assert answer.startswith("The capital of France is Paris"), answer

    hf = transformers.AutoModelForCausalLM.from_pretrained(prepared, dtype=torch.float32)
    torch.testing.assert_close(torch.stack(seq.logits), hf_logits(hf, seq.tokens),
                               atol=5e-4, rtol=1e-3)


def test_auto_dtype_on_gpus_is_the_checkpoints_16_bit_type():
    """vLLM's auto: an fp16 checkpoint (AWQ's, whose kernels are written for fp16) runs in fp16
    on a GPU, a bf16 or fp32 one in bf16; an explicit dtype wins; CPUs keep their own rule."""
    from pagedbackend.engine.model_files import resolve_dtype
    assert resolve_dtype("auto", "cuda", "float16") == "float16"
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "cuda", "float32") == "bfloat16"
    assert resolve_dtype("auto", "cuda", None) == "bfloat16"
    assert resolve_dtype("bfloat16", "cuda", "float16") == "bfloat16"
    assert resolve_dtype("auto", "cpu", "float16") in ("bfloat16", "float32")
