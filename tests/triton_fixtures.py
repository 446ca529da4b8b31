"""A real tritonserver on the real SmolLM2 model, started once per test session on free ports
(so the suite runs beside a `make serve`), the OpenAI gateway as a process in front of one, and
helpers to read /metrics and call HTTP."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import httpx
import pytest

from pagedbackend.serving.launcher import TritonServer, free_port, materialize_repository

# Small enough to start fast on 2 CPU cores; big enough for the tests' prompts.
# float32: tests compare separate generations, which bf16 rounding (e.g. a prefix-cache hit
# changing the prefill shapes) could make diverge; bf16 is covered by test_smollm2 and W6.
TEST_ENGINE_SETTINGS = {"max_model_len": "1024", "max_num_seqs": "32", "dtype": "float32"}


@contextlib.contextmanager
def running_server(model_dir: str, settings: Mapping[str, str] = TEST_ENGINE_SETTINGS,
                   edit: Optional[Callable[[Path], None]] = None) -> Iterator[TritonServer]:
    """tritonserver on free ports, in a temporary folder removed when it stops; `edit` may
    change the materialized repository before the start."""
    work = Path(tempfile.mkdtemp(prefix="pagedbackend-triton-test-"))
    try:
        repo = materialize_repository(work / "repo", {"model": model_dir, **settings})
        if edit is not None:
            edit(repo)
        server = TritonServer(repo, work, free_port(), free_port(), free_port())
        with open(work / "tritonserver.log", "w") as log:
            server.start(stdout=log, stderr=log)
            try:
                server.wait_ready(timeout=300)
            except Exception:
                server.stop()
                log.flush()
                tail = (work / "tritonserver.log").read_text()[-4000:]
                pytest.fail(f"tritonserver did not start:\n{tail}")
            try:
                yield server
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def running_gateway(server, tokenizer: str, *args: str, env: Optional[Mapping[str, str]] = None,
                    secret: Optional[str] = None) -> Iterator[dict]:
    """`python -m client.openai_gateway` in front of `server` on a free port, as its own process
    (uvicorn, so disconnects are real), with `args` added; yields {"base", "port", "log"} once
    /health answers. With `secret`, checks at the end that it never reached the gateway's log."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="gateway-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "client.openai_gateway", "--triton-grpc", server.grpc_url,
         "--triton-metrics", server.metrics_url, "--port", str(port), "--tokenizer", tokenizer,
         *args], cwd=Path(__file__).resolve().parents[1], env={**os.environ, **(env or {})},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(log.name).read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway not healthy: " + open(log.name).read()
            time.sleep(0.3)
        yield {"base": base, "port": port, "log": log.name}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        text = open(log.name).read()
        os.unlink(log.name)
        assert secret is None or secret not in text, "the API key appeared in the gateway's log"


@pytest.fixture(scope="session")
def triton(smollm2_dir):
    with running_server(smollm2_dir) as server:
        yield server


def metrics(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found:
        raise KeyError(f"{name}{labels} not in /metrics")
    return total


def http_post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.http_url}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http_ready(server, model: str = "") -> bool:
    path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
