"""The issue's "done when" against the real stack: tritonserver with the SmolLM2 ensemble, the
gateway as its own process (uvicorn, so disconnects are real), driven by the official openai SDK
(sync and async), langchain-openai, and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from triton_fixtures import metric_value, metrics, running_gateway

KEY = "sk-integration-test-key"
NAMES = ["smollm2", "smol-alias"]
QUESTION = "What is the capital of France?"

@pytest.fixture(scope="module")
def gateway(triton, smollm2_dir):
    """`python -m client.openai_gateway` on a free port; the key comes from the env variable."""
    with running_gateway(triton, smollm2_dir, "--host", "127.0.0.1", "--served-model-name",
                         *NAMES, env={"PAGEDBACKEND_API_KEY": KEY}, secret=KEY) as gw:
        yield {**gw, "metrics": triton}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def client(gateway):
    import openai
    return openai.OpenAI(base_url=gateway["base"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def aclient(gateway):
    import openai
    return openai.AsyncOpenAI(base_url=gateway["base"] + "/v1", api_key=KEY, max_retries=0)


def chat_prompt(tokenizer, text=QUESTION) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


MSG = [{"role": "user", "content": QUESTION}]


# ---- the openai SDK ------------------------------------------------------------------------
def test_models_lists_aliases(client):
    assert [m.id for m in client.models.list().data] == NAMES


def test_sdk_sync_chat_and_completion_say_paris(client, tokenizer):
    chat = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                          max_tokens=30)
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens == n_tokens(tokenizer, chat_prompt(tokenizer))
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    comp = client.completions.create(model="smol-alias", prompt=chat_prompt(tokenizer),
                                     temperature=0, max_tokens=30)
    assert "Paris" in comp.choices[0].text and comp.model == "smol-alias"
    # The same prompt through both endpoints, greedy: the same text.
    assert comp.choices[0].text == chat.choices[0].message.content


def test_tokenize_counts_what_the_engine_counts(gateway, client, tokenizer):
    headers = {"Authorization": f"Bearer {KEY}"}
    chat = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                          max_tokens=8)
    r = httpx.post(gateway["base"] + "/tokenize", json={"model": "smollm2", "messages": MSG},
                   headers=headers).json()
    assert r["count"] == len(r["tokens"]) == chat.usage.prompt_tokens
    back = httpx.post(gateway["base"] + "/detokenize", json={"tokens": r["tokens"]},
                      headers=headers).json()["prompt"]
    assert back == chat_prompt(tokenizer)
    r = httpx.post(gateway["base"] + "/tokenize", json={"prompt": "Hello world"},
                   headers=headers).json()
    assert r["tokens"] == tokenizer("Hello world")["input_ids"]


def test_sdk_sync_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                          max_tokens=30)
    stream = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                            max_tokens=30, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert "Paris" in "".join(parts)
    assert usage.model_dump() == full.usage.model_dump()
    assert finish == full.choices[0].finish_reason


def test_usage_equals_token_counts(client, tokenizer):
    prompt = "Count with me: one, two, three,"
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == n_tokens(tokenizer, prompt)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    s = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(s)
    assert chunks[-1].usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_sdk_async_streaming_and_not(aclient, tokenizer):
    async def go():
        full = await aclient.completions.create(model="smollm2", prompt=chat_prompt(tokenizer),
                                                temperature=0, max_tokens=30)
        stream = await aclient.chat.completions.create(model="smollm2", messages=MSG,
                                                       temperature=0, max_tokens=30,
                                                       stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        chat = await aclient.chat.completions.create(model="smollm2", messages=MSG,
                                                     temperature=0, max_tokens=30)
        await aclient.close()
        return full.choices[0].text, text, chat.choices[0].message.content

    comp, streamed, chat = asyncio.run(go())
    assert "Paris" in comp and "Paris" in streamed and streamed == chat


def test_n_2_returns_two_choices(client):
    r = client.chat.completions.create(model="smollm2", messages=MSG, n=2, temperature=0.8,
                                       seed=1, max_tokens=16)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens >= 2
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.chat.completions.create(model="smollm2", messages=MSG, n=2, temperature=0.8,
                                           seed=1, max_tokens=16)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    s = client.completions.create(model="smollm2", prompt="Once upon a time", n=2,
                                  max_tokens=8, stream=True)
    seen = {c.choices[0].index for c in s if c.choices}
    assert seen == {0, 1}


def test_logit_bias_and_bad_words_reach_the_engine(client, tokenizer):
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    plain = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                           max_tokens=24).choices[0].message.content
    biased = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                            max_tokens=24, logit_bias={str(paris[0]): -100})
    banned = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                            max_tokens=24, extra_body={"bad_words": ["Paris"]})
    assert "Paris" in plain
    for r in (biased, banned):
        text = r.choices[0].message.content
        assert "Paris" not in text and text.startswith("The capital of France is")


def test_response_format_and_guided_choice(client):
    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", messages=MSG, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    ask_json = [{"role": "user", "content": QUESTION + " Answer in JSON."}]
    r = client.chat.completions.create(model="smollm2", messages=ask_json, temperature=0,
                                       max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="smollm2", prompt="The best city is", max_tokens=8,
                                  extra_body={"guided_choice": ["Paris", "Rome"]})
    assert r.choices[0].text in ("Paris", "Rome")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


def test_forced_tool_calls_sdk_and_langchain(client, gateway):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="smollm2", messages=ask, temperature=0, max_tokens=40, tools=[WEATHER_TOOL])
    named = client.chat.completions.create(
        **kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = [c.choices[0].delta.tool_calls[0] for c in client.chat.completions.create(
        **kw, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if c.choices and c.choices[0].delta.tool_calls]
    assert streamed[0].function.name == "get_weather"
    assert "".join(t.function.arguments for t in streamed) == call.function.arguments
    required = client.chat.completions.create(**kw, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert {c.function.name for c in required.choices[0].message.tool_calls} == {"get_weather"}

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    llm = ChatOpenAI(base_url=gateway["base"] + "/v1", api_key=KEY, model="smollm2",
                     temperature=0, max_tokens=60)
    for method in ("function_calling", "json_schema"):
        city = llm.with_structured_output(City, method=method).invoke(QUESTION)
        assert isinstance(city, City) and city.name, method


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer):
    """lm-eval's loglikelihood request: echo, logprobs, one token."""
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert len(lp.tokens) == n_prompt + 1 == r.usage.prompt_tokens + 1
    assert "".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_logprobs_chat_and_completions(client):
    chat = client.chat.completions.create(model="smollm2", messages=MSG, temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0
        assert c.top_logprobs[0].token == c.token     # greedy picks the most likely token
    comp = client.completions.create(model="smollm2", prompt=QUESTION, temperature=0,
                                     max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_multibyte_stream_concat_equals_non_stream(client):
    prompt = "Répète exactement: 東京タワー 🚀 café 東京タワー 🚀 café 東京タワー 🚀 café"
    kw = dict(model="smollm2", prompt=prompt, temperature=0, max_tokens=40,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == full
    assert any(ord(ch) > 127 for ch in full), f"no multi-byte output to test: {full!r}"


# ---- LangChain ----------------------------------------------------------------------------
def test_langchain_chat_openai(gateway):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=gateway["base"] + "/v1", api_key=KEY, model="smollm2",
                     temperature=0, max_tokens=30, max_retries=0)
    assert "Paris" in llm.invoke(QUESTION).content
    assert "Paris" in "".join(chunk.content for chunk in llm.stream(QUESTION))


# ---- auth and errors ----------------------------------------------------------------------
def test_auth_on_every_protected_route(gateway):
    base = gateway["base"]
    calls = [("GET", "/v1/models", None), ("GET", "/v1/models/smollm2", None),
             ("GET", "/version", None), ("POST", "/tokenize", {"prompt": "Hi"}),
             ("POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"model": "smollm2", "messages": MSG,
                                               "max_tokens": 2})]
    for method, path, body in calls:
        r = httpx.request(method, base + path, json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["message"] == "Unauthorized"
        r = httpx.request(method, base + path, json=body, timeout=60,
                          headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = httpx.request(method, base + path, json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        if path == "/v1/models/smollm2":   # the engine model's settings, as configured
            settings = r.json()["settings"]
            assert settings["swap_space"] == 0 and settings["block_size"] == 16, settings
            assert settings["enable_prefix_caching"] is True and "quantization" not in settings
    assert httpx.get(base + "/health").status_code == 200
    # /metrics needs the key too (Prometheus can send it); Triton's metrics, vllm:* included
    assert httpx.get(base + "/metrics", timeout=30).status_code == 401
    r = httpx.get(base + "/metrics", timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'vllm:num_requests_running{model_name="smollm2-135m-instruct"}' in r.text


LONG = "word " * 12000     # beyond any context the engine is given
BAD = [
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400, None),
    ("/v1/chat/completions", {"model": "smollm2"}, 400, "messages"),
    ("/v1/completions", {"model": "smollm2", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "Hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSG, "temperature": -1}, 400,
     "temperature"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSG, "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 1_000_000}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2**31}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSG, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSG, "n": 100000}, 400, "n"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "logprobs": 100}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSG, "logprobs": True,
                              "top_logprobs": 100}, 400, "top_logprobs"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "logit_bias": {"12": -101}}, 400,
     "logit_bias[12]"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "allowed_token_ids": [10**9]}, 400,
     "allowed_token_ids"),
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "guided_regex": "(x"}, 400,
     "guided_regex"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MSG,
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"model": "smollm2", "prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user",
                                                                "content": LONG}]}, 400,
     "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_then_normal_service(gateway, path, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(gateway["base"] + path, content=content, headers=headers, timeout=120)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param
    if param:
        assert param in err["message"]
    ok = httpx.post(gateway["base"] + "/v1/completions", headers=headers, timeout=120,
                    json={"model": "smollm2", "prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200


def test_body_too_large(gateway):
    r = httpx.post(gateway["base"] + "/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smollm2", "prompt": "x" * (5 << 20)})
    assert r.status_code == 413


# ---- disconnect ---------------------------------------------------------------------------
def kv_usage(server) -> float:
    return metric_value(metrics(server), "vllm:kv_cache_usage_perc")


def wait_for(fn, timeout: float = 30.0, period: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(period)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_kv_blocks(gateway, stream):
    assert wait_for(lambda: kv_usage(gateway["metrics"]) == 0.0), "KV cache busy before the test"
    body = {"model": "smollm2", "prompt": "Tell me a very long story. " * 20, "n": 2,
            "max_tokens": 800, "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", gateway["base"] + "/v1/completions", json=body,
                             headers=headers) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(6):
                    next(lines)
                # The gauge is the engine loop's stats snapshot, taken every 0.5 s and published
                # by the sender thread, so it can still read 0 here: poll it.
                assert wait_for(lambda: kv_usage(gateway["metrics"]) > 0.0, timeout=15), \
                    "KV cache usage never rose above 0 during the request"
        else:   # give up on a long non-streamed request
            with pytest.raises(httpx.ReadTimeout):
                http.post(gateway["base"] + "/v1/completions", json=body, headers=headers,
                          timeout=3)
    # Closing the connection cancels both Triton streams; the engine frees their blocks.
    assert wait_for(lambda: kv_usage(gateway["metrics"]) == 0.0, timeout=20), \
        "KV blocks still held after the client went away"
    ok = httpx.post(gateway["base"] + "/v1/completions", headers=headers, timeout=120,
                    json={"model": "smollm2", "prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200
