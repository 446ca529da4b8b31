"""Prompt text from what clients send: chat messages through the model's own chat template, and
token-id prompts decoded back to text (the ensemble takes text)."""
from __future__ import annotations

from typing import Any, Optional

from client.openai_gateway.errors import bad_request
from client.openai_gateway.protocol import GenerationRequest, parse_chat


class PromptRenderer:
    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer       # a transformers tokenizer, or anything with the same calls

    @classmethod
    def from_path(cls, path: Optional[str]) -> "PromptRenderer":
        if not path:
            return cls(None)
        from transformers import AutoTokenizer   # heavy; only when a tokenizer is configured
        return cls(AutoTokenizer.from_pretrained(path))

    def prompts(self, req: GenerationRequest) -> list[str]:
        if req.kind == "chat":
            return [self._chat(req)]
        return [p if isinstance(p, str) else self._decode(p) for p in req.prompts]

    def _need(self, param: str):
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer (start it with --tokenizer)", param)
        return self.tokenizer

    def _chat(self, req: GenerationRequest) -> str:
        tok = self._need("messages")
        try:
            extra = {"tools": req.tools.tools} if req.tools.tools else {}
            if req.continue_final_message:
                extra["continue_final_message"] = True
            return tok.apply_chat_template(req.messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           **extra, **req.chat_template_kwargs)
        except Exception as e:  # noqa: BLE001 - jinja raises for conversations it refuses
            raise bad_request(f"messages could not be rendered with the chat template: {e}",
                              param="messages") from None

    def tokenize(self, body: dict, default_model: str) -> list[int]:
        """vLLM's /tokenize: the ids of `prompt` (special tokens added unless
        add_special_tokens=false) or of `messages` rendered by the chat template (none added,
        the template has them)."""
        if body.get("messages") is not None:
            req = parse_chat({**body, "tool_choice": body.get("tool_choice", "none")},
                             default_model)
            text, special = self._chat(req), False
        else:
            text, special = body.get("prompt"), True
            if not isinstance(text, str):
                raise bad_request("prompt (a string) or messages is required", param="prompt")
        special = body.get("add_special_tokens", special)
        if not isinstance(special, bool):
            raise bad_request(f"add_special_tokens={special!r} is invalid: must be true or false",
                              param="add_special_tokens")
        return list(self._need("prompt").encode(text, add_special_tokens=special))

    def detokenize(self, ids: Any) -> str:
        """vLLM's /detokenize: the text of token ids, special tokens kept."""
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and t >= 0 for t in ids):
            raise bad_request("tokens is invalid: must be a list of token ids >= 0",
                              param="tokens")
        return self._decode(ids) if ids else ""

    def _decode(self, ids: list) -> str:
        tok = self._need("prompt")
        if max(ids) >= len(tok):
            raise bad_request(f"prompt contains token id {max(ids)}, outside the vocabulary "
                              f"(size {len(tok)})", param="prompt")
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
