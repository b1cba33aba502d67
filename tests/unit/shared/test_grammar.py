"""Grammar building and the checks that refuse grammars which can never finish (no model, no tokenizer)."""

from __future__ import annotations

import pytest

from shared.grammar import GrammarError, choice_grammar, ebnf_grammar, json_schema_grammar
from shared.lark_check import endless_rules


@pytest.mark.parametrize("text, endless", [
    ('start: start "a"', ["start"]),
    ('start: a\na: "x" a', ["a", "start"]),
    ('start: (x)\nx: "a" x', ["start", "x"]),
    ('start: "a"~3 b\nb: b', ["b", "start"]),
    ('start: "x" start | "y"', None),
    ('start: a+\na: "q"', None),
    ('start: x\nx: [x] "a"', None),
    ('start: item*\nitem: "a" item', None),  # start may be empty: fine
    ('start: "(" digit ("+" digit)* ")"\ndigit: /[0-9]/', None),
    ('%json {"type": "object"}', None),  # not plain rules: not judged here
])
def test_endless_lark_rules(text: str, endless: list[str] | None) -> None:
    assert endless_rules(text) == endless


def test_gbnf_and_lark_grammars_that_never_finish_are_refused() -> None:
    with pytest.raises(GrammarError, match="can never be completed: start"):
        ebnf_grammar('root ::= "x" root')
    with pytest.raises(GrammarError, match="can never be completed"):
        ebnf_grammar('start: "x" start')
    assert 'start: "(" /[0-9]/ ")"' in ebnf_grammar('root ::= "(" [0-9] ")"')


def test_json_schemas_with_required_reference_cycles_are_refused() -> None:
    cyclic = {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"],
              "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/a"}}, "required": ["b"]}}}
    with pytest.raises(GrammarError, match="#/\\$defs/a -> #/\\$defs/a"):
        json_schema_grammar(cyclic)
    optional = {**cyclic, "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/a"}}}}}
    json_schema_grammar(optional)  # a tree that may stop: fine
    via_array = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                                      "minItems": 1}}}
    with pytest.raises(GrammarError):
        json_schema_grammar(via_array)
    with pytest.raises(GrammarError, match="must be an object"):
        json_schema_grammar(False)  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        choice_grammar([])
