"""The answer checkers: every kind has answers that must pass and near misses that must fail."""

from __future__ import annotations

from typing import Any

import pytest

from loadtests.quality.checkers import CHECKERS, Answer, Verdict, check, normalize, spec_problem


def spec(checker: str, expected: Any = None, params: dict[str, Any] | None = None,
         request: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"checker": checker, "expected": expected, "params": params or {}, "request": request or {}}
    assert spec_problem(out) is None, spec_problem(out)
    return out


def verdict(s: dict[str, Any], text: str, calls: tuple[tuple[str, str], ...] = ()) -> bool | None:
    return check(s, Answer(text, calls)).correct


def test_the_checker_names_are_the_contracts() -> None:
    assert CHECKERS == (
        "exact", "normalized", "choice", "numeric", "json_schema", "tool_call", "contains", "agree",
    )


# --- exact -----------------------------------------------------------------------------------


def test_exact_strips_the_answer_and_accepts_a_list() -> None:
    s = spec("exact", "Paris")
    assert verdict(s, "  Paris\n") is True
    assert verdict(s, "paris") is False  # case matters
    assert verdict(s, "Paris.") is False
    assert verdict(spec("exact", ["Paris", "PARIS"]), "PARIS") is True
    assert verdict(spec("exact", ["Paris", "PARIS"]), "Pari") is False
    assert check(s, Answer("Lyon")).reason == "expected 'Paris', got 'Lyon'"


# --- normalized ------------------------------------------------------------------------------


def test_normalize_is_squad_style() -> None:
    assert normalize("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert normalize("an apple a day") == "apple day"
    assert normalize("Theory") == "theory"  # an article only as a whole word


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("Paris", True),
        ("paris.", True),
        ("The Paris!", True),
        ("  PARIS  ", True),
        ("Paris\nIt is the capital of France.", True),  # the first line
        ("pari", False),  # near miss
        ("Parisian", False),
        ("Paris is the capital", False),  # more words, first_word off
        ("The capital is Paris.", False),
    ],
)
def test_normalized(text: str, ok: bool) -> None:
    assert verdict(spec("normalized", "Paris"), text) is ok


def test_normalized_first_word_and_accepted_list() -> None:
    s = spec("normalized", ["Paris", "Paname"], {"first_word": True})
    assert verdict(s, "Paris is the capital") is True
    assert verdict(s, "Paname, as locals say") is True
    assert verdict(s, "The capital is Paris") is False  # first normalized word is "capital"
    assert verdict(s, "pari is close") is False
    assert check(spec("normalized", "Paris"), Answer("pari")).reason == "expected 'paris', got 'pari'"


# --- choice ----------------------------------------------------------------------------------

CHOICES = ["London", "Paris", "Berlin", "Madrid"]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("B", True),
        ("(B)", True),
        ("B)", True),
        ("B.", True),
        ("Answer: B", True),
        ("The answer is **B**", True),
        ("b) Paris", True),
        ("(b)", True),
        ("b", True),
        ("Paris", True),  # no letter: the option text
        ("It is Paris, not Berlin", True),  # the option that appears first
        ("A", False),
        ("(C)", False),
        ("c) Berlin", False),
        ("B and C", True),  # two letters: the first standalone one wins
        ("C or B", False),
        ("a Paris answer", True),  # lowercase "a" unmarked is an article, not choice A
        ("Berlin", False),
        ("Bonn", False),  # no standalone letter, no option text
        ("", False),
    ],
)
def test_choice_first_standalone_letter(text: str, ok: bool) -> None:
    assert verdict(spec("choice", "B", {"choices": CHOICES}), text) is ok


