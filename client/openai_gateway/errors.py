"""OpenAI-shaped errors: one exception type, and the mapping from Triton's error text to a status."""
from __future__ import annotations

import re
from typing import Optional

# The engine's one error shape (pagedbackend.config.check), possibly wrapped by Triton in
# "in ensemble 'ensemble', ..." prefixes.
_FIELD_ERROR = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*)=(.+?) is invalid: must be (.+)$", re.S)
# Engine and tensor names that stand for what the client called the prompt.
_PROMPT_FIELDS = {"text_input", "prompt", "prompt_token_ids", "input_ids", "prompt_len",
                  "prompt_length", "num_prompt_tokens", "prompt_tokens"}
_QUEUE_FULL = ("exceeds maximum queue size", "queue is full", "queue full", "resource exhausted",
               "resource_exhausted", "too many requests", "max_inflight")
_UNAVAILABLE = ("not ready", "unavailable", "is not found", "unknown model", "failed to connect",
                "connection refused", "shutting down", "engine loop", "not loaded",
                "is not healthy", "max_queue_delay_ms")


class APIError(Exception):
    """An error the gateway answers with, in OpenAI's shape: {"error": {...}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[int] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.retry_after = code, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(err: ValueError, renames: Optional[dict] = None) -> APIError:
    """A `check()` ValueError ("<field>=<value> is invalid: must be ...") → 400 naming the field as
    the client spelled it (`renames` maps engine names back, e.g. logprobs → top_logprobs)."""
    renames = renames or {}
    msg = str(err)
    m = _FIELD_ERROR.search(msg)
    if not m:
        return bad_request(msg)
    field = renames.get(m.group(1), m.group(1))
    return bad_request(f"{field}={m.group(2)} is invalid: must be {m.group(3).strip()}", param=field)


def from_triton(message: str, prompt_param: str = "prompt",
                renames: Optional[dict] = None) -> APIError:
    """Triton's error text → the status a client should see. Triton's stream errors carry only a
    message, so the status is read from it: the engine's field errors are 400, a full queue 429, a
    server or model that is not ready 503; anything else is a 500 without internals."""
    low = message.lower()
    m = _FIELD_ERROR.search(message)
    if m:
        field = m.group(1)
        field = prompt_param if field in _PROMPT_FIELDS else (renames or {}).get(field, field)
        code = "context_length_exceeded" if field == prompt_param else None
        return APIError(400, f"{field}={m.group(2)} is invalid: must be {m.group(3).strip()}",
                        param=field, code=code)
    if any(s in low for s in _QUEUE_FULL):
        return APIError(429, "The server is busy; retry later.", type_="rate_limit_error",
                        code="server_busy", retry_after=1)
    if any(s in low for s in _UNAVAILABLE):
        return APIError(503, "The model is not ready; retry later.", type_="service_unavailable",
                        code="model_not_ready", retry_after=5)
    if "invalid" in low or "invalid_arg" in low:
        return bad_request(_first_line(message))
    return APIError(500, "The inference server failed to answer this request.",
                    type_="server_error", code="internal_error")


def _first_line(message: str) -> str:
    # Triton prefixes ("in ensemble 'ensemble', ") are kept out of what clients see.
    line = message.strip().splitlines()[0] if message.strip() else "invalid request"
    return re.sub(r"^(in ensemble '[^']*', )+", "", line)
