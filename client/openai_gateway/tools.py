"""Function calling for chat completions: `tools` and `tool_choice`, as vLLM serves them without a
model-specific tool-call parser.

The tools go to the chat template (`tools=`), and a forced choice becomes a structured output:
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is held to
  that function's `parameters` schema and returned as one tool call with those arguments
  (finish_reason as generated, `stop`);
- `"required"`: the output is held to a JSON array of `{"name", "parameters"}` objects, one of
  the tools each, and returned as those tool calls (finish_reason `tool_calls`);
- `"none"`: plain text.
- `"auto"` (the default when tools are given): the model chooses, and its calls are found in
  the free text by a parser of the model family's format. As in vLLM, only when the gateway runs
  with `--enable-auto-tool-choice --tool-call-parser NAME`, else refused. `hermes` (Qwen2.5,
  Qwen3, Hermes and others whose chat templates ask for `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`): the calls are returned as tool calls (finish_reason
  `tool_calls`), the text around them as content; output whose blocks do not parse is content.
  `llama3_json` (Llama 3.1/3.2's JSON tool calling): an output that is one or more `{"name":
  ..., "parameters": {...}}` objects (joined by `;`, after an optional `<|python_tag|>`) is
  the calls; any other output is content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from client.openai_gateway.errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolChoice:
    tools: list[dict] = field(default_factory=list)      # as given, for the chat template
    mode: str = "none"                                   # none | named | required | auto
    name: Optional[str] = None                           # the named function
    call_ids: dict = field(default_factory=dict)         # choice index -> call id (streams)
    parser: Optional[str] = None                         # mode auto: one of TOOL_PARSERS

    def structured_outputs(self) -> Optional[dict]:
        """The structured output that forces the choice, or None for plain text."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in self.tools}
        if self.mode == "named":
            return {"json": params[self.name]}
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                       "parameters": p},
                      "required": ["name", "parameters"]} for n, p in params.items()]
            return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": calls}}}
        return None

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """(the assistant message, finish_reason) of a finished choice."""
        content = None
        if self.mode == "auto":
            content, calls = PARSERS[self.parser][0](text)
        else:
            calls = self.calls(text, finish_reason)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        if self.mode in ("required", "auto"):
            finish_reason = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls}, finish_reason

    def calls(self, text: str, finish_reason: Optional[str]) -> Optional[list[dict]]:
        """The tool calls of a finished output; None when it is plain text (mode none, or an
        output cut by max_tokens before its JSON closed)."""
        if self.mode == "named":
            return [_call(self.name, text)]
        if self.mode != "required" or finish_reason != "stop":
            return None
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [_call(it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                for it in items]

    def auto_stream(self) -> "HermesStream | Llama3JsonStream":
        """A splitter of one streamed choice into content and calls (mode auto)."""
        return PARSERS[self.parser][1]()

    def stream_head(self, index: int) -> dict:
        """A named call's first delta: its id, type and name, arguments to follow."""
        call_id = self.call_ids.setdefault(index, _call_id())
        return {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                "function": {"name": self.name, "arguments": ""}}]}


def hermes_calls(text: str) -> tuple[Optional[str], Optional[list[dict]]]:
    """(content, calls) of a hermes-format output: every `<tool_call>{json}</tool_call>` block
    (the last may be left unclosed at the end) a call, the text outside them the content (None
    when only whitespace). No block, or any block that is not {"name": str, "arguments":
    object}: (text, None), the whole output as content."""
    if _HERMES_OPEN not in text:
        return text, None
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = _parsed_call(json.loads(block), ("arguments", "parameters"), {})
        except json.JSONDecodeError:
            return text, None
        if call is None:
            return text, None
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    return content or None, calls


