"""Speculative decoding through Triton: the engine model's speculative_config parameter (JSON),
greedy text with n-gram drafts equal to the session server's without, streamed responses of
several tokens, and vLLM's spec-decode counters on /metrics."""
from __future__ import annotations

import json

import pytest

from test_spec_decode_smollm2 import PARAGRAPH
from triton_fixtures import (TEST_ENGINE_SETTINGS, http_post, metric_value, metrics,
                             running_server)

pytest.importorskip("tritonclient.grpc")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def spec_server(smollm2_dir):
    with running_server(smollm2_dir, {**TEST_ENGINE_SETTINGS,
                                      "speculative_config": json.dumps(SPEC)}) as server:
        yield server


def prompt_text(smollm2_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return tok.apply_chat_template([{"role": "user", "content": "Repeat this paragraph "
                                     f"exactly:\n\n{PARAGRAPH}"}], tokenize=False,
                                   add_generation_prompt=True)


def stream(server, body):
    import urllib.request
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate_stream",
                                 data=json.dumps(body).encode())
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    return events


def test_greedy_text_equal_without_drafts_and_counters(triton, spec_server, smollm2_dir):  # noqa: F811
    body = {"text_input": prompt_text(smollm2_dir), "max_tokens": 32, "temperature": 0.0}
    status, plain = http_post(triton, "/v2/models/ensemble/generate", body)
    assert status == 200, plain
    status, spec = http_post(spec_server, "/v2/models/ensemble/generate", body)
    assert status == 200, spec
    plain, spec = json.loads(plain), json.loads(spec)
    assert spec["text_output"] == plain["text_output"]
    assert spec["num_output_tokens"] == plain["num_output_tokens"]
    events = stream(spec_server, {**body, "stream": True})
    assert "".join(e["text_output"] for e in events) == plain["text_output"]
    assert len(events) < plain["num_output_tokens"], "responses should carry several tokens"

    text = metrics(spec_server)
    drafts = metric_value(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= draft_tokens <= 4 * drafts
    assert 0.5 * draft_tokens < accepted <= draft_tokens       # the answer copies its input
    per_pos = [metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                            position=str(i)) for i in range(4)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[3]
    with pytest.raises(KeyError):         # the server without speculation has none
        metric_value(metrics(triton), "vllm:spec_decode_num_drafts_total")


def test_bad_speculative_config_parameter_names_the_field(tmp_path):
    from pagedbackend.serving.settings import engine_config
    with pytest.raises(ValueError, match=r"speculative_config.num_speculative_tokens=0 is "
                                         r"invalid"):
        engine_config({"model": "m", "speculative_config": '{"num_speculative_tokens": 0}'},
                      tmp_path)
    cfg = engine_config({"model": "m", "speculative_config": '{"method": "draft_model", '
                                                             '"model": "d"}'}, tmp_path)
    assert cfg.speculative_config.model == str((tmp_path / "d").resolve())
