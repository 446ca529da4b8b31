"""Bad inputs through every way in: Triton HTTP `generate`, gRPC streaming (tritonclient) and
the OpenAI gateway. Each case: the answer (a 4xx naming the field, or for gRPC an error naming
it), no traceback or path in it, and the server still answers the next request correctly.

One table (CASES); docs/RELIABILITY.md "## Bad inputs" is this table with what each got. Rows
with names=None are Triton 2.51's own parsing of the HTTP JSON (C++, before any of our code
runs): its message names no field; the row records what it answers."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pytest

from reliability_helpers import (QUESTION, grpc_stream, http_generate, openai_post,
                                 scalar_tensor, text_tensor)

MODEL = "smollm2-135m-instruct"
I32, F32, U64, BOOL = np.int32, np.float32, np.uint64, np.bool_
DEEP = "[" * 100_000 + "]" * 100_000                 # JSON nested past any parser's recursion
TEN_MB = "hello " * ((10 << 20) // 6)
LONG_PROMPT = "word " * 1500                           # > max_model_len=1024 tokens of the tests
MANY = [f"w{i}" for i in range(100_000)]               # a giant stop / bad_words list
OOV = 10 ** 6                                          # a token id outside the 49152 vocabulary
SALT = "s" * 2000                                      # longer than MAX_CACHE_SALT_CHARS
LEAKS = ("Traceback", 'File "', "/work/", "/root/", "/tmp/", "site-packages", ".py(", "At:\n")


@dataclass(frozen=True)
class Case:
    id: str
    via: str                     # http | grpc | chat | completions
    request: Any                 # fields over the base request (None: remove), or raw bytes
    status: int                  # HTTP status; gRPC: 400 = an error (stream errors carry no code)
    names: Optional[str]         # text the message must contain; None: Triton's own, unnamed
    model: str = "ensemble"      # gRPC: the Triton model


def sp(**fields) -> dict:
    """HTTP generate's sampling_parameters JSON input."""
    return {"sampling_parameters": json.dumps(fields)}


def T(name, value, dtype=None):
    """A gRPC tensor: text (list of str/bytes) or a scalar of dtype."""
    return text_tensor(name, value) if dtype is None else scalar_tensor(name, value, dtype)


