"""`make serve`: start tritonserver on model_repository/ (and the OpenAI gateway if present).

    python scripts/serve.py [--model DIR] [--block-size 16] [--max-num-seqs N] [--max-model-len N]
                            [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                            [--no-gateway] [--gateway-port 8080]

Engine settings default to model_repository/engine/config.pbtxt `parameters`; a flag or an
environment variable PAGEDBACKEND_<SETTING> (e.g. PAGEDBACKEND_MAX_MODEL_LEN=4096) overrides one
without editing files: the repository is materialised in a temporary folder with the values
substituted. Ports come from flags or TRITON_HTTP_PORT / TRITON_GRPC_PORT / TRITON_METRICS_PORT /
GATEWAY_PORT. Everything listens on 127.0.0.1. Ctrl-C or SIGTERM stops all it started.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedbackend.serving.launcher import (ENGINE_PARAMETERS, REPO_ROOT,  # noqa: E402
                                           TritonServer, env_overrides,
                                           materialize_repository, server_env)
from pagedbackend.serving.supervisor import Supervisor  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ENGINE_PARAMETERS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                       help=f"engine setting {name} (env {'PAGEDBACKEND_' + name.upper()})")
    env = os.environ
    p.add_argument("--http-port", type=int, default=int(env.get("TRITON_HTTP_PORT", 8000)))
    p.add_argument("--grpc-port", type=int, default=int(env.get("TRITON_GRPC_PORT", 8001)))
    p.add_argument("--metrics-port", type=int, default=int(env.get("TRITON_METRICS_PORT", 8002)))
    p.add_argument("--gateway-port", type=int, default=int(env.get("GATEWAY_PORT", 8080)))
    p.add_argument("--no-gateway", action="store_true",
                   help="do not start the OpenAI gateway (client/openai_gateway)")
    p.add_argument("--tool-call-parser", default=None,
                   help='the gateway serves tool_choice "auto" with this parser of tool calls '
                        "in the model's text (hermes: Qwen2.5/Qwen3/Hermes; llama3_json: "
                        "Llama 3.1/3.2)")
    p.add_argument("--log-verbose", type=int, default=0)
    return p.parse_args(argv)


def gateway_available() -> bool:
    try:
        importlib.import_module("client.openai_gateway.app")
        return True
    except Exception:  # noqa: BLE001 - absent or broken: serve Triton alone
        return False


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = env_overrides()
    overrides.update({k: getattr(args, k) for k in ENGINE_PARAMETERS
                      if getattr(args, k) is not None})
    workdir = Path(tempfile.mkdtemp(prefix="pagedbackend-serve-"))
    repository = materialize_repository(workdir / "model_repository", overrides)
    model_dir = overrides.get("model")
    server = TritonServer(repository, workdir, args.http_port, args.grpc_port,
                          args.metrics_port, log_verbose=args.log_verbose)
    children: list[subprocess.Popen] = []
    stopping = False

    def stop(signum=None, frame=None):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        for child in children:
            if child.poll() is None:
                child.terminate()
        server.stop()
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    signal.signal(signal.SIGTERM, lambda s, f: (stop(), sys.exit(0)))
    print(f"tritonserver: {' '.join(server.cmd)}", flush=True)
    server.start()
    try:
        server.wait_ready(timeout=float(os.environ.get("PAGEDBACKEND_START_TIMEOUT", 600)))
        print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics "
              f"{server.metrics_url}", flush=True)
        if not args.no_gateway and gateway_available():
            tokenizer = model_dir or str(REPO_ROOT / "models" / "smollm2-135m-instruct")
            children.append(subprocess.Popen(
                [sys.executable, "-m", "client.openai_gateway", "--triton-grpc", server.grpc_url,
                 "--triton-metrics", server.metrics_url,
                 "--host", "127.0.0.1", "--port", str(args.gateway_port), "--tokenizer",
                 str((REPO_ROOT / tokenizer).resolve())]
                + (["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
                   if args.tool_call_parser else []),
                cwd=str(REPO_ROOT), env=server_env()))
            print(f"OpenAI gateway: http://127.0.0.1:{args.gateway_port}/v1", flush=True)
        # restarts tritonserver if the engine's stub dies (supervisor.py says why)
        return Supervisor(server).run(stopping=lambda: stopping)
    except KeyboardInterrupt:
        return 0
    finally:
        stop()


if __name__ == "__main__":
    sys.exit(main())
