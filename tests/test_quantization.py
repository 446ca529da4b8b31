"""quantization="fp8": weights in float8 e4m3 with per-channel scales, inputs quantized per token,
the FP8 GEMM's result scaled by both (layers/quantization.py). The triton kernels' side (the
skinny matmul on fp8 weights, the per-row quantization kernel) is in test_kernels.py."""
import types

import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.config import EngineConfig
from pagedbackend.layers import linear as linear_module
from pagedbackend.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedbackend.layers.quantization import (FP8, MIN_SCALE, dequantize, fp8_linear,
                                              quantize_rows_fp8, quantize_weight_fp8)
from pagedbackend.testing import make_hf_checkpoint

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32,
              max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in
           ([5, 9, 13], list(range(40, 70)), [11, 12, 13, 14, 15, 16], list(range(100, 121)))]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fp8-llama")
    make_hf_checkpoint("llama", path)
    return str(path)


def test_weight_quantization_is_per_channel_and_within_e4m3_rounding():
    torch.manual_seed(0)
    w = torch.randn(48, 200) * torch.logspace(-4, 2, 48)[:, None]   # rows 6 decades apart
    w[7] = 0
    wq, scale = quantize_weight_fp8(w)
    assert wq.dtype == FP8 and scale.shape == (48,) and scale.dtype == torch.float32
    # each row's largest magnitude lands on e4m3's largest value, whatever the row's range
    assert torch.equal(wq.float().abs().amax(dim=1)[torch.arange(48) != 7], torch.full((47,), 448.))
    assert scale[7].item() == pytest.approx(MIN_SCALE) and (wq[7].float() == 0).all()
    back = dequantize(wq, scale, torch.float32)
    # 3 mantissa bits: within half a step (1/16 relative) of each value, or of the smallest
    # subnormal step (2^-9 of the scale) near zero
    bound = torch.maximum(w.abs() / 16, scale[:, None] * 2.0 ** -10) * 1.0001
    assert ((back - w).abs() <= bound).all()
    assert 0 < (back - w).norm() / w.norm() < 0.05


