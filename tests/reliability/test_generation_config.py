"""generation_config.json's sampling values as the defaults of unset fields (vLLM's
--generation-config auto), on a tiny random model: the engine, the offline LLM, Triton request
parsing, the opt-out, and what scripts/prepare_model.py writes."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from reliability_helpers import ROOT
from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.generation_config import apply_defaults, load_sampling_defaults
from pagedbackend.serving.request import parse_request
from pagedbackend.testing import make_hf_checkpoint

GEN = {"temperature": 0.3, "top_p": 0.8, "top_k": 0, "repetition_penalty": 1.1,
       "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gen")
    make_hf_checkpoint("llama", path, seed=3)
    (path / "generation_config.json").write_text(json.dumps(GEN))
    return str(path)


def test_load_maps_hf_names_and_checks_values(tiny_dir, tmp_path):
    got = load_sampling_defaults("auto", tiny_dir)
    assert got == {"temperature": 0.3, "top_p": 0.8, "top_k": -1, "repetition_penalty": 1.1,
                   "max_tokens": 5}                       # top_k 0 (HF: off) -> -1
    assert load_sampling_defaults("vllm", tiny_dir) == {}
    assert load_sampling_defaults(tiny_dir, "/nowhere") == got   # a folder of its own
    assert load_sampling_defaults("auto", str(tmp_path)) == {}   # no file: no defaults
    with pytest.raises(ValueError, match="generation_config="):
        load_sampling_defaults(str(tmp_path), tiny_dir)
    (tmp_path / "generation_config.json").write_text('{"temperature": -2}')
    with pytest.raises(ValueError, match="temperature=-2.0 is invalid"):
        load_sampling_defaults("auto", str(tmp_path))


def test_set_fields_win_and_max_new_tokens_caps_unbounded():
    defaults = {"temperature": 0.3, "top_p": 0.8, "max_tokens": 5}
    assert apply_defaults({"temperature": 0.0}, defaults) == \
        {"temperature": 0.0, "top_p": 0.8, "max_tokens": None}
    assert apply_defaults({"max_tokens": 40}, defaults)["max_tokens"] == 40


def test_triton_request_parsing_takes_defaults_for_unset_fields_only():
    defaults = {"temperature": 0.3, "top_p": 0.8}
    text = {"text_input": np.array([[b"Hi"]], dtype=object)}
    p = parse_request(text, None, defaults).params
    assert (p.temperature, p.top_p) == (0.3, 0.8)
    p = parse_request({**text, "temperature": np.array([[0.0]], np.float32)}, None,
                      defaults).params                    # a tensor sets it
    assert (p.temperature, p.top_p) == (0.0, 0.8)
    json_top_p = np.array([[b'{"top_p": 1.0}']], dtype=object)
    p = parse_request({**text, "sampling_parameters": json_top_p}, {"temperature": "1"},
                      defaults).params                    # JSON and request parameters set them
    assert (p.temperature, p.top_p) == (1.0, 1.0)
    assert parse_request(text).params.temperature == 1.0  # no defaults given: SamplingParams'
    beam = parse_request({**text, "beam_width": np.array([[2]], np.int32)}, None, defaults)
    assert beam.params.top_p == 1.0                       # beam search samples nothing


def test_llm_without_params_samples_as_the_model_says(tiny_dir):
    llm = LLM(tiny_dir, max_model_len=64, block_size=4, num_kv_blocks=64, seed=0)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.repetition_penalty) == (0.3, 0.8, 1.1)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    unset = llm.generate(prompt, None, use_tqdm=False)[0].outputs[0]
    assert len(unset.token_ids) == 5                       # max_new_tokens, not 16
    unbounded = llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert len(unbounded.token_ids) == 5                   # capped by max_new_tokens, as vLLM
    off = LLM(tiny_dir, max_model_len=64, block_size=4, num_kv_blocks=64,
              generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams()


def test_prepare_model_writes_the_model_card_values(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import prepare_model
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    assert prepare_model.add_sampling_defaults(str(tmp_path))
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True,
                       "temperature": 0.2, "top_p": 0.9}
    assert not prepare_model.add_sampling_defaults(str(tmp_path))   # once only
    assert load_sampling_defaults("auto", str(tmp_path)) == {"temperature": 0.2, "top_p": 0.9}
