"""A client's cancel stops the engine request wherever it lands in the ensemble, including while
a stream_guard step runs. A tritonserver of its own makes that moment easy to hit: its
stream_guard takes 0.8 s per response and its engine sends one response per second. With the
guard between the engine and the detokenizer, a cancel landing there got the next detokenizer
step dropped (which ends the ensemble) and no later guard step ran: the engine request ran to its
end (in test_disconnect_frees_kv_blocks under CPU load, 4 runs in 300)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from triton_fixtures import TEST_ENGINE_SETTINGS, metric_value, metrics, running_server

tritonclient = pytest.importorskip("tritonclient.grpc")
from client.triton_client import build_inputs  # noqa: E402

GUARD = Path(__file__).resolve().parents[1] / "model_repository" / "stream_guard" / "1" / "model.py"
GUARD_S = 0.8
SLOW_GUARD = f'''import importlib.util
import time

spec = importlib.util.spec_from_file_location("stream_guard_model", {str(GUARD)!r})
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)


class TritonPythonModel(guard.TritonPythonModel):
    def execute(self, requests):
        if not any(r.is_cancelled() for r in requests):
            time.sleep({GUARD_S})
        return super().execute(requests)
'''


def slow_guard(repo: Path) -> None:
    version = repo / "stream_guard" / "1"
    version.unlink()
    version.mkdir()
    (version / "model.py").write_text(SLOW_GUARD)


@pytest.fixture(scope="module")
def slow_triton(smollm2_dir):
    with running_server(smollm2_dir, {**TEST_ENGINE_SETTINGS, "max_responses_per_s": "1"},
                        edit=slow_guard) as server:
        yield server


def running(server) -> float:
    return metric_value(metrics(server), "vllm:num_requests_running")


def test_cancel_while_a_guard_step_runs_stops_the_engine(slow_triton):
    for i in range(3):
        client = tritonclient.InferenceServerClient(slow_triton.grpc_url)
        first = threading.Event()
        client.start_stream(callback=lambda result, error: first.set())
        client.async_stream_infer("ensemble", build_inputs(
            "Tell me a long story.", max_tokens=200, ignore_eos=True, stream=True),
            request_id=f"cancel-{i}", enable_empty_final_response=True)
        assert first.wait(60), "no first response"
        # The first response arrives as its guard step ends; the next one leaves the engine
        # about 1 s after the first, so its guard step runs from ~1 - GUARD_S s to ~1 s from now.
        time.sleep(1.0 - GUARD_S / 2)
        client.stop_stream(cancel_requests=True)
        client.close()
        deadline = time.monotonic() + 3 * (1.0 + GUARD_S)
        while running(slow_triton) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running(slow_triton) == 0, f"request {i} still runs after its cancel"