def test_fp8_linear_is_its_formula():
    """y = (x quantized per row) @ (w quantized per channel).T, both scales applied in fp32,
    plus the bias; any leading shape; near the full-precision matmul."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64) * 3
    w = torch.randn(40, 64) / 8
    b = torch.randn(40)
    wq, sw = quantize_weight_fp8(w)
    y = fp8_linear(x, wq, sw, b)
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    xq, sx = quantize_rows_fp8(x.reshape(10, 64))
    exact = (xq.float() * sx) @ dequantize(wq, sw, torch.float32).T + b
    assert torch.allclose(y.reshape(10, 40), exact, rtol=1e-5, atol=1e-5)
    full = torch.nn.functional.linear(x, w, b)
    assert 0 < ((y - full).norm() / full.norm()).item() < 0.06
    # bf16 activations give bf16 out
    assert fp8_linear(x.bfloat16(), wq, sw).dtype == torch.bfloat16


def tokens_with_inputs_rounded(plain: LLM, prompts, monkeypatch) -> list[list[int]]:
    """Greedy tokens of an unquantized engine whose q|k|v, o, gate|up and down layers round
    their input per token to e4m3 (and back) before the matmul: on weights that are already
    dequantized fp8 values, exactly what the fp8 engine computes."""
    layers = {m.weight.data_ptr() for m in plain.engine.runner.model.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}

    def rounding_linear(x, weight, bias=None):
        if weight.data_ptr() in layers:
            xq, sx = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
            x = (xq.float() * sx).reshape(x.shape)
        return torch.nn.functional.linear(x, weight, bias)
    with monkeypatch.context() as m:
        m.setattr(linear_module, "F", types.SimpleNamespace(linear=rounding_linear))
        return [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]


def test_engine_fp8_equals_the_model_computing_the_same_formula(llama_dir, monkeypatch):
    """quantization="fp8" reaches every q|k|v, o, gate|up and down layer (the embeddings and
    the LM head stay as loaded), and the engine generates exactly what the unquantized engine
    does once its weights are the dequantized fp8 ones and each of those layers rounds its
    input per token to e4m3: through prefill chunks, prefix-cache hits and decode."""
    fp8 = LLM(llama_dir, quantization="fp8", **ENGINE)
    model = fp8.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(layers) == 4 * model.args.num_hidden_layers
    for m in layers:
        assert m.weight.dtype == FP8 and m.weight_scale.shape == (m.weight.shape[0],)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    prompts = PROMPTS + [{"prompt_token_ids": list(range(40, 70)) + [3, 4]}]   # a prefix hit
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, GREEDY)]
    assert fp8.engine.stats().prefix_cache_hits > 0


    def dequantized_engine() -> LLM:
        plain = LLM(llama_dir, **ENGINE)
        for m in plain.engine.runner.model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                with torch.no_grad():
                    m.weight.copy_(dequantize(*quantize_weight_fp8(m.weight), torch.float32))
        return plain
    # (an engine each: the prefix cache would carry one run's K/V into the other)
    unrounded = [o.outputs[0].token_ids for o in dequantized_engine().generate(prompts, GREEDY)]
    want = tokens_with_inputs_rounded(dequantized_engine(), prompts, monkeypatch)
    assert got == want
    assert unrounded != want      # rounding the inputs shows: the test can tell them apart


def test_quantization_setting_is_checked():
    assert EngineConfig(model="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match=r"^quantization='int4' is invalid: must be None or one "
                                         r"of \('fp8', 'int8', 'awq', 'gptq'\)"):
        EngineConfig(model="m", quantization="int4")


def test_smollm2_fp8_still_answers(smollm2_dir):
    """The real model with its weights and inputs in e4m3 keeps its greedy answer."""
    llm = LLM(smollm2_dir, quantization="fp8", max_model_len=256)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))
    assert out[0].outputs[0].text == "The capital of France is Paris."


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: str, fp8_dir, dequantized_dir, method: str) -> dict:
    """The tiny checkpoint at src saved as an FP8 one (as llm-compressor / AutoFP8 write them:
    `*.weight` in e4m3, `*.weight_scale`, an `*.input_scale` this engine ignores) and, beside
    it, the 16-bit checkpoint of the weights it stands for. Per-tensor scales for quant_method
    "fp8", per-channel ([N, 1]) for compressed-tensors. Returns {name: (e4m3, scale)}."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    tensors = {}
    for f in Path(src).glob("*.safetensors"):
        tensors.update(load_file(f))
    fp8, plain, quantized = {}, {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEAR_NAMES:
            if method == "fp8":
                scale = (t.abs().max() / 448).reshape(())
                wq = (t / scale).clamp(-448, 448).to(FP8)
            else:
                wq, scale = quantize_weight_fp8(t)
                scale = scale.view(-1, 1)
            base = name[:-len(".weight")]
            fp8[name], fp8[base + ".weight_scale"] = wq, scale
            fp8[base + ".input_scale"] = torch.tensor(1.0)
            plain[name] = wq.float() * scale
            quantized[name] = (wq, scale)
        else:
            fp8[name] = plain[name] = t
    config = json.loads((Path(src) / "config.json").read_text())
    for out, weights, qc in (
            (Path(fp8_dir), fp8, {"quant_method": "fp8", "activation_scheme": "dynamic"}
             if method == "fp8" else {
                 "quant_method": "compressed-tensors", "format": "float-quantized",
                 "config_groups": {"group_0": {
                     "targets": ["Linear"],
                     "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                     "input_activations": {"num_bits": 8, "type": "float",
                                           "strategy": "token", "dynamic": True}}},
                 "ignore": ["lm_head"]}),
            (Path(dequantized_dir), plain, None)):
        for extra in Path(src).iterdir():
            if not extra.name.endswith(".safetensors") and extra.name != "config.json":
                shutil.copy(extra, out / extra.name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(
            {**config, **({"quantization_config": qc} if qc else {})}))
    return quantized


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_fp8_checkpoint_is_read_as_it_is(llama_dir, tmp_path, monkeypatch, method):
    """An FP8 checkpoint's e4m3 weights are the engine's, byte for byte, and its scales (per
    tensor: each of q, k, v fills its rows of q|k|v) the engine's per-channel scales, without
    quantization="fp8" being asked for; the engine generates exactly what the 16-bit model of
    the same weights does when each such layer rounds its input per token to e4m3."""
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "plain"
    fp8_dir.mkdir()
    plain_dir.mkdir()
    quantized = write_fp8_checkpoint(llama_dir, fp8_dir, plain_dir, method)
    llm = LLM(str(fp8_dir), **ENGINE)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    q, k, v = (quantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(attn.qkv_proj.weight.view(torch.uint8),
                       torch.cat([q[0], k[0], v[0]]).view(torch.uint8))
    want_scale = torch.cat([s.reshape(-1).expand(w.shape[0]) for w, s in (q, k, v)])
    assert torch.equal(attn.qkv_proj.weight_scale, want_scale)
    if method == "fp8":     # per tensor: q's rows share one scale, k's another
        assert attn.qkv_proj.weight_scale.unique().numel() == 3
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == tokens_with_inputs_rounded(LLM(str(plain_dir), **ENGINE), PROMPTS, monkeypatch)


def test_checkpoints_it_cannot_read_are_refused(llama_dir, tmp_path):
    """Quantized checkpoints of kinds it does not read (AWQ and GPTQ it does:
    test_quant_formats.py) are refused when the engine starts, naming what they are; e4m3 tensors without a quantization_config saying so are refused by name, not
    loaded without their scales."""
    import json
    import shutil
    from pathlib import Path
    for qc, what in (({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
                     ({"quant_method": "compressed-tensors", "config_groups": {"g": {
                         "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
                      "'int', 4 bits, strategy 'group'")):
        d = tmp_path / ("q-" + qc["quant_method"])
        shutil.copytree(llama_dir, d)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(ValueError, match=rf"^model=.* is invalid: its checkpoint is quantized "
                                             rf"with .*{what}"):
            LLM(str(d), **ENGINE)
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "plain"
    fp8_dir.mkdir()
    plain_dir.mkdir()
    write_fp8_checkpoint(llama_dir, fp8_dir, plain_dir, "fp8")
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"checkpoint tensor model\.layers\.\d+\.\w+\.\w+_proj"
                                         r"\.weight is float8 but its parameter is float32"):
        LLM(str(fp8_dir), **ENGINE)
    assert Path(plain_dir, "model.safetensors").exists()


def test_triton_parameter_quantization_serves_fp8(smollm2_dir):
    """The engine model's `quantization` parameter reaches the engine inside tritonserver: the
    ensemble's answer is the offline fp8 engine's, word for word, and still names Paris."""
    import json

    from transformers import AutoTokenizer

    from triton_fixtures import TEST_ENGINE_SETTINGS, http_post, running_server
    prompt = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=0)
    want, unquantized = (LLM(smollm2_dir, dtype="float32", max_model_len=1024, **kw).generate(
        prompt, params)[0].outputs[0] for kw in ({"quantization": "fp8"}, {}))
    with running_server(smollm2_dir, {**TEST_ENGINE_SETTINGS, "quantization": "fp8"}) as server:
        status, body = http_post(server, "/v2/models/ensemble/generate", {
            "text_input": prompt, "max_tokens": 20,
            "sampling_parameters": json.dumps({"temperature": 0, "logprobs": 0})})
    assert status == 200, body
    got = json.loads(body)
    assert got["text_output"] == want.text and "Paris" in want.text
    # the same text as the unquantized model; the logprobs tell them apart
    served = [e["logprob"] for e in json.loads(got["logprobs"])]
    fp8 = [lp[t] for t, lp in zip(want.token_ids, want.logprobs)]
    full = [lp[t] for t, lp in zip(unquantized.token_ids, unquantized.logprobs)]
    assert served == pytest.approx(fp8, abs=1e-4) and served != pytest.approx(full, abs=1e-3)
