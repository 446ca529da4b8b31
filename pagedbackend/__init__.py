"""pagedbackend: a paged-KV LLM engine (vLLM-style) that runs inside NVIDIA Triton."""
from pagedbackend.config import EngineConfig
from pagedbackend.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput,
                                  RequestOutput)
from pagedbackend.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]


def __getattr__(name):
    # Heavy imports (torch, transformers) only when the engine itself is used.
    if name == "LLM":
        from pagedbackend.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from pagedbackend.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
