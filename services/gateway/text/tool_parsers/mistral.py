"""``mistral``: ``[TOOL_CALLS][{"name", "arguments"}, ...]`` (the marker may have been skipped
as a special token)."""

from __future__ import annotations

import json

from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser, call_of, marker_split


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        n, started = marker_split(text, self.MARKER, final)
        if started:
            return n, True
        stripped = text.lstrip()  # the marker is a special token a detokenizer may have skipped
        if stripped.startswith("[{"):
            return len(text) - len(stripped), True
        if not final and stripped in ("", "["):
            return len(text) - len(stripped), False
        return n, False

    def calls(self, region: str) -> list[ParsedCall] | None:
        region = region.strip().removeprefix(self.MARKER).strip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(region)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_of(x) for x in items]
        return [c for c in calls if c is not None] if calls and all(calls) else None
