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

    quantized = set()

    def dequantized_engine() -> LLM:
        plain = LLM(llama_dir, **ENGINE)
        quantized.clear()
        for m in plain.engine.runner.model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                with torch.no_grad():
                    m.weight.copy_(dequantize(*quantize_weight_fp8(m.weight), torch.float32))
                quantized.add(m.weight.data_ptr())
        return plain
    # (an engine each: the prefix cache would carry one run's K/V into the other)
    unrounded = [o.outputs[0].token_ids for o in dequantized_engine().generate(prompts, GREEDY)]

    def rounding_linear(x, weight, bias=None):
        if weight.data_ptr() in quantized:
            xq, sx = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
            x = (xq.float() * sx).reshape(x.shape)
        return torch.nn.functional.linear(x, weight, bias)
    plain = dequantized_engine()
    monkeypatch.setattr(linear_module, "F", types.SimpleNamespace(linear=rounding_linear))
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    assert got == want
    assert unrounded != want      # rounding the inputs shows: the test can tell them apart


def test_quantization_setting_is_checked():
    assert EngineConfig(model="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match=r"^quantization='int4' is invalid: must be None or one "
                                         r"of \('fp8',\)"):
        EngineConfig(model="m", quantization="int4")


def test_smollm2_fp8_still_answers(smollm2_dir):
    """The real model with its weights and inputs in e4m3 keeps its greedy answer."""
    llm = LLM(smollm2_dir, quantization="fp8", max_model_len=256)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))
    assert out[0].outputs[0].text == "The capital of France is Paris."
