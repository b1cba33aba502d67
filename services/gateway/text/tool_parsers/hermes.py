"""``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>``, one block per call (Qwen 2.5,
Hermes, SmolLM3)."""

from __future__ import annotations

import json
import re

from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser, call_of, marker_split


class HermesParser(ToolParser):
    name = "hermes"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        return marker_split(text, "<tool_call>", final)

    def calls(self, region: str) -> list[ParsedCall] | None:
        out: list[ParsedCall] = []
        for m in self._call.finditer(region):
            try:
                call = call_of(json.loads(m.group(1)))
            except ValueError:
                return None
            if call is None:
                return None
            out.append(call)
        return out or None
