"""The FastAPI app: OpenAI's routes, API-key auth, body limits and OpenAI-shaped errors.

`create_app(backend, ...)` takes any `Backend` (backend.py), so unit tests run the whole HTTP
surface against a fake one and the real server hands in `TritonBackend`.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
import urllib.request
from importlib import metadata
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.openai_gateway.backend import Backend, BackendError
from client.openai_gateway.body import read_json
from client.openai_gateway.errors import APIError, from_triton
from client.openai_gateway.prompts import PromptRenderer
from client.openai_gateway.protocol import parse_chat, parse_completion, unknown_model
from client.openai_gateway.ratelimit import RateLimiter, RateLimitMiddleware
from client.openai_gateway.serving import Generation

log = logging.getLogger("openai_gateway")
# Open without the key: probes send none. (/metrics needs the key when one is set; Prometheus
# sends it with `authorization: {credentials: ...}`, or scrapes Triton's metrics port.)
PUBLIC_PATHS = ("/health",)
DEFAULT_MAX_BODY_BYTES = 4 << 20


def create_app(backend: Backend, served_names: list[str], api_key: Optional[str] = None,
               renderer: Optional[PromptRenderer] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               metrics_url: Optional[str] = None,
               tool_call_parser: Optional[str] = None,
               rate_limit: Optional[RateLimiter] = None) -> FastAPI:
    """metrics_url: Triton's Prometheus endpoint, served again at /metrics (vLLM's server has
    its metrics on its own port); None: no /metrics route. tool_call_parser: the format of tool
    calls in the model's free text (tools.TOOL_PARSERS), which tool_choice "auto" needs."""
    app = FastAPI(title="pagedbackend OpenAI gateway", docs_url=None, redoc_url=None,
                  openapi_url=None)
    renderer = renderer or PromptRenderer(None)
    created = int(time.time())
    if rate_limit is not None:      # added first: runs after the key check (ratelimit.py)
        app.add_middleware(RateLimitMiddleware, limiter=rate_limit)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), type_="invalid_request_error")
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = APIError(500, "internal server error", type_="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if await backend.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "5"})

    if metrics_url:
        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            try:
                body = await asyncio.to_thread(_fetch, metrics_url)
            except OSError as e:
                raise APIError(503, f"Triton's metrics endpoint did not answer: {e}",
                               type_="service_unavailable", code="metrics_unavailable",
                               retry_after=5) from None
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        try:
            triton = await backend.version()
        except Exception:  # noqa: BLE001 - the gateway's own version is still worth answering
            triton = None
        return {"version": _own_version(), "triton_version": triton}

    async def model_card(name: str) -> dict:
        # vLLM's card, with max_model_len when it is set and the engine's other settings
        # (swap_space, quantization, ...) under "settings"
        settings = await _settings(backend)
        card = {"id": name, "object": "model", "created": created, "owned_by": "pagedbackend",
                "root": served_names[0], "parent": None, "settings": settings}
        if isinstance(settings.get("max_model_len"), int):
            card["max_model_len"] = settings["max_model_len"]
        return card

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await model_card(n) for n in served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        if name not in served_names:
            raise unknown_model(name)
        return await model_card(name)

    async def generate(request: Request, parse):
        body = await read_json(request, max_body_bytes)
        req = parse(body, served_names[0])
        if req.model not in served_names:
            raise unknown_model(req.model)
        if req.logprobs is not None and not await _supports_logprobs(backend):
            param = "logprobs" if req.kind == "completion" or not req.logprobs else "top_logprobs"
            raise APIError(400, "logprobs are not available: the Triton model has no `logprobs` "
                           "output", param=param, code="logprobs_unsupported")
        gen = Generation(backend, req, renderer.prompts(req), req.model)
        if not req.stream:
            return JSONResponse(await until_disconnect(request, gen.response(), gen))
        await until_disconnect(request, gen.start(), gen)
        return SSEResponse(gen)

    def check_model(body: dict) -> None:
        if body.get("model") is not None and body["model"] not in served_names:
            raise unknown_model(str(body["model"]))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request, max_body_bytes)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_model(body)
        ids = renderer.tokenize(body, served_names[0])
        return {"count": len(ids), "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_json(request, max_body_bytes)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_model(body)
        return {"prompt": renderer.detokenize(body.get("tokens"))}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, functools.partial(parse_chat,
                                                         tool_parser=tool_call_parser))

    return app


class SSEResponse(StreamingResponse):
    """Server-Sent Events of one Generation. When the client disconnects Starlette cancels the
    sending task, which leaves the event generator suspended (it would be finalised only when
    garbage-collected): cancel the Triton streams here, at once."""

    def __init__(self, gen: Generation) -> None:
        super().__init__(gen.sse(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.cancel()


async def until_disconnect(request: Request, coro, gen: Generation, poll_s: float = 0.25):
    """Run `coro`; if the client goes away first, cancel it and every Triton stream of `gen`."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client closed the request", code="client_closed")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.close()


class ApiKeyMiddleware:
    """Bearer-token check on every route but /health; constant-time; 401 says nothing more."""

    def __init__(self, app, key: str) -> None:
        self.app, self._key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        if not hmac.compare_digest(given, self._key):
            err = APIError(401, "Unauthorized", type_="authentication_error",
                           code="invalid_api_key")
            resp = JSONResponse(err.body(), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


async def _settings(backend: Backend) -> dict:
    """The backend's engine settings, {} when it has none or cannot say (the list still
    answers)."""
    try:
        return dict(await backend.settings()) if hasattr(backend, "settings") else {}
    except Exception:  # noqa: BLE001 - the model list must not fail on this
        log.warning("engine settings unavailable", exc_info=True)
        return {}


async def _supports_logprobs(backend: Backend) -> bool:
    try:
        return await backend.supports_logprobs()
    except BackendError as e:
        raise from_triton(e.message) from None


def _fetch(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:      # noqa: S310 - our own URL
        return r.read()


def _own_version() -> str:
    try:
        return metadata.version("pagedbackend")
    except metadata.PackageNotFoundError:
        return "unknown"
