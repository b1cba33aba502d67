"""OpenAI tool calling: what a request's ``tool_choice`` asks for, and one choice's calls as they stream
(the parsers that find calls in text are in ``tool_parsers/``, one module each).

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import bad_request
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.text.tool_parsers import make_parser
from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser, call_id
from services.gateway.text.tool_parsers.forced import ForcedCallParser, forced_call_schema
from shared.grammar import json_schema_grammar


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
