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
