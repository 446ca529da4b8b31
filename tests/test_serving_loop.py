"""The engine model's threads (EngineLoop) with a fake engine and fake response senders:
deltas, exactly one final per request on success / error / cancel / engine death, and the
context ids the detokenizer needs (checked with a SentencePiece-style byte-fallback tokenizer)."""
import re
import threading
import time
from dataclasses import dataclass, field

import pytest

from pagedbackend.engine.detokenizer import decode_delta
from pagedbackend.outputs import CompletionOutput, RequestOutput
from pagedbackend.sampling_params import SamplingParams
from pagedbackend.serving.engine_loop import EngineLoop
from pagedbackend.serving.request import ParsedRequest
from pagedbackend.serving.responses import Chunk, Outgoing, coalesce


@dataclass
class _Req:
    rid: str
    prompt: list
    params: SamplingParams
    out: list = field(default_factory=list)
    aborted: bool = False


class FakeEngine:
    """Emits the token ids of `script` (or 100, 101, ...) one per step; `fail_at` raises."""

    def __init__(self, script=None, fail_at=None, tokenizer=None):
        self.reqs, self.script, self.fail_at, self.steps = {}, script, fail_at, 0
        self.aborted = []
        self.tokenizer = tokenizer

    def add_request(self, rid, prompt, params, priority=0, cache_salt=None, detokenize=True,
                    arrival_time=None):
        if prompt == "bad":
            raise ValueError("prompt='bad' is invalid: must be good")
        ids = list(prompt) if isinstance(prompt, list) else [1, 2, 3]
        self.reqs[rid] = _Req(rid, ids, params)

    def has_unfinished(self):
        return bool(self.reqs)

    def abort(self, ids):
        for rid in ids:
            self.reqs[rid].aborted = True
            self.aborted.append(rid)

    def stats(self):
        return None

    def step(self):
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("device lost")
        outs = []
        for rid, r in list(self.reqs.items()):
            reason, delta = None, []
            if r.aborted:
                reason = "abort"
            else:
                n = len(r.out)
                delta = [self.script[n] if self.script else 100 + n]
                r.out += delta
                if len(r.out) >= r.params.max_tokens:
                    reason = "length"
            text = "".join(f"<{t}>" for t in delta)
            outs.append(RequestOutput(rid, None, r.prompt, [CompletionOutput(
                0, "", list(r.out), None, None, reason, None, delta, text)], reason is not None))
            if reason:
                del self.reqs[rid]
        return outs


class Sender:
    def __init__(self):
        self.items, self.cancelled, self.done = [], False, threading.Event()

    def is_cancelled(self):
        return self.cancelled


def run_loop(engine, **kw):
    def send(handle, item):
        handle.items.append(item)
        if item.final:
            handle.done.set()
    kw.setdefault("coalesce", False)    # exact per-step responses; coalescing has its own tests
    return EngineLoop(engine, send, log=lambda m: None, cancel_poll_s=0.01, **kw).start()


def req(prompt="p", stream=True, max_tokens=4, stop=()):
    return ParsedRequest(prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=prompt if isinstance(prompt, list) else None,
                         params=SamplingParams(max_tokens=max_tokens, stop=list(stop)),
                         stream=stream)


def stream_all(loop, n, max_tokens):
    """n streaming requests of prompt [5, 6, 7]; waits for all, stops the loop; the senders."""
    senders = [Sender() for _ in range(n)]
    for s in senders:
        loop.submit(s, req(prompt=[5, 6, 7], max_tokens=max_tokens))
    assert all(s.done.wait(30) for s in senders)
    loop.shutdown()
    return senders


def finals(sender):
    return [i for i in sender.items if i.final]


def test_stream_sends_deltas_and_one_final():
    loop = run_loop(FakeEngine())
    s = Sender()
    loop.submit(s, req(prompt=[5, 6, 7, 8, 9, 10, 11, 12], max_tokens=3))
    assert s.done.wait(5)
    loop.shutdown()
    assert [i.chunk.token_ids for i in s.items] == [[100], [101], [102]]
    assert len(finals(s)) == 1 and s.items[-1].chunk.finish_reason == "length"
    # context = the 6 ids before each delta (prompt tail first)
    assert s.items[0].chunk.context_ids == [7, 8, 9, 10, 11, 12]
    assert s.items[2].chunk.context_ids == [9, 10, 11, 12, 100, 101]
    assert all(i.chunk.text is None for i in s.items)     # no stop strings: ids only
    assert s.items[0].chunk.num_input_tokens == 8


