"""OpenAI tool calling: the grammar that forces a call, and the parsers that find calls in text.

``tool_choice``:

- ``none``: no tools in the prompt, plain text out;
- ``auto`` (the default with tools): the model's chat template shows it the tools;
  whatever it writes is parsed by the gateway's ``--tool-call-parser`` (vLLM's
  names): ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``, Qwen 2.5,
  Hermes, SmolLM3), ``llama3_json`` (a ``{"name", "parameters"}`` object, after an
  optional ``<|python_tag|>``, several separated by ``;``), ``mistral``
  (``[TOOL_CALLS][{"name", "arguments"}, ...]``);
- ``required`` / a named function: enforced with a grammar, as vLLM does, so the
  call always parses whatever the parser: a named function's output is its
  arguments object (``parameters`` schema); ``required`` outputs a JSON array of
  ``{"name", "parameters"}`` (one item when ``parallel_tool_calls`` is false).

Streams: text streams as content until the parser sees where a call may start;
from there the text is held back and, at the end, the calls go out as
``delta.tool_calls`` (one entry per call, whole arguments), so a stream carries
exactly the calls of the non-streamed answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gateway.api.errors import bad_request
from services.gateway.api.protocol import ChatCompletionRequest, Tool
from shared.grammar import json_schema_grammar

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _args_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call_of(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedCall(obj["name"], _args_text(args))


# ---------------------------------------------------------------------------
# parsers: where calls start (for streams), and the calls of a whole text
# ---------------------------------------------------------------------------


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


def _marker_split(text: str, marker: str, final: bool) -> tuple[int, bool]:
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


class HermesParser(ToolParser):
    name = "hermes"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        return _marker_split(text, "<tool_call>", final)

    def calls(self, region: str) -> list[ParsedCall] | None:
        out: list[ParsedCall] = []
        for m in self._call.finditer(region):
            try:
                call = _call_of(json.loads(m.group(1)))
            except ValueError:
                return None
            if call is None:
                return None
            out.append(call)
        return out or None


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
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            out.append(call)
            pos = end
            while pos < len(region) and region[pos] in " \t\r\n;":
                pos += 1
        return out or None


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def split(self, text: str, final: bool) -> tuple[int, bool]:
        n, started = _marker_split(text, self.MARKER, final)
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
        calls = [_call_of(x) for x in items]
        return [c for c in calls if c is not None] if calls and all(calls) else None


def make_parser(name: str) -> ToolParser:
    parsers: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                            "mistral": MistralParser}
    if name not in parsers:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return parsers[name]()


# ---------------------------------------------------------------------------
# forced calls: the grammar and how to read its output
# ---------------------------------------------------------------------------


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
        calls = [_call_of(x, ("parameters", "arguments")) for x in obj] if isinstance(obj, list) else []
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


@dataclass
class ToolPlan:
    """What a chat request with tools does: the template's tools, the grammar, the parser."""

    template_tools: list[dict[str, Any]] | None
    grammar: str
    parser: ToolParser | None  # None: tool_choice none, plain text


def plan_tools(req: ChatCompletionRequest, parser_name: str, template_knows_tools: bool) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice not in ("none", None):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan(None, "", None)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    if choice == "none":
        return ToolPlan(None, "", None)
    template_tools = [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
    if choice == "auto":
        if not template_knows_tools:
            raise bad_request("this model's chat template does not show tools to the model, so tool_choice "
                              "'auto' cannot work; use tool_choice 'required' or a named function",
                              "tool_choice", code="unsupported")
        return ToolPlan(template_tools, "", make_parser(parser_name))
    function = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
    if function is not None and function not in names:
        raise bad_request(f"tool_choice names {function!r}, which is not among the tools", "tool_choice")
    grammar = json_schema_grammar(forced_call_schema(tools, function, req.parallel_tool_calls))
    return ToolPlan(template_tools, grammar, ForcedCallParser(function))


# ---------------------------------------------------------------------------
# one choice's output, as it streams
# ---------------------------------------------------------------------------


@dataclass
class ToolStream:
    """Splits one choice's streamed text into content deltas and, at the end, tool calls."""

    parser: ToolParser
    text: str = ""
    emitted: int = 0
    started: bool = False
    ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """(content to send now, calls to send now: only at the end)."""
        self.text += delta
        if not self.started:
            n, self.started = self.parser.split(self.text, final)
            n = max(n, self.emitted)
        else:
            n = self.emitted
        if not final:
            out, self.emitted = self.text[self.emitted:n], n
            return out, []
        content, calls = self.parser.parse(self.text)
        if not calls:  # nothing parsed: everything held back is content after all
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out, []
        out, self.emitted = content[self.emitted:], len(self.text)
        return out, calls


def calls_json(calls: Sequence[ParsedCall], ids: list[str], with_index: bool) -> list[dict[str, Any]]:
    while len(ids) < len(calls):
        ids.append(call_id())
    out = []
    for i, c in enumerate(calls):
        entry: dict[str, Any] = {"id": ids[i], "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}}
        if with_index:
            entry = {"index": i, **entry}
        out.append(entry)
    return out
