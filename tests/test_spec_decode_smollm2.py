"""Speculative decoding on the real SmolLM2-135M-Instruct: n-gram drafts on a task that copies
its input give the same greedy text as without, stop strings cut the same text (and drop the
accepted tokens after them), streamed deltas of several tokens add up."""
import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.llm import chat_token_ids

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in "
             "the salty wind. Every evening the keeper climbed the spiral stairs to light the "
             "lamp, and every morning he wrote the weather in a small leather book.")
TASKS = [[{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"}],
         [{"role": "user", "content": "Rewrite this paragraph, replacing 'keeper' with "
                                      f"'guardian':\n\n{PARAGRAPH}"}]]
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
KW = dict(dtype="float32", block_size=16, max_num_seqs=8, num_kv_blocks=128, max_model_len=1024)
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def ref(smollm2_dir):
    """The greedy answers without speculation."""
    return [o.outputs[0] for o in LLM(smollm2_dir, **KW).chat(TASKS, GREEDY)]


@pytest.fixture(scope="module")
def spec(smollm2_dir):
    return LLM(smollm2_dir, speculative_config=SPEC, **KW)


def no_leak(llm):
    llm.engine.check_invariants()
    assert llm.engine.stats().num_used_blocks == 0


def test_copying_task_same_greedy_text_and_drafts_accepted(ref, spec):
    got = [o.outputs[0] for o in spec.chat(TASKS, GREEDY)]
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in ref]
    st = spec.engine.drafter.stats
    assert st.acceptance_rate > 0.5, st        # the answer copies the paragraph
    no_leak(spec)


@pytest.mark.parametrize("stop", ["stood", "edge of"])
def test_stop_string_inside_accepted_drafts_cuts_the_same_text(ref, spec, stop):
    want = ref[0]
    assert stop in want.text
    got = spec.chat(TASKS[:1], GREEDY.clone(stop=[stop], logprobs=1))[0].outputs[0]
    assert got.text == want.text[:want.text.index(stop)]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    # the tokens end with the one that completed the stop string, as without drafts
    n = len(got.token_ids)
    assert got.token_ids == want.token_ids[:n]
    assert stop in spec.engine.tokenizer.decode(want.token_ids[:n])
    assert stop not in spec.engine.tokenizer.decode(want.token_ids[:n - 1])
    # the dropped tokens' logprobs went with them
    assert len(got.logprobs) == n
    assert got.cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(got.logprobs, got.token_ids)), abs=1e-4)
    no_leak(spec)


def test_streamed_deltas_of_several_tokens_add_up(ref, spec):
    eng = spec.engine
    eng.add_request("r", {"prompt_token_ids": chat_token_ids(eng.tokenizer, TASKS[0])}, GREEDY)
    texts, sizes = [], []
    while eng.has_unfinished():
        for out in eng.step():
            texts.append(out.outputs[0].delta_text)
            sizes.append(len(out.outputs[0].delta_token_ids))
            final = out
    assert "".join(texts) == final.outputs[0].text == ref[0].text
    assert max(sizes) > 1, "accepted drafts should arrive as several tokens in one delta"
    no_leak(spec)