def test_non_stream_sends_exactly_one_response():
    loop = run_loop(FakeEngine())
    s = Sender()
    loop.submit(s, req(stream=False, max_tokens=4, stop=["zz"]))
    assert s.done.wait(5)
    loop.shutdown()
    assert len(s.items) == 1 and s.items[0].final
    c = s.items[0].chunk
    assert c.token_ids == [100, 101, 102, 103] and c.num_output_tokens == 4
    assert c.text == "<100><101><102><103>"                # engine-made text (stop strings)


def test_engine_validation_error_is_one_invalid_final_and_others_continue():
    loop = run_loop(FakeEngine())
    bad, good = Sender(), Sender()
    loop.submit(bad, req(prompt="bad"))
    loop.submit(good, req(max_tokens=2))
    assert bad.done.wait(5) and good.done.wait(5)
    loop.shutdown()
    assert len(bad.items) == 1 and bad.items[0].error_kind == "invalid"
    assert "prompt='bad' is invalid" in bad.items[0].error
    assert len(finals(good)) == 1 and good.items[-1].chunk.finish_reason == "length"


def test_cancel_aborts_within_a_step_and_sends_one_final():
    engine = FakeEngine()
    loop = run_loop(engine)
    s, other = Sender(), Sender()
    loop.submit(s, req(max_tokens=10_000))
    loop.submit(other, req(max_tokens=50))
    deadline = time.time() + 5
    while len(s.items) < 3 and time.time() < deadline:
        time.sleep(0.001)
    s.cancelled = True
    assert s.done.wait(5)
    assert other.done.wait(5)
    loop.shutdown()
    assert len(finals(s)) == 1 and s.items[-1].error_kind == "cancelled"
    assert engine.aborted and len(s.items) < 10_000
    assert other.items[-1].chunk.finish_reason == "length" and len(finals(other)) == 1


def test_stop_by_key_cancels_and_answers_the_stop_request():
    engine = FakeEngine()
    loop = run_loop(engine)
    s, stopper = Sender(), Sender()
    loop.submit(s, req(max_tokens=10_000), key="k1")
    while not s.items:
        time.sleep(0.001)
    loop.stop("k1", stopper)
    loop.stop("unknown", None)
    assert s.done.wait(5)
    loop.shutdown()
    assert s.items[-1].error_kind == "cancelled" and len(finals(s)) == 1
    assert len(stopper.items) == 1 and stopper.items[0].final and stopper.items[0].chunk is None


