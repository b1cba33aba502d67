"""Tool-call parsers (hermes, llama3_json, mistral, forced) and their streams.

A stream fed any split of a text must send, in all, the same content and the same
calls as parsing the whole text at once: the property streamed == non-streamed
tool calls rests on.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.text.tool_parsers import make_parser
from services.gateway.text.tool_parsers.base import ParsedCall, ToolParser
from services.gateway.text.tool_parsers.forced import ForcedCallParser, forced_call_schema
from services.gateway.text.tools import ToolStream

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": 1}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": 1}}]'
CALLS = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", '{"zone": 1}')]


@pytest.mark.parametrize("name, text, content", [
    ("hermes", HERMES, "I will check.\n"),
    ("llama3_json", LLAMA, ""),
    ("llama3_json", LLAMA.removeprefix("<|python_tag|>"), ""),
    ("mistral", MISTRAL, ""),
    ("mistral", MISTRAL.removeprefix("[TOOL_CALLS]"), ""),  # the marker skipped as a special token
])
def test_parsers_find_the_calls(name: str, text: str, content: str) -> None:
    got_content, calls = make_parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, json.loads(c.arguments)) for c in CALLS]


@pytest.mark.parametrize("name, text", [
    ("hermes", "Just text, no calls."),
    ("hermes", "Broken <tool_call>{not json</tool_call>"),
    ("llama3_json", "Hello {there}"),
    ("llama3_json", "{not json"),
    ("mistral", "[TOOL_CALLS] nope"),
])
def test_text_without_parseable_calls_stays_content(name: str, text: str) -> None:
    assert make_parser(name).parse(text) == (text, [])


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral"):
        make_parser("pythonic")


def test_forced_parsers() -> None:
    assert ForcedCallParser("f").parse('{"a": 1}') == ("", [ParsedCall("f", '{"a": 1}')])
    assert ForcedCallParser(None).parse('[{"name": "g", "parameters": {}}]') == ("", [ParsedCall("g", "{}")])
    assert ForcedCallParser("f").parse('{"a": ') == ('{"a": ', [])  # cut short: plain text


def test_forced_schema_shapes() -> None:
    from services.gateway.protocol import Tool

    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
             Tool.model_validate({"type": "function", "function": {"name": "g"}})]
    assert forced_call_schema(tools, "f", True) == {"type": "object"}
    schema = forced_call_schema(tools, None, False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == ["f", "g"]


def _stream_all(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    stream = ToolStream(parser)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, k = stream.feed(piece, final=i == len(pieces) - 1)
        content += c
        calls += k
        if i < len(pieces) - 1:
            assert not k  # calls only at the end
    return content, calls


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL),
                        ("hermes", "plain <tool text"), ("llama3_json", "  <|pyth"), ("mistral", "[x")]),
       st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_stream_equals_whole_parse_for_any_split(case: tuple[str, str], cuts: list[int]) -> None:
    name, text = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [text]
    parser = make_parser(name)
    content, calls = _stream_all(parser, pieces)
    assert (content, calls) == parser.parse(text)
