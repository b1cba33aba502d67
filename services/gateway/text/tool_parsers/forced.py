"""Forced calls (``tool_choice`` ``required`` or a named function): the JSON schema whose grammar
forces the call, and the parser that reads its output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.gateway.protocol import Tool
from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser, call_of


class ForcedCallParser(ToolParser):
    """The output of a forced tool choice: a named function's arguments, or a required call array."""

    name = "forced"

    def __init__(self, function: str | None) -> None:
        self.function = function

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        return 0, True  # all of it is the call

    def calls(self, region: str) -> list[ParsedCall] | None:
        try:
            obj = json.loads(region)
        except ValueError:
            return None  # cut short by max_tokens
        if self.function is not None:
            return [ParsedCall(self.function, json.dumps(obj, ensure_ascii=False))]
        calls = [call_of(x, ("parameters", "arguments")) for x in obj] if isinstance(obj, list) else []
        return [c for c in calls if c is not None] or None


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params else {"type": "object", "properties": {}}


def forced_call_schema(tools: Sequence[Tool], function: str | None, parallel: bool) -> dict[str, Any]:
    if function is not None:
        tool = next(t for t in tools if t.function.name == function)
        return _parameters(tool)
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