def test_choice_letters_outside_the_choices_and_inside_words_do_not_count() -> None:
    s = spec("choice", "B", {"choices": CHOICES})
    assert verdict(s, "E is not an option; B") is True  # E is not among A-D
    assert verdict(s, "Because B") is True  # the B of "Because" is not standalone
    assert verdict(s, "It's B") is True  # the s after the apostrophe is not standalone
    assert check(s, Answer("C")).reason == "expected B, got C"
    assert check(s, Answer("Bonn")).correct is False
    assert "found no choice" in check(s, Answer("Bonn")).reason
    # without choices every letter A-Z counts
    assert verdict(spec("choice", "B"), "E, then B") is False
    assert verdict(spec("choice", "B"), "(b)") is True


# --- numeric ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "ok"),
    [
        ("42", 42, True),
        ("43", 42, False),  # near miss
        ("42.0", 42, True),
        ("The answer is 42.", 42, True),
        ("41.9999", 42, False),  # default abs_tol is 1e-9
        ("1,234", 1234, True),
        ("$1,234.50 in total", 1234.5, True),
        ("1,234", 1, False),  # the thousands separator is not a list separator
        ("-3", -3, True),
        ("-3", 3, False),
        ("x = 7-5", 7, True),
        ("2.50", 2.5, True),
        ("1e3", 1000, True),
        (".5", 0.5, True),
        ("no number here", 0, False),
        ("12 apples and 13 pears", 13, False),  # the first number by default
    ],
)
def test_numeric(text: str, expected: float, ok: bool) -> None:
    assert verdict(spec("numeric", expected), text) is ok


def test_numeric_first_or_last() -> None:
    text = "First 3 + 4 = 7"
    assert verdict(spec("numeric", 3), text) is True
    assert verdict(spec("numeric", 7), text) is False
    assert verdict(spec("numeric", 7, {"pick": "last"}), text) is True
    assert verdict(spec("numeric", 3, {"pick": "last"}), text) is False


def test_numeric_tolerance_bound_is_inclusive() -> None:
    s = spec("numeric", 1.0, {"abs_tol": 0.1})
    assert verdict(s, "1.1") is True  # exactly at the bound (decimal arithmetic: 1.1 - 1.0 == 0.1)
    assert verdict(s, "0.9") is True
    assert verdict(s, "1.1000001") is False  # just beyond
    assert verdict(s, "0.8999999") is False
    rel = spec("numeric", 200, {"rel_tol": 0.05})  # 5% of 200 = 10
    assert verdict(rel, "210") is True
    assert verdict(rel, "190") is True
    assert verdict(rel, "210.001") is False
    # the larger of the two bounds applies
    both = spec("numeric", 200, {"abs_tol": 20, "rel_tol": 0.05})
    assert verdict(both, "220") is True
    assert verdict(both, "220.5") is False


def test_numeric_reason_and_huge_numbers() -> None:
    assert check(spec("numeric", 12), Answer("13")).reason == "expected 12, got 13"
    assert verdict(spec("numeric", 12), "1e999999999999") is False
    assert check(spec("numeric", 12), Answer("13", finish_reason="length")).reason.endswith(
        "(stopped at max_tokens)"
    )


# --- json_schema -----------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"name": "Ada", "age": 36}', True),
        ('  {"age": 36, "name": "Ada", "extra": 1}\n', True),
        ('```json\n{"name": "Ada", "age": 36}\n```', True),  # fenced
        ('```\n{"name": "Ada", "age": 36}\n```', True),
        ('{"name": "Ada"}', False),  # missing a required key
        ('{"name": "Ada", "age": "36"}', False),  # wrong type
        ('{"name": "Ada", "age": 36.5}', False),
        ('{"name": "Ada", "age": 36', False),  # not JSON
        ('Here it is: {"name": "Ada", "age": 36}', False),
        ('[{"name": "Ada", "age": 36}]', False),
    ],
)
def test_json_schema_from_the_response_format(text: str, ok: bool) -> None:
    assert verdict(spec("json_schema", request=FORMAT), text) is ok


