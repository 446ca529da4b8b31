"""Stateless incremental detokenization, shared by the engine and the Triton detokenizer model.

The text that new ids add is S(ctx + new)[len(S(ctx)):], where S decodes and drops a trailing
incomplete character. With the last DETOKENIZE_CONTEXT ids as ctx, deltas concatenate exactly to
the whole text for byte-level BPE (characters split across tokens) and for SentencePiece
tokenizers (a leading "▁" only becomes a space after some context), whichever process decodes
which delta.
"""
from __future__ import annotations

from typing import Any, Sequence

# A UTF-8 character spans at most 4 byte tokens; two more give SentencePiece its space context.
DETOKENIZE_CONTEXT = 6
_INCOMPLETE = "\ufffd"


def _text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    if not ids:
        return ""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)
    return text.rstrip(_INCOMPLETE)


def decode_delta(tokenizer: Any, context_ids: Sequence[int], new_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> str:
    """Text added by new_ids after context_ids (empty while a character is incomplete)."""
    if not new_ids:
        return ""
    before = _text(tokenizer, context_ids, skip_special_tokens)
    after = _text(tokenizer, list(context_ids) + list(new_ids), skip_special_tokens)
    return after[len(before):]


def context_for(all_ids: Sequence[int], start: int) -> list[int]:
    """The ids a delta starting at `start` needs as context."""
    return list(all_ids[max(0, start - DETOKENIZE_CONTEXT):start])
