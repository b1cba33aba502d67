"""Checkers: one pure function per kind, judging one answer against a task item's spec.

``check(spec, answer, reference)`` runs on every finished task request in the load tool, so
the checkers are cheap: the regular expressions are compiled once and a JSON Schema's validator
is built once per distinct schema (cached by its canonical JSON).

The rules, per kind (``spec["expected"]``, ``spec["params"]``, ``spec["request"]``):

- ``exact``: the answer's text, stripped, equals the expected string (or one of a list).
- ``normalized``: SQuAD-style normalization (lowercase, punctuation dropped, articles a/an/the
  dropped, whitespace collapsed) of the answer's first line or of the whole answer equals a
  normalized accepted answer; with ``params.first_word`` the first normalized word may equal it.
- ``choice``: the answer's letter is the first standalone letter among the choices' letters
  (A.. one per ``params.choices`` entry; A-Z without them). Standalone: not touching another
  letter, digit, ``_`` or apostrophe. An uppercase letter counts bare ("B", "B.", "Answer: B");
  a lowercase one only in parentheses ("(b)", "b)") or as the whole answer ("b"), so the
  article "a" is not read as choice A. No letter: the option whose normalized text appears
  first in the normalized answer (the longer one on a tie). Correct iff that is the expected.
  With ``params.by`` "text" the letters are ignored and the option whose text comes first is the
  choice (a model that writes "A) owl" for option B chose owl).
- ``numeric``: the first (``params.pick`` "last": the last) number in the text; "1,234",
  "-3", "2.50", ".5" and "1e3" parse; compared in decimal arithmetic, so a bound given in
  decimal is exact: correct iff |x - expected| <= max(abs_tol (1e-9), rel_tol (0) * |expected|).
- ``json_schema``: the stripped text (a whole-answer ```json fence removed) parses as JSON and
  validates against ``params.schema`` or ``request.response_format.json_schema.schema``; each
  key of an expected object must be there and match (see ``same``).
- ``tool_call``: the first tool call names ``expected["name"]``, its arguments are a JSON
  object (empty text counts as ``{}``) valid against that tool's ``parameters`` in
  ``request.tools``, and each key of ``expected["arguments"]`` matches (see ``same``).
- ``contains``: a normalized expected string (any of a list) appears in the normalized answer
  as whole words ("42" is in "code 42 now", not in "1420").
- ``agree``: correct iff the text and the tool calls equal the reference answer's exactly;
  without a reference the verdict is ``None`` ("no reference").

A wrong verdict on an answer that stopped at ``max_tokens`` says so in its reason.
"""

from __future__ import annotations

import json
import math
import re
import string
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Context, Decimal, InvalidOperation
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.validators import validator_for


@dataclass(frozen=True)
class Answer:
    text: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    """(function name, arguments JSON text), in order."""
    finish_reason: str | None = None


@dataclass(frozen=True)
class Verdict:
    correct: bool | None
    """None: cannot be judged (``agree`` without a reference)."""
    reason: str


CHECKERS = ("exact", "normalized", "choice", "numeric", "json_schema", "tool_call", "contains", "agree")

PARAMS: dict[str, tuple[str, ...]] = {
    "exact": (),
    "normalized": ("first_word",),
    "choice": ("by", "choices"),
    "numeric": ("abs_tol", "pick", "rel_tol"),
    "json_schema": ("schema",),
    "tool_call": (),
    "contains": (),
    "agree": (),
}
"""The options each checker reads from ``params``; any other is refused when a set is loaded."""

DEFAULT_ABS_TOL = 1e-9
NUMBER_TOL = 1e-9
"""How close two numbers in JSON answers and tool arguments must be to match."""

# --- text helpers ----------------------------------------------------------------------------

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")


def normalize(text: str) -> str:
    """SQuAD normalization: lowercase, punctuation dropped, articles dropped, whitespace collapsed."""
    text = text.lower().translate(_PUNCT)
    if not text.isascii():
        text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _strings(expected: Any) -> list[str]:
    return [expected] if isinstance(expected, str) else list(expected)


