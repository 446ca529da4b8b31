"""`python -m client.openai_gateway --triton-grpc 127.0.0.1:8001 --port 8080 ...`"""
from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from client.openai_gateway.app import DEFAULT_MAX_BODY_BYTES, create_app
from client.openai_gateway.prompts import PromptRenderer
from client.openai_gateway.ratelimit import RateLimiter
from client.openai_gateway.tools import TOOL_PARSERS
from client.openai_gateway.triton_backend import TritonBackend

API_KEY_ENV = "PAGEDBACKEND_API_KEY"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client.openai_gateway",
                                description="OpenAI-compatible API in front of Triton")
    p.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton's gRPC host:port")
    p.add_argument("--triton-model", default="ensemble", help="the Triton model to call")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use for the model (the first is the default); "
                        "default: the tokenizer directory's name")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument("--tokenizer", default=None,
                   help="model directory with the tokenizer files (chat template)")
    p.add_argument("--triton-metrics", default=None,
                   help="Triton's metrics URL, served again at /metrics (default: "
                        "http://<--triton-grpc host>:8002/metrics; 'off': no /metrics)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model chooses, and '
                        "its calls are found in its text by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the format of tool calls in the model's text: hermes (<tool_call>"
                        "{json}</tool_call>, Qwen2.5/Qwen3/Hermes chat templates) or "
                        "llama3_json (Llama 3.1/3.2: the output is the JSON call)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--rate-limit", type=float, default=None, metavar="R",
                   help="at most R requests per second per API key (429 + Retry-After past it)")
    p.add_argument("--rate-limit-burst", type=float, default=None, metavar="B",
                   help="bursts of up to B requests per key (default: max(1, R))")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.rate_limit is None and args.rate_limit_burst is not None:
        p.error("--rate-limit-burst needs --rate-limit")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser")
    return args


def build_app(args: argparse.Namespace):
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    names = args.served_model_name or [
        os.path.basename(os.path.normpath(args.tokenizer)) if args.tokenizer else args.triton_model]
    backend = TritonBackend(args.triton_grpc, args.triton_model)
    metrics = args.triton_metrics
    if metrics is None:
        metrics = f"http://{args.triton_grpc.rsplit(':', 1)[0]}:8002/metrics"
    app = create_app(backend, names, api_key=api_key,
                     renderer=PromptRenderer.from_path(args.tokenizer),
                     max_body_bytes=args.max_body_bytes,
                     metrics_url=None if metrics == "off" else metrics,
                     tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice
                     else None,
                     rate_limit=None if args.rate_limit is None else
                     RateLimiter(args.rate_limit, args.rate_limit_burst))
    # The key itself is never logged; only whether one is set.
    logging.getLogger("openai_gateway").info(
        "serving %s on http://%s:%d (Triton gRPC %s, model %s, api key %s)", names, args.host,
        args.port, args.triton_grpc, args.triton_model, "on" if api_key else "off")
    return app


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
