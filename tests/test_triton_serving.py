"""Integration: a real tritonserver (started once, tests/triton_fixtures.py) on SmolLM2, driven
through gRPC streaming, HTTP generate / generate_stream and perf_analyzer."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from triton_fixtures import http_post, http_ready, metric_value, metrics

tritonclient = pytest.importorskip("tritonclient.grpc")
from client.triton_client import TritonLLMClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def grpc(triton, model="ensemble"):  # noqa: F811
    return TritonLLMClient(triton.grpc_url, model)


def sse(triton, body):  # noqa: F811
    """generate_stream: the text deltas and the last event."""
    import urllib.request
    req = urllib.request.Request(f"http://{triton.http_url}/v2/models/ensemble/generate_stream",
                                 data=json.dumps(body).encode())
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    return events


def test_models_ready_and_vllm_metrics_listed(triton):  # noqa: F811
    for model in ("tokenizer", "engine", "detokenizer", "stream_guard", "ensemble"):
        assert http_ready(triton, model)
    text = metrics(triton)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count",
                 "vllm:iteration_tokens_total_count"):
        assert f'{name}{{model_name="smollm2-135m-instruct"' in text, name
    assert 'vllm:request_success_total{finished_reason="stop"' in text
    # the KV cache's settings as labels of one gauge at 1 (vLLM's cache_config_info)
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1"), info
    for label in ('cache_dtype="auto"', 'block_size="16"', 'enable_prefix_caching="True"',
                  'model_name="smollm2-135m-instruct"'):
        assert label in info[0], (label, info[0])


def test_chat_answer_through_every_api_matches_offline_engine(triton, tokenizer, smollm2_dir):  # noqa: F811
    prompt = chat(tokenizer, FRANCE)
    with grpc(triton) as c:
        streamed = c.generate(prompt, max_tokens=32, temperature=0.0, stream=True)
    assert len(streamed.deltas) > 1 and "Paris" in streamed.text
    events = sse(triton, {"text_input": prompt, "max_tokens": 32, "temperature": 0.0,
                          "stream": True})
    assert len(events) > 1 and events[-1]["finish_reason"] in ("stop", "length")
    assert "".join(e["text_output"] for e in events) == streamed.text
    status, body = http_post(triton, "/v2/models/ensemble/generate",
                             {"text_input": prompt, "max_tokens": 32, "temperature": 0.0})
    assert status == 200, body
    one = json.loads(body)
    assert one["text_output"] == streamed.text and "Paris" in one["text_output"]
    assert one["num_output_tokens"] == streamed.num_output_tokens
    assert one["num_input_tokens"] == len(tokenizer.encode(prompt))

    from pagedbackend import LLM, SamplingParams
    llm = LLM(model=smollm2_dir, max_model_len=1024, dtype="float32")
    try:
        offline = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))
    finally:
        llm.engine.shutdown() if hasattr(llm, "engine") else None
    assert offline[0].outputs[0].text == one["text_output"]
    assert offline[0].outputs[0].finish_reason == one["finish_reason"]


def test_non_ascii_stream_concatenates_to_non_streamed_text(triton, tokenizer):  # noqa: F811
    prompt = chat(tokenizer, "Say hello in Chinese and Japanese.")
    with grpc(triton) as c:
        whole = c.generate(prompt, max_tokens=40, temperature=0.0)
        streamed = c.generate(prompt, max_tokens=40, temperature=0.0, stream=True)
    assert any(ord(ch) > 127 for ch in whole.text), whole.text
    assert len(streamed.deltas) > 10
    assert streamed.text.encode() == whole.text.encode()


def test_stop_strings_cut_exactly_streaming_or_not(triton, tokenizer):  # noqa: F811
    prompt = chat(tokenizer, FRANCE)
    with grpc(triton) as c:
        full = c.generate(prompt, max_tokens=32, temperature=0.0).text
        cut = c.generate(prompt, max_tokens=32, temperature=0.0, stop=["Paris"])
        streamed = c.generate(prompt, max_tokens=32, temperature=0.0, stop=["Paris"], stream=True)
    assert cut.finish_reason == "stop" and streamed.deltas[-1].finish_reason == "stop"
    assert cut.text == full[:full.index("Paris")] == streamed.text


def test_bad_words_tensor_and_logit_bias_in_sampling_parameters(triton, tokenizer):  # noqa: F811
    prompt = chat(tokenizer, FRANCE)
    with grpc(triton) as c:
        full = c.generate(prompt, max_tokens=24, temperature=0.0).text
        banned = c.generate(prompt, max_tokens=24, temperature=0.0, bad_words=["Paris"],
                            stream=True)
    assert "Paris" in full and "Paris" not in banned.text and banned.text
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    body = {"text_input": prompt, "max_tokens": 24, "sampling_parameters": json.dumps(
        {"temperature": 0, "logit_bias": {str(paris[0]): -100}})}
    status, raw = http_post(triton, "/v2/models/ensemble/generate", body)
    assert status == 200, raw
    text = json.loads(raw)["text_output"]
    assert "Paris" not in text and text.startswith("The capital of France is")


def test_structured_outputs_through_the_ensemble(triton, tokenizer):  # noqa: F811
    prompt = chat(tokenizer, FRANCE)
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    body = {"text_input": prompt, "max_tokens": 40, "sampling_parameters": json.dumps(
        {"temperature": 0, "structured_outputs": {"json": schema}})}
    status, raw = http_post(triton, "/v2/models/ensemble/generate", body)
    assert status == 200, raw
    assert set(json.loads(json.loads(raw)["text_output"])) == {"city"}
    # vLLM's older name, streamed
    events = sse(triton, {**body, "stream": True, "sampling_parameters": json.dumps(
        {"temperature": 0, "guided_decoding": {"choice": ["Lyon", "Paris", "Nice"]}})})
    assert "".join(ev["text_output"] for ev in events) in ("Lyon", "Paris", "Nice")
    assert events[-1]["finish_reason"] == "stop"


def test_logprobs_output_streaming_or_not(triton, tokenizer):  # noqa: F811
    body = {"text_input": chat(tokenizer, FRANCE), "max_tokens": 6,
            "sampling_parameters": json.dumps({"temperature": 0, "logprobs": 2})}
    status, raw = http_post(triton, "/v2/models/ensemble/generate", body)
    assert status == 200, raw
    one = json.loads(raw)
    entries = json.loads(one["logprobs"])
    assert len(entries) == one["num_output_tokens"] == 6
    for e in entries:
        assert len(e["top_logprobs"]) == 2 and e["logprob"] <= 0
        # greedy: the sampled token is the most likely one
        assert e["top_logprobs"][0][0] == e["token"]
        assert abs(e["top_logprobs"][0][1] - e["logprob"]) < 1e-6
    assert "".join(e["token"] for e in entries) == one["text_output"]
    events = sse(triton, {**body, "stream": True})
    streamed = [e for ev in events if ev.get("logprobs") for e in json.loads(ev["logprobs"])]
    assert [e["token_id"] for e in streamed] == [e["token_id"] for e in entries]
    status, raw = http_post(triton, "/v2/models/ensemble/generate",
                            {**body, "sampling_parameters": json.dumps({"temperature": 0})})
    assert json.loads(raw)["logprobs"] == ""       # not asked for: empty


def test_prompt_logprobs_output(triton, tokenizer):  # noqa: F811
    prompt = "The capital of France is Paris, and the capital of Italy is"
    body = {"text_input": prompt, "max_tokens": 3, "sampling_parameters": json.dumps(
        {"temperature": 0, "prompt_logprobs": 2})}
    status, raw = http_post(triton, "/v2/models/ensemble/generate", body)
    assert status == 200, raw
    one = json.loads(raw)
    entries = json.loads(one["prompt_logprobs"])
    ids = tokenizer(prompt)["input_ids"]
    assert [e["token_id"] for e in entries] == ids
    assert len(entries) == one["num_input_tokens"]
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] == []
    assert "".join(e["token"] for e in entries) == prompt
    for e in entries[1:]:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0][1] >= e["logprob"] - 1e-6     # best first
    # the model's view: " is" after "...the capital of Italy" is likelier than " capital"
    # right after "The"
    assert entries[-1]["logprob"] > entries[1]["logprob"]
    events = sse(triton, {**body, "stream": True})
    assert json.loads(events[0]["prompt_logprobs"]) == entries
    assert all(ev["prompt_logprobs"] == "" for ev in events[1:])
    plain = json.loads(http_post(triton, "/v2/models/ensemble/generate",
                                 {"text_input": prompt, "max_tokens": 3})[1])
    assert plain["prompt_logprobs"] == ""


def test_tensorrt_llm_client_tensors(triton, tokenizer, smollm2_dir):  # noqa: F811
    """end_id, return_log_probs, guided decoding and beam_width as TensorRT-LLM's clients send
    them (generate endpoint: JSON fields become the tensors of those names)."""
    prompt = chat(tokenizer, FRANCE)
    paris = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    gen = lambda **kw: http_post(triton, "/v2/models/ensemble/generate",
                                 {"text_input": prompt, "max_tokens": 24, "temperature": 0, **kw})
    status, raw = gen(end_id=paris, return_log_probs=True)
    assert status == 200, raw
    out = json.loads(raw)
    # a stop token, as vLLM's stop_token_ids: it ends the output and stays in it (TensorRT-LLM's
    # usual end_id, the EOS, is a special token and stays out of the text)
    assert out["text_output"] == "The capital of France is Paris"
    assert out["finish_reason"] == "stop"
    assert len(json.loads(out["logprobs"])) == out["num_output_tokens"]
    status, raw = gen(guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
    assert status == 200 and set(json.loads(json.loads(raw)["text_output"])) == {"city"}
    # beam search: the offline search's best beam, streamed or not, as one final response
    from pagedbackend import LLM, BeamSearchParams
    llm = LLM(smollm2_dir, max_model_len=256)
    best = llm.beam_search({"prompt": prompt}, BeamSearchParams(beam_width=2, max_tokens=24)
                           )[0].sequences[0]
    ids = llm.engine.tokenize_prompt(prompt)[1]
    want = tokenizer.decode(best.tokens[len(ids):], skip_special_tokens=True)
    llm.engine.shutdown()
    status, raw = gen(beam_width=2, length_penalty=1.0)
    assert status == 200, raw
    out = json.loads(raw)
    assert out["text_output"] == want and "Paris" in want
    assert out["num_output_tokens"] == len(best.tokens) - len(ids)
    events = sse(triton, {"text_input": prompt, "max_tokens": 24, "beam_width": 2,
                          "stream": True})
    assert "".join(ev["text_output"] for ev in events) == want
    status, raw = gen(beam_width=2, top_p=0.5)
    assert status == 400 and "top_p=0.5 is invalid with beam_width=2" in json.loads(raw)["error"]


def test_exclude_input_in_output_false_echoes_the_prompt(triton):  # noqa: F811
    with grpc(triton) as c:
        plain = c.generate("The sky is", max_tokens=4, temperature=0.0)
        echoed = c.generate("The sky is", max_tokens=4, temperature=0.0,
                            exclude_input_in_output=False)
    assert echoed.text == "The sky is" + plain.text


def test_engine_model_takes_token_ids(triton, tokenizer):  # noqa: F811
    ids = tokenizer.encode("The sky is")
    with grpc(triton, "engine") as c:
        out = c.generate(input_ids=ids, max_tokens=5, temperature=0.0)
    assert out.num_input_tokens == len(ids) and out.num_output_tokens == 5
    assert out.finish_reason == "length"


def test_16_concurrent_streams_and_token_counters(triton):  # noqa: F811
    time.sleep(1.0)          # counters publish every 0.1 s: let earlier tests' tokens land first
    before = metrics(triton)
    results, errors = [None] * 16, []

    def run(i):
        try:
            with grpc(triton) as c:
                results[i] = c.generate(f"Story number {i}:", max_tokens=12, ignore_eos=True,
                                        temperature=0.8, seed=i, stream=True)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert all(r.num_output_tokens == 12 and r.finish_reason == "length" for r in results)
    time.sleep(1.0)                                        # the metrics thread publishes
    after = metrics(triton)

    def grew(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("vllm:generation_tokens_total") == 16 * 12
    assert grew("vllm:prompt_tokens_total") == sum(r.num_input_tokens for r in results)
    assert grew("vllm:request_success_total", finished_reason="length") == 16
    assert grew("vllm:request_generation_tokens_count") == 16
    # one inter-token latency per token after the first, in the counter-built histogram
    assert grew("vllm:inter_token_latency_seconds_count") == 16 * 11
    assert grew("vllm:inter_token_latency_seconds_bucket", le="+Inf") == 16 * 11
    assert grew("vllm:request_decode_time_seconds_count") == 16
    assert grew("vllm:request_prefill_time_seconds_count") == 16
    # every token of these requests was scheduled in some step
    assert grew("vllm:iteration_tokens_total_sum") >= grew("vllm:prompt_tokens_total") + 16 * 11
    assert metric_value(after, "vllm:num_requests_running") == 0


@pytest.mark.parametrize("model", ["ensemble", "engine"])
def test_cancel_mid_stream_frees_the_request(triton, model):  # noqa: F811
    aborted = metric_value(metrics(triton), "vllm:request_success_total", finished_reason="abort")
    c = grpc(triton, model)
    kw = {"input_ids": [1, 504, 3458, 314]} if model == "engine" else {}
    stream = c.stream("Tell me a very long story." if model == "ensemble" else None,
                      max_tokens=900, ignore_eos=True, **kw)
    deadline = time.time() + 30
    for _ in stream:        # keep streaming until the gauges (published every 0.5 s) show it
        if metric_value(metrics(triton), "vllm:kv_cache_usage_perc") > 0 or time.time() > deadline:
            break
    assert metric_value(metrics(triton), "vllm:kv_cache_usage_perc") > 0
    c.cancel()
    deadline = time.time() + 20
    while time.time() < deadline:
        # The abort is counted when its final response is sent and the gauges follow in the
        # sender's next metrics pass (one IPC call each), so a scrape can land between them
        text = metrics(triton)
        if (metric_value(text, "vllm:request_success_total", finished_reason="abort") > aborted
                and metric_value(text, "vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.1)
    # the loop counts an abort only when it sent that request's final response
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0
    assert metric_value(text, "vllm:num_requests_running") == 0
    c.close()
    with grpc(triton) as again:
        assert again.generate("Hi", max_tokens=3).num_output_tokens == 3


BAD_INPUTS = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 9.0}, "presence_penalty"),
    ({"frequency_penalty": -9.0}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2147483647}, "max_tokens"),
    ({"max_tokens": 1024}, "max_tokens"),                  # prompt + max_tokens > max_model_len
    ({"max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ({"sampling_parameters": "{oops"}, "sampling_parameters"),
    ({"sampling_parameters": '{"bogus": 1}'}, "sampling_parameters.bogus"),
    ({"sampling_parameters": '{"n": 3}'}, "n="),
    ({"text_input": ""}, "text_input"),
    ({"text_input": "word " * 1100}, "max_model_len"),    # prompt longer than the context
    ({"sampling_parameters": '{"temperature": "hot"}'}, "sampling_parameters.temperature"),
    ({"sampling_parameters": '{"logit_bias": {"5": 500}}'}, "logit_bias[5]"),
    ({"sampling_parameters": '{"allowed_token_ids": [99999999]}'}, "allowed_token_ids"),
    ({"sampling_parameters": '{"structured_outputs": {"regex": "(x"}}'},
     "structured_outputs.regex"),
    ({"sampling_parameters": '{"guided_decoding": {"choice": []}}'}, "structured_outputs.choice"),
]


@pytest.mark.parametrize("change, field", BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
def test_bad_input_is_400_naming_the_field(triton, change, field):  # noqa: F811
    body = {"text_input": "Hello there", "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, text = http_post(triton, "/v2/models/ensemble/generate", body)
    assert status == 400, text
    assert field in json.loads(text)["error"]


def test_missing_prompt_on_the_engine_model_is_400(triton):  # noqa: F811
    status, text = http_post(triton, "/v2/models/engine/generate", {"max_tokens": 4})
    assert status == 400 and "text_input is missing" in json.loads(text)["error"]


def test_mistyped_grpc_tensor_and_health_afterwards(triton):  # noqa: F811
    import queue
    inp = tritonclient.InferInput("max_tokens", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    text = tritonclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hello"]], dtype=object))
    client = tritonclient.InferenceServerClient(triton.grpc_url)
    got = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: got.put(error))
    client.async_stream_infer("ensemble", [text, inp])
    error = got.get(timeout=60)
    client.stop_stream()
    client.close()
    assert error is not None and "max_tokens" in str(error) and "INT32" in str(error)
    assert http_ready(triton) and http_ready(triton, "ensemble")
    with grpc(triton) as c:
        assert c.generate("Hello", max_tokens=2).num_output_tokens == 2


def test_perf_analyzer_streaming_run(triton):  # noqa: F811
    pa = ROOT / ".venv" / "bin" / "perf_analyzer"
    if not pa.exists():
        pytest.skip("perf_analyzer (tritonclient[all]) is not installed")
    run = subprocess.run([str(ROOT / "perf" / "perf_analyzer.sh"), "-u", triton.grpc_url,
                          "--concurrency-range", "2:2", "--request-count", "4"],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "VENV": str(ROOT / ".venv")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Concurrency: 2, throughput:" in run.stdout