def same(expected: Any, got: Any) -> bool:
    """``got`` matches ``expected``: strings compared normalized, numbers within 1e-9, booleans and
    null exactly, lists item by item, objects on the expected keys (recursively)."""
    if expected is None or isinstance(expected, bool):
        return got is expected
    if isinstance(expected, int | float):
        if not isinstance(got, int | float) or isinstance(got, bool):
            return False
        try:
            return abs(got - expected) <= NUMBER_TOL
        except OverflowError:
            return False
    if isinstance(expected, str):
        return isinstance(got, str) and normalize(got) == normalize(expected)
    if isinstance(expected, list):
        return (isinstance(got, list) and len(got) == len(expected)
                and all(same(e, g) for e, g in zip(expected, got, strict=True)))
    if isinstance(expected, dict):
        return isinstance(got, dict) and all(k in got and same(v, got[k]) for k, v in expected.items())
    return bool(expected == got)


def _mismatch(expected: dict[str, Any], got: Any, what: str) -> str | None:
    """Why ``got`` does not match each key of ``expected``; None when it does."""
    if not isinstance(got, dict):
        return f"{what} is not an object"
    for key, value in expected.items():
        if key not in got:
            return f"{what}: missing key {key!r}"
        if not same(value, got[key]):
            return f"{what}: key {key!r} expected {_short(value)}, got {_short(got[key])}"
    return None


# --- JSON Schema -----------------------------------------------------------------------------

_VALIDATORS: dict[str, Any] = {}
_VALIDATOR_CACHE_SIZE = 1024


def validator(schema: Any) -> Any:
    """The (cached) validator for ``schema``: its ``$schema`` draft, Draft 2020-12 by default.
    Raises ``jsonschema.exceptions.SchemaError`` for a schema that is not valid."""
    key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    found = _VALIDATORS.get(key)
    if found is None:
        cls = validator_for(schema, default=Draft202012Validator)
        cls.check_schema(schema)
        found = cls(schema)
        if len(_VALIDATORS) >= _VALIDATOR_CACHE_SIZE:
            _VALIDATORS.clear()
        _VALIDATORS[key] = found
    return found


def _schema_error(schema: Any, instance: Any, what: str) -> str | None:
    error = best_match(validator(schema).iter_errors(instance))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    message = error.message if len(error.message) <= 160 else error.message[:157] + "..."
    return f"{what}{where} does not match the schema: {message}"


def response_schema(spec: dict[str, Any]) -> Any:
    """A ``json_schema`` item's schema: ``params.schema``, else the response format's; None if neither."""
    params = spec.get("params") or {}
    if "schema" in params:
        return params["schema"]
    response_format = (spec.get("request") or {}).get("response_format")
    if isinstance(response_format, dict):
        json_schema = response_format.get("json_schema")
        if isinstance(json_schema, dict) and "schema" in json_schema:
            return json_schema["schema"]
    return None


def tool_parameters(spec: dict[str, Any], name: str) -> tuple[bool, Any]:
    """(found, parameters schema or None) of the tool ``name`` in ``request.tools``."""
    tools = (spec.get("request") or {}).get("tools")
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            return True, function.get("parameters")
    return False, None


def _parse_json(text: str) -> tuple[bool, Any, str]:
    try:
        return True, json.loads(text), ""
    except (ValueError, RecursionError) as exc:
        return False, None, str(exc)[:120]


# --- the checkers ----------------------------------------------------------------------------


def _exact(spec: dict[str, Any], answer: Answer) -> Verdict:
    accepted = _strings(spec.get("expected"))
    got = answer.text.strip()
    if got in accepted:
        return Verdict(True, f"got {_short(got)}")
    return Verdict(False, f"expected {_short(accepted[0])}, got {_short(got)}")


