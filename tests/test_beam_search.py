"""LLM.beam_search (vLLM's offline beam search) against a beam search written out here over
transformers' log-softmax on the same weights (fp32): the same beams, scores and finishes."""
import dataclasses

import pytest
import torch

from pagedbackend import LLM, BeamSearchParams
from pagedbackend.testing import make_hf_checkpoint

PROMPTS = [[5, 9, 13], list(range(40, 52)), [7] * 5]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam-llama")
    hf = make_hf_checkpoint("llama", path)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=64)
    return hf, llm


def reference(hf, prompt, width, steps, eos, ignore_eos, length_penalty):
    """Beam search by hand: every beam's top 2 x width next tokens, EOS candidates complete,
    beams ranked by cum_logprob / len ** length_penalty (len with the prompt, without EOS)."""
    def key(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] in eos)) ** length_penalty)
    live, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [t], cum + lp)
                (done if t in eos and not ignore_eos else candidates).append(beam)
        live = sorted(candidates, key=key, reverse=True)[:width]
    return [(tokens, cum, "stop" if tokens[-1] in eos and not ignore_eos else "length")
            for tokens, cum in sorted(done + live, key=key, reverse=True)[:width]]


def check(got, want, prompt):
    assert [(s.tokens, s.finish_reason) for s in got.sequences] == [(t, f) for t, _, f in want]
    for s, (_, cum, _) in zip(got.sequences, want):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
        # each generated position's candidates, its own token among them
        assert len(s.logprobs) == len(s.tokens) - len(prompt)
        assert all(t in lp for t, lp in zip(s.tokens[len(prompt):], s.logprobs))


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_match_a_search_written_out_over_transformers(model, width, length_penalty):
    hf, llm = model
    eos = set(llm.engine.info.eos_token_ids)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for p, out in zip(PROMPTS, outs):
        assert len(out.sequences) == width
        assert all(s.tokens[:len(p)] == p for s in out.sequences)
        check(out, reference(hf, p, width, 6, eos, False, length_penalty), p)


def test_an_eos_candidate_completes_its_beam(model, monkeypatch):
    """With EOS a token the search meets at once, beams ending in it leave the search with
    finish_reason "stop" (and compete at the end with the rest); ignore_eos keeps them going."""
    hf, llm = model
    prompt = PROMPTS[0]
    first = reference(hf, prompt, 3, 1, set(), True, 1.0)
    eos = first[1][0][-1]                       # the second-best first token
    monkeypatch.setattr(llm.engine, "info",
                        dataclasses.replace(llm.engine.info, eos_token_ids=(eos,)))
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    got = llm.beam_search({"prompt_token_ids": prompt}, params)[0]
    want = reference(hf, prompt, 3, 5, {eos}, False, 1.0)
    check(got, want, prompt)
    assert any(f == "stop" for _, _, f in want)
    ignoring = llm.beam_search({"prompt_token_ids": prompt},
                               dataclasses.replace(params, ignore_eos=True))[0]
    check(ignoring, reference(hf, prompt, 3, 5, {eos}, True, 1.0), prompt)
    assert all(s.finish_reason == "length" and len(s.tokens) == len(prompt) + 5
               for s in ignoring.sequences)


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=11, max_tokens=4),
                                                       "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty="x"), "length_penalty"),
])
def test_bad_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.*must be"):
        BeamSearchParams(**kwargs)