class QueueingEngine(FakeEngine):
    """Runs only the first `capacity` requests (in arrival order); the others wait without
    output until an abort ends them, as in a full scheduler."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity

    def step(self):
        time.sleep(0.002)
        waiting = {rid: self.reqs.pop(rid) for rid in list(self.reqs)[self.capacity:]
                   if not self.reqs[rid].aborted}
        try:
            return super().step()
        finally:
            self.reqs.update(waiting)


def test_queued_streams_get_empty_probes_and_a_stop_then_ends_them():
    # Through the ensemble only a response's stream_guard step sees a client's cancel; a queued
    # request has none, so the loop sends it empty ones (queued_probe_s) and the guard's stop
    # ends it while it still waits.
    engine = QueueingEngine(capacity=1)
    loop = run_loop(engine, queued_probe_s=0.1)
    running, queued, plain = Sender(), Sender(), Sender()
    loop.submit(running, req(max_tokens=10**6), key="r")
    while not running.items:
        time.sleep(0.001)
    loop.submit(queued, req(max_tokens=4), key="q")
    loop.submit(plain, req(max_tokens=4, stream=False), key="p")
    time.sleep(0.45)
    probes = list(queued.items)
    assert 2 <= len(probes) <= 5, probes
    assert all(not p.final and p.chunk.empty and p.chunk.request_key == "q" for p in probes)
    assert plain.items == []                # one response only when not streaming: no probes
    assert all(not i.chunk.empty for i in running.items)    # it has tokens: never probed
    loop.stop("q")
    assert queued.done.wait(5)
    assert queued.items[-1].error_kind == "cancelled" and len(finals(queued)) == 1
    loop.stop("r")
    loop.stop("p")
    assert running.done.wait(5) and plain.done.wait(5)
    loop.shutdown()
    assert set(engine.aborted) == {"0", "1", "2"}


def test_no_probes_when_off():
    engine = QueueingEngine(capacity=1)
    loop = run_loop(engine)
    running, queued = Sender(), Sender()
    loop.submit(running, req(max_tokens=10**6), key="r")
    loop.submit(queued, req(max_tokens=4), key="q")
    time.sleep(0.3)
    assert queued.items == []
    loop.stop("r")
    assert queued.done.wait(5)          # then scheduled and run to its end
    loop.shutdown()
    assert queued.items[-1].chunk.finish_reason == "length"


def test_a_probe_merged_with_the_first_tokens_leaves_them_as_they_were():
    probe = Chunk([], [], None, None, 0, 0, request_key="k")
    first = Chunk([7, 8], [1, 2, 3], "ab", None, 3, 2, prefix="echo ", request_key="k")
    assert probe.empty and not first.empty
    merged = coalesce([Outgoing("h", probe), Outgoing("h", first)])
    assert len(merged) == 1 and merged[0].chunk == first


def test_a_cancel_that_overtakes_its_request_waits_for_it():
    # stop() finds a request's key as soon as submit() has registered it, which can be before
    # the loop takes the request from its inbox: the cancel must still reach the engine. The
    # loop is not started; its rounds are run by hand in the order that race produces.
    engine = FakeEngine()
    loop = EngineLoop(engine, lambda handle, item: None, log=lambda m: None)
    loop.submit(Sender(), req(max_tokens=100), key="k")
    loop.stop("k")
    loop._take_cancels()                # the request is not in the engine yet
    loop._take_inbox(block=False)
    loop._take_cancels()
    assert engine.aborted == list(engine.reqs)
    # a cancel whose request was refused (and so forgotten) is not kept
    loop.submit(Sender(), req(prompt="bad"), key="b")
    loop.stop("b")
    loop._take_cancels()
    loop._take_inbox(block=False)
    loop._take_cancels()
    assert loop._cancels.empty() and len(engine.aborted) == 1


def test_engine_death_fails_open_and_new_requests_once():
    dead = threading.Event()
    loop = run_loop(FakeEngine(fail_at=3), on_dead=dead.set)
    a, b = Sender(), Sender()
    loop.submit(a, req(max_tokens=100))
    loop.submit(b, req(max_tokens=100))
    assert a.done.wait(5) and b.done.wait(5) and dead.wait(5)
    assert not loop.alive
    late = Sender()
    loop.submit(late, req())
    assert late.done.wait(5)
    loop.shutdown()
    for s in (a, b, late):
        assert len(finals(s)) == 1 and s.items[-1].error_kind == "unavailable"


def test_shutdown_closes_open_requests():
    loop = run_loop(FakeEngine())
    s = Sender()
    loop.submit(s, req(max_tokens=10**6))
    while not s.items:
        time.sleep(0.001)
    loop.shutdown()
    assert len(finals(s)) == 1 and s.items[-1].error_kind == "unavailable"


def _sentencepiece_style_tokenizer():
    """A byte-fallback BPE with a Metaspace ("▁") pre-tokenizer, like Llama-2 / Mistral."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "c", "a", "f", "▁h", "▁he", "▁hel",
                  "▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world", "▁c", "▁ca",
                  "▁caf"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"), ("▁", "w"),
              ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d"), ("▁", "c"),
              ("▁c", "a"), ("▁ca", "f")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("text", [
    "hello world, café ok",
    "hello world café 世界 🙂 hello",
    "héllo wörld 🙂🙂 ok",
    "😀😀😀 日本語のテキスト ✓ fin",
])
def test_chunks_detokenize_exactly_on_any_instance(text):
    """The loop's context ids + decode_delta, each delta decoded by a fresh call (as by one of
    several detokenizer instances), concatenate to the whole text."""
    tok = _sentencepiece_style_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback used
    prompt, output = [ids[0]], ids[1:]
    loop = run_loop(FakeEngine(script=output, tokenizer=tok))
    s = Sender()
    loop.submit(s, req(prompt=prompt, max_tokens=len(output)))
    assert s.done.wait(5)
    loop.shutdown()
    streamed = "".join(decode_delta(tok, i.chunk.context_ids, i.chunk.token_ids)
                       for i in s.items)
    whole = tok.decode(ids, clean_up_tokenization_spaces=False)
    head = tok.decode(prompt, clean_up_tokenization_spaces=False)
    assert head + streamed == whole


