import importlib
import os

import pytest
import torch

# Without CUDA the triton-language kernels run in triton's interpreter, which triton reads when
# it decorates a function: its own library's too (tl.zeros is one), decorated when triton is
# first imported. Set here, before any test module can import triton (test_perf_variants.py's
# importorskip did, and a later kernel test file then failed in every kernel); kernel_env.py
# also sets it for the kernel test files run on their own.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The matmul tuners' disk cache (kernels/tuning_cache.py) stays out of the suite and of the
# servers it starts: GPU runs tune afresh, and nothing is written under ~/.cache. Its own tests
# point it at a temporary folder.
os.environ["PAGEDBACKEND_TUNING_CACHE"] = "off"

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
