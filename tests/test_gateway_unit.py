"""The gateway's HTTP surface against a fake backend: parameter mapping, validation → status,
SSE framing, auth, error shapes, disconnects. Fast; no Triton."""
from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest
from fastapi.testclient import TestClient

from client.openai_gateway import create_app
from client.openai_gateway.__main__ import build_app, parse_args
from client.openai_gateway.backend import BackendError, Chunk, TokenLogprob
from client.openai_gateway.errors import from_triton
from client.openai_gateway.prompts import PromptRenderer
from client.openai_gateway.triton_backend import TritonBackend, parse_logprobs

KEY = "sk-test-0123456789"

ANSWER = "Paris est la capitale — 東京 🚀."


class FakeTokenizer:
    def __len__(self) -> int:
        return 1000

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        self.template_kwargs = kw
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def decode(self, ids, **kw):
        return " ".join(f"t{i}" for i in ids)

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [len(w) for w in text.split()]


class FakeBackend:
    """Answers ANSWER (or `self.answer`) word by word; `self.fail` raises a Triton error text,
    `self.fail_after` does so mid-stream; records requests and which streams were closed early."""

    def __init__(self) -> None:
        self.requests, self.closed, self.finished = [], [], []
        self.is_ready, self.answer, self.fail, self.fail_after = True, ANSWER, None, None
        self.delay = 0.0
        self.has_logprobs = True
        self.engine_settings, self.settings_error = {"max_model_len": 2048, "swap_space": 4,
                                                     "preemption_mode": "auto"}, None

    async def ready(self) -> bool:
        return self.is_ready

    async def version(self) -> str:
        return "2.51.0"

    async def supports_logprobs(self) -> bool:
        return self.has_logprobs

    async def settings(self) -> dict:
        if self.settings_error:
            raise RuntimeError(self.settings_error)
        return self.engine_settings

    async def generate(self, req):
        self.requests.append(req)
        done = False
        try:
            if self.fail:
                raise BackendError(self.fail)
            words = self.answer.split(" ")
            pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
            n_in = len(req.prompt.split())
            max_tokens = req.params.get("max_tokens") or len(pieces)
            pieces = pieces[:max_tokens]
            finish = "length" if len(pieces) < len(words) else "stop"
            lp = req.params.get("logprobs")

            def logprobs(ps):
                if lp is None:
                    return None
                return [TokenLogprob(p, -0.5, [(p, -0.5), ("x", -1.5)][:max(lp, 0) or 0])
                        for p in ps]

            prompt_lp = None
            if req.params.get("prompt_logprobs") is not None:    # the prompt's words, -1 each
                words_in = req.prompt.split(" ")
                prompt_lp = [TokenLogprob(w if i == 0 else " " + w, None if i == 0 else -1.0,
                                          [] if i == 0 else [(" " + w, -1.0)])
                             for i, w in enumerate(words_in)]
            if not req.stream:
                await asyncio.sleep(self.delay * len(pieces))
                yield Chunk("".join(pieces), finish, n_in, len(pieces), logprobs(pieces),
                            prompt_lp)
            else:
                for i, p in enumerate(pieces):
                    await asyncio.sleep(self.delay)
                    if self.fail_after is not None and i == self.fail_after:
                        raise BackendError("in ensemble 'ensemble', engine loop died")
                    last = i == len(pieces) - 1
                    yield Chunk(p, finish if last else None, n_in, i + 1, logprobs([p]),
                                prompt_lp if i == 0 else None)
            done = True
        finally:
            (self.finished if done else self.closed).append(req.request_id)


@pytest.fixture
def fake():
    return FakeBackend()


def make(fake, **kw):
    app = create_app(fake, ["smol", "alias"], renderer=PromptRenderer(FakeTokenizer()), **kw)
    return TestClient(app)


@pytest.fixture
def client(fake):
    return make(fake)


def sse_events(resp):
    """Parse an SSE body strictly: every event is one `data: ...` line then a blank line."""
    raw = resp.text
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    return [e[6:] for e in events]


