"""The tool-call parsers of ``--tool-call-parser`` (vLLM's names), one module each, and the
registry that makes one by name; ``base`` holds what they share, ``forced`` reads the output of a
forced tool choice."""

from __future__ import annotations

from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser
from services.gateway.text.tool_parsers.hermes import HermesParser
from services.gateway.text.tool_parsers.llama3_json import Llama3JsonParser
from services.gateway.text.tool_parsers.mistral import MistralParser

__all__ = ["TOOL_CALL_PARSERS", "ParsedCall", "ToolParser", "make_parser"]

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


def make_parser(name: str) -> ToolParser:
    parsers: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                            "mistral": MistralParser}
    if name not in parsers:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return parsers[name]()
