"""Offline API, as vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
from typing import Any, Optional, Sequence, Union

from pagedbackend.config import EngineConfig, check
from pagedbackend.engine.llm_engine import LLMEngine, PromptType
from pagedbackend.outputs import BeamSearchOutput, RequestOutput
from pagedbackend.sampling_params import BeamSearchParams, SamplingParams


# vLLM arguments that change nothing here, accepted so that scripts written for vLLM run:
# remote model code is never run (only Llama-family architectures load), and stats are not logged.
IGNORED_VLLM_ARGS = ("trust_remote_code", "disable_log_stats")


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        for name in IGNORED_VLLM_ARGS:
            if kwargs.pop(name, None):
                logging.getLogger("pagedbackend").info("LLM(%s=...) changes nothing here", name)
        unknown = sorted(set(kwargs) - fields)
        if unknown:      # as a ValueError naming it, not dataclass's TypeError
            check(False, unknown[0], kwargs[unknown[0]],
                  f"an engine setting: one of {', '.join(sorted(fields - {'model'}))}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 priority: Optional[Sequence[int]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order.
        use_tqdm: a progress bar of finished requests, as vLLM's (shown only on a terminal)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # None: the model's generation_config.json values (vLLM's get_default_sampling_params)
        params = sampling_params or self.engine.default_sampling_params()
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
        bar = _progress(len(ids), use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (engine/beam_search.py): each prompt's best
        params.beam_width sequences, best first."""
        from pagedbackend.engine.beam_search import beam_search
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return beam_search(self, list(prompts), params)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Optional[list] = None,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """One conversation or a list of them through the model's chat template, as vLLM's."""
        check(not (add_generation_prompt and continue_final_message), "continue_final_message",
              True, "false when add_generation_prompt is true")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            extra["continue_final_message"] = True
        prompts = [{"prompt_token_ids": chat_token_ids(self.engine.tokenizer, c,
                                                       add_generation_prompt, **extra)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _progress(total: int, wanted: bool) -> Any:
    if not wanted or total < 2 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Processed prompts", unit="req")


def chat_token_ids(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                   **kwargs: Any) -> list[int]:
    """The model's chat template applied (by default with the assistant turn opened)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kwargs)
    if hasattr(ids, "keys"):   # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