class HermesStream:
    """Splits a streamed hermes-format output: text before the first `<tool_call>` goes out as
    content as it comes, except a tail that may be the start of the tag (held until the next
    piece tells); from the tag on, everything is held for hermes_calls at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0           # characters of text already sent as content
        self.in_call = False

    def feed(self, piece: str) -> str:
        """The content that can go out now."""
        self.text += piece
        if self.in_call:
            return ""
        at = self.text.find(_HERMES_OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            end = at
        else:           # hold back a tail that is a prefix of the tag
            end = len(self.text)
            for k in range(min(len(_HERMES_OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if _HERMES_OPEN.startswith(self.text[-k:]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, Optional[list[dict]]]:
        """(the content not sent yet, the calls): with calls, the held text's content is what
        stands outside the blocks (the content already sent is not repeated); without, all of
        the held text."""
        _, calls = hermes_calls(self.text)
        rest = self.text[self.sent:]
        if calls is None:
            return rest, None
        return _HERMES_BLOCK.sub("", rest).strip(), calls


_PYTHON_TAG = "<|python_tag|>"


def llama3_json_calls(text: str) -> tuple[Optional[str], Optional[list[dict]]]:
    """(None, calls) when the whole output (after an optional <|python_tag|>) is `;`-joined
    {"name": str, "parameters" (or "arguments"): object} objects, else (text, None)."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, None
        call = _parsed_call(obj, ("parameters", "arguments"), None)
        if call is None:
            return text, None
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


class Llama3JsonStream:
    """An output is calls or content as a whole: content goes out as it comes once its first
    characters are neither `{` nor (the start of) `<|python_tag|>`; otherwise it is held for
    llama3_json_calls at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.content: Optional[bool] = None     # None: not decided yet

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.content is None:
            head = self.text.lstrip()
            if not head or _PYTHON_TAG.startswith(head):
                return ""
            self.content = not (head.startswith("{") or head.startswith(_PYTHON_TAG))
        if not self.content:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def finish(self) -> tuple[str, Optional[list[dict]]]:
        _, calls = llama3_json_calls(self.text)
        return ("", calls) if calls is not None else (self.text[self.sent:], None)


# parser name -> (whole output -> (content, calls), a stream splitter)
PARSERS = {"hermes": (hermes_calls, HermesStream),
           "llama3_json": (llama3_json_calls, Llama3JsonStream)}


def parse_tools(body: dict, auto_parser: Optional[str] = None) -> ToolChoice:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolChoice()
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise bad_request('tools is invalid: must be a list of {"type": "function", "function": '
                          '{"name", "description", "parameters"}} with names of 1-64 letters, '
                          'digits, _ or - and parameters a JSON schema object', param="tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools is invalid: function names must be unique", param="tools")
    if choice == "none":
        return ToolChoice(tools, "none")
    if choice is None or choice == "auto":
        if auto_parser is not None:
            return ToolChoice(tools, "auto", parser=auto_parser)
        raise bad_request('tool_choice="auto" is not supported: this gateway runs without a '
                          'parser for tool calls in free text (start it with '
                          '--enable-auto-tool-choice --tool-call-parser NAME, NAME one of '
                          f'{", ".join(TOOL_PARSERS)}); use "required", a named function '
                          '({"type": "function", "function": {"name": ...}}) or "none"',
                          param="tool_choice")
    if choice == "required":
        return ToolChoice(tools, "required")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) \
        and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
        else None
    if name is None:
        raise bad_request('tool_choice is invalid: must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools",
                          param="tool_choice")
    return ToolChoice(tools, "named", name)


def _is_tool(t: Any) -> bool:
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    return (isinstance(fn, dict) and isinstance(fn.get("name"), str)
            and bool(_NAME.match(fn["name"]))
            and isinstance(fn.get("parameters") or {}, dict)
            and isinstance(fn.get("description", ""), str))


def _parsed_call(obj: Any, arg_keys: tuple[str, str], missing: Any) -> Optional[dict]:
    """A call from a parsed {"name": str, <arg_keys[0] or [1]>: object}, the first key
    preferred (`missing` when neither is there); None when obj is not that."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arg_keys[0], obj.get(arg_keys[1], missing))
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], json.dumps(args, ensure_ascii=False))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
