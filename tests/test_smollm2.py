"""The real SmolLM2-135M-Instruct through the engine: transformers parity, chat, text output."""
import json

import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.detokenizer import context_for, decode_delta
from pagedbackend.engine.llm import chat_token_ids

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    # float32, like the transformers reference these tests compare with.
    return LLM(smollm2_dir, dtype="float32", block_size=16, max_num_seqs=64)


def test_default_dtype_answers_paris(smollm2_dir):
    """dtype=auto (bf16 where the CPU multiplies bf16 natively) still answers correctly."""
    llm = LLM(smollm2_dir, max_model_len=512)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text


def test_chat_answers_paris(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert out.text.startswith("The capital of France is Paris")
    assert out.finish_reason == "stop"          # EOS (<|im_end|>) ended it


def test_greedy_identical_to_transformers_in_a_batch(llm, smollm2_dir):
    from transformers import AutoModelForCausalLM
    tok = llm.get_tokenizer()
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Hi", "Explain photosynthesis in one sentence.",
             "Translate 'good morning' to French.", "What is 17 times 3?",
             "Name a famous painter."]
    prompts = [chat_token_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    n = 24
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # No EOS for transformers either (min_new_tokens would mask EOS instead of ignoring it).
    hf.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert len(ref) == n
        assert o.outputs[0].token_ids == ref


def test_stop_string_cuts_text_exactly(llm):
    full = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    cut = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop=["France"]))[0]
    o = cut.outputs[0]
    assert o.text == full[:full.index("France")]
    assert (o.finish_reason, o.stop_reason) == ("stop", "France")
    inc = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop=["Paris"],
                                            include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == full[:full.index("Paris") + len("Paris")]


def test_streamed_deltas_concatenate_to_text_with_multibyte_output(llm):
    eng = llm.engine
    msgs = [{"role": "user", "content": "Écris « bonjour » en chinois (你好) et ajoute un emoji 😀."}]
    ids = chat_token_ids(eng.tokenizer, msgs)
    for rid, stop in (("plain", []), ("stop", ["\n\n"])):
        eng.add_request(rid, {"prompt_token_ids": ids},
                        SamplingParams(temperature=0.8, seed=7, max_tokens=48, stop=stop))
    deltas, final = {"plain": "", "stop": ""}, {}
    while eng.has_unfinished():
        for out in eng.step():
            deltas[out.request_id] += out.outputs[0].delta_text
            if out.finished:
                final[out.request_id] = out.outputs[0]
    for rid in final:
        assert deltas[rid] == final[rid].text
    # The stateless detokenizer (as the Triton detokenizer instances use it) agrees too.
    o = final["plain"]
    all_ids = ids + o.token_ids
    pieces = [decode_delta(eng.tokenizer, context_for(eng.tokenizer, all_ids, len(ids) + i), [t])
              for i, t in enumerate(o.token_ids)]
    assert "".join(pieces) == o.text
    assert any(ord(c) > 127 for c in o.text), o.text


def test_seeded_sampling_is_reproducible_in_mixed_batches(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16)
    a = llm.chat(QUESTION, p)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    mixed = llm.generate(["Tell me a story", {"prompt_token_ids": chat_token_ids(tok, QUESTION)},
                          "Count to ten"],
                         [SamplingParams(temperature=1.0, max_tokens=20), p,
                          SamplingParams(temperature=0.5, max_tokens=8)])
    assert mixed[1].outputs[0].token_ids == a