def chunks(resp):
    ev = sse_events(resp)
    assert ev[-1] == "[DONE]"
    return [json.loads(e) for e in ev[:-1]]


CHAT = {"model": "smol", "messages": [{"role": "user", "content": "What is the capital?"}]}
COMP = {"model": "smol", "prompt": "The capital of France is"}


# ---- routes --------------------------------------------------------------------------------
def test_models_aliases_version_health(client, fake):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["smol", "alias"]
    assert client.get("/v1/models/alias").json()["id"] == "alias"
    assert client.get("/v1/models/nope").status_code == 404
    card = data[0]
    assert card["max_model_len"] == 2048
    assert card["settings"] == {"max_model_len": 2048, "swap_space": 4, "preemption_mode": "auto"}
    fake.settings_error = "engine config unreadable"        # the list still answers
    card = client.get("/v1/models/smol").json()
    assert card["id"] == "smol" and card["settings"] == {} and "max_model_len" not in card
    fake.settings_error = None
    assert client.get("/version").json()["triton_version"] == "2.51.0"
    assert client.get("/health").status_code == 200
    fake.is_ready = False
    r = client.get("/health")
    assert r.status_code == 503 and r.headers["Retry-After"]


def test_completion_non_streaming(client, fake):
    r = client.post("/v1/completions", json={**COMP, "max_tokens": 50, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "smol"
    assert body["choices"][0]["text"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"
    n_out = len(ANSWER.split(" "))
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": n_out,
                             "total_tokens": 5 + n_out}
    req = fake.requests[0]
    assert req.prompt == COMP["prompt"] and req.stream is False
    assert req.params["max_tokens"] == 50 and req.params["temperature"] == 0


def test_alias_answers_with_its_own_name(client):
    assert client.post("/v1/completions", json={**COMP, "model": "alias"}).json()["model"] == "alias"


def test_parameter_mapping_incl_vllm_extras(client, fake):
    body = {**COMP, "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "stop": "\n",
            "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 20,
            "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
            "priority": 3, "cache_salt": "tenant-a", "user": "u1", "unknown_field": {"x": 1},
            "logit_bias": {"1": 2}, "allowed_token_ids": [1, 5], "bad_words": ["no"]}
    assert client.post("/v1/completions", json=body).status_code == 200
    req = fake.requests[0]
    assert req.params == {"max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"],
                          "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                          "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                          "min_tokens": 2, "ignore_eos": True, "logprobs": None,
                          "logit_bias": {"1": 2}, "allowed_token_ids": [1, 5],
                          "bad_words": ["no"]}
    assert req.priority == 3 and req.cache_salt == "tenant-a"


def test_max_completion_tokens_wins_and_chat_defaults_to_context(client, fake):
    client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "max_completion_tokens": 4})
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/completions", json=COMP)
    assert [r.params["max_tokens"] for r in fake.requests] == [4, None, 16]


def test_n_fans_out_with_derived_seeds(client, fake):
    r = client.post("/v1/completions", json={**COMP, "n": 3, "seed": 7}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [q.params["seed"] for q in fake.requests] == [7, 8, 9]
    assert r["usage"]["prompt_tokens"] == 5          # the prompt counts once
    assert r["usage"]["completion_tokens"] == 3 * len(ANSWER.split(" "))
    fake.requests.clear()
    client.post("/v1/chat/completions", json={**CHAT, "n": 2, "temperature": 1.0})
    seeds = [q.params["seed"] for q in fake.requests]
    assert len(set(seeds)) == 2


def test_prompt_batch_and_token_ids(client, fake):
    r = client.post("/v1/completions", json={**COMP, "prompt": ["a b", "c"], "n": 2}).json()
    assert len(r["choices"]) == 4
    assert r["usage"]["prompt_tokens"] == 3
    client.post("/v1/completions", json={**COMP, "prompt": [1, 2, 3]})
    assert fake.requests[-1].prompt == "t1 t2 t3"


def test_chat_template_and_content_parts(client, fake):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]}]
    r = client.post("/v1/chat/completions", json={"model": "smol", "messages": msgs})
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert fake.requests[0].prompt == "<system>Be brief.</s><user>Hi there</s><assistant>"
    client.post("/v1/chat/completions", json={**CHAT, "add_generation_prompt": False})
    assert not fake.requests[-1].prompt.endswith("<assistant>")