def _normalized(spec: dict[str, Any], answer: Answer) -> Verdict:
    accepted = [normalize(e) for e in _strings(spec.get("expected"))]
    text = answer.text.strip()
    whole = normalize(text)
    first_line = normalize(text.split("\n", 1)[0])
    if first_line in accepted or whole in accepted:
        return Verdict(True, f"got {_short(first_line if first_line in accepted else whole)}")
    if (spec.get("params") or {}).get("first_word"):
        words = whole.split(" ", 1)
        if words[0] in accepted:
            return Verdict(True, f"first word {_short(words[0])}")
    return Verdict(False, f"expected {_short(accepted[0])}, got {_short(first_line)}")


_LETTER = re.compile(r"(?<![A-Za-z0-9_'\u2019])(\()?([A-Za-z])(\))?(?![A-Za-z0-9_'\u2019])")
_LETTERS = string.ascii_uppercase
_EDGE = string.punctuation + string.whitespace


def choice_of(text: str, choices: list[str] | None = None) -> str | None:
    """The letter an answer picks (see the module's rule), or None."""
    letters = _LETTERS[: len(choices)] if choices else _LETTERS
    bare = text.strip(_EDGE)
    for match in _LETTER.finditer(text):
        opening, letter, closing = match.groups()
        if letter.upper() not in letters:
            continue
        if letter.isupper() or opening or closing or bare == letter:
            return letter.upper()
    if not choices:
        return None
    said = normalize(text)
    best: tuple[int, int, str] | None = None  # (position, -length, letter)
    for letter, option in zip(letters, choices, strict=True):
        option = normalize(option)
        at = said.find(option) if option else -1
        if at >= 0 and (best is None or (at, -len(option)) < best[:2]):
            best = (at, -len(option), letter)
    return None if best is None else best[2]


def option_named(text: str, choices: list[str]) -> str | None:
    """The letter of the option whose text comes first in the answer (letters ignored), or None."""
    return choice_of(" ".join(m for m in _LETTER.sub(" ", text).split()), choices) if choices else None


def _choice(spec: dict[str, Any], answer: Answer) -> Verdict:
    expected = str(spec.get("expected")).strip().upper()
    params = spec.get("params") or {}
    if params.get("by", "letter") == "text":
        got = option_named(answer.text, params.get("choices") or [])
    else:
        got = choice_of(answer.text, params.get("choices"))
    if got is None:
        return Verdict(False, f"expected {expected}, found no choice in {_short(answer.text)}")
    if got == expected:
        return Verdict(True, f"chose {got}")
    return Verdict(False, f"expected {expected}, got {got}")


_NUMBER = re.compile(
    r"(?<![\d.,])[-+\u2212]?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
)
_DECIMAL = Context(prec=60, Emax=999_999_999, Emin=-999_999_999, traps=[])


def numbers_in(text: str) -> list[str]:
    """The numbers in ``text`` as written, in order."""
    return [m.group(0) for m in _NUMBER.finditer(text)]


def _decimal(value: Any) -> Decimal:
    return Decimal(str(value).replace(",", "").replace("\u2212", "-"))


def _numeric(spec: dict[str, Any], answer: Answer) -> Verdict:
    params = spec.get("params") or {}
    expected = spec.get("expected")
    if params.get("pick", "first") == "last":
        found = numbers_in(answer.text)
        written = found[-1] if found else None
    else:
        match = _NUMBER.search(answer.text)
        written = match.group(0) if match else None
    if written is None:
        return Verdict(False, f"expected {expected}, found no number in {_short(answer.text)}")
    try:
        got, want = _decimal(written), _decimal(expected)
    except InvalidOperation:
        return Verdict(False, f"expected {expected}, got {written!r}, not a number")
    tolerance = max(_decimal(params.get("abs_tol", DEFAULT_ABS_TOL)),
                    _DECIMAL.multiply(_decimal(params.get("rel_tol", 0)), _DECIMAL.abs(want)))
    if _DECIMAL.abs(_DECIMAL.subtract(got, want)) <= tolerance:
        return Verdict(True, f"got {written}")
    return Verdict(False, f"expected {expected}, got {written}")