def token_id(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_logit_bias_and_allowed_token_ids_steer_the_answer(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    paris = token_id(tok, " Paris")
    plain = llm.chat(QUESTION, greedy)[0].outputs[0]
    assert paris in plain.token_ids
    # -100 keeps the token out, as a JSON client would send it (string keys)
    no_paris = llm.chat(QUESTION, greedy.clone(logit_bias={str(paris): -100}))[0].outputs[0]
    assert paris not in no_paris.token_ids and "The capital of France is" in no_paris.text
    # +100 on one token makes it every token
    banana = token_id(tok, " banana")
    forced = llm.chat(QUESTION, greedy.clone(logit_bias={banana: 100}, max_tokens=4))[0]
    assert forced.outputs[0].token_ids == [banana] * 4
    yes_no = [token_id(tok, " yes"), token_id(tok, " no"), token_id(tok, " maybe")]
    out = llm.chat(QUESTION, SamplingParams(temperature=1.0, seed=5, max_tokens=10,
                                            ignore_eos=True, allowed_token_ids=yes_no))[0]
    assert len(out.outputs[0].token_ids) == 10 and set(out.outputs[0].token_ids) <= set(yes_no)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_keep_words_out_of_the_answer(smollm2_dir, llm, async_scheduling):
    """One-token words are banned at every step; a word of several tokens loses its last token
    only where the output ends with the rest of it, which needs every earlier token on the host
    before the step is launched (async scheduling lands the step in flight first)."""
    eng = llm if not async_scheduling else LLM(smollm2_dir, dtype="float32", block_size=16,
                                               async_scheduling=True)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = eng.chat(QUESTION, greedy)[0].outputs[0].text
    assert "capital of France" in plain and "Paris" in plain
    words = ["capital of France", "Paris"]
    assert len(tok.encode(" capital of France", add_special_tokens=False)) > 1
    outs = eng.chat([QUESTION, QUESTION], [greedy.clone(bad_words=words), greedy])
    text = outs[0].outputs[0].text
    assert "capital of France" not in text and "Paris" not in text and text != plain
    assert "capital of" in text or "France" in text      # only the whole word is banned
    assert outs[1].outputs[0].text == plain              # its batch neighbour is unchanged


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def test_structured_outputs_hold_the_answer_to_the_grammar(llm):
    import re

    import jsonschema
    greedy = SamplingParams(temperature=0, max_tokens=80)
    free = llm.chat(ASK_PERSON, greedy)[0].outputs[0].text
    outs = llm.chat([ASK_PERSON] * 5 + [QUESTION], [
        greedy.clone(structured_outputs={"json": PERSON}),
        greedy.clone(structured_outputs={"json_object": True}),
        greedy.clone(structured_outputs={"regex": r"[0-9]{3}-[A-Z]{2}"}),
        SamplingParams(temperature=1.5, seed=1, n=3, max_tokens=16,
                       structured_outputs={"choice": ["red", "green", "blue"]}),
        greedy.clone(structured_outputs={"grammar": 'root ::= "yes" | "no"'}),
        greedy])
    person = json.loads(outs[0].outputs[0].text)
    jsonschema.validate(person, PERSON)
    assert list(person) == ["name", "age"]                       # the schema's order
    assert outs[0].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outs[1].outputs[0].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", outs[2].outputs[0].text)
    assert len(outs[3].outputs) == 3
    assert all(o.text in ("red", "green", "blue") for o in outs[3].outputs)
    assert outs[4].outputs[0].text in ("yes", "no")
    # the free-text neighbour in the same batch is untouched
    assert outs[5].outputs[0].text.startswith("The capital of France is Paris")
    with pytest.raises(json.JSONDecodeError):      # else the test above would prove nothing
        json.loads(free)


def test_structured_outputs_async_equal_sync_and_bad_grammars_name_the_field(smollm2_dir, llm):
    asy = LLM(smollm2_dir, dtype="float32", block_size=16, async_scheduling=True)
    assert asy.engine.async_scheduling
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": PERSON})
    want = llm.chat(ASK_PERSON, params)[0].outputs[0]
    got = asy.chat(ASK_PERSON, params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    for spec, field in (({"regex": "(unclosed"}, "structured_outputs.regex"),
                        ({"grammar": "root ::= nothing_defined"}, "structured_outputs.grammar"),
                        ({"json": {"type": "no-such-type"}}, "structured_outputs.json")):
        with pytest.raises(ValueError, match=rf"^{field}=.* is invalid: must be a valid"):
            asy.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not asy.engine.has_unfinished()
    assert asy.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text \
        .startswith("The capital of France is Paris")


def test_chat_continues_the_final_message(llm):
    start = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(start, SamplingParams(temperature=0, max_tokens=8),
                   add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")