def test_coalesce_merges_each_requests_queued_chunks_in_order():
    a, b = Sender(), Sender()
    ch = lambda ids, ctx, fin=None, lp=None, pre="": Chunk(ids, ctx, None, fin, 5, len(ids),
                                                          prefix=pre, request_key="k", logprobs=lp)
    items = [Outgoing(a, ch([1], [9, 8], pre="P", lp=[(1, -0.1, [])])), Outgoing(b, ch([7], [0])),
             Outgoing(a, ch([2, 3], [8, 1], lp=[(2, -0.2, []), (3, -0.3, [])])),
             Outgoing(b, None, error="the request was cancelled", error_kind="cancelled",
                      final=True),
             Outgoing(a, ch([4], [3], fin="length", lp=[(4, -0.4, [])]), final=True)]
    out = coalesce(items)
    assert [o.handle for o in out] == [a, b, b]
    m = out[0].chunk
    assert out[0].final and m.token_ids == [1, 2, 3, 4] and m.context_ids == [9, 8]
    assert m.num_output_tokens == 4 and m.finish_reason == "length" and m.prefix == "P"
    assert [t for t, _, _ in m.logprobs] == [1, 2, 3, 4]
    assert out[1].chunk.token_ids == [7] and not out[1].final
    assert out[2].error_kind == "cancelled" and out[2].final
    # a chunk after an error or final is never merged backwards
    later = coalesce([Outgoing(a, ch([1], [0]), final=True), Outgoing(a, ch([2], [1]))])
    assert [o.chunk.token_ids for o in later] == [[1], [2]]


def test_slow_sender_gets_fewer_larger_responses_with_the_same_tokens():
    engine = FakeEngine()

    def send(handle, item):
        time.sleep(0.02)                    # an IPC-bound sender that falls behind
        handle.items.append(item)
        if item.final:
            handle.done.set()
    loop = EngineLoop(engine, send, log=lambda m: None, cancel_poll_s=0.01).start()
    senders = stream_all(loop, 8, max_tokens=40)
    for s in senders:
        ids = [t for i in s.items for t in i.chunk.token_ids]
        assert ids == [100 + n for n in range(40)]
        assert len(finals(s)) == 1 and s.items[-1].final
        assert sum(i.chunk.num_output_tokens for i in s.items) == 40
    assert sum(len(s.items) for s in senders) < 8 * 40 / 2, "responses were not merged"


def test_response_rate_budget_merges_steps_but_sends_first_and_last_at_once():
    class SlowEngine(FakeEngine):
        def step(self):
            time.sleep(0.005)               # ~200 steps/s
            return super().step()
    senders = stream_all(run_loop(SlowEngine(), max_responses_per_s=40), 4, max_tokens=30)
    for s in senders:
        chunks = [i.chunk for i in s.items]
        assert chunks[0].token_ids == [100]                      # first token not held
        assert [t for c in chunks for t in c.token_ids] == [100 + n for n in range(30)]
        assert sum(c.num_output_tokens for c in chunks) == 30
        assert len(finals(s)) == 1 and chunks[-1].finish_reason == "length"
        # 4 streams at 40 responses/s: one response per ~100 ms instead of every ~5 ms step
        assert len(chunks) < 15, len(chunks)
        assert chunks[1].context_ids[-1] == chunks[0].token_ids[-1]   # merged chunk's context


def test_real_async_engine_behind_the_loop_streams_and_cancels(tmp_path):
    """The GPU default (async scheduling) behind the serving loop, on the CPU with a tiny random
    model: streamed ids equal offline greedy, a cancel with a step in flight ends in exactly one
    cancelled final, and every KV block comes back."""
    from pagedbackend import LLM
    from pagedbackend.engine.llm_engine import LLMEngine
    from pagedbackend.config import EngineConfig
    from pagedbackend.testing import make_hf_checkpoint
    make_hf_checkpoint("llama", tmp_path, seed=2, std=0.15)
    cfg = dict(dtype="float32", block_size=4, num_kv_blocks=64)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [13, 14]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **cfg).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)]
    engine = LLMEngine(EngineConfig(model=str(tmp_path), async_scheduling=True, **cfg))
    loop = run_loop(engine, max_responses_per_s=0)
    senders = [Sender() for _ in prompts]
    for s, p in zip(senders, prompts):
        loop.submit(s, ParsedRequest(prompt=None, prompt_token_ids=p, params=greedy.clone(),
                                     stream=True))
    victim = Sender()
    loop.submit(victim, ParsedRequest(prompt=None, prompt_token_ids=[3, 4],
                                      params=SamplingParams(temperature=0, max_tokens=200,
                                                            ignore_eos=True), stream=True))
    deadline = time.time() + 10
    while not victim.items and time.time() < deadline:
        time.sleep(0.01)
    victim.cancelled = True
    assert all(s.done.wait(30) for s in senders + [victim])
    loop.shutdown()
    for s, ids in zip(senders, want):
        assert [t for i in s.items for t in i.chunk.token_ids] == ids
        assert len(finals(s)) == 1
    assert len(finals(victim)) == 1 and victim.items[-1].error_kind == "cancelled"
    engine.check_invariants()
    assert engine.stats().num_used_blocks == 0