_FENCE = re.compile(r"\A```[ \t]*(?:json)?[ \t]*\r?\n(.*?)\r?\n?[ \t]*```\Z", re.DOTALL | re.IGNORECASE)


def _json_schema(spec: dict[str, Any], answer: Answer) -> Verdict:
    text = answer.text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    ok, parsed, error = _parse_json(text)
    if not ok:
        return Verdict(False, f"not JSON ({error}): {_short(text)}")
    schema = response_schema(spec)
    if schema is not None:
        problem = _schema_error(schema, parsed, "the answer")
        if problem:
            return Verdict(False, problem)
    expected = spec.get("expected")
    if isinstance(expected, dict):
        problem = _mismatch(expected, parsed, "the answer")
        if problem:
            return Verdict(False, problem)
    return Verdict(True, "valid JSON" + (", expected values" if expected else ""))


def _tool_call(spec: dict[str, Any], answer: Answer) -> Verdict:
    expected = spec.get("expected") or {}
    name = expected.get("name")
    if not answer.tool_calls:
        return Verdict(False, f"expected a call to {name!r}, got no tool call (text {_short(answer.text)})")
    called, arguments = answer.tool_calls[0]
    if called != name:
        return Verdict(False, f"expected a call to {name!r}, got {called!r}")
    ok, parsed, error = _parse_json(arguments if arguments.strip() else "{}")
    if not ok:
        return Verdict(False, f"{called} arguments are not JSON ({error}): {_short(arguments)}")
    if not isinstance(parsed, dict):
        return Verdict(False, f"{called} arguments are not a JSON object: {_short(arguments)}")
    _, parameters = tool_parameters(spec, name)
    if parameters is not None:
        problem = _schema_error(parameters, parsed, f"{called} arguments")
        if problem:
            return Verdict(False, problem)
    wanted = expected.get("arguments")
    if isinstance(wanted, dict):
        problem = _mismatch(wanted, parsed, f"{called} arguments")
        if problem:
            return Verdict(False, problem)
    return Verdict(True, f"called {called}")


def _contains(spec: dict[str, Any], answer: Answer) -> Verdict:
    said = normalize(answer.text)
    accepted = [normalize(e) for e in _strings(spec.get("expected"))]
    for wanted in accepted:
        if wanted and f" {wanted} " in f" {said} ":
            return Verdict(True, f"contains {_short(wanted)}")
    return Verdict(False, f"{_short(accepted[0])} not in {_short(said)}")


def _agree(answer: Answer, reference: Answer | None) -> Verdict:
    if reference is None:
        return Verdict(None, "no reference")
    calls = tuple(tuple(c) for c in answer.tool_calls)
    if calls != tuple(tuple(c) for c in reference.tool_calls):
        counts = f"{len(calls)} vs {len(reference.tool_calls)}"
        return Verdict(False, f"tool calls differ from the reference ({counts})")
    if answer.text != reference.text:
        at = next((i for i, (a, b) in enumerate(zip(answer.text, reference.text, strict=False)) if a != b),
                  min(len(answer.text), len(reference.text)))
        return Verdict(False, f"differs from the reference at character {at}")
    return Verdict(True, "same as the reference")


_CHECK: dict[str, Callable[[dict[str, Any], Answer], Verdict]] = {
    "exact": _exact,
    "normalized": _normalized,
    "choice": _choice,
    "numeric": _numeric,
    "json_schema": _json_schema,
    "tool_call": _tool_call,
    "contains": _contains,
}


def check(spec: dict[str, Any], answer: Answer, reference: Answer | None = None) -> Verdict:
    """Judge ``answer`` by ``spec`` (``{"checker", "expected", "params", "request"}``)."""
    name = spec.get("checker")
    if name == "agree":
        verdict = _agree(answer, reference)
    elif name in _CHECK:
        verdict = _CHECK[name](spec, answer)
    else:
        raise ValueError(f"unknown checker {name!r} (one of {', '.join(CHECKERS)})")
    if verdict.correct is False and answer.finish_reason == "length":
        return Verdict(False, verdict.reason + " (stopped at max_tokens)")
    return verdict


