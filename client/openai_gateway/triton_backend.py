"""The gateway's Triton side: one gRPC bidirectional stream per choice, with tritonclient's asyncio
API, against the `ensemble` model's client tensors (docs/DESIGN.md, "Triton tensors").

Tensor shapes and which inputs exist are read from the model's config once, so a leading batch
dimension (max_batch_size > 0) or a missing optional tensor needs no change here: a sampling field
without its own tensor travels in the `sampling_parameters` JSON instead.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import AsyncIterator, Optional

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from client.openai_gateway.backend import BackendError, BackendRequest, Chunk, TokenLogprob
from pagedbackend.config import EngineConfig
from pagedbackend.serving.admission import AdmissionConfig
from pagedbackend.serving.settings import convert_parameter, parameters_of

# SamplingParams field → ensemble tensor, with the tensor's datatype.
_TENSORS = {
    "max_tokens": ("max_tokens", "INT32"), "temperature": ("temperature", "FP32"),
    "top_p": ("top_p", "FP32"), "top_k": ("top_k", "INT32"), "min_p": ("min_p", "FP32"),
    "repetition_penalty": ("repetition_penalty", "FP32"),
    "presence_penalty": ("presence_penalty", "FP32"),
    "frequency_penalty": ("frequency_penalty", "FP32"), "seed": ("seed", "UINT64"),
    "min_tokens": ("min_tokens", "INT32"), "ignore_eos": ("ignore_eos", "BOOL"),
    "stop": ("stop_words", "BYTES"), "bad_words": ("bad_words", "BYTES"),
}
_NUMPY = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_,
          "BYTES": np.object_}


# The engine model's parameters the model list shows (set ones only; docs/SERVING.md names them)
SHOWN_SETTINGS = ("max_model_len", "dtype", "kv_cache_dtype", "quantization", "block_size",
                  "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                  "enable_prefix_caching", "speculative_config", "swap_space",
                  "preemption_mode", "max_queue_len", "max_queue_delay_ms")


# each shown setting's type as the engine reads it
_HINTS = {f.name: str(f.type) for cls in (EngineConfig, AdmissionConfig)
          for f in dataclasses.fields(cls)}


class TritonBackend:
    def __init__(self, url: str, model: str = "ensemble", engine_model: str = "engine") -> None:
        self.url, self.model, self.engine_model = url, model, engine_model
        self._settings: Optional[dict] = None
        self._client: Optional[grpcclient.InferenceServerClient] = None
        self._inputs: Optional[set] = None      # input names of the model, read once
        self._outputs: set = set()
        self._batched = False

    def _grpc(self) -> grpcclient.InferenceServerClient:
        # Created on first use, inside the server's event loop, which the gRPC channel binds to.
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            c = self._grpc()
            return bool(await c.is_server_ready() and await c.is_model_ready(self.model))
        except Exception:  # noqa: BLE001 - any failure to answer means "not ready"
            return False

    async def version(self) -> str:
        meta = await self._grpc().get_server_metadata(as_json=True)
        return str(meta.get("version", ""))

    async def _model_inputs(self) -> set:
        if self._inputs is None:
            try:
                cfg = (await self._grpc().get_model_config(self.model, as_json=True))["config"]
            except InferenceServerException as e:
                raise BackendError(f"unavailable: {e.message()}") from None
            self._batched = int(cfg.get("max_batch_size", 0)) > 0
            self._inputs = {i["name"] for i in cfg.get("input", [])}
            self._outputs = {o["name"] for o in cfg.get("output", [])}
        return self._inputs

    async def supports_logprobs(self) -> bool:
        await self._model_inputs()
        return "logprobs" in self._outputs

    async def settings(self) -> dict:
        """The engine model's configured parameters among SHOWN_SETTINGS, typed as the engine
        types them (EngineConfig's and AdmissionConfig's fields), read once; {} while the
        engine model's config cannot be read."""
        if self._settings is None:
            try:
                cfg = (await self._grpc().get_model_config(self.engine_model,
                                                           as_json=True))["config"]
            except InferenceServerException:
                return {}
            params = parameters_of(cfg)
            self._settings = {k: convert_parameter(k, params[k], _HINTS.get(k, "str"))
                              for k in SHOWN_SETTINGS if k in params}
        return self._settings

    def _tensor(self, name: str, dtype: str, values: list) -> grpcclient.InferInput:
        arr = np.array(values, dtype=_NUMPY[dtype])
        if dtype == "BYTES":
            arr = np.array([v.encode() for v in values], dtype=np.object_)
        if self._batched:
            arr = arr.reshape(1, -1)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    async def _request(self, req: BackendRequest) -> dict:
        names = await self._model_inputs()
        inputs = [self._tensor("text_input", "BYTES", [req.prompt]),
                  # Always streamed from Triton, also for non-streaming clients: the ensemble
                  # notices a cancelled request only between its steps, i.e. at a response, so
                  # a non-streamed request would run to its end after its client left.
                  self._tensor("stream", "BOOL", [True]),
                  self._tensor("exclude_input_in_output", "BOOL", [True])]
        extra = {}
        for field, value in req.params.items():
            tensor = _TENSORS.get(field)
            if tensor is not None and not _fits(value, tensor[1]):
                tensor = None        # e.g. top_k=10**12: exact in the JSON, wrapped in an INT32
            if value is None or value == [] or tensor is None or tensor[0] not in names:
                if value is not None and value != []:
                    extra[field] = value
                elif field == "max_tokens":
                    extra[field] = None       # up to the context, said explicitly
                continue
            inputs.append(self._tensor(tensor[0], tensor[1],
                                       value if isinstance(value, list) else [value]))
        if req.priority:
            inputs.append(self._tensor("priority", "INT32", [req.priority]))
        if req.cache_salt:
            inputs.append(self._tensor("cache_salt", "BYTES", [req.cache_salt]))
        if extra:
            inputs.append(self._tensor("sampling_parameters", "BYTES", [json.dumps(extra)]))
        return {"model_name": self.model, "inputs": inputs, "request_id": req.request_id,
                "parameters": {"triton_enable_empty_final_response": True}}

    async def generate(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        """Chunks as Triton sends them, or, for `req.stream=False`, one chunk for the whole
        output (the deltas concatenate exactly to the non-streamed text)."""
        whole: Optional[Chunk] = None
        async with contextlib.aclosing(self._responses(req)) as responses:
            async for chunk in responses:
                if req.stream:
                    yield chunk
                elif whole is None:
                    whole = chunk
                else:
                    whole.text += chunk.text
                    whole.finish_reason = chunk.finish_reason or whole.finish_reason
                    whole.num_input_tokens = max(whole.num_input_tokens, chunk.num_input_tokens)
                    whole.num_output_tokens = chunk.num_output_tokens
                    if chunk.logprobs:
                        whole.logprobs = (whole.logprobs or []) + chunk.logprobs
                    whole.prompt_logprobs = whole.prompt_logprobs or chunk.prompt_logprobs
        if whole is not None:
            yield whole

    async def _responses(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        request = await self._request(req)

        async def one_request():
            yield request

        stream = self._grpc().stream_infer(one_request())
        final, num_output = False, 0
        try:
            async for result, error in stream:
                if error is not None:
                    raise BackendError(error.message() if hasattr(error, "message")
                                       else str(error))
                final = _is_final(result)
                chunk = _chunk(result)
                if chunk is not None and not _empty(chunk):
                    # The engine counts the tokens of each response; clients get running totals.
                    num_output += chunk.num_output_tokens
                    chunk.num_output_tokens = num_output
                    yield chunk
                if final:
                    return
        except InferenceServerException as e:
            raise BackendError(e.message()) from None
        except asyncio.CancelledError:
            raise
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - gRPC transport errors (server gone, refused)
            detail = e.details() if hasattr(e, "details") else str(e)
            raise BackendError(f"unavailable: {detail}") from None
        finally:
            if not final:
                # The client went away (or we failed): cancelling the gRPC call makes Triton cancel
                # the request, and the engine aborts it and frees its KV blocks.
                stream.cancel()


def _fits(value, dtype: str) -> bool:
    """Whether an integer value survives the tensor's integer type unchanged."""
    bounds = {"INT32": (-2**31, 2**31), "UINT64": (0, 2**64)}.get(dtype)
    if bounds is None or not isinstance(value, int) or isinstance(value, bool):
        return True
    return bounds[0] <= value < bounds[1]


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def _empty(chunk: Chunk) -> bool:
    """A response with nothing in it: the engine's probe of a queued request (docs/SERVING.md
    `queued_probe_ms`). Dropped here, so a queue timeout still ends the request before its HTTP
    status is sent."""
    return not (chunk.text or chunk.finish_reason or chunk.num_output_tokens or chunk.logprobs
                or chunk.prompt_logprobs)


def _chunk(result) -> Optional[Chunk]:
    """One Triton response → Chunk; None for the empty final response."""
    text = result.as_numpy("text_output")
    if text is None:
        return None
    finish = _scalar(result, "finish_reason")
    lp = _scalar(result, "logprobs")
    plp = _scalar(result, "prompt_logprobs")
    return Chunk(text="".join(_str(t) for t in np.ravel(text)),
                 finish_reason=finish or None,
                 num_input_tokens=int(_scalar(result, "num_input_tokens") or 0),
                 num_output_tokens=int(_scalar(result, "num_output_tokens") or 0),
                 logprobs=parse_logprobs(lp) if lp else None,
                 prompt_logprobs=parse_logprobs(plp) if plp else None)


def _scalar(result, name: str):
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return None
    v = np.ravel(arr)[0]
    return _str(v) if isinstance(v, (bytes, np.bytes_, str)) else v


def _str(v) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) else str(v)


def parse_logprobs(text: str) -> list[TokenLogprob]:
    """The `logprobs` output, JSON, one entry per new token: {"token", "logprob",
    "top_logprobs": [[token, logprob], ...]} (also accepted: vLLM's {token_id: {"logprob",
    "decoded_token"}} maps, sampled token first)."""
    out = []
    for e in json.loads(text):
        if "logprob" in e:
            top = [(str(t), float(lp)) for t, lp in e.get("top_logprobs") or []]
            lp = None if e["logprob"] is None else float(e["logprob"])
            out.append(TokenLogprob(str(e.get("token", "")), lp, top))
        else:
            items = [(v.get("decoded_token", k), float(v["logprob"])) for k, v in e.items()]
            ranked = sorted(items, key=lambda x: -x[1])
            out.append(TokenLogprob(items[0][0], items[0][1], ranked))
    return out
