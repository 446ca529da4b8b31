"""Start a `tritonserver` on this repository's model_repository: find the binary, build a Python
backend folder with the stub, materialise the repository with engine settings substituted.

Shared by `scripts/serve.py` (make serve) and the integration tests, so both start Triton the same
way. Nothing here imports torch or tritonclient.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path
from typing import Mapping, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
# Engine settings kept in model_repository/engine/config.pbtxt `parameters`; each can be overridden
# by a flag (--block-size) or an environment variable (PAGEDBACKEND_BLOCK_SIZE).
ENGINE_PARAMETERS = ("model", "block_size", "max_num_seqs", "max_model_len",
                     "max_num_batched_tokens", "gpu_memory_utilization", "tensor_parallel_size",
                     "dtype", "kv_cache_dtype", "quantization", "device", "enable_prefix_caching",
                     "num_kv_blocks", "kv_cache_memory_bytes", "load_format", "enforce_eager",
                     "seed", "async_scheduling", "max_responses_per_s", "stream_coalesce",
                     "speculative_config", "swap_space", "preemption_mode",
                     "generation_config", "max_queue_len", "max_queue_delay_ms", "queued_probe_ms")
ENV_PREFIX = "PAGEDBACKEND_"


def env_overrides(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    return {k: environ[ENV_PREFIX + k.upper()] for k in ENGINE_PARAMETERS
            if environ.get(ENV_PREFIX + k.upper(), "") != ""}


def find_tritonserver() -> Path:
    """$TRITONSERVER if set, else `tritonserver` from PATH (as in NVIDIA's containers), else the
    one in the pytriton wheel."""
    if os.environ.get("TRITONSERVER"):
        return Path(os.environ["TRITONSERVER"])
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    try:
        import pytriton  # noqa: F401  (only to locate the wheel)
    except ImportError as e:
        raise RuntimeError("no `tritonserver` on PATH and nvidia-pytriton is not installed; "
                           "run `make setup`") from e
    binary = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
    if not binary.exists():
        raise RuntimeError(f"nvidia-pytriton has no tritonserver binary at {binary}")
    return binary


def backend_directory(tritonserver: Path, workdir: Path) -> Path:
    """A backend folder whose python/ holds the stub built for this interpreter's version.

    NVIDIA's containers ship it ready (/opt/tritonserver/backends); the pytriton wheel keeps the
    stubs per Python version apart, so copy the right one next to libtriton_python.so.
    """
    shipped = tritonserver.parent.parent / "backends"
    if (shipped / "python" / "triton_python_backend_stub").exists():
        return shipped
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = tritonserver.parent.parent / "python_backend_stubs" / version / \
        "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"no Python backend stub for Python {version} at {stub}")
    out = workdir / "backends" / "python"
    out.mkdir(parents=True, exist_ok=True)
    for src in (shipped / "python").iterdir():
        if src.is_file():
            shutil.copy2(src, out / src.name)
    shutil.copy2(stub, out / stub.name)
    return out.parent


def set_parameter(pbtxt: str, key: str, value: str) -> str:
    """Replace (or add) `parameters { key: "<key>" value { string_value: "..." } }`."""
    value = value.replace("\\", "\\\\").replace('"', '\\"')
    pattern = re.compile(r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")'
                         r'((?:[^"\\]|\\.)*)(")')
    if pattern.search(pbtxt):
        return pattern.sub(lambda m: m.group(1) + value + m.group(3), pbtxt, count=1)
    return pbtxt + f'\nparameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def materialize_repository(dst: Path, overrides: Mapping[str, str],
                           src: Path = MODEL_REPOSITORY) -> Path:
    """Copy the repository's config.pbtxt files into `dst` with settings substituted; version
    folders are symlinked, so model.py files still find this checkout. Relative model paths are
    made absolute against the checkout."""
    overrides = dict(overrides)
    model = overrides.get("model", "")
    if model:
        overrides["model"] = str((REPO_ROOT / model).resolve()) if not os.path.isabs(model) \
            else model
    dst.mkdir(parents=True, exist_ok=True)
    for model_dir in sorted(p for p in src.iterdir() if (p / "config.pbtxt").exists()):
        out = dst / model_dir.name
        out.mkdir(exist_ok=True)
        pbtxt = (model_dir / "config.pbtxt").read_text()
        if model_dir.name == "engine":
            for key, value in overrides.items():
                pbtxt = set_parameter(pbtxt, key, str(value))
        elif model and 'key: "tokenizer_dir"' in pbtxt:
            pbtxt = set_parameter(pbtxt, "tokenizer_dir", overrides["model"])
        (out / "config.pbtxt").write_text(pbtxt)
        for version in model_dir.iterdir():
            if version.is_dir() and version.name.isdigit() and not (out / version.name).exists():
                (out / version.name).symlink_to(version.resolve(), target_is_directory=True)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(tritonserver: Optional[Path] = None) -> dict[str, str]:
    """The stub takes its sys.path from the first `python3` on PATH: put this venv's first.
    A stub copied out of the pytriton wheel also loses its RPATH to the wheel's bundled
    libraries, and needs this interpreter's libpython: both go on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.prefix) / "bin") + os.pathsep + env.get("PATH", "")
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    if tritonserver is not None:
        libs.append(str(tritonserver.parents[3] / "nvidia_pytriton.libs"))
    libs = [d for d in libs if d and os.path.isdir(d)]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env


def shm_regions(pgid: int) -> list[str]:
    """The Python backend's shared-memory regions (/dev/shm names) of the stubs in process group
    `pgid`, read from their command lines: what a SIGKILLed server leaves behind."""
    names = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        names += [a.decode() for a in args if a.startswith(b"triton_python_backend_shm_region")]
    return names


def remove_shm(names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass                               # removed by Triton itself on a clean exit


# Triton's APIs no client of the models needs, each able to change or read out the server:
# model load/unload (model-repository), shared-memory registration, tracing and log settings.
# Restricted to requests that carry the header ADMIN_KEY_HEADER: <admin key> (Triton's own
# --http-restricted-api / --grpc-restricted-protocol); health, metadata, model-config,
# statistics and inference stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_KEY_HEADER = "triton-admin-key"
ADMIN_KEY_ENV = "PAGEDBACKEND_ADMIN_KEY"


def restricted_api_args(admin_key: str) -> list[str]:
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_KEY_HEADER}={admin_key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_KEY_HEADER}={admin_key}"]


def admin_key(environ: Mapping[str, str] = os.environ) -> str:
    """$PAGEDBACKEND_ADMIN_KEY, or a random key nobody knows (the APIs are then closed)."""
    return environ.get(ADMIN_KEY_ENV) or secrets.token_hex(16)


class TritonServer:
    """One tritonserver process in its own process group, bound to 127.0.0.1, its admin APIs
    (RESTRICTED_APIS) open only to requests with `admin_headers`."""

    def __init__(self, repository: Path, workdir: Path, http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, log_verbose: int = 0,
                 extra_args: tuple[str, ...] = ()):
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        key = admin_key()
        self.admin_headers = {ADMIN_KEY_HEADER: key}
        # Triton's gRPC side reads the header with this prefix
        self.admin_grpc_headers = {f"triton-grpc-protocol-{ADMIN_KEY_HEADER}": key}
        binary = find_tritonserver()
        self.env = server_env(binary)
        self.cmd = [
            str(binary), "--model-repository", str(repository),
            "--backend-directory", str(backend_directory(binary, workdir)),
            "--http-address", "127.0.0.1", "--http-port", str(http_port),
            "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics_port),
            # Explicit mode so a model whose engine died can unload itself (goes not-ready).
            "--model-control-mode", "explicit", "--load-model", "*",
            "--allow-cpu-metrics", "true", "--log-verbose", str(log_verbose),
            "--exit-timeout-secs", "10",
            *restricted_api_args(key),
            *extra_args]
        self.proc: Optional[subprocess.Popen] = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, stdout=None, stderr=None) -> "TritonServer":
        self._output = (stdout, stderr)
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=stdout, stderr=stderr,
                                     start_new_session=True)
        return self

    def restart(self, stop_timeout: float = 2.0) -> "TritonServer":
        """Stop (SIGKILL after stop_timeout seconds) and start again: same ports, same output."""
        self.stop(stop_timeout)
        return self.start(*self._output)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until /v2/health/ready answers 200 and then /metrics does: tritonserver starts its
        metrics endpoint after the HTTP one, so a first scrape right after readiness could be
        refused (seen in the test suite)."""
        deadline = time.monotonic() + timeout
        urls = [f"http://{self.http_url}/v2/health/ready", self.metrics_url]
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(urls[0], timeout=2) as r:
                    if r.status == 200:
                        urls.pop(0)
                        if not urls:
                            return
                        continue
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s (waiting for {urls[0]})")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group (server and its stubs), SIGKILL what is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5.0
        regions = shm_regions(pgid)
        while time.monotonic() < deadline:     # stubs exit shortly after the server
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        remove_shm(regions)
