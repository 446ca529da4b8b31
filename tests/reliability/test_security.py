"""Security of what ships: the gateway's API key on every route but /health, its body limit,
everything bound to 127.0.0.1 unless told otherwise, Triton's admin APIs closed to requests
without the admin key, and no pickle / eval / exec on data that comes in from outside."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import httpx
import pytest

from reliability_helpers import API_KEY, ROOT

ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/smollm2-135m-instruct", None),
          ("GET", "/version", None), ("GET", "/metrics", None),
          ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
          ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
          ("POST", "/v1/chat/completions",
           {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_api_key_on_every_route_but_health(gateway, method, path, body):
    url = gateway["base"] + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}, {"X-Api-Key": API_KEY}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and API_KEY not in r.text
    r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(gateway["base"] + "/health", timeout=10).status_code == 200


def test_api_key_compared_in_constant_time():
    from client.openai_gateway import app
    source = inspect.getsource(app.ApiKeyMiddleware)
    assert "hmac.compare_digest(given, self._key)" in source
    assert not re.search(r"self\._key\s*[!=]=|[!=]=\s*self\._key", source)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_413_with_a_message(gateway, chunked):
    """10 MB against the default 4 MiB limit: the client gets the 413 (not a reset connection),
    declared in Content-Length or streamed without one; the next request is served."""
    big = b'{"prompt": "' + b"x" * (10 << 20) + b'"}'
    content = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)) if chunked else big
    r = httpx.post(gateway["base"] + "/v1/completions", content=content, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "4194304 bytes" in err["message"]
    r = httpx.post(gateway["base"] + "/v1/completions", timeout=60,
                   json={"prompt": "The capital of France is", "max_tokens": 2,
                         "temperature": 0}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]


# 127.0.0.1 as /proc/net/tcp writes it, and as ::ffff:127.0.0.1 in /proc/net/tcp6
LOOPBACK = ("0100007F", "0000000000000000FFFF00000100007F")


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def test_everything_listens_on_127_0_0_1_only(triton, gateway):
    """The running test servers (started as serve.py starts them) bind the loopback address
    only, and the defaults of serve.py and the gateway say 127.0.0.1."""
    for port in (triton.http_port, triton.grpc_port, triton.metrics_port, gateway["port"]):
        addrs = _listening(port)
        assert addrs and all(a in LOOPBACK for a in addrs), (port, addrs)
    from client.openai_gateway.__main__ import parse_args
    assert parse_args([]).host == "127.0.0.1"
    text = (ROOT / "scripts" / "serve.py").read_text()
    assert '"--host", "127.0.0.1"' in text and "0.0.0.0" not in text


ADMIN = [("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/engine/unload"),
         ("GET", "/v2/logging"), ("GET", "/v2/trace/setting"),
         ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status")]


def test_triton_admin_apis_need_the_admin_key(triton):
    """Model control, shared memory, trace and logging answer 403 without the header (an
    unload attempt leaves the model ready); inference, health and metadata stay open."""
    base = f"http://{triton.http_url}"
    for method, path in ADMIN:
        r = httpx.request(method, base + path, timeout=30)
        assert r.status_code == 403 and "restricted" in r.text, (path, r.text)
    assert httpx.get(base + "/v2/models/engine/ready", timeout=10).status_code == 200
    for method, path in ADMIN:
        if "unload" not in path and "cuda" not in path:    # the CPU build has no CUDA shm
            r = httpx.request(method, base + path, headers=triton.admin_headers, timeout=30)
            assert r.status_code == 200, (path, r.text)
    for path in ("/v2/health/ready", "/v2/models/ensemble", "/v2/models/ensemble/config"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.get_log_settings()
    with pytest.raises(InferenceServerException, match="restricted"):
        client.unload_model("engine")
    assert client.get_log_settings(headers=triton.admin_grpc_headers, as_json=True)
    assert client.is_model_ready("ensemble")


def test_container_restricts_the_admin_apis(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        import serve_container
    finally:
        sys.path.remove(str(ROOT / "deploy"))
    monkeypatch.setattr(serve_container, "find_tritonserver", lambda: Path("/x/bin/tritonserver"))
    monkeypatch.setattr(serve_container, "backend_directory", lambda b, w: Path("/x/backends"))
    monkeypatch.setenv("PAGEDBACKEND_ADMIN_KEY", "k1")
    triton, _ = serve_container.commands(serve_container.parse_args([]), tmp_path)
    apis = "model-repository,shared-memory,trace,logging"
    assert f"--http-restricted-api={apis}:triton-admin-key=k1" in triton
    assert f"--grpc-restricted-protocol={apis}:triton-admin-key=k1" in triton
    monkeypatch.delenv("PAGEDBACKEND_ADMIN_KEY")
    again, _ = serve_container.commands(serve_container.parse_args([]), tmp_path)
    key = [a for a in again if a.startswith("--http-restricted-api")][0].rsplit("=", 1)[1]
    assert len(key) >= 32 and key != "k1"                # unset: a random key, APIs closed


# ---- no deserialisation or code evaluation of outside data in shipped code ------------------
SHIPPED = ("pagedbackend", "client", "model_repository", "scripts", "deploy")
DANGEROUS = re.compile(
    r"\bpickle\.loads?\(|\bcPickle\b|\bdill\b|\bcloudpickle\b|\bmarshal\.loads?\(|\bshelve\b"
    r"|(?<![.\w])eval\(|(?<![.\w])exec\(|\bcompile\([^)]*['\"]exec['\"]"
    r"|\byaml\.(?:unsafe_)?load\((?![^)]*SafeLoader)|torch\.load\((?![^)]*weights_only=True)"
    r"|shell=True|\bos\.system\(|\bos\.popen\(|__import__\(")
# file -> why its match is not outside data
ALLOWED = {
    "pagedbackend/worker/tp_worker.py": "pickle.loads of what rank 0 (the same engine, the "
    "parent process) sends on its multiprocessing Pipe; no network or client data",
}


def scan(files) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if DANGEROUS.search(code):
                found.setdefault(str(path.relative_to(ROOT)), []).append(f"{n}: {line.strip()}")
    return found


def test_no_pickle_eval_or_exec_on_outside_data():
    files = [p for d in SHIPPED for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    found = scan(files)
    assert set(found) - set(ALLOWED) == set(), {k: v for k, v in found.items()
                                                if k not in ALLOWED}
    assert set(ALLOWED) <= set(found), "an allowed use is gone: drop it from ALLOWED"


def test_the_scan_is_not_vacuous(tmp_path):
    bad = ROOT / "tests" / "reliability" / "_scan_probe.py"
    bad.write_text("import pickle, yaml, torch\nx = pickle.loads(b)\ny = eval(s)\n"
                   "z = yaml.load(t)\nw = torch.load(f)\nmodel.eval()\nstop.exec(decoupled=True)\n"
                   "ok = torch.load(f, weights_only=True)\n")
    try:
        lines = scan([bad])["tests/reliability/_scan_probe.py"]
    finally:
        bad.unlink()
    assert [line.split(":")[0] for line in lines] == ["2", "3", "4", "5"]
