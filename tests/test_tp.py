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
from pagedbackend.serving.processes import descendants
from pagedbackend.testing import ARCHS, make_hf_checkpoint

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
# Small blocks, a small pool and a small token budget: chunked prefill, prefix hits and
# preemption all happen while the ranks run in lockstep.
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=6,
              max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def mixed_prompts(vocab: int = 160) -> list[dict]:
    shared = [(7 * i + 3) % vocab for i in range(9)]
    bodies = [[5], list(range(40, 75)), [11, 12, 13], list(range(100, 121)), [1, 2], [90] * 17,
              list(range(150, 160)) + list(range(10))]
    return [{"prompt_token_ids": (shared + b) if i % 2 else b} for i, b in enumerate(bodies)]


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def logprob_gap(a, b) -> float:
    """The largest difference between two runs' prompt logprobs of the prompt tokens."""
    pairs = [(next(iter(x.values())), next(iter(y.values())))
             for pa, pb in zip(a, b) for x, y in zip(pa[1:], pb[1:])]
    return max(abs(x - y) for x, y in pairs)


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
    one = LLM(checkpoints[arch], **ENGINE)
    want = token_ids(one, prompts)
    llm = LLM(checkpoints[arch], tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.info.num_kv_blocks == ENGINE["num_kv_blocks"]
        assert token_ids(llm, prompts) == want
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
        # prompt logprobs: every rank runs the LM head at the prompt positions (collectives)
        params = GREEDY.clone(max_tokens=2, prompt_logprobs=2)
        got = [o.prompt_logprobs for o in llm.generate(prompts[:3], params)]
        ref = [o.prompt_logprobs for o in one.generate(prompts[:3], params)]
        assert [len(g) for g in got] == [len(p["prompt_token_ids"]) for p in prompts[:3]]
        for g, r in zip(got, ref):
            for eg, er in zip(g[1:], r[1:]):
                assert sorted(eg) == sorted(er)
                assert all(abs(eg[t] - er[t]) < 1e-4 for t in eg)
    finally:
        llm.engine.shutdown()


def test_tp2_fp8_kv_cache_matches_tp1(checkpoints):
    """kv_cache_dtype reaches every rank: each holds its KV heads in e4m3, and two ranks
    generate what one does with the same cache."""
    prompts = mixed_prompts()
    fp8 = {**ENGINE, "kv_cache_dtype": "fp8"}
    want = token_ids(LLM(checkpoints["llama"], **fp8), prompts)
    assert want != token_ids(LLM(checkpoints["llama"], **ENGINE), prompts)   # fp8 shows
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **fp8)
    try:
        assert token_ids(llm, prompts) == want
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
    params = SamplingParams(temperature=0, max_tokens=8)
    kwargs = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)
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


