"""Beam search, as vLLM's: built on the engine's own steps, one token at a time. Every round
submits each live beam (its prompt and tokens so far) as a one-token request asking for the top
2 x beam_width logprobs; the prefix cache holds the beams' shared history, so a round prefills
little beyond each beam's last block. Candidates are each beam's returned tokens with
cum_logprob + logprob; a candidate ending in an EOS token (unless ignore_eos) is complete and
leaves the search, the rest keep the beam_width best by
cum_logprob / len(tokens) ** length_penalty (len counting the prompt, and not a final EOS). The
best beam_width of the completed and the last live beams are returned.

`BeamSearch` is one prompt's search; `LLM.beam_search` (below) runs many offline, and the
serving loop runs one per request with beam_width > 1 (serving/beam_requests.py).
"""
from __future__ import annotations

from typing import Any, Sequence

from pagedbackend.outputs import BeamSearchOutput, BeamSearchSequence
from pagedbackend.sampling_params import BeamSearchParams, SamplingParams


def score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    n = len(beam.tokens) - (1 if beam.tokens[-1] in eos else 0)
    return beam.cum_logprob / (n ** length_penalty)


def round_params(params: BeamSearchParams) -> SamplingParams:
    """A live beam's one-token request in a round."""
    return SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                          temperature=params.temperature, ignore_eos=True,
                          skip_special_tokens=False)


class BeamSearch:
    """One prompt's search: its live and completed beams, advanced one round at a time."""

    def __init__(self, prompt_ids: Sequence[int], params: BeamSearchParams, eos: set[int]):
        self.params, self.eos = params, eos
        self.live = [BeamSearchSequence(list(prompt_ids), [])]
        self.done: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def finished(self) -> bool:
        return not self.live or self.rounds >= self.params.max_tokens

    def key(self, beam: BeamSearchSequence) -> float:
        return score(beam, self.eos, self.params.length_penalty)

    def advance(self, tops: Sequence[dict[int, float]]) -> None:
        """One round: tops[j] is live beam j's top next tokens -> logprob."""
        candidates = []
        for beam, top in zip(self.live, tops):
            for token, logprob in top.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                         beam.cum_logprob + logprob)
                if token in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.done.append(new)
                else:
                    candidates.append(new)
        self.live = sorted(candidates, key=self.key, reverse=True)[:self.params.beam_width]
        self.rounds += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the completed and the live beams, best first."""
        for beam in self.live:
            beam.finish_reason = "length"
        return sorted(self.done + self.live, key=self.key, reverse=True)[:self.params.beam_width]


def beam_search(llm: Any, prompts: Sequence[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.engine
    eos = set(engine.info.eos_token_ids)
    step = round_params(params)
    searches = [BeamSearch(engine.tokenize_prompt(p)[1], params, eos) for p in prompts]
    while True:
        active = [s for s in searches if not s.finished]
        if not active:
            break
        outs = iter(llm.generate([{"prompt_token_ids": b.tokens}
                                  for s in active for b in s.live], step, use_tqdm=False))
        for s in active:
            s.advance([next(outs).outputs[0].logprobs[0] for _ in s.live])
    results = []
    tokenizer = engine.tokenizer
    for s in searches:
        best = s.best()
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results
