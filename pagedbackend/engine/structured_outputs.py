"""Structured outputs (vLLM's `structured_outputs`, formerly `guided_decoding`): generation held to
a JSON schema, any JSON object, a regular expression, one of several strings, or an EBNF grammar.

The grammars are compiled by xgrammar (the backend vLLM uses by default), imported only when the
first such request arrives. Each request gets a `GrammarState`: before a step the sampler asks it
for the tokens allowed next (a bitmask, 32 tokens per int32, bit set = allowed), after the step
the scheduler feeds it the sampled token (`Request.append_token`), and the request stops, as
finished, once the grammar is complete. A request with a grammar is never launched with a step
in flight (`Request.needs_all_tokens`): its mask depends on the token before.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any, Sequence

from pagedbackend.config import check

logger = logging.getLogger("pagedbackend")

class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.failed = False

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token. A token the grammar refuses (only possible when every
        token was masked, e.g. min_tokens banning the end) ends the request."""
        if self.failed or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token_id)):
            self.failed = True
            logger.warning("structured output: the grammar refused token %d; the request ends",
                           token_id)

    @property
    def done(self) -> bool:
        return self.failed or self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [rows, ceil(V / 32)] mask.
        A finished grammar allows every token: with async scheduling a step may be scheduled
        before the one that finished the request has landed, and its token is dropped."""
        if self.done:
            bitmask[row] = -1
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Per engine: the tokenizer's vocabulary for xgrammar (built on first use) and a cache of
    compiled grammars, so a schema sent with every request is compiled once. `compile` may run
    on another thread than the engine's (the Triton engine model compiles on its execute
    thread, so a large schema does not stall the running batch): the cache is locked."""

    CACHE_SIZE = 64

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(set(stop_token_ids))
        self._compiler: Any = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _xgrammar(self) -> Any:
        check(self._tokenizer is not None, "structured_outputs", "...",
              "unset for a model without a tokenizer")
        try:
            import xgrammar
        except ImportError:
            check(False, "structured_outputs", "...",
                  "unset: this installation lacks the xgrammar package (pip install xgrammar)")
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info)
        return xgrammar

    def compile(self, spec: dict) -> Any:
        """The compiled grammar of SamplingParams.structured_outputs, from the cache or built
        now; one that does not compile raises ValueError naming structured_outputs.<kind>."""
        self._xgrammar()
        (kind, value), = spec.items()
        key = (kind, json.dumps(value))
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        try:
            compiled = self._compile(kind, value)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)   # "[time] file.cc:N: "
            check(False, f"structured_outputs.{kind}", _short(value),
                  f"a valid {_WHAT[kind]} ({first[:200]})")
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, spec: dict) -> GrammarState:
        """A fresh GrammarState for a spec (compiled, or taken from the cache)."""
        return GrammarState(self._xgrammar().GrammarMatcher(self.compile(spec)))

    def _compile(self, kind: str, value: Any) -> Any:
        c = self._compiler
        if kind == "json":
            return c.compile_json_schema(value)
        if kind == "json_object":        # an object, as OpenAI's JSON mode (not any value)
            return c.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
            return c.compile_grammar(f"root ::= {alternatives}")
        return c.compile_grammar(value)


_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
         "choice": "list of choices", "grammar": "EBNF grammar"}


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
