"""Function calling for chat completions: `tools` and `tool_choice`, as vLLM serves them without a
model-specific tool-call parser.

The tools go to the chat template (`tools=`), and a forced choice becomes a structured output:
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is held to
  that function's `parameters` schema and returned as one tool call with those arguments
  (finish_reason as generated, `stop`);
- `"required"`: the output is held to a JSON array of `{"name", "parameters"}` objects, one of
  the tools each, and returned as those tool calls (finish_reason `tool_calls`);
- `"none"`: plain text.
`"auto"` (the default when tools are given) would need a parser that finds tool calls in free
text, which differs per model; as vLLM without `--enable-auto-tool-choice`, it is refused.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from client.openai_gateway.errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class ToolChoice:
    tools: list[dict] = field(default_factory=list)      # as given, for the chat template
    mode: str = "none"                                   # "none" | "named" | "required"
    name: Optional[str] = None                           # the named function
    call_ids: dict = field(default_factory=dict)         # choice index -> call id (streams)

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
        calls = self.calls(text, finish_reason)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        if self.mode == "required":
            finish_reason = "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason

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

    def stream_head(self, index: int) -> dict:
        """A named call's first delta: its id, type and name, arguments to follow."""
        call_id = self.call_ids.setdefault(index, _call_id())
        return {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                "function": {"name": self.name, "arguments": ""}}]}


def parse_tools(body: dict) -> ToolChoice:
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
        raise bad_request('tool_choice="auto" is not supported: this server has no parser for '
                          'tool calls in free text; use "required", a named function '
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


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
