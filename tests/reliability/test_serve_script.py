"""`make serve` as a user runs it: scripts/serve.py in its own process group (as a terminal
starts it), the README's client.stream example against it, then Ctrl-C (SIGINT to the group):
everything it started is gone within seconds. One serve.py start for the module."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reliability_helpers import QUESTION, ROOT

from pagedbackend.serving.processes import process_table

# Generous: the point is seconds, not the minute it used to take; not a speed assertion.
STOPPED_WITHIN_S = 30.0


def _group_members(pgids: set[int]) -> list[str]:
    """Live (non-zombie) processes in these process groups, as 'pid state cmd'."""
    return [f"{p.pid} {p.state} {p.cmdline}" for p in process_table().values()
            if p.pgid in pgids and p.live]


def _children(pid: int) -> list[int]:
    return [p.pid for p in process_table().values() if p.ppid == pid]


def _start(model_dir: str, tmp_path: Path) -> tuple[subprocess.Popen, dict, Path]:
    from pagedbackend.serving.launcher import free_port

    ports = {k: free_port() for k in ("http", "grpc", "metrics", "gateway")}
    env = {**os.environ, "PAGEDBACKEND_MAX_MODEL_LEN": "1024", "PAGEDBACKEND_MAX_NUM_SEQS": "8"}
    env.pop("PAGEDBACKEND_API_KEY", None)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "--model", model_dir,
         "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
         "--metrics-port", str(ports["metrics"]), "--gateway-port", str(ports["gateway"])],
        cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    return proc, ports, log


def _stop_group(proc: subprocess.Popen, pgids: set[int]) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.fixture(scope="module")
def served(sampling_model_dir, tmp_path_factory):
    """serve.py on free ports, the model folder with generation_config.json's sampling values;
    yields once the gateway answers /health (Triton and the ensemble are ready then)."""
    proc, ports, log = _start(sampling_model_dir, tmp_path_factory.mktemp("serve"))
    pgids = {proc.pid}
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{ports['gateway']}/health",
                             timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        pgids |= set(_children(proc.pid))        # tritonserver and the gateway lead their own
        yield {"proc": proc, "ports": ports, "log": log, "pgids": pgids}
    finally:
        _stop_group(proc, pgids)


def test_readme_stream_example_answers_paris(served, sampling_model_dir):
    """The README's command, as written, plus the Triton URL. Sampled at the model's
    generation_config.json values (temperature 0.2, top_p 0.9), so one run may wander; three
    runs that all miss Paris would be a ~1-in-50 event at the float32 rate measured (57%)."""
    cmd = [sys.executable, "-m", "client.stream", QUESTION, "--chat", "--max-tokens", "32",
           "--url", f"127.0.0.1:{served['ports']['grpc']}", "--tokenizer", sampling_model_dir]
    answers = []
    for _ in range(3):
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        answers.append(run.stdout)
        if "Paris" in run.stdout:
            break
    assert any("Paris" in a for a in answers), answers


def test_unset_fields_take_generation_config_values(served, chat_prompt):
    """Seeded, so deterministic: a request without temperature/top_p samples exactly as one
    with the model's values (0.2, 0.9), not as one at SamplingParams' 1.0."""
    from client.triton_client import TritonLLMClient

    def text(**kw):
        with TritonLLMClient(f"127.0.0.1:{served['ports']['grpc']}") as c:
            return c.generate(chat_prompt, max_tokens=24, seed=3, **kw).text

    unset = text()
    assert unset == text(temperature=0.2, top_p=0.9)
    assert unset != text(temperature=1.0, top_p=1.0)


def test_ctrl_c_stops_everything_within_seconds(served):
    """SIGINT to serve.py's process group, as a terminal's Ctrl-C: serve.py, tritonserver (and
    its Python stubs) and the gateway all exit."""
    from pagedbackend.serving.launcher import shm_regions

    assert len(served["pgids"]) == 3, _group_members(served["pgids"])
    regions = [r for pgid in served["pgids"] for r in shm_regions(pgid)]
    assert len(regions) >= 4, regions          # one per Python model: the stubs were seen
    t0 = time.monotonic()
    os.killpg(served["proc"].pid, signal.SIGINT)
    served["proc"].wait(STOPPED_WITHIN_S)
    while _group_members(served["pgids"]) and time.monotonic() - t0 < STOPPED_WITHIN_S:
        time.sleep(0.1)
    assert not _group_members(served["pgids"]), served["log"].read_text()[-3000:]
    assert not [r for r in regions if os.path.exists(f"/dev/shm/{r}")]   # none left behind
    print(f"everything stopped {time.monotonic() - t0:.1f} s after Ctrl-C")


def test_second_ctrl_c_kills_at_once_while_loading(smollm2_dir, tmp_path):
    """Ctrl-C twice while the engine is still loading: no waiting for the load to finish."""
    proc, _, log = _start(smollm2_dir, tmp_path)
    pgids = {proc.pid}
    try:
        deadline = time.monotonic() + 60
        while len(pgids) < 2 and time.monotonic() < deadline:   # tritonserver has started
            pgids |= set(_children(proc.pid))
            time.sleep(0.05)
        assert len(pgids) == 2, log.read_text()
        time.sleep(1.0)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(STOPPED_WITHIN_S)
        while _group_members(pgids) and time.monotonic() - t0 < STOPPED_WITHIN_S:
            time.sleep(0.1)
        assert not _group_members(pgids), log.read_text()[-3000:]
        print(f"killed {time.monotonic() - t0:.1f} s after the second Ctrl-C")
    finally:
        _stop_group(proc, pgids)
