"""AWQ / GPTQ formats (layers/quant_formats.py, layers/quant_grouped.py): packing bit-exact with
AutoAWQ's and AutoGPTQ's, the loaded layers equal to the reference dequantization to the bit,
INT8 weights, and bad checkpoints refused by name before anything runs."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedbackend import LLM
from pagedbackend.config import EngineConfig
from pagedbackend.layers.quant_formats import (AWQ_ORDER, GroupQuantSpec, dequantize_awq,
                                               dequantize_gptq, pack_int32, quantize_rtn,
                                               unpack_int32)
from pagedbackend.layers.quantization import dequantize, int8_linear, quantize_weight_int8
from pagedbackend.testing import make_hf_checkpoint
from quant_fixtures import quantize_dir, reference_weights

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32,
              max_model_len=64)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("q-llama")
    make_hf_checkpoint("llama", path)
    return str(path)


def test_pack_unpack_round_trip_and_field_positions():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (12, 64), generator=g)
        assert torch.equal(unpack_int32(pack_int32(codes, bits), bits), codes)
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, 7), generator=g, dtype=torch.int64)
        words = words.to(torch.int32)
        assert torch.equal(pack_int32(unpack_int32(words, bits), bits), words)
    codes = torch.randint(0, 16, (3, 32), generator=g)
    assert torch.equal(unpack_int32(pack_int32(codes, 4, AWQ_ORDER), 4, AWQ_ORDER), codes)
    # AutoAWQ: column 8c + AWQ_ORDER[i] in bits 4i..4i+3 (column 1 -> bits 16..19);
    # GPTQ: in order (column / row 1 -> bits 4..7); the top field sets the sign bit
    one = torch.zeros(1, 8, dtype=torch.int64)
    one[0, 1] = 0xA
    assert pack_int32(one, 4, AWQ_ORDER).item() == 0xA << 16
    assert pack_int32(one, 4).item() == 0xA << 4
    top = torch.zeros(1, 8, dtype=torch.int64)
    top[0, 7] = 0xF
    assert pack_int32(top, 4).item() == -(1 << 28)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        pack_int32(torch.full((1, 8), 16), 4)


@pytest.mark.parametrize("spec", [GroupQuantSpec("awq", 4, 32, sym=False),
                                  GroupQuantSpec("gptq", 4, 32, desc_act=True, sym=False),
                                  GroupQuantSpec("gptq", 8, -1, sym=True)])
def test_rtn_within_half_a_step_and_layouts(spec):
    torch.manual_seed(1)
    w = torch.randn(48, 64) * torch.logspace(-2, 0, 48)[:, None]
    order = torch.randperm(64) if spec.desc_act else None
    t = quantize_rtn(w, spec, order)
    per = 32 // spec.bits
    if spec.method == "awq":
        assert t["qweight"].shape == (64, 48 // per) and t["qzeros"].shape == (2, 48 // per)
        back = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], spec.group_size)
    else:
        groups = spec.groups(64)
        assert t["qweight"].shape == (64 // per, 48) and t["qzeros"].shape == (groups, 48 // per)
        assert t["g_idx"].shape == (64,) and t["g_idx"].dtype == torch.int32
        if spec.desc_act:   # groups follow the order: its first 32 channels make group 0
            assert (t["g_idx"][order[:32]] == 0).all() and (t["g_idx"][order[32:]] == 1).all()
        if spec.sym:        # the stored zero is 2**(bits-1) - 1 in every field
            assert (unpack_int32(t["qzeros"], spec.bits) == (1 << spec.bits - 1) - 1).all()
        back = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], spec.bits)
    assert t["scales"].dtype == torch.float16 and back.shape == w.shape
    g_idx = t.get("g_idx", torch.arange(64) // 32).long()
    step = t["scales"].float()[g_idx].t()                         # [N, K]
    # the nearest level; sym (GPTQ's grid: scale 2 max|w| / (2**bits - 1), zero 2**(bits-1))
    # has one level fewer above zero, so +max|w| clamps to half a step further
    assert ((back - w).abs() <= step * (1.0 if spec.sym else 0.5) + 1e-6).all()
    assert (back - w).norm() / w.norm() < 2.5 * 2.0 ** -spec.bits


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory) -> str:
    """Layers wide enough for groups of 128 (inputs 128 and 256)."""
    path = tmp_path_factory.mktemp("q-wide")
    make_hf_checkpoint("llama", path, hidden_size=128, intermediate_size=256)
    return str(path)


@pytest.mark.parametrize("method,kw", [("awq", {}), ("gptq", dict(desc_act=True, sym=False)),
                                       ("gptq", dict(bits=8, group_size=16)),
                                       ("awq", dict(group_size=128)),
                                       ("gptq", dict(group_size=64, desc_act=True))])
def test_tool_checkpoint_loads_bit_exact(llama_dir, wide_llama_dir, tmp_path, method, kw):
    """Every layer the engine loads from scripts/quantize.py's checkpoint dequantizes to the
    reference dequantization of the checkpoint's tensors, to the last bit (q|k|v and gate|up
    packed, act order's channel permutation applied)."""
    src = wide_llama_dir if kw.get("group_size", 32) >= 64 else llama_dir
    qdir = quantize_dir(src, tmp_path / method, method, **kw)
    config = json.loads(Path(qdir, "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == method and "round" not in json.dumps(config)
    ref = reference_weights(qdir)
    model = LLM(qdir, **ENGINE).engine.runner.model
    for i, layer in enumerate(model.model.layers):
        for mod, parts in ((layer.self_attn.qkv_proj, "self_attn.q_proj self_attn.k_proj "
                            "self_attn.v_proj"), (layer.self_attn.o_proj, "self_attn.o_proj"),
                           (layer.mlp.gate_up_proj, "mlp.gate_proj mlp.up_proj"),
                           (layer.mlp.down_proj, "mlp.down_proj")):
            want = torch.cat([ref[f"model.layers.{i}.{p}.weight"] for p in parts.split()])
            q = mod.quant
            assert mod.weight is None and q.bits == kw.get("bits", 4)
            if q.perm is not None:
                want = want[:, q.perm]
            assert torch.equal(q.dequantize(torch.float32), want)
    if kw.get("desc_act"):
        assert model.model.layers[0].self_attn.qkv_proj.quant.perm is not None


def test_int8_weights(llama_dir):
    torch.manual_seed(2)
    w = torch.randn(40, 64) * torch.logspace(-3, 1, 40)[:, None]
    wq, s = quantize_weight_int8(w)
    assert wq.dtype == torch.int8 and (wq.abs().amax(dim=1) == 127).all()
    assert ((dequantize(wq, s, torch.float32) - w).abs() <= s[:, None] * 0.5001).all()
    x = torch.randn(3, 64)
    torch.testing.assert_close(int8_linear(x, wq, s), x @ dequantize(wq, s, torch.float32).T)
    llm = LLM(llama_dir, quantization="int8", **ENGINE)
    proj = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert proj.weight.dtype == torch.int8 and proj.weight_scale.shape == (64,)


def _with_config(src, dst, **qc_changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads(Path(dst, "config.json").read_text())
    cfg["quantization_config"].update(qc_changes)
    Path(dst, "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _edit_tensors(src, dst, edit) -> str:
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(str(Path(dst, "model.safetensors")))
    edit(t)
    save_file(t, str(Path(dst, "model.safetensors")))
    return str(dst)


def test_bad_checkpoints_are_refused_by_name(llama_dir, tmp_path):
    awq = quantize_dir(llama_dir, tmp_path / "awq", "awq")
    gptq = quantize_dir(llama_dir, tmp_path / "gptq", "gptq", desc_act=True)
    cases = [
        (_with_config(awq, tmp_path / "m", quant_method="bitsandbytes"), {},
         r"quantized with 'bitsandbytes'"),
        (_with_config(awq, tmp_path / "b", bits=3), {},
         r"quantization_config\.bits=3 is invalid: must be one of \(4,\) for awq"),
        (_with_config(gptq, tmp_path / "g", group_size=48), {},
         r"group_size=48 is invalid: must divide the input size of every layer "
         r"\(model\.layers\.0\.self_attn\.qkv_proj has 64\)"),
        (_with_config(awq, tmp_path / "v", version="gemv"), {}, r"version='gemv' is invalid"),
        (_with_config(gptq, tmp_path / "h", lm_head=True), {}, r"lm_head=True is invalid"),
        (_edit_tensors(awq, tmp_path / "z", lambda t: t.pop(
            "model.layers.1.mlp.down_proj.qzeros")), {},
         r"lacks weights for: model\.layers\.1\.mlp\.down_proj\.qzeros"),
        (_edit_tensors(gptq, tmp_path / "s", lambda t: t.update({
            "model.layers.0.self_attn.k_proj.scales":
                t["model.layers.0.self_attn.k_proj.scales"][:, :8].contiguous()})), {},
         r"checkpoint tensor model\.layers\.0\.self_attn\.k_proj\.scales has shape \(2, 8\): "
         r"must be \(2, 32\)"),
        (_edit_tensors(gptq, tmp_path / "i", lambda t: t.update({
            "model.layers.0.mlp.up_proj.g_idx":
                t["model.layers.0.mlp.up_proj.g_idx"].roll(1)})), {},
         r"g_idx of model\.layers\.0\.mlp\.gate_up_proj's parts differ"),
        (awq, {"quantization": "gptq"},
         r"quantization='gptq' is invalid: must be None or 'awq', as the checkpoint"),
        (llama_dir, {"quantization": "awq"},
         r"quantization='awq' is invalid: the checkpoint has no quantization_config"),
    ]
    for path, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(path, **ENGINE, **extra)
    assert EngineConfig(model="m", quantization="gptq").quantization == "gptq"
    with pytest.raises(ValueError, match=r"quantization='int4' is invalid: must be None or one "
                                         r"of \('fp8', 'int8', 'awq', 'gptq'\)"):
        EngineConfig(model="m", quantization="int4")
