"""What the gateway needs from an inference server: `ready`, `version`, `supports_logprobs`, and
`generate`, an async iterator of `Chunk`s that is cancelled by closing it. `TritonBackend` (triton_backend.py) is the
real one; tests inject a fake with the same members."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Protocol


class BackendError(Exception):
    """The server refused or failed a request; `message` is its text, mapped by errors.from_triton."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class TokenLogprob:
    token: str
    logprob: Optional[float]                         # None: a prompt's first token
    top: list = field(default_factory=list)          # [(token, logprob), ...], best first


@dataclass
class BackendRequest:
    request_id: str
    prompt: str
    params: dict                                     # SamplingParams fields (vLLM names)
    stream: bool
    priority: int = 0
    cache_salt: Optional[str] = None


@dataclass
class Chunk:
    text: str                                        # the new text (whole text when not streaming)
    finish_reason: Optional[str] = None              # set on the last chunk
    num_input_tokens: int = 0
    num_output_tokens: int = 0                       # cumulative for the request
    logprobs: Optional[list] = None                  # TokenLogprob per new token, when asked
    # TokenLogprob per prompt token (the first one's logprob None), in the first chunk when
    # params asked for prompt_logprobs
    prompt_logprobs: Optional[list] = None


class Backend(Protocol):
    async def ready(self) -> bool: ...

    async def version(self) -> str: ...

    async def supports_logprobs(self) -> bool: ...

    # the engine's settings shown in the model list (optional: a backend without it shows none)
    async def settings(self) -> dict: ...

    def generate(self, request: BackendRequest) -> AsyncIterator[Chunk]: ...
