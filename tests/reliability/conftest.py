"""Fixtures of the reliability battery: the session's tritonserver (tests/conftest.py `triton`),
one OpenAI gateway with an API key in front of it, SmolLM2 with its sampling defaults. The ways
in are in reliability_helpers.py; fault fixtures live in fault_fixtures.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from reliability_helpers import API_KEY, QUESTION, ROOT  # noqa: F401 (QUESTION: tests)


@pytest.fixture(scope="session")
def gateway(triton, smollm2_dir):
    """`python -m client.openai_gateway` on a free port with an API key (from the env variable),
    the default 4 MiB body limit; yields its base URL."""
    from pagedbackend.serving.launcher import free_port

    port = free_port()
    env = {**os.environ, "PAGEDBACKEND_API_KEY": API_KEY}
    log = tempfile.NamedTemporaryFile("w+", prefix="gateway-rel-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "client.openai_gateway", "--triton-grpc", triton.grpc_url,
         "--triton-metrics", triton.metrics_url, "--port", str(port),
         "--tokenizer", smollm2_dir], cwd=ROOT, env=env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
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
        yield {"base": base, "log": log.name, "port": port}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        text = open(log.name).read()
        os.unlink(log.name)
        assert API_KEY not in text, "the API key appeared in the gateway's log"


@pytest.fixture(scope="session")
def chat_prompt(smollm2_dir) -> str:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                   add_generation_prompt=True)


@pytest.fixture(scope="session")
def sampling_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """SmolLM2 with generation_config.json's sampling values as scripts/prepare_model.py writes
    them: the prepared folder itself once `make model` has brought it up to date, else a
    folder of links to its files with the file rewritten (the prepared folder is not ours)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import prepare_model
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    gen = json.loads((Path(smollm2_dir) / "generation_config.json").read_text())
    if all(gen.get(k) == v for k, v in prepare_model.SMOLLM2_SAMPLING.items()):
        return smollm2_dir
    out = tmp_path_factory.mktemp("smollm2-sampling") / "smollm2-135m-instruct"
    out.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f.resolve())
    shutil.copy(Path(smollm2_dir) / "generation_config.json", out / "generation_config.json")
    assert prepare_model.add_sampling_defaults(str(out))
    return str(out)
