"""AWQ / GPTQ checkpoints (written by scripts/quantize.py) through the engine: greedy tokens equal
transformers running the reference-dequantized float32 weights, with chunked prefill, prefix-cache
hits and preemption in the same run; two tensor-parallel ranks (gloo) equal one, act order's
g_idx sharded over row-parallel layers included."""
import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.testing import make_hf_checkpoint
from quant_fixtures import dequantized_hf_model, hf_greedy, quantize_dir

# a small pool, blocks and budget: chunked prefill, prefix hits and preemption in one run
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=32,
              max_num_seqs=6, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHARED = [(7 * i + 3) % 160 for i in range(9)]
PROMPTS = [p if i % 2 else SHARED + p for i, p in enumerate(
    [[5], list(range(40, 75)), [11, 12, 13], list(range(100, 121)), [90] * 17, [1, 2]])]
CASES = {"awq": dict(method="awq"), "gptq-act": dict(method="gptq", desc_act=True, sym=False),
         "gptq-sym": dict(method="gptq", group_size=16)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}

    def get(arch: str) -> str:
        if arch not in out:
            path = tmp_path_factory.mktemp(f"src-{arch}")
            extra = {"num_key_value_heads": 2} if arch == "mistral" else {}
            make_hf_checkpoint(arch, path, **extra)
            out[arch] = str(path)
        return out[arch]
    return get


def engine_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch,case", [("llama", "awq"), ("llama", "gptq-act"),
                                       ("qwen2", "gptq-act"), ("qwen2", "awq"),
                                       ("qwen3", "awq"), ("qwen3", "gptq-sym"),
                                       ("mistral", "gptq-act"), ("mistral", "awq")])
def test_engine_equals_transformers_on_dequantized_weights(sources, tmp_path, arch, case):
    src = sources(arch)
    qdir = quantize_dir(src, tmp_path / case, **{"group_size": 32, **CASES[case]})
    llm = LLM(qdir, **ENGINE)
    got = engine_tokens(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    want = hf_greedy(dequantized_hf_model(src, qdir), PROMPTS, GREEDY.max_tokens)
    assert got == want
    assert got != engine_tokens(LLM(src, **ENGINE))     # the 4-bit weights show


@pytest.mark.parametrize("arch,case", [("llama", "gptq-act"), ("qwen3", "awq")])
def test_tp2_equals_tp1(sources, tmp_path, arch, case):
    """Column-parallel shards split the packed output words, row-parallel ones the packed input
    rows and their groups; an act-order row-parallel shard keeps every group's scales and its
    slice of g_idx."""
    qdir = quantize_dir(sources(arch), tmp_path / case, **{"group_size": 16, **CASES[case]})
    want = engine_tokens(LLM(qdir, **ENGINE))
    llm = LLM(qdir, tensor_parallel_size=2, **ENGINE)
    try:
        assert engine_tokens(llm) == want
        if case == "gptq-act":      # the row-parallel shards' groups are uneven: g_idx kept
            o_proj = llm.engine.runner.runner.model.model.layers[0].self_attn.o_proj.quant
            assert o_proj.perm is not None and o_proj.g_idx is not None
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def smollm2_gptq(smollm2_dir, tmp_path_factory) -> str:
    return quantize_dir(smollm2_dir, tmp_path_factory.mktemp("smol") / "gptq", "gptq",
                        group_size=64, desc_act=True)


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_gptq_4bit_still_answers(smollm2_gptq):
    """The real model through scripts/quantize.py (4 bits, round-to-nearest) keeps its greedy
    answer. Groups of 128 do not divide its hidden size (576); with groups of 64, GPTQ act order
    keeps the sentence word for word (AWQ adds ", France", GPTQ in order runs on: the report of
    issue 23 lists the settings tried)."""
    llm = LLM(smollm2_gptq, max_model_len=256)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quant.bits == 4
    out = llm.chat(CAPITAL, GREEDY.clone(max_tokens=20, ignore_eos=False))
    assert out[0].outputs[0].text == "The capital of France is Paris."


def test_triton_serves_a_gptq_directory(smollm2_gptq):
    """A GPTQ model directory behind tritonserver (quantization empty, as shipped: found from
    its config.json) answers as the offline engine does, word for word."""
    import json

    from transformers import AutoTokenizer

    from triton_fixtures import TEST_ENGINE_SETTINGS, http_post, running_server
    prompt = AutoTokenizer.from_pretrained(smollm2_gptq).apply_chat_template(
        CAPITAL, tokenize=False, add_generation_prompt=True)
    want = LLM(smollm2_gptq, dtype="float32", max_model_len=1024).generate(
        prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    with running_server(smollm2_gptq, {**TEST_ENGINE_SETTINGS, "quantization": ""}) as server:
        status, body = http_post(server, "/v2/models/ensemble/generate", {
            "text_input": prompt, "max_tokens": 20,
            "sampling_parameters": json.dumps({"temperature": 0})})
    assert status == 200, body
    assert json.loads(body)["text_output"] == want and "Paris" in want
