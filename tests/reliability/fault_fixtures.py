"""Helpers of the fault and overload tests (tests/reliability/test_faults.py, test_overload.py):
servers of their own with special settings, the gateway as a process, the processes below a
tritonserver, the `vllm:*` gauges, and streaming clients that report how a request ended.
Import what you use explicitly; tests/conftest.py gives `smollm2_dir` and the session `triton`."""
from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from typing import Callable, Iterator, Optional

import httpx

from triton_fixtures import metric_value, metrics, running_gateway

from pagedbackend.serving import processes

GATEWAY_KEY = "sk-fault-test-key"


def wait_for(fn: Callable[[], bool], timeout: float = 30.0, period: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(period)
    return bool(fn())


def gauges(server) -> dict[str, float]:
    """The engine's vllm gauges: running, waiting, kv (usage fraction)."""
    text = metrics(server)
    return {"running": metric_value(text, "vllm:num_requests_running"),
            "waiting": metric_value(text, "vllm:num_requests_waiting"),
            "kv": metric_value(text, "vllm:kv_cache_usage_perc")}


def idle(server) -> bool:
    try:
        return gauges(server) == {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    except (OSError, KeyError):
        return False


def descendants(root: int) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of every process below `root` (state "Z": a zombie)."""
    return [(p.pid, p.state, p.cmdline) for p in processes.descendants(root)]


def engine_stub(server) -> int:
    """The pid of the engine model's triton_python_backend_stub (its argv names engine/1)."""
    stubs = [p for p, state, cmd in descendants(server.proc.pid)
             if "triton_python_backend_stub" in cmd and "/engine/1/" in cmd and state != "Z"]
    assert len(stubs) == 1, f"expected one engine stub, found {stubs}"
    return stubs[0]


def http_stream(server, body: dict, events: "queue.Queue", model: str = "ensemble",
                timeout: float = 120.0) -> None:
    """POST generate_stream; put ("data", dict) per SSE event, then one ("end", how): "final"
    (a response with finish_reason), "error: <text>", or "closed: <exception>"."""
    url = f"http://{server.http_url}/v2/models/{model}/generate_stream"
    how = "closed: the stream ended without a final response"
    try:
        with httpx.stream("POST", url, json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    how = f"error: {data['error']}"
                    break
                events.put(("data", data))
                if data.get("finish_reason"):
                    how = "final"
                    break
    except (httpx.HTTPError, OSError) as e:
        how = f"closed: {type(e).__name__}: {e}"
    events.put(("end", how))


def grpc_inputs(prompt: str, max_tokens: int, stream: bool = True, **extra):
    from client.triton_client import build_inputs
    return build_inputs(prompt, max_tokens=max_tokens, stream=stream, ignore_eos=True, **extra)


class GrpcStream:
    """One gRPC bidirectional stream to the ensemble; `events` gets ("data", result) per
    response and ("end", "final" | "error: ...") once."""

    def __init__(self, server, prompt: str, max_tokens: int, model: str = "ensemble", **extra):
        import tritonclient.grpc as grpcclient

        self.events: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=self._on)
        self.client.async_stream_infer(model, grpc_inputs(prompt, max_tokens, **extra),
                                       enable_empty_final_response=True)

    def _on(self, result, error) -> None:
        if error is not None:
            self.events.put(("end", f"error: {error}"))
            return
        self.events.put(("data", result))
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.events.put(("end", "final"))

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        """Stop the stream; in a thread, since stop_stream() waits for a server that may hang."""
        def stop() -> None:
            with contextlib.suppress(Exception):
                self.client.stop_stream()
            with contextlib.suppress(Exception):
                self.client.close()
        t = threading.Thread(target=stop, daemon=True)
        t.start()
        t.join(5)


def first_data(events: "queue.Queue", timeout: float = 60.0):
    kind, value = events.get(timeout=timeout)
    assert kind == "data", f"the request ended before its first response: {value}"
    return value


def ending(events: "queue.Queue", timeout: float) -> Optional[str]:
    """How the request ended ("final", "error: ...", "closed: ..."), or None if it did not end
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kind, value = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if kind == "end":
            return value


@contextlib.contextmanager
def gateway_process(server, model_dir: str, *extra: str) -> Iterator[str]:
    """`python -m client.openai_gateway` in front of `server` on a free port; yields its base
    URL. The key is GATEWAY_KEY."""
    with running_gateway(server, model_dir, "--host", "127.0.0.1", "--served-model-name",
                         "smollm2", *extra, env={"PAGEDBACKEND_API_KEY": GATEWAY_KEY}) as gw:
        yield gw["base"]


def auth(key: str = GATEWAY_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def alive(pid: int) -> bool:
    """Running (a zombie, or a pid that is gone, is not)."""
    proc = processes.read_proc(pid)
    return proc is not None and proc.live