H, G, C, P = "http", "grpc", "chat", "completions"
CASES = [
    # ---- wrong types -------------------------------------------------------------------------
    Case("temperature-string", H, {"temperature": "hot"}, 500, None),
    Case("temperature-string-in-json", H, sp(temperature="hot"), 400, "temperature"),
    Case("temperature-bytes-tensor", G, [T("temperature", ["hot"])], 400, "temperature"),
    Case("temperature-string", C, {"temperature": "hot"}, 400, "temperature"),
    Case("max-tokens-float", C, {"max_tokens": 2.5}, 400, "max_tokens"),
    Case("stream-string", H, {"stream": "yes"}, 500, None),
    Case("stream-string", C, {"stream": "yes"}, 400, "stream"),
    Case("priority-string", H, {"priority": "high"}, 500, None),
    Case("priority-float-tensor", G, [T("priority", 1.5, F32)], 400, "priority"),
    Case("priority-string", C, {"priority": "high"}, 400, "priority"),
    Case("input-ids-float", G, [T("input_ids", 1.0, F32)], 400, "input_ids", model="engine"),
    Case("stop-not-strings", C, {"stop": [1, 2]}, 400, "stop"),
    Case("logit-bias-not-object", C, {"logit_bias": [1, 2]}, 400, "logit_bias"),
    Case("messages-bad-role", C, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages[0].role"),
    Case("temperature-shape-3", G, [("temperature", np.ones((1, 3), F32), "FP32")], 400,
         "temperature"),
    Case("text-input-batch-2", H, {"text_input": ["a", "b"]}, 400, "text_input"),
    # ---- NaN / inf / negative / huge sampling values -----------------------------------------
    Case("temperature-nan", H, sp(temperature=float("nan")), 400, "temperature"),
    Case("temperature-nan", G, [T("temperature", float("nan"), F32)], 400, "temperature"),
    Case("temperature-nan", C, b'{"messages": [{"role": "user", "content": "x"}], '
                               b'"temperature": NaN}', 400, "temperature"),
    Case("temperature-inf", H, b'{"text_input": "x", "max_tokens": 4, "temperature": Infinity}',
         400, "temperature"),
    Case("temperature-inf", G, [T("temperature", float("inf"), F32)], 400, "temperature"),
    Case("temperature-inf", C, b'{"messages": [{"role": "user", "content": "x"}], '
                               b'"temperature": Infinity}', 400, "temperature"),
    Case("temperature-negative", H, {"temperature": -1.0}, 400, "temperature"),
    Case("temperature-negative", C, {"temperature": -1}, 400, "temperature"),
    Case("top-p-zero", H, {"top_p": 0.0}, 400, "top_p"),
    Case("top-p-1.5", C, {"top_p": 1.5}, 400, "top_p"),
    Case("top-k-negative", G, [T("top_k", -5, I32)], 400, "top_k"),
    Case("top-k-huge-is-fine", C, {"top_k": 10 ** 12}, 200, None),
    Case("min-p-2", H, {"min_p": 2.0}, 400, "min_p"),
    Case("repetition-penalty-0", G, [T("repetition_penalty", 0.0, F32)], 400,
         "repetition_penalty"),
    Case("frequency-penalty-1e30", H, {"frequency_penalty": 1e30}, 400, "frequency_penalty"),
    Case("presence-penalty-inf", C, {"presence_penalty": 1e400}, 400, "presence_penalty"),
    Case("seed-negative", H, {"seed": -1}, 500, None),
    Case("seed-negative", C, {"seed": -1}, 400, "seed"),
    Case("seed-2^64", C, {"seed": 2 ** 64}, 400, "seed"),
    Case("logit-bias-1000", H, sp(logit_bias={"5": 1000}), 400, "logit_bias"),
    # ---- max_tokens 0 / 2^31-1, min_tokens ---------------------------------------------------
    Case("max-tokens-0", H, {"max_tokens": 0}, 400, "max_tokens"),
    Case("max-tokens-0", G, [T("max_tokens", 0, I32)], 400, "max_tokens"),
    Case("max-tokens-0", C, {"max_tokens": 0}, 400, "max_tokens"),
    Case("max-tokens-2^31-1", H, {"max_tokens": 2 ** 31 - 1}, 400, "max_tokens"),
    Case("max-tokens-2^31-1", G, [T("max_tokens", 2 ** 31 - 1, I32)], 400, "max_tokens"),
    Case("max-tokens-2^31-1", C, {"max_tokens": 2 ** 31 - 1}, 400, "max_tokens"),
    Case("max-tokens-2^31-1", P, {"max_tokens": 2 ** 31 - 1}, 400, "max_tokens"),
    Case("max-completion-tokens-negative", C, {"max_completion_tokens": -1}, 400,
         "max_completion_tokens"),
    Case("max-tokens-past-context", H, {"max_tokens": 1100}, 400, "max_tokens"),
    Case("min-tokens-over-max", G, [T("min_tokens", 10, I32)], 400, "min_tokens"),
    # ---- prompts: too long, empty, invalid UTF-8, token ids out of the vocabulary ------------
    Case("prompt-too-long", H, {"text_input": LONG_PROMPT}, 400, "prompt"),
    Case("prompt-too-long", G, [T("text_input", [LONG_PROMPT])], 400, "prompt"),
    Case("prompt-too-long", C, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
         "messages"),
    Case("prompt-too-long", P, {"prompt": LONG_PROMPT}, 400, "prompt"),
    Case("prompt-10MB", H, {"text_input": TEN_MB}, 400, "text_input"),
    Case("prompt-10MB", G, [T("text_input", [TEN_MB])], 400, "text_input"),
    Case("prompt-empty", H, {"text_input": ""}, 400, "text_input"),
    Case("prompt-empty", G, [T("text_input", [""])], 400, "text_input"),
    Case("prompt-empty", P, {"prompt": ""}, 400, "prompt"),
    Case("messages-empty", C, {"messages": []}, 400, "messages"),
    Case("prompt-missing", H, {"text_input": None}, 200, "error"),
    Case("prompt-missing", G, [T("max_tokens", 4, I32)], 400, "text_input", model="engine"),
    Case("prompt-missing", P, {"prompt": None}, 400, "prompt"),
    Case("invalid-utf8", H, b'{"text_input": "caf\xff\xfe", "max_tokens": 4}', 400, "text_input"),
    Case("invalid-utf8", G, [T("text_input", [b"caf\xff\xfe"])], 400, "text_input"),
    Case("invalid-utf8", C, b'{"messages": [{"role": "user", "content": "caf\xff"}]}', 400,
         "JSON"),
    Case("lone-surrogate", H, b'{"text_input": "a\\ud800b", "max_tokens": 4}', 500, None),
    Case("lone-surrogate", C, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
         "messages[0].content"),
    Case("token-id-out-of-vocab", G, [("input_ids", np.array([[OOV]], I32), "INT32")], 400,
         "prompt_token_ids", model="engine"),
    Case("token-id-negative", G, [("input_ids", np.array([[-5]], I32), "INT32")], 400,
         "input_ids", model="engine"),
    Case("token-id-out-of-vocab", P, {"prompt": [1, OOV]}, 400, "prompt"),
    Case("logit-bias-out-of-vocab", H, sp(logit_bias={str(OOV): 5}), 400, "logit_bias"),
    Case("logit-bias-out-of-vocab", C, {"logit_bias": {str(OOV): 5}}, 400, "logit_bias"),
    Case("allowed-token-ids-out-of-vocab", H, sp(allowed_token_ids=[OOV]), 400,
         "allowed_token_ids"),
    Case("stop-token-ids-out-of-vocab", H, sp(stop_token_ids=[OOV]), 400, "stop_token_ids"),
    Case("end-id-out-of-vocab", G, [T("end_id", OOV, I32)], 400, "stop_token_ids"),
    # ---- n 10^6, logprobs 10^6, beams --------------------------------------------------------
    Case("n-10^6", H, sp(n=10 ** 6), 400, "n="),
    Case("n-10^6", C, {"n": 10 ** 6}, 400, "n="),
    Case("n-10^6", P, {"n": 10 ** 6}, 400, "n="),
    Case("logprobs-10^6", H, sp(logprobs=10 ** 6), 400, "logprobs"),
    Case("logprobs-10^6", P, {"logprobs": 10 ** 6}, 400, "logprobs"),
    Case("top-logprobs-10^6", C, {"logprobs": True, "top_logprobs": 10 ** 6}, 400,
         "top_logprobs"),
    Case("prompt-logprobs-10^6", H, sp(prompt_logprobs=10 ** 6), 400, "prompt_logprobs"),
    Case("beam-width-1000", H, {"beam_width": 1000}, 400, "beam_width"),
    Case("num-return-sequences-5", G, [T("num_return_sequences", 5, I32)], 400,
         "num_return_sequences"),
    Case("use-beam-search", C, {"use_beam_search": True}, 400, "use_beam_search"),
    # ---- giant lists -------------------------------------------------------------------------
    Case("stop-100k", H, {"stop_words": MANY}, 400, "stop"),
    Case("stop-100k", G, [T("stop_words", MANY)], 400, "stop"),
    Case("stop-100k", C, {"stop": MANY}, 400, "stop"),
    Case("bad-words-100k", H, {"bad_words": MANY}, 400, "bad_words"),
    Case("bad-words-100k", C, {"bad_words": MANY}, 400, "bad_words"),
    Case("stop-100k-in-json", H, sp(stop=MANY), 400, "stop"),
    # ---- bodies: deeply nested, 10 MB, not JSON, not an object -------------------------------
    Case("body-deeply-nested", H, ('{"text_input": "x", "foo": ' + DEEP + "}").encode(), 400,
         "foo"),
    Case("body-deeply-nested", C, ('{"messages": ' + DEEP + "}").encode(), 400, "nested"),
    Case("body-10MB", C, {"messages": [{"role": "user", "content": TEN_MB}]}, 413,
         "larger than"),
    Case("body-not-json", H, b"not json", 500, None),
    Case("body-not-json", C, b"not json", 400, "JSON"),
    Case("body-an-array", H, b"[1, 2]", 500, None),
    Case("body-an-array", P, b"[1, 2]", 400, "JSON object"),
    # ---- sampling_parameters JSON ------------------------------------------------------------
    Case("sampling-parameters-malformed", H, {"sampling_parameters": "{temperature: 0"}, 400,
         "sampling_parameters"),
    Case("sampling-parameters-malformed", G, [T("sampling_parameters", ["{temperature: 0"])],
         400, "sampling_parameters"),
    Case("sampling-parameters-deeply-nested", H, {"sampling_parameters": DEEP}, 400,
         "sampling_parameters"),
    Case("sampling-parameters-deeply-nested", G, [T("sampling_parameters", [DEEP])], 400,
         "sampling_parameters"),
    Case("sampling-parameters-an-array", H, {"sampling_parameters": "[1, 2]"}, 400,
         "sampling_parameters"),
    Case("sampling-parameters-unknown-field", H, sp(foo=1), 400, "sampling_parameters.foo"),
    # ---- unknown fields ----------------------------------------------------------------------
    Case("unknown-field", H, {"foo": 1}, 200, None),
    Case("unknown-tensor", G, [T("foo", 1, I32)], 400, "foo"),
    Case("unknown-field", C, {"foo": 1}, 200, None),
    Case("unknown-field", P, {"foo": {"bar": [1]}}, 200, None),
    # ---- bad grammars / JSON schemas ---------------------------------------------------------
    Case("regex-unclosed", H, sp(structured_outputs={"regex": "(unclosed"}), 400,
         "structured_outputs.regex"),
    Case("json-schema-bad-type", H, sp(structured_outputs={"json": {"type": "bogus"}}), 400,
         "structured_outputs.json"),
    Case("ebnf-bad", H, sp(structured_outputs={"grammar": "root ::= ("}), 400,
         "structured_outputs.grammar"),
    Case("two-structured-kinds", H, sp(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
         "structured_outputs"),
    Case("guide-type-bogus", G, [T("guided_decoding_guide_type", ["bogus"])], 400,
         "guided_decoding_guide_type"),
    Case("guide-json-not-json", G, [T("guided_decoding_guide_type", ["json_schema"]),
                                    T("guided_decoding_guide", ["{not json"])], 400,
         "structured_outputs.json"),
    Case("json-schema-bad-type", C, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format"),
    Case("response-format-type-bogus", C, {"response_format": {"type": "bogus"}}, 400,
         "response_format"),
    Case("regex-unclosed", C, {"structured_outputs": {"regex": "(x"}}, 400, "structured_outputs"),
    Case("guided-grammar-bad", P, {"guided_grammar": "root ::= ("}, 400, "guided_grammar"),
    Case("json-schema-nested-900", H, sp(structured_outputs={"json": json.loads(
        '{"type": "array", "items": ' * 900 + '{"type": "string"}' + "}" * 900)}), 400,
         "nested at most 32"),
    Case("json-schema-nested-100", C, {"structured_outputs": {"json": json.loads(
        '{"type": "array", "items": ' * 100 + '{"type": "string"}' + "}" * 100)}}, 400,
         "nested at most 32"),
    Case("regex-alternations-x100", H, sp(structured_outputs={"regex": "(a|b)*" * 100}), 400,
         "structured_outputs.regex"),
    # ---- priority, cache_salt ----------------------------------------------------------------
    Case("priority-2^40", C, {"priority": 2 ** 40}, 400, "priority"),
    Case("cache-salt-number", H, {"cache_salt": 5}, 500, None),
    Case("cache-salt-too-long", H, {"cache_salt": SALT}, 400, "cache_salt"),
    Case("cache-salt-invalid-utf8", G, [T("cache_salt", [b"\xff\xfe"])], 400, "cache_salt"),
    Case("cache-salt-too-long", G, [T("cache_salt", [SALT])], 400, "cache_salt"),
    Case("cache-salt-number", C, {"cache_salt": 5}, 400, "cache_salt"),
    Case("cache-salt-empty", C, {"cache_salt": ""}, 400, "cache_salt"),
    Case("cache-salt-too-long", C, {"cache_salt": SALT}, 400, "cache_salt"),
    Case("unknown-model", C, {"model": "gpt-9"}, 404, "model"),
]
BASE = {H: {"text_input": "Hello", "max_tokens": 4},
        C: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        P: {"model": MODEL, "prompt": "Hello", "max_tokens": 4}}


def send(case: Case, triton, gateway) -> tuple[int, str]:
    raw = case.request if isinstance(case.request, bytes) else None
    body = None
    if raw is None and case.via != G:
        body = {k: v for k, v in {**BASE[case.via], **case.request}.items() if v is not None}
    if case.via == H:
        return http_generate(triton, body, raw=raw)
    if case.via == G:
        given = {t[0] for t in case.request}
        base = [] if case.model == "engine" else \
            [T("text_input", ["Hello"]), T("max_tokens", 4, I32)]
        return grpc_stream(triton, [t for t in base if t[0] not in given] + case.request,
                           model=case.model)
    return openai_post(gateway, f"/v1/{'chat/completions' if case.via == C else case.via}",
                       body, raw=raw)


def still_answers(triton) -> None:
    status, text = http_generate(triton, {"text_input": "The capital of France is",
                                          "max_tokens": 2, "temperature": 0})
    assert status == 200 and "Paris" in json.loads(text)["text_output"], text


@pytest.mark.parametrize("case", CASES, ids=[f"{c.via}-{c.id}" for c in CASES])
def test_bad_input(case, triton, gateway):
    status, message = send(case, triton, gateway)
    assert status == case.status, message[:500]
    if case.names is not None:
        assert case.names in message, message[:500]
    assert not [s for s in LEAKS if s in message], message[:2000]
    assert len(message) < 4000, f"{len(message)} characters echoed back"
    still_answers(triton)


@pytest.mark.parametrize("via", [H, G, C, P])
def test_every_way_in_still_answers_greedily(via, triton, gateway, chat_prompt):
    """After all the bad inputs: the greedy answer to the question, through each interface."""
    if via == H:
        status, text = http_generate(triton, {"text_input": chat_prompt, "max_tokens": 16,
                                              "temperature": 0})
        answer = json.loads(text)["text_output"]
    elif via == G:
        status, answer = grpc_stream(triton, [T("text_input", [chat_prompt]),
                                              T("max_tokens", 16, I32), T("temperature", 0, F32)])
    else:
        body = ({"messages": [{"role": "user", "content": QUESTION}]} if via == C
                else {"prompt": chat_prompt})
        status, text = openai_post(gateway, "/v1/chat/completions" if via == C
                                   else "/v1/completions",
                                   {"model": MODEL, "max_tokens": 16, "temperature": 0, **body})
        choice = json.loads(text)["choices"][0]
        answer = choice["message"]["content"] if via == C else choice["text"]
    assert status == 200 and "Paris" in answer, answer


def test_the_table_has_40_cases_through_3_ways_in():
    assert len({c.id for c in CASES}) >= 40 and {c.via for c in CASES} == {H, G, C, P}


def test_gateway_warns_of_ignored_fields(caplog):
    """Unknown fields are ignored as vLLM's server ignores them: with a warning naming them
    (never their values); fields it reads, or OpenAI's without effect here, are not named."""
    import logging

    from client.openai_gateway.protocol import parse_chat, parse_completion
    caplog.set_level(logging.WARNING, logger="openai_gateway")
    parse_chat({**BASE[C], "temperature": 0, "metadata": {"a": "b"}, "guided_regex": "a+",
                "stream_options": {"include_usage": False}}, MODEL)
    assert "ignored" not in caplog.text
    parse_completion({**BASE[P], "foo": "secret-value", "bar": 1}, MODEL)
    assert "ignored: bar, foo" in caplog.text and "secret-value" not in caplog.text
