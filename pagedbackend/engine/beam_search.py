"""LLM.beam_search, as vLLM's offline beam search: built on the engine's own steps, one token at
a time. Every step submits each live beam (its prompt and tokens so far) as a one-token request
asking for the top 2 x beam_width logprobs; the prefix cache holds the beams' shared history,
so a step prefills little beyond each beam's last block. Candidates are each beam's returned
tokens with cum_logprob + logprob; a candidate ending in an EOS token (unless ignore_eos) is
complete and leaves the search, the rest keep the beam_width best by
cum_logprob / len(tokens) ** length_penalty (len counting the prompt, and not a final EOS). The
best beam_width of the completed and the last live beams are returned.
"""
from __future__ import annotations

from typing import Any, Sequence

from pagedbackend.outputs import BeamSearchOutput, BeamSearchSequence
from pagedbackend.sampling_params import BeamSearchParams, SamplingParams


def score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    n = len(beam.tokens) - (1 if beam.tokens[-1] in eos else 0)
    return beam.cum_logprob / (n ** length_penalty)


def beam_search(llm: Any, prompts: Sequence[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.engine
    eos = set(engine.info.eos_token_ids)
    width = params.beam_width
    step = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                          ignore_eos=True, skip_special_tokens=False)
    live = [[BeamSearchSequence(engine.tokenize_prompt(p)[1], [])] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def key(beam: BeamSearchSequence) -> float:
        return score(beam, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        beams = [(i, b) for i, bs in enumerate(live) for b in bs]
        if not beams:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in beams], step,
                            use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(beams, outs):
            top = out.outputs[0].logprobs[0]
            for token, logprob in top.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                         beam.cum_logprob + logprob)
                if token in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=key, reverse=True)[:width] for c in candidates]
    results = []
    tokenizer = engine.tokenizer
    for finished, last in zip(done, live):
        for beam in last:
            beam.finish_reason = "length"
        best = sorted(finished + last, key=key, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results
