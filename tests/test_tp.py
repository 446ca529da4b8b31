"""Tensor parallelism end to end on the CPU (gloo): TP>1 engines give TP=1's greedy tokens, bad
shardings are refused before anything is spawned, a dead worker makes the engine fail fast with
a clear error, and no worker process outlives its engine."""
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.testing import ARCHS, make_hf_checkpoint

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
# Small blocks, a small pool and a small token budget: chunked prefill, prefix hits and
# preemption all happen while the ranks run in lockstep.
ENGINE = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=6,
              max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def mixed_prompts(vocab: int = 160) -> list[dict]:
    shared = [(7 * i + 3) % vocab for i in range(9)]
    bodies = [[5], list(range(40, 75)), [11, 12, 13], list(range(100, 121)), [1, 2], [90] * 17,
              list(range(150, 160)) + list(range(10))]
    return [{"prompt_token_ids": (shared + b) if i % 2 else b} for i, b in enumerate(bodies)]


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); count it as gone only once it has been reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"tp-{arch}")
        # The tiny Mistral has one KV head; give it two so TP=2 can split them.
        make_hf_checkpoint(arch, path, **({"num_key_value_heads": 2} if arch == "mistral" else {}))
        out[arch] = str(path)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_matches_tp1(checkpoints, arch):
    prompts = mixed_prompts()
    want = token_ids(LLM(checkpoints[arch], **ENGINE), prompts)
    llm = LLM(checkpoints[arch], tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.info.num_kv_blocks == ENGINE["num_kv_blocks"]
        assert token_ids(llm, prompts) == want
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    finally:
        llm.engine.shutdown()


def test_two_engines_side_by_side(checkpoints):
    """Each engine has its own store port and process groups: two live at once don't collide."""
    prompts = mixed_prompts()[:3]
    want = token_ids(LLM(checkpoints["qwen2"], **ENGINE), prompts)
    a = LLM(checkpoints["qwen2"], tensor_parallel_size=2, **ENGINE)
    b = LLM(checkpoints["qwen2"], tensor_parallel_size=2, **ENGINE)
    try:
        assert set(a.engine.runner.worker_pids).isdisjoint(b.engine.runner.worker_pids)
        for _ in range(2):
            assert token_ids(a, prompts) == want
            assert token_ids(b, prompts) == want
    finally:
        a.engine.shutdown()
        b.engine.shutdown()


def test_killed_worker_fails_fast_and_leaves_nothing(checkpoints):
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    pids = engine.runner.worker_pids
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [3, 5, 7]}, params)
    engine.add_request("b", {"prompt_token_ids": list(range(30, 50))}, params)
    for _ in range(3):
        engine.step()
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 5.0
    assert "tensor-parallel worker rank 1 exited with code -9" in str(err.value)
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        engine.step()          # and on every later call, never a hang
    engine.shutdown()
    assert wait_gone(pids) == []
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


def test_shutdown_and_garbage_collection_leave_no_workers(checkpoints):
    llm = LLM(checkpoints["qwen3"], tensor_parallel_size=2, **ENGINE)
    pids = llm.engine.runner.worker_pids
    assert all(alive(p) for p in pids)
    llm.engine.shutdown()
    llm.engine.shutdown()      # idempotent
    assert wait_gone(pids, timeout=1.0) == []
    llm = LLM(checkpoints["qwen3"], tensor_parallel_size=2, **ENGINE)
    pids = llm.engine.runner.worker_pids
    del llm
    gc.collect()               # the runner's finalizer stops the workers
    assert wait_gone(pids) == []


_ORPHAN_SCRIPT = """
import sys, time
from pagedbackend import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=4, num_kv_blocks=16, max_model_len=64)
print(*llm.engine.runner.worker_pids, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_dies(checkpoints):
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, checkpoints["llama"]],
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
    finally:
        proc.kill()            # SIGKILL: no atexit, no finalizer runs
        proc.wait()
    assert wait_gone(pids, timeout=5.0) == []


@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="run `make model` first")
def test_smollm2_tp3_matches_tp1_and_tp2_is_refused():
    children = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError) as err:
        LLM(str(SMOLLM2), tensor_parallel_size=2, max_model_len=256)
    msg = str(err.value)
    assert "tensor_parallel_size=2" in msg
    assert "num_attention_heads=9" in msg and "num_key_value_heads=3" in msg
    assert {p.pid for p in multiprocessing.active_children()} == children, "spawned before refusing"

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12)
    kwargs = dict(max_model_len=256, num_kv_blocks=64)
    want = token_ids(LLM(str(SMOLLM2), **kwargs), prompts, params)
    llm = LLM(str(SMOLLM2), tensor_parallel_size=3, **kwargs)
    engine = llm.engine
    pids = engine.runner.worker_pids
    try:
        assert token_ids(llm, prompts, params) == want
        # Kill rank 2 while a long prefill is (most likely) inside a collective.
        engine.add_request("long", {"prompt_token_ids": list(range(100, 330))}, params)
        threading.Timer(0.05, os.kill, (pids[1], signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel worker rank 2 exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 5.0
    finally:
        engine.shutdown()
    assert wait_gone(pids) == []
