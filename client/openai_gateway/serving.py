"""One OpenAI request → n × prompts backend streams, merged into OpenAI's response or SSE chunks.

Each choice is its own backend request (n>1 fans out with seeds derived from `seed`), so the engine
batches them like any other requests and a disconnect cancels every one of them.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from client.openai_gateway.backend import Backend, BackendError, BackendRequest, Chunk
from client.openai_gateway.errors import APIError, from_triton
from client.openai_gateway.protocol import GenerationRequest

_DONE = object()


@dataclass
class _Choice:
    index: int
    prompt_index: int
    prefix: str = ""                     # echoed prompt
    parts: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    offset: int = 0                      # completions' text_offset so far
    prompt_logprobs: Optional[list] = None  # echo with logprobs: the prompt's, from the engine
    splitter: Optional[Any] = None          # tool_choice auto: content and calls of the stream


class Generation:
    """The backend streams of one OpenAI request, merged into one queue of (choice, chunk)."""

    def __init__(self, backend: Backend, req: GenerationRequest, prompts: list[str],
                 served_name: str) -> None:
        self.req, self.model = req, served_name
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices: list[_Choice] = []
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._tasks: list[asyncio.Task] = []
        self._pending: list = []
        seed = req.params.get("seed")
        for p, prompt in enumerate(prompts):
            for i in range(req.n):
                c = _Choice(index=len(self.choices), prompt_index=p,
                            prefix=prompt if req.echo else "")
                c.offset = len(c.prefix)
                self.choices.append(c)
                params = dict(req.params)
                if seed is not None:
                    params["seed"] = (seed + i) % 2**64
                elif req.n > 1:   # distinct samples, not n copies of the engine's default stream
                    params["seed"] = random.getrandbits(63)
                breq = BackendRequest(request_id=f"{self.id}-{c.index}", prompt=prompt,
                                      params=params, stream=req.stream, priority=req.priority,
                                      cache_salt=req.cache_salt)
                self._tasks.append(asyncio.ensure_future(self._pump(c.index, backend, breq)))

    async def _pump(self, index: int, backend: Backend, breq: BackendRequest) -> None:
        it = backend.generate(breq)
        try:
            async for chunk in it:
                await self._queue.put((index, chunk))
            await self._queue.put((index, _DONE))
        except BackendError as e:
            await self._queue.put((index, e))
        except Exception as e:  # noqa: BLE001 - a transport failure ends this request only
            await self._queue.put((index, BackendError(f"unavailable: {type(e).__name__}")))
        finally:
            await _aclose(it)

    async def start(self) -> None:
        """Wait for the first answer so that a refused request gets its HTTP status, not a 200."""
        first = await self._queue.get()
        if isinstance(first[1], BackendError):
            await self.close()
            raise self._error(first[1])
        self._pending.append(first)

    def _error(self, e: BackendError) -> APIError:
        return from_triton(e.message, self.req.prompt_param, self.req.renames)

    async def events(self) -> AsyncIterator[tuple[_Choice, Chunk]]:
        """(choice, chunk) until every choice has finished; raises APIError on a backend error."""
        running = len(self._tasks)
        while running:
            index, item = self._pending.pop(0) if self._pending else await self._queue.get()
            if item is _DONE:
                running -= 1
                continue
            if isinstance(item, BackendError):
                raise self._error(item)
            c = self.choices[index]
            c.num_input_tokens = max(c.num_input_tokens, item.num_input_tokens)
            c.num_output_tokens = max(c.num_output_tokens, item.num_output_tokens)
            c.finish_reason = item.finish_reason or c.finish_reason
            if item.prompt_logprobs is not None:
                c.prompt_logprobs = item.prompt_logprobs
            yield c, item

    def cancel(self) -> None:
        """Cancel every backend stream; each pump closes its stream as it ends."""
        for t in self._tasks:
            t.cancel()

    async def close(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def usage(self) -> dict:
        prompt = {}
        for c in self.choices:   # each prompt counts once, whatever n
            prompt[c.prompt_index] = max(prompt.get(c.prompt_index, 0), c.num_input_tokens)
        p, g = sum(prompt.values()), sum(c.num_output_tokens for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    # ---- non-streaming ----------------------------------------------------------------------
    async def response(self) -> dict:
        try:
            async for c, chunk in self.events():
                c.parts.append(chunk.text)
                c.logprobs.extend(chunk.logprobs or [])
        finally:
            await self.close()
        choices = [self._final_choice(c) for c in self.choices]
        obj = "chat.completion" if self.req.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def _final_choice(self, c: _Choice) -> dict:
        text = c.prefix + "".join(c.parts)
        if self.req.kind == "chat":
            message, finish = self.req.tools.message(text, c.finish_reason)
            return {"index": c.index, "message": message,
                    "logprobs": self._logprobs(c, c.logprobs), "finish_reason": finish}
        return {"index": c.index, "text": text,
                "logprobs": self._logprobs(c, self._with_prompt(c, c.logprobs)),
                "finish_reason": c.finish_reason}

    def _with_prompt(self, c: _Choice, entries: list) -> list:
        """Echo with logprobs: the prompt's entries first, their offsets from 0 (once)."""
        if not c.prefix or c.prompt_logprobs is None:
            return entries
        c.offset, prompt, c.prompt_logprobs = 0, c.prompt_logprobs, []
        return prompt + entries

    # ---- streaming --------------------------------------------------------------------------
    async def sse(self) -> AsyncIterator[str]:
        """OpenAI's chunk stream: a role (chat) or echo (completions) chunk per choice, deltas, a
        finish chunk per choice, the usage chunk if asked, then [DONE]."""
        try:
            # echo with logprobs: the echo waits for the prompt's logprobs (first response)
            echo_later = self.req.params.get("prompt_logprobs") is not None
            for c in self.choices:
                if self.req.kind == "chat":
                    yield self._chunk(c, {"role": "assistant", "content": ""})
                elif c.prefix and not echo_later:
                    yield self._chunk(c, c.prefix)
            tools = self.req.tools
            async for c, chunk in self.events():
                if c.prefix and echo_later and c.prompt_logprobs:
                    yield self._chunk(c, c.prefix, logprobs=self._with_prompt(c, []))
                if tools.mode == "required":        # the calls go out whole, once complete
                    c.parts.append(chunk.text)
                    c.logprobs.extend(chunk.logprobs or [])
                elif tools.mode == "auto":          # content as it comes, calls once complete
                    c.splitter = c.splitter or tools.auto_stream()
                    text = c.splitter.feed(chunk.text)
                    if text or chunk.logprobs:
                        yield self._chunk(c, {"content": text}, logprobs=chunk.logprobs)
                elif chunk.text or chunk.logprobs:
                    yield self._chunk(c, self._delta(c, chunk.text), logprobs=chunk.logprobs)
                if chunk.finish_reason:
                    finish = chunk.finish_reason
                    if tools.mode == "required":
                        message, finish = tools.message("".join(c.parts), finish)
                        yield self._chunk(c, _indexed(message), logprobs=c.logprobs)
                    elif tools.mode == "auto":
                        rest, calls = (c.splitter or tools.auto_stream()).finish()
                        if rest:
                            yield self._chunk(c, {"content": rest})
                        if calls:
                            finish = "tool_calls"
                            yield self._chunk(c, _indexed({"tool_calls": calls}))
                    yield self._chunk(c, {} if self.req.kind == "chat" else "", finish=finish)
            if self.req.include_usage:
                yield _sse({**self._head(), "choices": [], "usage": self.usage()})
        except APIError as e:
            yield _sse(e.body())
        finally:
            await self.close()
        yield "data: [DONE]\n\n"

    def _delta(self, c: _Choice, text: str):
        """A streamed piece of text: completions' text, chat's content, or a named tool call's
        arguments (its id and name go first, with the first piece)."""
        if self.req.kind != "chat":
            return text
        tools = self.req.tools
        if tools.mode != "named":
            return {"content": text}
        head = c.index not in tools.call_ids
        delta = tools.stream_head(c.index) if head else {"tool_calls": [{"index": 0,
                                                                        "function": {}}]}
        delta["tool_calls"][0]["function"]["arguments"] = text
        return delta

    def _head(self) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, c: _Choice, delta, logprobs=None, finish: Optional[str] = None) -> str:
        lp = self._logprobs(c, logprobs or []) if logprobs else None
        if self.req.kind == "chat":
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": finish}
        body = {**self._head(), "choices": [choice]}
        if self.req.continuous_usage:           # vLLM's running totals in every chunk
            body["usage"] = self.usage()
        elif self.req.include_usage:
            body["usage"] = None
        return _sse(body)

    def _logprobs(self, c: _Choice, entries: list) -> Optional[dict]:
        if self.req.logprobs is None:
            return None
        if self.req.kind == "chat":
            return {"content": [
                {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                  for t, lp in e.top[:self.req.logprobs]]}
                for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(c.offset)
            c.offset += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else dict(e.top[:self.req.logprobs])
                                 for e in entries],
                "text_offset": offsets}


def _indexed(message: dict) -> dict:
    """A finished message as a stream delta: tool calls carry their index."""
    delta = {k: v for k, v in message.items() if k != "role"}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    return delta


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _aclose(it) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001 - closing a failed stream must not mask its error
            pass