# -- inside Triton ---------------------------------------------------------------------------
def _triton_or_skip():
    from pagedbackend.serving import launcher
    try:
        launcher.find_tritonserver()
    except RuntimeError as e:
        pytest.skip(str(e))
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip("run `make model` first (the ensemble needs SmolLM2's tokenizer)")
    return launcher


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `root`."""
    return [(p.pid, p.cmdline) for p in descendants(root)]


def _stream(grpc_url: str, prompt: str, max_tokens: int, timeout: float = 60.0):
    """Send one greedy request to the ensemble; yield (text, error) per response until final."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    for name, value, dtype in (("text_input", np.array([[prompt]], dtype=object), "BYTES"),
                               ("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
                               ("temperature", np.array([[0.0]], np.float32), "FP32"),
                               ("ignore_eos", np.array([[True]]), "BOOL"),
                               ("stream", np.array([[True]]), "BOOL")):
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                yield None, str(error)
                return
            out = result.as_numpy("text_output")
            yield ("" if out is None or not out.size else out.reshape(-1)[0].decode()), None
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def test_triton_engine_tp2_answers_like_tp1_and_fails_fast(tmp_path):
    """The engine model with tensor_parallel_size=2 on the CPU answers exactly like TP=1; killing
    a worker errors the open request within seconds, the model goes not-ready, no worker is left."""
    import shutil
    import urllib.error
    import urllib.request

    launcher = _triton_or_skip()
    model = tmp_path / "tiny-llama"
    # A tiny Llama over SmolLM2's tokenizer (vocab 49152 splits in two; SmolLM2 itself cannot).
    make_hf_checkpoint("llama", model, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2 / name, model / name)
    settings = dict(dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=256,
                    max_num_seqs=8)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ref = LLM(str(model), **settings)
    want = [o.outputs[0].text for o in ref.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]

    overrides = {k: str(v) for k, v in settings.items()}
    overrides.update(model=str(model), tensor_parallel_size="2", device="cpu")
    repo = launcher.materialize_repository(tmp_path / "repository", overrides)
    ports = [launcher.free_port() for _ in range(3)]
    log = open(tmp_path / "triton.log", "w")
    server = launcher.TritonServer(repo, tmp_path, *ports).start(stdout=log, stderr=log)
    try:
        server.wait_ready(timeout=180)
        workers = [p for p, cmd in _descendants(server.proc.pid) if "spawn_main" in cmd]
        assert len(workers) == 1, "one worker process for rank 1"
        for prompt, text in zip(prompts, want):
            got = list(_stream(server.grpc_url, prompt, 12))
            assert [e for _, e in got if e] == []
            assert "".join(t for t, _ in got) == text

        responses = _stream(server.grpc_url, "Once upon a time", 200)
        assert next(responses)[1] is None             # generating
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        errors = [e for _, e in responses if e]
        assert time.monotonic() - start < 10.0
        assert errors, "the open request must end with an error"
        ready = f"http://{server.http_url}/v2/models/engine/ready"
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(ready, timeout=2)
            except urllib.error.HTTPError:
                break                                 # 400: not ready
            time.sleep(0.2)
        else:
            pytest.fail("the engine model still reports ready after its worker died")
        assert wait_gone(workers) == []
    finally:
        server.stop()
        log.close()


def test_tp2_fp8_weights_close_to_tp1(checkpoints):
    """quantization="fp8" reaches every rank. Each quantizes its own shard, and a row-parallel
    layer's input per token over its slice of the columns, so two ranks compute the same
    matmuls with other scales than one: close to TP=1's fp8 logprobs, not equal to them."""
    prompts = mixed_prompts()
    params = GREEDY.clone(max_tokens=1, prompt_logprobs=0)
    fp8 = {**ENGINE, "quantization": "fp8"}
    want = [o.prompt_logprobs for o in LLM(checkpoints["llama"], **fp8).generate(prompts, params)]
    full = [o.prompt_logprobs for o in LLM(checkpoints["llama"], **ENGINE).generate(prompts, params)]
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **fp8)
    try:
        got = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    # the ranks' other scales move the logprobs by about as much as fp8 rounding itself does
    # (0.10 against 0.15 here), far from a missing or misapplied scale (units, not tenths)
    assert 0 < logprob_gap(got, want) < 2 * logprob_gap(want, full) < 1.0


def test_tp2_reads_an_fp8_checkpoint(checkpoints, tmp_path):
    """Each rank takes its rows of a per-channel FP8 checkpoint's weights and scales (q|k|v and
    gate|up split by rows, o and down by columns with every output row's scale): as close to
    TP=1 on the same checkpoint as the runtime-quantized case above."""
    from test_quantization import write_fp8_checkpoint
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "plain"
    fp8_dir.mkdir()
    plain_dir.mkdir()
    write_fp8_checkpoint(checkpoints["llama"], fp8_dir, plain_dir, "compressed-tensors")
    prompts = mixed_prompts()
    params = GREEDY.clone(max_tokens=1, prompt_logprobs=0)
    want = [o.prompt_logprobs for o in LLM(str(fp8_dir), **ENGINE).generate(prompts, params)]
    full = [o.prompt_logprobs for o in LLM(checkpoints["llama"], **ENGINE).generate(prompts, params)]
    llm = LLM(str(fp8_dir), tensor_parallel_size=2, **ENGINE)
    try:
        got = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert 0 < logprob_gap(got, want) < 2 * logprob_gap(want, full) < 1.0
