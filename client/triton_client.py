"""A small gRPC streaming client for the `ensemble` (text) and `engine` (token ids) models.

    from client.triton_client import TritonLLMClient
    with TritonLLMClient("127.0.0.1:8001") as c:
        for delta in c.stream("Hello", max_tokens=16, temperature=0.0):
            print(delta.text, end="", flush=True)
        print(c.generate("Hello", max_tokens=16).text)

A client holds one gRPC stream and one request at a time (tritonclient reports stream errors
without their request id); use one client per concurrent request.
"""
from __future__ import annotations

import itertools
import json
import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

# Client tensor -> numpy dtype (the TensorRT-LLM Triton backend's dtypes).
TENSOR_DTYPES = {
    "max_tokens": np.int32, "temperature": np.float32, "top_k": np.int32, "top_p": np.float32,
    "min_p": np.float32, "repetition_penalty": np.float32, "presence_penalty": np.float32,
    "frequency_penalty": np.float32, "min_tokens": np.int32, "seed": np.uint64,
    "ignore_eos": np.bool_, "priority": np.int32, "stream": np.bool_,
    "exclude_input_in_output": np.bool_,
}
TRITON_DTYPES = {np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64", np.bool_: "BOOL"}


@dataclass
class Delta:
    text: str
    finish_reason: Optional[str]
    num_input_tokens: int
    num_output_tokens: int


@dataclass
class Completion:
    text: str
    finish_reason: Optional[str]
    num_input_tokens: int
    num_output_tokens: int
    deltas: list[Delta]


def build_inputs(prompt: Optional[str] = None, input_ids: Optional[Sequence[int]] = None,
                 stop: Optional[Sequence[str]] = None, cache_salt: Optional[str] = None,
                 sampling_parameters: Optional[dict] = None,
                 bad_words: Optional[Sequence[str]] = None, **scalars: Any
                 ) -> list[grpcclient.InferInput]:
    """InferInputs with a batch dimension of 1, as the ensemble and engine declare them."""
    inputs = []

    def add(name, array, triton_dtype):
        inp = grpcclient.InferInput(name, list(array.shape), triton_dtype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)

    def text(name, values):
        add(name, np.array([[v.encode("utf-8") for v in values]], dtype=object), "BYTES")

    if prompt is not None:
        text("text_input", [prompt])
    if input_ids is not None:
        add("input_ids", np.array([list(input_ids)], dtype=np.int32), "INT32")
    for name, value in scalars.items():
        if value is None:
            continue
        if name not in TENSOR_DTYPES:
            raise TypeError(f"unknown input {name!r}: one of {sorted(TENSOR_DTYPES)}")
        dtype = TENSOR_DTYPES[name]
        add(name, np.array([[value]], dtype=dtype), TRITON_DTYPES[dtype])
    if stop:
        text("stop_words", list(stop))
    if bad_words:
        text("bad_words", list(bad_words))
    if cache_salt is not None:
        text("cache_salt", [cache_salt])
    if sampling_parameters:
        text("sampling_parameters", [json.dumps(sampling_parameters)])
    return inputs


class TritonLLMClient:
    def __init__(self, url: str = "127.0.0.1:8001", model: str = "ensemble"):
        self.model = model
        self._client = grpcclient.InferenceServerClient(url)
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = threading.Lock()
        self._ids = itertools.count()
        self._stream_open = False

    def __enter__(self) -> "TritonLLMClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def cancel(self) -> None:
        """Cancel the in-flight request (ends the gRPC stream with cancel_requests=True)."""
        if self._stream_open:
            self._stream_open = False
            self._client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        if self._stream_open:
            self._stream_open = False
            self._client.stop_stream()
        self._client.close()

    def stream(self, prompt: Optional[str] = None, *, input_ids: Optional[Sequence[int]] = None,
               stream: bool = True, **kwargs: Any) -> Iterator[Delta]:
        """Yield one Delta per server response until the final one (raises on a server error)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this client already has a request in flight; use one client "
                               "per concurrent request")
        try:
            if not self._stream_open:
                self._client.start_stream(
                    callback=lambda result, error: self._responses.put((result, error)))
                self._stream_open = True
            self._client.async_stream_infer(
                self.model, build_inputs(prompt, input_ids, stream=stream, **kwargs),
                request_id=f"c{next(self._ids)}", enable_empty_final_response=True)
            while True:
                result, error = self._responses.get()
                if error is not None:
                    raise error
                params = result.get_response().parameters
                final = "triton_final_response" in params and \
                    params["triton_final_response"].bool_param
                if result.get_response().outputs:
                    d = _delta(result)
                    if d.text or d.finish_reason or d.num_output_tokens:
                        yield d         # else the engine's probe of a queued request: nothing
                if final:
                    return
        finally:
            self._busy.release()

    def generate(self, prompt: Optional[str] = None, **kwargs: Any) -> Completion:
        """Non-streamed request (stream=False, one response); pass stream=True to collect deltas."""
        kwargs.setdefault("stream", False)
        deltas = list(self.stream(prompt, **kwargs))
        last = deltas[-1] if deltas else Delta("", None, 0, 0)
        return Completion("".join(d.text for d in deltas), last.finish_reason,
                          last.num_input_tokens, sum(d.num_output_tokens for d in deltas),
                          deltas)


def _delta(result) -> Delta:
    def first(name, default):
        try:
            arr = result.as_numpy(name)
        except Exception:  # noqa: BLE001
            arr = None
        return default if arr is None else arr.reshape(-1)[0]

    text = first("text_output", b"")
    reason = first("finish_reason", b"")
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    reason = reason.decode("utf-8") if isinstance(reason, bytes) else str(reason)
    return Delta(text, reason or None, int(first("num_input_tokens", 0)),
                 int(first("num_output_tokens", 0)))


__all__ = ["Completion", "Delta", "InferenceServerException", "TritonLLMClient", "build_inputs"]