def test_each_busy_period_is_reported_once_from_the_sender_thread():
    class TimedEngine(FakeEngine):
        def timing_summary(self, reset=False):
            return {"steps": self.steps, "host_ms": 0.5, "note": "not a number",
                    "path_steps": {"decode_graph": 3, "mixed_eager": 1},
                    "path_ms": {"decode_graph": 3.42, "mixed_eager": 40.0}}

        def step(self):
            if self.steps % 2 == 0:     # slow steps in each period: the slowest is named
                time.sleep(0.12)
            return super().step()

    lines, threads = [], set()

    def info(line):
        lines.append(line)
        threads.add(threading.current_thread().name)

    loop = run_loop(TimedEngine(), info=info)
    for burst in range(2):                     # two busy periods with idle time between
        senders = [Sender() for _ in range(3)]
        for s in senders:
            loop.submit(s, req(prompt=[5, 6, 7], max_tokens=4))
        assert all(s.done.wait(10) for s in senders)
        deadline = time.time() + 5
        while len(lines) <= burst and time.time() < deadline:
            time.sleep(0.01)
    loop.shutdown()
    assert len(lines) == 2 and threads == {"engine-sender"}
    for line in lines:
        # 4 tokens each: 4 steps, more if the loop woke between the three submits
        m = re.match(r"busy period: [0-9.]+ s, (\d+) steps, engine.step \d+% of the wall", line)
        assert m and 4 <= int(m.group(1)) <= 6, line
        assert "engine step split: steps " in line and "host_ms 0.5" in line
        assert "not a number" not in line
        assert line.endswith("; steps by path: decode_graph 3, mixed_eager 1; ms a step by "
                             "path: decode_graph 3.42, mixed_eager 40"), line
        slow = re.search(r"slowest step ([0-9.]+) ms at \+([0-9.]+) s", line)
        assert slow and float(slow.group(1)) >= 120 and float(slow.group(2)) < 5, line


class RecordingGrammars:
    """The engine's GrammarCompiler interface: records where it compiled; "(" fails."""

    def __init__(self):
        self.threads = []

    def compile(self, spec):
        self.threads.append(threading.current_thread().name)
        if spec.get("regex") == "(":
            raise ValueError("structured_outputs.regex='(' is invalid: must be a valid regular "
                             "expression (the parenthesis is not closed)")


def test_structured_output_grammars_compile_on_the_submitting_thread():
    """A large schema compiles for a while: on the caller's (Triton's execute) thread, so the
    loop thread never stalls the running batch for it; a bad one is refused there, alone."""
    eng = FakeEngine()
    eng.grammars = RecordingGrammars()
    added, add = [], eng.add_request
    eng.add_request = lambda rid, prompt, params, **kw: (added.append(params),
                                                         add(rid, prompt, params, **kw))
    sent = []
    loop = EngineLoop(eng, lambda h, item: sent.append((h, item))).start()
    try:
        good = SamplingParams(max_tokens=2, structured_outputs={"regex": "[a-z]+"})
        bad = SamplingParams(max_tokens=2, structured_outputs={"regex": "("})
        loop.submit("ok", ParsedRequest(prompt=None, prompt_token_ids=[1], params=good))
        loop.submit("bad", ParsedRequest(prompt=None, prompt_token_ids=[1], params=bad))
        loop.submit("plain", ParsedRequest(prompt=None, prompt_token_ids=[1],
                                           params=SamplingParams(max_tokens=2)))
        deadline = time.time() + 10
        while sum(1 for _, item in sent if item.final) < 3 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        loop.shutdown()
    assert eng.grammars.threads == [threading.current_thread().name] * 2
    finals = {h: item for h, item in sent if item.final}
    assert finals["bad"].error.startswith("structured_outputs.regex='('")
    assert finals["bad"].error_kind == "invalid"
    assert finals["ok"].error is None and finals["plain"].error is None
    assert [p.structured_outputs for p in added] == [{"regex": "[a-z]+"}, None]   # not "bad"
