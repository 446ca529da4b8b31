"""The baselines our benchmarks compare against, at a tiny size on the CPU: the gpt-fast-style
static-cache decoder of perf/w1_compiled_baseline.py computes the model transformers computes,
and perf/w5_vs_transformers.py's continuous-batching run serves every request to its length."""
import pytest
import torch

from pagedbackend import SamplingParams
from pagedbackend.testing import make_hf_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("baseline-llama")
    return str(path), make_hf_checkpoint("llama", path)


def test_static_cache_decoder_follows_transformers(perf_module, tiny_llama):
    """Prefill, then one-token decode steps through the static cache: each step's logits are
    transformers' logits of the whole sequence at that position (rope, GQA, cache writes)."""
    base = perf_module("w1_compiled_baseline")
    _, hf = tiny_llama
    m = base.StaticLlama(hf.config.to_dict(), 48, torch.float32, torch.device("cpu")).eval()
    m.load_hf_state_dict(hf.state_dict())
    seq = [5, 9, 13, 40, 41, 42, 7, 100, 3, 77]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
        got = m(torch.tensor([seq[:6]]), torch.arange(6))[0]
        for i in range(6, len(seq)):      # one token at a time, at its position
            got = torch.cat([got, m(torch.tensor([[seq[i]]]), torch.tensor([i]))[0]])
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)
    toks, secs = base.generate(m, base.decode_one, seq[:5], 6)
    want = hf.generate(torch.tensor([seq[:5]]), max_new_tokens=6, do_sample=False)[0, 5:]
    assert toks == want.tolist() and secs > 0


def test_baseline_reports_tokens_per_s_and_the_bytes_it_reads(perf_module, tiny_llama):
    base = perf_module("w1_compiled_baseline")
    _, hf = tiny_llama
    cfg = hf.config.to_dict()
    res = base.run_baseline(prompt_len=8, output_len=6, repeats=1, compile_step=False, cfg=cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    per_layer = sum(p.numel() for n, p in hf.named_parameters() if ".layers.0." in n)
    want = 4 * (per_layer * cfg["num_hidden_layers"] + h + v * h)   # fp32, not the embedding
    assert res["weight_bytes_per_step"] == want
    assert res["decode_tokens_per_s"] > 0 and len(res["runs"]) == 1 and not res["compiled"]


def test_transformers_continuous_batching_serves_each_request_to_its_length(perf_module,
                                                                            tiny_llama):
    w5 = perf_module("w5_vs_transformers")
    path, _ = tiny_llama
    model = w5.load_transformers(path, "cpu", torch.float32)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 12, 3)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in (5, 9, 4)]
    cb = w5.run_transformers_cb(model, prompts, params, 60, warmup=False,
                                cb_config=dict(block_size=16, num_blocks=16, max_batch_tokens=64))
    assert cb["tokens"] == 18 and cb["finished"] == 3 and not cb["partial"] and not cb["errors"]
    assert cb["output_tokens_per_s"] > 0
    static = w5.run_transformers(model, prompts, params, 2, 30)
    assert static["tokens"] == 18
    # a transformers without continuous batching: a reason, not an exception
    assert "init_continuous_batching" in w5.run_transformers_cb(object(), prompts, params,
                                                                 1)["skipped"]