# --- spec validation (used when a task set is loaded) ----------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _strings_problem(expected: Any, normalized: bool) -> str | None:
    values = [expected] if isinstance(expected, str) else expected
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return "'expected' must be a string or a non-empty list of strings"
    if normalized and not all(normalize(v) for v in values):
        return "'expected' must keep some text after normalization (not only articles or punctuation)"
    return None


def _schema_problem(schema: Any, what: str) -> str | None:
    if not isinstance(schema, dict | bool):
        return f"{what} must be a JSON Schema object"
    try:
        validator(schema)
    except SchemaError as exc:
        return f"{what} is not a valid JSON Schema: {exc.message}"
    return None


def spec_problem(spec: dict[str, Any]) -> str | None:
    """What is wrong with a check spec (a message naming the field), or None when it can be judged."""
    name = spec.get("checker")
    if name not in CHECKERS:
        return f"unknown checker {name!r} (one of {', '.join(CHECKERS)})"
    expected, params, request = spec.get("expected"), spec.get("params") or {}, spec.get("request") or {}
    if not isinstance(params, dict):
        return "'params' must be an object"
    if not isinstance(request, dict):
        return "'request' must be an object"
    unknown = sorted(set(params) - set(PARAMS[name]))
    if unknown:
        known = ", ".join(PARAMS[name]) or "none"
        return f"unknown params for {name}: {', '.join(map(repr, unknown))} (it reads: {known})"
    if name in ("exact", "normalized", "contains"):
        problem = _strings_problem(expected, normalized=name != "exact")
        if problem:
            return problem
        if "first_word" in params and not isinstance(params["first_word"], bool):
            return "'params.first_word' must be true or false"
    elif name == "choice":
        choices = params.get("choices")
        if choices is not None and (
            not isinstance(choices, list) or not 2 <= len(choices) <= 26
            or not all(isinstance(c, str) for c in choices)
        ):
            return "'params.choices' must be a list of 2 to 26 option texts"
        if params.get("by", "letter") not in ("letter", "text"):
            return "'params.by' must be 'letter' or 'text'"
        if params.get("by") == "text" and not choices:
            return "'params.by' 'text' needs 'params.choices': the option texts the answer is read for"
        letters = _LETTERS[: len(choices)] if choices else _LETTERS
        letter = expected.strip().upper() if isinstance(expected, str) else ""
        if len(letter) != 1 or letter not in letters:
            return f"'expected' must be one letter among {letters[0]}-{letters[-1]}"
    elif name == "numeric":
        if not _is_number(expected):
            return "'expected' must be a finite number"
        if params.get("pick", "first") not in ("first", "last"):
            return "'params.pick' must be 'first' or 'last'"
        for key in ("abs_tol", "rel_tol"):
            if key in params and (not _is_number(params[key]) or params[key] < 0):
                return f"'params.{key}' must be a non-negative number"
    elif name == "json_schema":
        schema = response_schema(spec)
        if schema is None:
            return "json_schema needs a schema: params.schema or request.response_format.json_schema.schema"
        problem = _schema_problem(schema, "the schema")
        if problem:
            return problem
        if expected is not None and not isinstance(expected, dict):
            return "'expected' must be an object of expected values (or absent)"
    elif name == "tool_call":
        if not isinstance(expected, dict) or not isinstance(expected.get("name"), str):
            return "'expected' must be an object with the tool's 'name' (and optional 'arguments')"
        extra = sorted(set(expected) - {"name", "arguments"})
        if extra:
            return f"'expected' has unknown keys {', '.join(map(repr, extra))} (it reads: name, arguments)"
        if "arguments" in expected and not isinstance(expected["arguments"], dict):
            return "'expected.arguments' must be an object"
        found, parameters = tool_parameters(spec, expected["name"])
        if not found:
            return f"the expected tool {expected['name']!r} is not among request.tools"
        if parameters is not None:
            return _schema_problem(parameters, f"tool {expected['name']!r} parameters")
    return None
