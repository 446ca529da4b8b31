"""Fixtures of the reliability battery: the session's tritonserver (tests/conftest.py `triton`),
one OpenAI gateway with an API key in front of it, SmolLM2 with its sampling defaults. The ways
in are in reliability_helpers.py; fault fixtures live in fault_fixtures.py."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from reliability_helpers import API_KEY, QUESTION, ROOT  # noqa: F401 (QUESTION: tests)
from triton_fixtures import running_gateway


@pytest.fixture(scope="session")
def gateway(triton, smollm2_dir):
    """`python -m client.openai_gateway` on a free port with an API key (from the env variable),
    the default 4 MiB body limit and the default address; yields its base URL, port and log."""
    with running_gateway(triton, smollm2_dir, env={"PAGEDBACKEND_API_KEY": API_KEY},
                         secret=API_KEY) as gw:
        yield gw


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
