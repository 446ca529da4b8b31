"""Stateless incremental detokenization, shared by the engine and the Triton detokenizer model.

The text that new ids add is T(ctx + new)[len(T(ctx)):], where T(ids) decodes ids up to their
last *clean* boundary: the end if the text is complete, else the start of the last token that
begins a character. A token begins a character unless its first byte is a UTF-8 continuation
byte (byte-level BPE) or it is a byte-fallback token <0x80>..<0xBF> (SentencePiece). Decoding is
local at clean boundaries, so with ctx starting at one (see `context_for`), deltas concatenate
exactly to the whole text whichever process decodes which delta — also for byte-fallback
decoders, which turn a whole run of byte tokens into U+FFFD while its last character is
incomplete, and for SentencePiece's leading "▁", which only becomes a space after some context.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

# A UTF-8 character spans at most 4 byte tokens; two more give SentencePiece its space context.
DETOKENIZE_CONTEXT = 6
# How far back context_for may move the window's start to reach a clean boundary.
MAX_EXTRA_CONTEXT = 8
_INCOMPLETE = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_continuation(b: int) -> bool:
    return 0x80 <= b < 0xC0


def _byte_level_decoder_map() -> dict[str, int]:
    """Byte-level BPE shows each byte as one printable character; this maps them back.

    Printable Latin-1 bytes stand for themselves; the others take code points from 256 up, in
    byte order."""
    printable = (set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
                 | set(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _uses_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder])
    return any(p.get("type") == "ByteLevel" for p in parts if isinstance(p, dict))


def clean_starts(tokenizer: Any) -> list[bool]:
    """Per token id: does the token begin a character? Computed once per tokenizer."""
    cached = getattr(tokenizer, "_pagedbackend_clean_starts", None)
    if cached is not None:
        return cached
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    byte_map = _byte_level_decoder_map() if _uses_byte_level(tokenizer) else None
    table = []
    for t in tokens:
        clean = True
        if t:
            m = _BYTE_TOKEN.fullmatch(t)
            if m:
                clean = not _is_continuation(int(m.group(1), 16))
            elif byte_map is not None and t[0] in byte_map:
                clean = not _is_continuation(byte_map[t[0]])
        table.append(clean)
    try:
        tokenizer._pagedbackend_clean_starts = table
    except AttributeError:
        pass
    return table


def _begins_char(table: list[bool], token_id: int) -> bool:
    return token_id >= len(table) or table[token_id]


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    if not ids:
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def _clean_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    text = _decode(tokenizer, ids, skip_special_tokens)
    if not text.endswith(_INCOMPLETE):
        return text
    table = clean_starts(tokenizer)
    for j in range(len(ids) - 1, 0, -1):
        if _begins_char(table, ids[j]):
            return _decode(tokenizer, ids[:j], skip_special_tokens)
    return ""


def decode_delta(tokenizer: Any, context_ids: Sequence[int], new_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> str:
    """Text added by new_ids after context_ids (empty while a character is incomplete)."""
    if not new_ids:
        return ""
    ctx = list(context_ids)
    before = _clean_text(tokenizer, ctx, skip_special_tokens)
    after = _clean_text(tokenizer, ctx + list(new_ids), skip_special_tokens)
    return after[len(before):]


def context_for(tokenizer: Any, all_ids: Sequence[int], start: int) -> list[int]:
    """The ids a delta starting at `start` needs as context: at least DETOKENIZE_CONTEXT of
    them, beginning at a token that begins a character (as far as all_ids reaches back)."""
    s = max(0, start - DETOKENIZE_CONTEXT)
    floor = max(0, s - MAX_EXTRA_CONTEXT)
    if s > 0 and tokenizer is not None:
        table = clean_starts(tokenizer)
        while s > floor and not _begins_char(table, all_ids[s]):
            s -= 1
    return list(all_ids[s:start])
