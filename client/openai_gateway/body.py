"""A request body as JSON, or the 4xx that says why not: larger than the limit (413), not JSON,
nested too deeply, or holding text that is not Unicode (a lone UTF-16 surrogate such as
"\\ud800", which JSON allows and UTF-8 cannot carry to Triton)."""
from __future__ import annotations

import json
from typing import Any, Optional

from starlette.requests import Request

from client.openai_gateway.errors import APIError

# A body over the limit is still read (and dropped) up to this many times the limit, so that the
# client, which is still sending, receives the 413 instead of a reset connection.
DRAIN_FACTOR = 4


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past `limit` bytes (declared or streamed), 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    buf, seen = bytearray(), 0
    async for part in request.stream():
        seen += len(part)
        if seen > limit:
            too_large = True
        if too_large:
            if seen > DRAIN_FACTOR * limit:
                break
            continue
        buf += part
    if too_large:
        raise APIError(413, f"the request body is larger than {limit} bytes: send at most "
                       f"{limit} bytes", code="request_too_large")
    try:
        body = json.loads(buf)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to be a request",
                       code="invalid_json") from None
    where = _lone_surrogate(body, "")
    if where is not None:
        raise APIError(400, f"{where or 'the request body'} is invalid: must be Unicode text "
                       "(it holds a lone UTF-16 surrogate escape such as \\ud800)",
                       param=where or None, code="invalid_unicode")
    return body


def _lone_surrogate(value: Any, path: str) -> Optional[str]:
    """The path (messages[0].content) of the first string with a lone surrogate; None if none.
    Depth is bounded: json.loads has already refused what Python cannot recurse into."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = value.items()
        for k, v in items:
            key = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _lone_surrogate(k, key) is not None:
                return key
            found = _lone_surrogate(v, key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None
