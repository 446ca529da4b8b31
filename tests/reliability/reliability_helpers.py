"""The reliability battery's ways in (Triton HTTP generate, gRPC streaming, the OpenAI gateway)
as plain functions returning (status, text), and shared constants."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-reliability-test-key"
QUESTION = "What is the capital of France?"


# ---- the three interfaces, each returning (status, body text) --------------------------------
def http_generate(triton, body, raw: Optional[bytes] = None) -> tuple[int, str]:
    """POST /v2/models/ensemble/generate (Triton's HTTP generate endpoint)."""
    data = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(f"http://{triton.http_url}/v2/models/ensemble/generate", content=data,
                   timeout=120)
    return r.status_code, r.text


def grpc_stream(triton, inputs: list, model: str = "ensemble") -> tuple[int, str]:
    """One request on a gRPC stream (tritonclient), inputs as (name, array, datatype); returns
    (200, text) or (400, the error's message) for an error."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        tensors = []
        for name, array, dtype in inputs:
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            tensors.append(t)
        client.async_stream_infer(model, tensors, request_id="r",
                                  enable_empty_final_response=True)
        text = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:      # Triton 2.51's stream errors carry a message, no code
                return 400, error.message()
            out = result.as_numpy("text_output")
            if out is not None:
                text += [v.decode("utf-8", "replace") for v in out.reshape(-1)]
            params = result.get_response().parameters
            if params["triton_final_response"].bool_param:
                return 200, "".join(text)
    finally:
        client.stop_stream()
        client.close()


def openai_post(gateway, path: str, body=None, raw: Optional[bytes] = None,
                key: Optional[str] = API_KEY, headers: Optional[dict] = None
                ) -> tuple[int, str]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(gateway["base"] + path, content=data, headers=hdrs, timeout=120)
    return r.status_code, r.text


def text_tensor(name: str, values: list) -> tuple:
    return name, np.array([[v if isinstance(v, bytes) else v.encode() for v in values]],
                          dtype=object), "BYTES"


def scalar_tensor(name: str, value, dtype) -> tuple:
    names = {np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64", np.bool_: "BOOL"}
    return name, np.array([[value]], dtype=dtype), names[dtype]