def test_echo(client):
    r = client.post("/v1/completions", json={**COMP, "echo": True}).json()
    assert r["choices"][0]["text"] == COMP["prompt"] + ANSWER
    s = client.post("/v1/completions", json={**COMP, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks(s)) == COMP["prompt"] + ANSWER


# ---- streaming -----------------------------------------------------------------------------
def test_chat_stream_framing_and_concat(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    cs = chunks(r)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == cs[0]["id"] for c in cs)
    assert cs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in cs)
    assert text == ANSWER
    assert cs[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in cs)
    non_stream = client.post("/v1/chat/completions", json=CHAT).json()
    assert non_stream["choices"][0]["message"]["content"] == text


def test_stream_include_usage(client):
    r = client.post("/v1/completions", json={**COMP, "stream": True, "n": 2,
                                              "stream_options": {"include_usage": True}})
    cs = chunks(r)
    assert cs[-1]["choices"] == [] and cs[-1]["usage"]["completion_tokens"] == \
        2 * len(ANSWER.split(" "))
    assert all(c["usage"] is None for c in cs[:-1])
    for i in (0, 1):
        assert "".join(c["choices"][0]["text"] for c in cs[:-1]
                       if c["choices"][0]["index"] == i) == ANSWER


def test_stream_error_before_first_token_gets_status(client, fake):
    fake.fail = "in ensemble 'ensemble', max_tokens=99999 is invalid: must be <= 2048 - prompt"
    r = client.post("/v1/completions", json={**COMP, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_stream_error_mid_stream(client, fake):
    fake.fail_after = 2
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    ev = sse_events(r)
    err = json.loads(ev[-2])
    assert err["error"]["code"] == "model_not_ready" and ev[-1] == "[DONE]"


def test_logprobs_shapes(client):
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "Paris" and content[0]["bytes"] == list(b"Paris")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["Paris", "x"]
    r = client.post("/v1/completions", json={**COMP, "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"][0] == "Paris" and lp["text_offset"][0] == 0
    assert lp["top_logprobs"][0] == {"Paris": -0.5}
    # with echo the prompt's tokens come first (test_echo_with_logprobs_scores_the_prompt_too)
    r = client.post("/v1/completions", json={**COMP, "logprobs": 1, "echo": True}).json()
    lp = r["choices"][0]["logprobs"]
    n = len(COMP["prompt"].split(" "))
    assert lp["tokens"][n] == "Paris" and lp["text_offset"][n] == len(COMP["prompt"])
    assert client.post("/v1/completions", json=COMP).json()["choices"][0]["logprobs"] is None


def test_logprobs_refused_when_triton_has_no_logprobs_output(client, fake):
    fake.has_logprobs = False
    r = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = client.post("/v1/completions", json={**COMP, "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["code"] == "logprobs_unsupported"
    assert client.post("/v1/completions", json=COMP).status_code == 200


# ---- errors --------------------------------------------------------------------------------
BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": "smol"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "smol", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "smol", "messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role"),
    ("/v1/completions", {"model": "smol", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "smol"}, 400, "prompt"),
    ("/v1/completions", {**COMP, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {**COMP, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**COMP, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {**COMP, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**COMP, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -5}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {**COMP, "n": 0}, 400, "n"),
    ("/v1/completions", {**COMP, "n": 10**6}, 400, "n"),
    ("/v1/completions", {**COMP, "logprobs": 50}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", {**COMP, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**COMP, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**COMP, "seed": -1}, 400, "seed"),
    ("/v1/completions", {**COMP, "priority": 1.5}, 400, "priority"),
    ("/v1/completions", {**COMP, "use_beam_search": True, "n": 2}, 400, "use_beam_search"),
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", [1, 2], 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests(client, fake, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post(path, **kw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param:
        assert param.split("[")[0] in err["message"]
    assert not fake.requests                   # refused before reaching Triton
    assert client.post("/v1/completions", json=COMP).status_code == 200


@pytest.mark.parametrize("message,status,param", [
    ("in ensemble 'ensemble', prompt_token_ids=[...] is invalid: must be at most 2048 tokens "
     "(max_model_len)", 400, "prompt"),
    ("text_input=4000 tokens is invalid: must be <= 2048", 400, "prompt"),
    ("max_tokens=30000 is invalid: must be <= 2043 (max_model_len - prompt tokens)", 400,
     "max_tokens"),
    ("Exceeds maximum queue size", 429, None),
    ("in ensemble 'ensemble', Request for unknown model: 'engine' is not ready", 503, None),
    ("unavailable: failed to connect to all addresses", 503, None),
    ("Traceback ... /secret/path.py line 3 KeyError", 500, None),
])
def test_triton_errors_map_to_statuses(client, fake, message, status, param):
    fake.fail = message
    r = client.post("/v1/completions", json=COMP)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param
    if status in (429, 503):
        assert int(r.headers["Retry-After"]) > 0
    if status == 500:
        assert "secret" not in r.text and "Traceback" not in r.text
    if status == 400 and param == "prompt":
        fake.requests.clear()
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.json()["error"]["param"] == "messages"


def test_error_map_keeps_the_allowed_range():
    e = from_triton("in ensemble 'ensemble', top_k=0 is invalid: must be -1 or >= 1")
    assert e.status == 400 and e.message == "top_k=0 is invalid: must be -1 or >= 1"


def test_body_too_large(fake):
    client = make(fake, max_body_bytes=1000)
    r = client.post("/v1/completions", json={**COMP, "prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert client.post("/v1/completions", json=COMP).status_code == 200


def test_unknown_route_is_openai_shaped(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# ---- auth ----------------------------------------------------------------------------------
PROTECTED = [("get", "/v1/models", None), ("get", "/v1/models/smol", None), ("get", "/version", None),
             ("post", "/v1/completions", COMP), ("post", "/v1/chat/completions", CHAT)]


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_auth(fake, method, path, body, caplog):
    caplog.set_level(logging.DEBUG)
    client = make(fake, api_key=KEY)
    kw = {"json": body} if body else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        r = getattr(client, method)(path, headers=headers, **kw)
        assert r.status_code == 401
        assert r.json()["error"]["message"] == "Unauthorized"
    r = getattr(client, method)(path, headers={"Authorization": f"Bearer {KEY}"}, **kw)
    assert r.status_code == 200
    assert client.get("/health").status_code == 200
    assert KEY not in caplog.text


def test_api_key_from_env(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("PAGEDBACKEND_API_KEY", KEY)
    app = build_app(parse_args(["--served-model-name", "a", "b"]))
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 401
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [m["id"] for m in r.json()["data"]] == ["a", "b"]
    assert KEY not in caplog.text and "api key on" in caplog.text


# ---- disconnects ---------------------------------------------------------------------------
async def _call_and_disconnect(app, path, body, disconnect_after_s):
    """Drive the ASGI app by hand: send the body, then report a disconnect after a while."""
    sent = []
    payload = json.dumps(body).encode()
    state = {"body_sent": False}
    gone_at = asyncio.get_running_loop().time() + disconnect_after_s

    async def receive():   # like uvicorn's: waits (cancellably) until the client is gone
        if not state["body_sent"]:
            state["body_sent"] = True
            return {"type": "http.request", "body": payload, "more_body": False}
        left = gone_at - asyncio.get_running_loop().time()
        if left > 0:
            await asyncio.sleep(left)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_backend_streams(fake, stream):
    fake.delay = 0.05
    fake.answer = " ".join(["word"] * 200)           # 10 s of output if nothing cancels it
    app = create_app(fake, ["smol"], renderer=PromptRenderer(FakeTokenizer()))

    async def go():
        await _call_and_disconnect(app, "/v1/completions",
                                   {**COMP, "n": 2, "stream": stream, "max_tokens": 200}, 0.3)
        for _ in range(5):   # closed at once, not whenever the garbage collector runs
            await asyncio.sleep(0)

    asyncio.run(go())
    assert len(fake.closed) == 2 and not fake.finished


# ---- Triton tensors ------------------------------------------------------------------------
def _tensors(backend, **params):
    from client.openai_gateway.backend import BackendRequest
    req = BackendRequest("r1", "héllo", params, stream=True, priority=2, cache_salt="s")
    out = asyncio.run(backend._request(req))
    return {t.name(): t for t in out["inputs"]}, out


@pytest.mark.parametrize("batched", [False, True])
def test_triton_tensor_mapping(batched):
    b = TritonBackend("127.0.0.1:1")
    b._inputs = {"text_input", "stream", "exclude_input_in_output", "max_tokens", "temperature",
                 "seed", "stop_words", "top_k", "priority", "cache_salt", "sampling_parameters"}
    b._batched = batched
    t, out = _tensors(b, max_tokens=5, temperature=0.5, seed=2**63 + 1, stop=["a", "b"],
                      top_k=3, min_p=0.1, logprobs=2, ignore_eos=False)
    lead = [1] if batched else []
    assert t["text_input"].datatype() == "BYTES" and t["text_input"].shape() == lead + [1]
    assert t["max_tokens"].datatype() == "INT32" and t["temperature"].datatype() == "FP32"
    assert t["seed"].datatype() == "UINT64" and t["stop_words"].shape() == lead + [2]
    assert t["priority"].datatype() == "INT32" and t["cache_salt"].datatype() == "BYTES"
    assert t["stream"].datatype() == "BOOL" and t["exclude_input_in_output"].datatype() == "BOOL"
    # min_p and ignore_eos have no tensor in this config: they travel as JSON, as logprobs does.
    assert "min_p" not in t and "ignore_eos" not in t
    assert out["parameters"] == {"triton_enable_empty_final_response": True}
    raw = t["sampling_parameters"]._get_content()
    assert b'"min_p": 0.1' in raw and b'"logprobs": 2' in raw and b'"ignore_eos": false' in raw
    t, _ = _tensors(b, max_tokens=None)
    assert b'"max_tokens": null' in t["sampling_parameters"]._get_content()


def test_parse_logprobs_both_shapes():
    a = parse_logprobs(json.dumps([{"token": "Par", "logprob": -0.1,
                                    "top_logprobs": [["Par", -0.1], ["The", -2.0]]}]))
    assert a[0].token == "Par" and a[0].top[1] == ("The", -2.0)
    b = parse_logprobs(json.dumps([{"17": {"logprob": -1.0, "decoded_token": "is"},
                                    "4": {"logprob": -0.5, "decoded_token": "was"}}]))
    assert b[0].token == "is" and b[0].top[0] == ("was", -0.5)
    assert np.isclose(b[0].logprob, -1.0)


def test_triton_backend_streams_from_triton_and_merges_for_non_streaming_clients():
    from client.openai_gateway.backend import BackendRequest
    b = TritonBackend("127.0.0.1:1")
    closed = []

    async def responses(req):
        try:
            for i, piece in enumerate(["Pa", "ris", " 東京"]):
                yield Chunk(piece, "stop" if i == 2 else None, 4, i + 1)
        finally:
            closed.append(req.request_id)

    b._responses = responses

    async def collect(stream):
        return [c async for c in b.generate(BackendRequest("r", "p", {}, stream=stream))]

    (whole,) = asyncio.run(collect(False))
    assert (whole.text, whole.finish_reason, whole.num_output_tokens) == ("Paris 東京", "stop", 3)
    assert [c.text for c in asyncio.run(collect(True))] == ["Pa", "ris", " 東京"]

    async def leave_early():
        gen = b.generate(BackendRequest("early", "p", {}, stream=True))
        await gen.__anext__()
        await gen.aclose()
    asyncio.run(leave_early())
    assert closed[-1] == "early"


def test_structured_output_fields_map_to_one_spec(client, fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    bodies = [
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                            "schema": schema}}},
        {**CHAT, "response_format": {"type": "json_object"}},
        {**CHAT, "response_format": {"type": "text"}},
        {**COMP, "guided_json": json.dumps(schema)},
        {**COMP, "guided_choice": ["a", "b"]},
        {**COMP, "guided_regex": "[a-z]+"},
        {**COMP, "guided_grammar": 'root ::= "x"'},
        {**COMP, "structured_outputs": {"choice": ["y"]}},
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert client.post(path, json=body).status_code == 200
    got = [r.params.get("structured_outputs") for r in fake.requests]
    assert got == [{"json": schema}, {"json_object": True}, None,
                   {"json": json.dumps(schema)}, {"choice": ["a", "b"]},
                   {"regex": "[a-z]+"}, {"grammar": 'root ::= "x"'}, {"choice": ["y"]}]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_structured_output_fields_are_400(client, fake, extra, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not fake.requests


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_is_one_call_with_the_schema_s_arguments(fake):
    tok = FakeTokenizer()
    app = create_app(fake, ["smol"], renderer=PromptRenderer(tok))
    client = TestClient(app)
    fake.answer = '{"city": "Paris"}'
    body = {**CHAT, "tools": [WEATHER, TIME], "tool_choice": NAMED}
    r = client.post("/v1/chat/completions", json=body).json()
    assert fake.requests[0].params["structured_outputs"] == {
        "json": WEATHER["function"]["parameters"]}
    assert tok.template_kwargs["tools"] == [WEATHER, TIME]
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # streamed: the id and name first, then the arguments in pieces
    cs = chunks(client.post("/v1/chat/completions", json={**body, "stream": True}))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in cs
             if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert len(calls) == 2 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather" and "id" not in calls[1]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert cs[-1]["choices"][0]["finish_reason"] == "stop"


def test_required_tool_choice_returns_the_calls_with_finish_reason_tool_calls(client, fake):
    fake.answer = ('[{"name": "get_time", "parameters": {}}, '
                   '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    body = {**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"}
    r = client.post("/v1/chat/completions", json=body).json()
    schema = fake.requests[0].params["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"]]
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("get_time", {}),
                                                          ("get_weather", {"city": "Oslo"})]
    cs = chunks(client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in cs if c["choices"]]
    with_calls = [d for d in deltas if "tool_calls" in d]
    assert len(with_calls) == 1 and [c["index"] for c in with_calls[0]["tool_calls"]] == [0, 1]
    assert not any(d.get("content") for d in deltas)
    assert cs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # cut by max_tokens before the JSON closed: the text, as it is
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 2}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["message"]["content"] == '[{"name": "get_time",'


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>')


def test_auto_tool_choice_finds_hermes_calls_in_the_text(fake):
    """With --enable-auto-tool-choice --tool-call-parser hermes, tool_choice "auto" (the default
    with tools) lets the model choose: `<tool_call>` blocks in its text become tool calls
    (finish_reason tool_calls) and the text around them the content, streamed as it comes;
    text without blocks, or with blocks that are not calls, stays content."""
    client = make(fake, tool_call_parser="hermes")
    fake.answer = HERMES
    body = {**CHAT, "tools": [WEATHER, TIME]}
    r = client.post("/v1/chat/completions", json=body).json()
    assert "structured_outputs" not in fake.requests[0].params
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cs = chunks(client.post("/v1/chat/completions",
                            json={**body, "tool_choice": "auto", "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in cs if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check. " and len(deltas[1:-1]) > 2   # in pieces, tag withheld
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "get_weather", {"city": "Paris"})]
    assert cs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    for answer in (ANSWER, 'a <tool_call> {"name": oops} </tool_call> b'):
        fake.answer = answer
        r = client.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": answer}
        assert r["choices"][0]["finish_reason"] == "stop"
        cs = chunks(client.post("/v1/chat/completions", json={**body, "stream": True}))
        assert "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in cs if c["choices"]) == answer
        assert cs[-1]["choices"][0]["finish_reason"] == "stop"


def named_calls(calls):
    """[(name, arguments)] of parsed tool calls, or None."""
    return None if calls is None else [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def feed_in_pieces(stream, text, size):
    """(content sent while streaming, content left at the end, calls) of text cut in pieces."""
    sent = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
    return (sent, *stream.finish())


@pytest.mark.parametrize("text, content, calls", [
    (HERMES, "Let me check.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "get_time", "parameters": {}}</tool_call>\n<tool_call>'
     '{"name": "get_weather", "arguments": {"city": "東京"}}</tool_call> done',
     "done", [("get_time", {}), ("get_weather", {"city": "東京"})]),
    ('x <tool_call>{"name": "get_time", "arguments": {}}', "x", [("get_time", {})]),  # unclosed
    ("if a < b and b <tool then", "if a < b and b <tool then", None),
    ('<tool_call>["get_time"]</tool_call>', '<tool_call>["get_time"]</tool_call>', None),
])
def test_hermes_parser_whole_and_streamed_in_any_pieces(text, content, calls):
    from client.openai_gateway.tools import HermesStream, hermes_calls
    got_content, got_calls = hermes_calls(text)
    assert got_content == content and named_calls(got_calls) == calls
    for size in (1, 2, 5, 11):      # the stream: content never shows a tag, however it is cut
        sent, rest, streamed_calls = feed_in_pieces(HermesStream(), text, size)
        if calls is None:
            assert sent + rest == text and streamed_calls is None
        else:
            assert "<tool_call>" not in sent and (sent.strip() + " " + rest).strip() == content
            assert [c["function"]["name"] for c in streamed_calls] == [n for n, _ in calls]


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather",
                                                                  {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_time", "arguments": {}}; {"name": "get_weather", '
     '"parameters": {"city": "Oslo"}}', [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ("  {not json} ", None),
    ('{"name": "get_time", "parameters": {}} and then some text', None),
    ("The weather {is} fine.", None),
    ("<|python", None),
])
def test_llama3_json_parser_whole_and_streamed(text, calls):
    """llama3_json: the whole output is the calls (`;`-joined JSON objects after an optional
    <|python_tag|>) or it is content; streamed, content goes out once its first characters
    say so, calls are held whole."""
    from client.openai_gateway.tools import Llama3JsonStream, llama3_json_calls
    content, got = llama3_json_calls(text)
    assert named_calls(got) == calls and content == (None if calls else text)
    for size in (1, 3, 8):
        sent, rest, streamed = feed_in_pieces(Llama3JsonStream(), text, size)
        if calls is None:
            assert sent + rest == text and streamed is None
        else:
            assert sent == rest == "" and len(streamed) == len(calls)
    if not text.lstrip().startswith(("{", "<|")):       # plain text streams from the start
        assert Llama3JsonStream().feed(text[:2]) == text[:2]


def test_auto_tool_choice_llama3_json_through_the_app(fake):
    client = make(fake, tool_call_parser="llama3_json")
    fake.answer = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    body = {**CHAT, "tools": [WEATHER]}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] \
        == [{"city": "Paris"}]
    cs = chunks(client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in cs if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    assert sum("tool_calls" in d for d in deltas) == 1
    assert cs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    fake.answer = ANSWER
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ANSWER}


def test_auto_tool_choice_flags(monkeypatch):
    """vLLM's flags: --enable-auto-tool-choice needs a known --tool-call-parser; the parser
    alone does not turn "auto" on."""
    from client.openai_gateway import __main__ as gateway_main
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])               # no parser named
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    fake = FakeBackend()
    fake.answer = HERMES
    monkeypatch.setattr(gateway_main, "TritonBackend", lambda *a: fake)
    monkeypatch.setattr(gateway_main.PromptRenderer, "from_path",
                        staticmethod(lambda path: PromptRenderer(FakeTokenizer())))
    body = {**CHAT, "model": "a", "tools": [WEATHER]}
    for flags, status in ((["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], 200),
                          (["--tool-call-parser", "hermes"], 400)):
        client = TestClient(build_app(parse_args(["--served-model-name", "a",
                                                  "--triton-metrics", "off", *flags])))
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == status, flags
        if status == 200:
            assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        else:
            assert r.json()["error"]["param"] == "tool_choice"


def test_tool_choice_none_is_plain_text_with_the_tools_in_the_prompt(client, fake):
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert "structured_outputs" not in fake.requests[0].params


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER]}, "tool_choice"),                           # auto, by default
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_400(client, fake, extra, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not fake.requests


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"model": "smol", "prompt": "ab cde f"})
    assert r.json() == {"count": 4, "tokens": [1, 2, 3, 1]}
    r = client.post("/tokenize", json={"prompt": "ab cde", "add_special_tokens": False})
    assert r.json()["tokens"] == [2, 3]
    # chat: the template's text, no special tokens added on top
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi there"}]})
    text = FakeTokenizer().apply_chat_template([{"role": "user", "content": "hi there"}])
    assert r.json()["tokens"] == [len(w) for w in text.split()]
    assert client.post("/detokenize", json={"tokens": [5, 7]}).json() == {"prompt": "t5 t7"}
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "no"},
                               "add_special_tokens"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": "12"}, "tokens"),
                              ("/tokenize", {"model": "gpt-9", "prompt": "x"}, "model")):
        r = client.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_echo_with_logprobs_scores_the_prompt_too(client, fake):
    """OpenAI's legacy completions: with echo and logprobs the prompt's tokens come first in
    logprobs (the first one's logprob null), text offsets over the echoed text."""
    body = {"model": "smol", "prompt": "The capital", "max_tokens": 2, "echo": True,
            "logprobs": 1}
    r = client.post("/v1/completions", json=body).json()
    assert fake.requests[0].params["prompt_logprobs"] == 1
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == "The capital" + "Paris est"
    assert lp["tokens"] == ["The", " capital", "Paris", " est"]
    assert lp["token_logprobs"] == [None, -1.0, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {" capital": -1.0}
    assert lp["text_offset"] == [0, 3, 11, 16]
    cs = chunks(client.post("/v1/completions", json={**body, "stream": True}))
    streamed = [c["choices"][0] for c in cs if c["choices"]]
    assert streamed[0]["text"] == "The capital"
    assert streamed[0]["logprobs"]["token_logprobs"] == [None, -1.0]
    assert "".join(c["text"] for c in streamed) == r["choices"][0]["text"]
    offsets = [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    # without echo the prompt is not scored
    client.post("/v1/completions", json={**body, "echo": False})
    assert "prompt_logprobs" not in fake.requests[-1].params


def test_metrics_route_passes_triton_s_text_or_says_503(fake, tmp_path):
    page = tmp_path / "metrics"
    page.write_text('vllm:num_requests_running{model_name="m"} 3\n')
    client = TestClient(create_app(fake, ["smol"], api_key=KEY, metrics_url=page.as_uri()))
    assert client.get("/metrics").status_code == 401              # the key, as on every route
    r = client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.text == page.read_text()
    gone = TestClient(create_app(fake, ["smol"], metrics_url=(tmp_path / "none").as_uri()))
    r = gone.get("/metrics")
    assert r.status_code == 503 and r.json()["error"]["code"] == "metrics_unavailable"
    assert TestClient(create_app(fake, ["smol"])).get("/metrics").status_code == 404


def test_continue_final_message_and_continuous_usage(fake):
    tok = FakeTokenizer()
    client = TestClient(create_app(fake, ["smol"], renderer=PromptRenderer(tok)))
    msgs = CHAT["messages"] + [{"role": "assistant", "content": "Paris is"}]
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": msgs,
                                                     "continue_final_message": True}).status_code == 200
    assert tok.template_kwargs == {"continue_final_message": True}
    assert not fake.requests[0].prompt.endswith("<assistant>")    # no new turn opened
    r = client.post("/v1/chat/completions", json={**CHAT, "continue_final_message": True,
                                                  "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    body = {**COMP, "stream": True, "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": True}}
    cs = chunks(client.post("/v1/completions", json=body))
    done = [c["usage"]["completion_tokens"] for c in cs]
    assert all(c["usage"] is not None for c in cs) and done == sorted(done)
    assert done[-1] == len(ANSWER.split(" ")) and cs[-1]["choices"] == []