def test_json_schema_reasons_name_the_problem() -> None:
    s = spec("json_schema", request=FORMAT)
    missing = check(s, Answer('{"name": "Ada"}'))
    assert missing.correct is False and "'age' is a required property" in missing.reason
    wrong = check(s, Answer('{"name": "Ada", "age": "36"}'))
    assert wrong.correct is False and "['age']" in wrong.reason and "not of type 'integer'" in wrong.reason
    assert check(s, Answer("{nope")).reason.startswith("not JSON")


def test_json_schema_expected_values_and_params_schema() -> None:
    s = spec("json_schema", {"name": "ada lovelace", "age": 36}, {"schema": PERSON})
    assert verdict(s, '{"name": "Ada Lovelace.", "age": 36}') is True  # strings compared normalized
    assert verdict(s, '{"name": "Ada Lovelace", "age": 36.0}') is True
    assert verdict(s, '{"name": "Ada Lovelace", "age": 37}') is False
    assert verdict(s, '{"name": "Ada Byron", "age": 36}') is False
    loose = spec("json_schema", {"city": "Paris"}, {"schema": {"type": "object"}})
    assert verdict(loose, '{"city": "paris"}') is True
    assert check(loose, Answer('{"town": "Paris"}')).reason == "the answer: missing key 'city'"


# --- tool_call -------------------------------------------------------------------------------

WEATHER_TOOLS = {
    "tools": [
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        },
    ],
    "tool_choice": "auto",
}


@pytest.mark.parametrize(
    ("calls", "ok"),
    [
        ((("get_weather", '{"city": "Paris"}'),), True),
        ((("get_weather", '{"city": "paris!", "days": 3}'),), True),
        ((("get_weather", '{"city": "Paris"}'), ("get_time", "{}")), True),  # the first call counts
        ((("get_time", "{}"), ("get_weather", '{"city": "Paris"}')), False),
        ((("get_time", '{"city": "Paris"}'),), False),  # wrong name
        ((("get_weather", "city=Paris"),), False),  # arguments not JSON
        ((("get_weather", '{"town": "Paris"}'),), False),  # required parameter missing
        ((("get_weather", '{"city": "Paris", "days": "3"}'),), False),  # wrong type
        ((("get_weather", '["Paris"]'),), False),  # not an object
        ((("get_weather", '{"city": "Lyon"}'),), False),  # expected argument differs
        ((), False),  # no call at all
    ],
)
def test_tool_call(calls: tuple[tuple[str, str], ...], ok: bool) -> None:
    s = spec("tool_call", {"name": "get_weather", "arguments": {"city": "Paris"}}, request=WEATHER_TOOLS)
    assert verdict(s, "", calls) is ok


def test_tool_call_reasons_and_numbers() -> None:
    s = spec("tool_call", {"name": "get_weather"}, request=WEATHER_TOOLS)
    assert verdict(s, "", (("get_weather", '{"city": "Lyon"}'),)) is True  # no expected arguments
    no_call = check(s, Answer("It is sunny")).reason
    assert no_call == "expected a call to 'get_weather', got no tool call (text 'It is sunny')"
    wrong = check(s, Answer("", (("get_time", "{}"),))).reason
    assert wrong == "expected a call to 'get_weather', got 'get_time'"
    assert "not JSON" in check(s, Answer("", (("get_weather", "{city"),))).reason
    assert "'city' is a required property" in check(s, Answer("", (("get_weather", "{}"),))).reason
    n = spec("tool_call", {"name": "get_weather", "arguments": {"days": 3}}, request=WEATHER_TOOLS)
    assert verdict(n, "", (("get_weather", '{"city": "x", "days": 3}'),)) is True
    assert verdict(n, "", (("get_weather", '{"city": "x", "days": 4}'),)) is False
    t = spec("tool_call", {"name": "get_time"}, request=WEATHER_TOOLS)
    assert verdict(t, "", (("get_time", ""),)) is True  # empty arguments are {}


# --- contains --------------------------------------------------------------------------------


