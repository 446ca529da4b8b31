"""Offline API, as vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from pagedbackend.config import EngineConfig
from pagedbackend.engine.llm_engine import LLMEngine, PromptType
from pagedbackend.outputs import RequestOutput
from pagedbackend.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                        final_only=True)
                ids.append(rid)
        except ValueError:
            self.engine.abort(ids)
            self.engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: Optional[SamplingParams] = None) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_token_ids(self.engine.tokenizer, c)} for c in convs]
        return self.generate(prompts, sampling_params)


def chat_token_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The model's chat template applied with the assistant turn opened."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):   # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
