"""``llama3_json``: a ``{"name", "parameters"}`` object after an optional ``<|python_tag|>``,
several separated by ``;``."""

from __future__ import annotations

import json

from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser, call_of


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith(("{", self.TAG)):
            return start, True
        if not stripped or (not final and self.TAG.startswith(stripped)):
            return (len(text), False) if final else (start, False)
        return len(text), False

    def calls(self, region: str) -> list[ParsedCall] | None:
        region = region.strip().removeprefix(self.TAG).strip()
        decoder = json.JSONDecoder()
        out: list[ParsedCall] = []
        pos = 0
        while pos < len(region):
            try:
                obj, end = decoder.raw_decode(region, pos)
            except ValueError:
                return None
            call = call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            out.append(call)
            pos = end
            while pos < len(region) and region[pos] in " \t\r\n;":
                pos += 1
        return out or None
