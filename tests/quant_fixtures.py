"""Shared by the AWQ / GPTQ tests: tiny checkpoints written by scripts/quantize.py, and the
reference dequantization of their tensors."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import quantize as quantize_tool  # noqa: E402

from pagedbackend.layers.quant_formats import dequantize_awq, dequantize_gptq  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_dir(src, out, method: str, bits: int = 4, group_size: int = 32,
                 desc_act: bool = False, sym: bool = True) -> str:
    args = ["--method", method, "--bits", str(bits), "--group-size", str(group_size)]
    if method == "gptq":
        args += ["--desc-act"] * desc_act + ["--sym" if sym else "--no-sym"]
    quantize_tool.main(args + [str(src), str(out)])
    return str(out)


def reference_weights(qdir) -> dict[str, torch.Tensor]:
    """{HF linear weight name: W [N, K] float32} dequantized from the checkpoint's tensors by
    quant_formats' reference functions."""
    from safetensors.torch import load_file
    t = load_file(os.path.join(qdir, "model.safetensors"))
    qc = json.loads(Path(qdir, "config.json").read_text())["quantization_config"]
    out = {}
    for name in t:
        if not name.endswith(".qweight"):
            continue
        base = name[:-len(".qweight")]
        if qc["quant_method"] == "awq":
            w = dequantize_awq(t[name], t[base + ".qzeros"], t[base + ".scales"],
                               qc["group_size"])
        else:
            w = dequantize_gptq(t[name], t[base + ".qzeros"], t[base + ".scales"],
                                t[base + ".g_idx"], qc["bits"])
        out[base + ".weight"] = w
    return out


def dequantized_hf_model(src, qdir):
    """The transformers model of `src` with every quantized layer's weight replaced by the
    reference dequantization of `qdir`'s tensors (float32)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in reference_weights(qdir).items():
            params[name].copy_(w)
    return model.eval()


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_tokens):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            outs.append(ids[0, len(p):].tolist())
    return outs
