"""`make serve`: start tritonserver on model_repository/ (and the OpenAI gateway if present).

    python scripts/serve.py [--model DIR] [--block-size 16] [--max-num-seqs N] [--max-model-len N]
                            [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                            [--no-gateway] [--gateway-port 8080]

Engine settings default to model_repository/engine/config.pbtxt `parameters`; a flag or an
environment variable PAGEDBACKEND_<SETTING> (e.g. PAGEDBACKEND_MAX_MODEL_LEN=4096) overrides one
without editing files: the repository is materialised in a temporary folder with the values
substituted. Ports come from flags or TRITON_HTTP_PORT / TRITON_GRPC_PORT / TRITON_METRICS_PORT /
GATEWAY_PORT. Everything listens on 127.0.0.1. Ctrl-C or SIGTERM stops all it started within
STOP_GRACE_S seconds (then SIGKILL); a second Ctrl-C kills at once.
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
                                           materialize_repository, remove_shm, server_env,
                                           shm_regions)
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


# Seconds the first Ctrl-C (or SIGTERM) gives Triton and the gateway to exit before SIGKILL;
# a second Ctrl-C kills at once.
STOP_GRACE_S = float(os.environ.get("PAGEDBACKEND_STOP_GRACE_S", 5))


class Stopping(Exception):
    """Raised by the first Ctrl-C / SIGTERM wherever main() is (also inside wait_ready)."""


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
    gateway: list[subprocess.Popen] = []   # each leads its own process group, as tritonserver

    def groups() -> list[subprocess.Popen]:
        """tritonserver's current process (the supervisor may restart it), and the gateway."""
        return [p for p in (server.proc, *gateway) if p is not None]

    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            raise Stopping()
        print("stopping now", file=sys.stderr, flush=True)
        _signal_groups(groups(), signal.SIGKILL)   # second Ctrl-C: no more waiting

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"tritonserver: {' '.join(server.cmd)}", flush=True)
    try:
        server.start()
        server.wait_ready(timeout=float(os.environ.get("PAGEDBACKEND_START_TIMEOUT", 600)))
        print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics "
              f"{server.metrics_url}", flush=True)
        if not args.no_gateway and gateway_available():
            tokenizer = model_dir or str(REPO_ROOT / "models" / "smollm2-135m-instruct")
            gateway.append(subprocess.Popen(
                [sys.executable, "-m", "client.openai_gateway", "--triton-grpc", server.grpc_url,
                 "--triton-metrics", server.metrics_url,
                 "--host", "127.0.0.1", "--port", str(args.gateway_port), "--tokenizer",
                 str((REPO_ROOT / tokenizer).resolve())]
                + (["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
                   if args.tool_call_parser else []),
                cwd=str(REPO_ROOT), env=server_env(), start_new_session=True))
            print(f"OpenAI gateway: http://127.0.0.1:{args.gateway_port}/v1", flush=True)
        # restarts tritonserver if the engine's stub dies (supervisor.py says why)
        return Supervisor(server).run()
    except Stopping:
        print("stopping (Ctrl-C again to kill at once)", file=sys.stderr, flush=True)
        return 0
    finally:
        try:
            _stop_all(groups(), STOP_GRACE_S)
        except Stopping:                  # a signal while stopping: kill what is left
            _stop_all(groups(), 0.0)
        shutil.rmtree(workdir, ignore_errors=True)


def _signal_groups(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)     # the whole group: tritonserver's stubs too
        except ProcessLookupError:
            pass


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every group, SIGKILL what is still there after grace_s, reap the children. The
    terminal's Ctrl-C never reaches them (own sessions), so this is their one signal."""
    regions = [r for p in procs for r in shm_regions(p.pid)]
    _signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(p) for p in procs):
        time.sleep(0.1)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()
    remove_shm(regions)           # a killed server leaves its stubs' /dev/shm regions behind


def _group_alive(p: subprocess.Popen) -> bool:
    p.poll()                          # reap the leader, or its zombie keeps the group alive
    try:
        os.killpg(p.pid, 0)
        return True
    except ProcessLookupError:
        return False


if __name__ == "__main__":
    sys.exit(main())