def test_contains() -> None:
    s = spec("contains", "Eiffel Tower")
    assert verdict(s, "You mean the eiffel-tower? No: the EIFFEL TOWER, in Paris.") is True
    assert verdict(s, "The Eiffel tower.") is True
    assert verdict(s, "The Eiffel") is False
    assert verdict(s, "Tower Eiffel") is False
    any_of = spec("contains", ["Mount Everest", "Chomolungma"])
    assert verdict(any_of, "locals call it chomolungma") is True
    assert verdict(any_of, "It is Mount Everest!") is True
    assert verdict(any_of, "It is K2") is False
    code = spec("contains", "42")  # whole words: a number inside a longer one is not the span
    assert verdict(code, "The code is 42.") is True
    assert verdict(code, "The code is 1420.") is False
    assert verdict(code, "The code is 420") is False


# --- agree -----------------------------------------------------------------------------------


def test_agree_with_and_without_a_reference() -> None:
    s = spec("agree")
    ref = Answer("Paris", (("f", '{"a": 1}'),))
    assert check(s, Answer("Paris")) == Verdict(None, "no reference")
    assert check(s, Answer("Paris", (("f", '{"a": 1}'),)), ref) == Verdict(True, "same as the reference")
    assert check(s, Answer("Paris ", (("f", '{"a": 1}'),)), ref).correct is False  # text differs
    assert check(s, Answer("Paris"), ref).correct is False  # tool calls differ
    assert check(s, Answer("Paris", (("f", '{"a":1}'),)), ref).correct is False
    assert check(s, Answer("Parks"), Answer("Paris")).reason == "differs from the reference at character 3"


# --- specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"checker": "fuzzy", "expected": "x"}, "unknown checker 'fuzzy'"),
        ({"checker": "numeric", "expected": "12"}, "finite number"),
        ({"checker": "numeric", "expected": 12, "params": {"tolerance": 0.1}}, "'tolerance'"),
        ({"checker": "numeric", "expected": 12, "params": {"abs_tol": -1}}, "abs_tol"),
        ({"checker": "numeric", "expected": 12, "params": {"pick": "middle"}}, "pick"),
        ({"checker": "choice", "expected": "E", "params": {"choices": CHOICES}}, "A-D"),
        ({"checker": "choice", "expected": "BC"}, "one letter"),
        ({"checker": "normalized", "expected": "the"}, "normalization"),
        ({"checker": "exact", "expected": []}, "non-empty list"),
        ({"checker": "json_schema"}, "needs a schema"),
        ({"checker": "json_schema", "params": {"schema": {"type": "nope"}}}, "not a valid JSON Schema"),
        ({"checker": "tool_call", "expected": {"name": "get_weather"}}, "not among request.tools"),
        ({"checker": "tool_call", "expected": {"name": "get_weather", "args": {}}, "request": WEATHER_TOOLS},
         "'args'"),
    ],
)
def test_spec_problems_are_named(bad: dict[str, Any], words: str) -> None:
    problem = spec_problem(bad)
    assert problem is not None and words in problem


def test_unknown_checker_raises() -> None:
    with pytest.raises(ValueError, match="unknown checker 'fuzzy'"):
        check({"checker": "fuzzy"}, Answer("x"))


def test_choice_by_option_text_ignores_the_letter() -> None:
    s = spec("choice", "B", params={"choices": ["cat", "owl", "goat"], "by": "text"})
    assert verdict(s, "A) owl") is True  # the model named owl, whatever letter it put before it
    assert verdict(s, "B) cat") is False
    assert verdict(s, "B") is False  # no option named: nothing chosen
    assert verdict(s, "The owl, not the cat.") is True  # the first option named counts
    assert verdict(s, "The cat, not the owl.") is False
    assert spec_problem({"checker": "choice", "expected": "A", "params": {"by": "text"}}) is not None
    assert spec_problem({"checker": "choice", "expected": "A", "params": {"by": "word", "choices": ["x", "y"]}})
