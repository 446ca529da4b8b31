import importlib
import os

import pytest

# One tritonserver for the whole session, shared by every module that asks for `triton`.
from triton_fixtures import triton  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(ROOT, "models", "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real SmolLM2-135M-Instruct, prepared by `make model` (scripts/prepare_model.py)."""
    if not os.path.exists(os.path.join(SMOLLM2, "config.json")):
        pytest.fail(f"{SMOLLM2} is missing: run `make model` (scripts/prepare_model.py)")
    return SMOLLM2


@pytest.fixture()
def perf_module(monkeypatch):
    """import_module for the perf/ scripts, with perf/ on sys.path as when they run."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "perf"))
    return importlib.import_module
