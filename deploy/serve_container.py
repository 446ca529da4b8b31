"""Container entrypoint: Triton (HTTP 8000, gRPC 8001, metrics 8002) and the OpenAI gateway (8080)
as two supervised processes. If either exits, the other is stopped and the container exits with
the failing status, so Kubernetes restarts the pod instead of serving half a stack.

Engine settings come from PAGEDBACKEND_<PARAMETER> variables (pagedbackend.serving.launcher), the
API key from PAGEDBACKEND_API_KEY, aliases from PAGEDBACKEND_SERVED_MODEL_NAME (space-separated).
Triton's model-control, shared-memory, trace and logging APIs answer only requests with the header
`triton-admin-key: $PAGEDBACKEND_ADMIN_KEY` (gRPC: `triton-grpc-protocol-triton-admin-key`); unset,
the key is random and they are closed.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedbackend.serving.launcher import (DEFAULT_MODEL_DIR, REPO_ROOT, admin_key,
                                           backend_directory, env_overrides, find_tritonserver,
                                           materialize_repository, restricted_api_args)


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=env("PAGEDBACKEND_HOST", "0.0.0.0"))
    p.add_argument("--http-port", type=int, default=int(env("PAGEDBACKEND_HTTP_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(env("PAGEDBACKEND_GRPC_PORT", "8001")))
    p.add_argument("--metrics-port", type=int,
                   default=int(env("PAGEDBACKEND_METRICS_PORT", "8002")))
    p.add_argument("--gateway-port", type=int,
                   default=int(env("PAGEDBACKEND_GATEWAY_PORT", "8080")))
    p.add_argument("--served-model-name", nargs="+",
                   default=env("PAGEDBACKEND_SERVED_MODEL_NAME", "").split() or None)
    p.add_argument("--workdir", default=None, help="where the materialised repository goes")
    return p.parse_args(argv)


def commands(args: argparse.Namespace, workdir: Path) -> tuple[list[str], list[str]]:
    overrides = env_overrides()
    model = overrides.get("model", DEFAULT_MODEL_DIR)
    model = model if os.path.isabs(model) else str(REPO_ROOT / model)
    repo = materialize_repository(workdir / "model_repository", {**overrides, "model": model})
    binary = find_tritonserver()
    triton = [str(binary), "--model-repository", str(repo),
              "--backend-directory", str(backend_directory(binary, workdir)),
              "--http-address", args.host, "--http-port", str(args.http_port),
              "--grpc-address", args.host, "--grpc-port", str(args.grpc_port),
              "--metrics-address", args.host, "--metrics-port", str(args.metrics_port),
              "--model-control-mode", "explicit", "--load-model", "*",
              "--allow-cpu-metrics", "true",
              # model load/unload, shared memory, trace and logging only with the admin key
              *restricted_api_args(admin_key())]
    gateway = [sys.executable, "-m", "client.openai_gateway",
               "--triton-grpc", f"127.0.0.1:{args.grpc_port}",
               "--host", args.host, "--port", str(args.gateway_port), "--tokenizer", model]
    if args.served_model_name:
        gateway += ["--served-model-name", *args.served_model_name]
    return triton, gateway


def supervise(cmds: list[list[str]]) -> int:
    procs = [subprocess.Popen(c, cwd=REPO_ROOT, start_new_session=True) for c in cmds]
    stopping = []

    def stop(*_):
        stopping.append(True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        done = [p for p in procs if p.poll() is not None]
        if done:
            code = done[0].returncode or 1
            break
        time.sleep(0.5)
    for p in procs:                       # gateway first would be nicer; both get SIGTERM
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    return code


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedbackend-"))
    return supervise(list(commands(args, workdir)))


if __name__ == "__main__":
    sys.exit(main())