def test_smollm2_beam_search_text(smollm2_dir):
    """The real model: the best beam of a chat prompt decodes (prompt included, as vLLM's) to
    the prompt's text followed by an answer naming Paris."""
    llm = LLM(smollm2_dir, max_model_len=256)
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2,
                                                                      max_tokens=12))[0]
    best = out.sequences[0]
    assert best.text.startswith(llm.get_tokenizer().decode(ids))
    assert "Paris" in best.text[len(llm.get_tokenizer().decode(ids)):]
    from pagedbackend.engine.beam_search import score
    eos = set(llm.engine.info.eos_token_ids)
    scores = [score(s, eos, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


# ------------------------------------------------------------------ beam_width through serving

def serve(llm, requests, cancel_after=None):
    """Runs the engine model's loop over llm's engine: requests is {handle: ParsedRequest};
    returns {handle: final Outgoing}. cancel_after: (handle, key, seconds) stops that one."""
    import threading
    import time

    from pagedbackend.serving.engine_loop import EngineLoop
    finals, done = {}, threading.Event()

    def send(handle, item):
        if item.final:
            finals[handle] = item
            if len(finals) == len(requests):
                done.set()
    loop = EngineLoop(llm.engine, send, log=lambda m: None, cancel_poll_s=0.01).start()
    try:
        for handle, r in requests.items():
            loop.submit(handle, r, key=handle)
        if cancel_after:
            time.sleep(cancel_after[1])
            loop.stop(cancel_after[0])
        assert done.wait(120)
    finally:
        loop.shutdown()
    assert not llm.engine.has_unfinished()      # every round's sub-request ended
    return finals


def beam_request(prompt, width, max_tokens, stream=False, length_penalty=1.0, **fields):
    from pagedbackend import SamplingParams
    from pagedbackend.serving.request import ParsedRequest
    return ParsedRequest(prompt=None, prompt_token_ids=prompt, stream=stream,
                         params=SamplingParams(max_tokens=max_tokens, **fields),
                         beam_width=width, length_penalty=length_penalty)


def test_serving_runs_beam_search_beside_other_requests(model):
    """beam_width > 1 on the engine model's loop: the best beam of the offline search, as one
    final response (streaming or not), while a plain request runs beside it."""
    _, llm = model
    from pagedbackend import SamplingParams
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    offline = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    greedy = llm.generate({"prompt_token_ids": PROMPTS[2]},
                          SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    finals = serve(llm, {
        "a": beam_request(PROMPTS[0], 3, 6, length_penalty=0.5),
        "b": beam_request(PROMPTS[1], 3, 6, stream=True, length_penalty=0.5),
        "plain": beam_request(PROMPTS[2], 1, 8, temperature=0)})
    for handle, prompt, out in (("a", PROMPTS[0], offline[0]), ("b", PROMPTS[1], offline[1])):
        chunk, best = finals[handle].chunk, out.sequences[0]
        assert finals[handle].error is None
        assert chunk.token_ids == best.tokens[len(prompt):]
        assert chunk.finish_reason == best.finish_reason
        assert chunk.num_input_tokens == len(prompt)
        assert chunk.num_output_tokens == len(best.tokens) - len(prompt)
    assert finals["plain"].chunk.token_ids == greedy.outputs[0].token_ids


def test_serving_beam_search_refusals_and_cancel_leave_the_engine_clean(model):
    _, llm = model
    finals = serve(llm, {
        "top_p": beam_request(PROMPTS[0], 2, 4, top_p=0.5),
        "long": beam_request(PROMPTS[0], 2, 64),
        "ok": beam_request(PROMPTS[1], 2, 3, ignore_eos=True)})
    assert finals["top_p"].error == ("top_p=0.5 is invalid with beam_width=2: beam search "
                                     "takes max_tokens, temperature, ignore_eos and "
                                     "length_penalty only")
    assert finals["long"].error.startswith("max_tokens=64 is invalid: must be in [1, 61]")
    assert finals["top_p"].error_kind == finals["long"].error_kind == "invalid"
    assert finals["ok"].error is None and finals["ok"].chunk.num_output_tokens == 3
    # a search stopped mid-way (59 rounds of 10 beams) ends at once, its round's sub-requests
    # aborted
    finals = serve(llm, {"slow": beam_request(PROMPTS[2], 10, 59, ignore_eos=True)},
                   cancel_after=("slow", 0.05))
    assert finals["slow"].error_kind == "cancelled" and finals["slow"].chunk is None
