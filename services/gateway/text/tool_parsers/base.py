"""What every tool-call parser shares: a parsed call, the parser interface, and the helpers
that read a call object and find where calls start."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _args_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def call_of(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")) -> ParsedCall | None:
    """The call a decoded JSON object names (arguments under the first of ``args_keys``); None if none."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedCall(obj["name"], _args_text(args))


class ToolParser:
    """``split(text, final)`` -> (n, started): ``text[:n]`` is content for sure; started: calls begin at n."""

    name = ""

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        raise NotImplementedError

    def calls(self, region: str) -> list[ParsedCall] | None:
        """The calls in the text from where they start; None when it does not parse."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a whole output; a region that does not parse stays content."""
        n, started = self.split(text, final=True)
        if not started:
            return text, []
        calls = self.calls(text[n:])
        if not calls:
            return text, []
        return text[:n], calls


def marker_split(text: str, marker: str, final: bool) -> tuple[int, bool]:
    """``ToolParser.split`` for calls that start at ``marker``."""
    i = text.find(marker)
    if i >= 0:
        return i, True
    if final:
        return len(text), False
    # hold back a tail that could be the start of the marker
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k, False
    return len(text), False
