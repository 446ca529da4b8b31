"""Write an AWQ or GPTQ checkpoint of a 16/32-bit Llama-family model directory.

Round-to-nearest, with no calibration data: each weight goes to the nearest level of its group
(AWQ's activation-aware scaling search and GPTQ's error-compensating updates are NOT run). The
tensors and config.json are those AutoAWQ (GEMM) and AutoGPTQ / GPTQModel (v1) write, so vLLM,
transformers and this engine read the result like theirs; its quality is RTN's. --desc-act writes
GPTQ's act-order layout (a non-monotonic g_idx); without activations to rank the input channels,
they are ordered by the column norms of the layers that share the input.

    .venv/bin/python scripts/quantize.py --method awq --bits 4 --group-size 128 IN OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedbackend.layers.quant_formats import GroupQuantSpec, quantize_rtn  # noqa: E402

# the layers quantized (as AutoAWQ / GPTQ do: the decoder's linear layers; embeddings, norms
# and the LM head stay), and the siblings sharing an input (one act order for each set)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
            ("down_proj",))


def read_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise SystemExit(f"{model_dir}: no *.safetensors file (quantize needs safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for n in names:
        tensors.update(load_file(os.path.join(model_dir, n)))
    return tensors


def act_order(weights: list[torch.Tensor]) -> torch.Tensor:
    """Input channels by falling column norm over every layer sharing the input (a stand-in
    for GPTQ's Hessian diagonal, which needs activations)."""
    norms = torch.stack([w.float().norm(dim=0) for w in weights]).sum(dim=0)
    return torch.argsort(norms, descending=True, stable=True)


def quantize_tensors(tensors: dict[str, torch.Tensor], spec: GroupQuantSpec
                     ) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    layers = sorted({n.rsplit(".", 2)[0] for n in tensors
                     if n.endswith(".weight") and ".layers." in n
                     and n.rsplit(".", 2)[1] in sum(SIBLINGS, ())})
    for layer in layers:            # e.g. model.layers.3.self_attn
        for sib in SIBLINGS:
            names = [f"{layer}.{s}.weight" for s in sib if f"{layer}.{s}.weight" in tensors]
            if not names:
                continue
            order = act_order([tensors[n] for n in names]) if spec.desc_act else None
            for name in names:
                base = name[:-len(".weight")]
                del out[name]
                for suffix, t in quantize_rtn(tensors[name], spec, order).items():
                    out[f"{base}.{suffix}"] = t
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Round-to-nearest "
                                 "(no calibration): see the module's docstring.")
    ap.add_argument("--method", choices=("awq", "gptq"), required=True)
    ap.add_argument("--bits", type=int, default=4, help="4 (awq, gptq) or 8 (gptq)")
    ap.add_argument("--group-size", type=int, default=128, help="input channels per scale; "
                    "-1: one group per row")
    ap.add_argument("--desc-act", action="store_true", help="gptq: act-order layout")
    ap.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                    help="gptq: symmetric (zero 2**(bits-1)); default sym. awq is always "
                         "asymmetric (zero points)")
    ap.add_argument("input")
    ap.add_argument("output")
    a = ap.parse_args(argv)
    if a.method == "awq" and (a.desc_act or a.sym):
        ap.error("--desc-act and --sym are GPTQ's; awq is asymmetric with groups in order")
    spec = GroupQuantSpec.from_config(GroupQuantSpec(
        a.method, a.bits, a.group_size, a.desc_act,
        a.method == "gptq" and a.sym is not False).config())     # the fields checked
    with open(os.path.join(a.input, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise SystemExit(f"{a.input} is already quantized "
                         f"({config['quantization_config'].get('quant_method')})")
    tensors = quantize_tensors(read_tensors(a.input), spec)
    os.makedirs(a.output, exist_ok=True)
    for name in os.listdir(a.input):
        src = os.path.join(a.input, name)
        if os.path.isfile(src) and not name.endswith(".safetensors") \
                and name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(src, os.path.join(a.output, name))
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(a.output, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = spec.config()
    with open(os.path.join(a.output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{a.output}: {a.method} {spec.bits}-bit, group {spec.group_size}"
          f"{', act order' if spec.desc_act else ''}{', sym' if spec.sym else ''} "
          "(round-to-nearest)")


if __name__ == "__main__":
    main()
