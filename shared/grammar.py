"""Grammars for structured outputs, with llguidance: build, check, compile once (no torch here).

Who does what (docs/architecture.md, "Structured outputs"):

- the gateway turns a request's ``response_format`` / ``structured_outputs`` /
  ``guided_*`` / tool-choice into ONE llguidance grammar string (``*_grammar``
  below) and checks it (``check_grammar``: it compiles it against the model's
  tokenizer, so a bad schema, an unsupported feature or a grammar that can never
  finish is a 400 before any work);
- the string travels in ``SamplingParams.grammar``;
- the worker compiles it again (``GrammarCache``: once per distinct string,
  bounded LRU, in a thread while the forward runs), masks the logits and
  advances one matcher per request (services/worker/logits_processors.py).

llguidance has no torch dependency, so the gateway can use it too.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llguidance
from llguidance import LLMatcher, LLTokenizer

from shared.lark_check import endless_rules

# Compact JSON (no free whitespace): a model cannot wander off into endless blanks, and the
# output is what clients expect to parse. The same options everywhere, so the gateway's check
# and the worker's compile agree.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 1 << 20


class GrammarError(ValueError):
    """The grammar is unusable; the message is the engine's (a 400 for the client)."""


def json_schema_grammar(schema: Mapping[str, Any] | bool) -> str:
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise GrammarError("the JSON schema must be an object")
    _check_finite_schema(schema)
    try:
        return str(LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from e


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


def regex_grammar(regex: str) -> str:
    return str(LLMatcher.grammar_from_regex(regex))


def choice_grammar(choices: Sequence[str]) -> str:
    if not choices:
        raise GrammarError("choice needs at least one string")
    return regex_grammar("|".join(f"(?:{re.escape(c)})" for c in choices))


def ebnf_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (``::=`` rules, llama.cpp / xgrammar's)."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises bare exceptions on bad input
            raise GrammarError(f"invalid GBNF grammar: {e}") from e
    endless = endless_rules(text)
    if endless:
        raise GrammarError(f"the grammar can never be completed: {', '.join(endless)} "
                           "have no finite expansion (every alternative recurses)")
    return str(LLMatcher.grammar_from_lark(text))


def _check_finite_schema(schema: Mapping[str, Any]) -> None:
    """Refuse schemas whose every instance is infinite: a ``$ref`` cycle through required parts.

    llguidance compiles such a schema but no output ever completes it; the request would
    only ever end at max_tokens. Only the definite cases are refused: a cycle through
    required properties, ``allOf`` and non-empty arrays (``anyOf`` may always escape).
    """
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), Mapping):
            defs.update({f"#/{key}/{k}": v for k, v in schema[key].items()})

    def must_refs(node: Any) -> list[str]:
        if not isinstance(node, Mapping):
            return []
        out: list[str] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.append(ref)
        required_raw, props_raw = node.get("required"), node.get("properties")
        required: list[Any] = required_raw if isinstance(required_raw, list) else []
        props: Mapping[str, Any] = props_raw if isinstance(props_raw, Mapping) else {}
        for name in required:
            out += must_refs(props.get(name))
        all_of = node.get("allOf")
        for sub in all_of if isinstance(all_of, list) else []:
            out += must_refs(sub)
        min_items = node.get("minItems")
        if isinstance(min_items, int) and min_items > 0:
            out += must_refs(node.get("items"))
        return out

    def visit(ref: str, path: list[str]) -> None:
        if ref in path:
            raise GrammarError(f"the schema can never be completed: {' -> '.join([*path, ref])} "
                               "is a cycle of required references")
        if ref in defs:
            for nxt in must_refs(defs[ref]):
                visit(nxt, [*path, ref])

    try:
        for ref in must_refs(schema):
            visit(ref, ["#"])
    except RecursionError:
        raise GrammarError("the schema is nested too deeply") from None


# ---------------------------------------------------------------------------
# tokenizers and compiling
# ---------------------------------------------------------------------------


def load_tokenizer(folder: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """llguidance's view of a model's vocabulary, from a ``tokenizer.json`` folder (~1 s).

    ``vocab_size`` is the model's (its embedding may be padded beyond the tokenizer's);
    ``eos_token_ids`` are what a finished grammar allows, the ids the scheduler stops on.
    """
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(folder / "tokenizer.json")).to_str()
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def compile_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """A fresh matcher for ``grammar`` (GrammarError with llguidance's message if it is bad)."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    if matcher.is_stopped():
        raise GrammarError("the grammar admits only the empty output")
    return matcher


def check_grammar(tokenizer: LLTokenizer, grammar: str) -> None:
    compile_matcher(tokenizer, grammar)


class GrammarCache:
    """Compiled grammars by their text: the first request with a grammar compiles it, later ones copy it.

    Bounded LRU; thread-safe (the worker compiles in a side thread). A grammar that failed
    to compile is cached too, so a repeated bad grammar costs nothing more.
    """

    def __init__(self, tokenizer: LLTokenizer, max_entries: int = 256) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._entries: OrderedDict[str, LLMatcher | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def matcher(self, grammar: str) -> LLMatcher:
        """A matcher in its initial state for ``grammar`` (raises GrammarError)."""
        with self._lock:
            entry = self._entries.get(grammar)
            if entry is not None:
                self._entries.move_to_end(grammar)
                self.num_hits += 1
        if entry is None:
            try:
                entry = compile_matcher(self.tokenizer, grammar)  # outside the lock: it drops the GIL
            except GrammarError as e:
                entry = e
            with self._lock:
                self.num_compiled += 1
                self._entries[grammar] = entry
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        if isinstance(entry, GrammarError):
            raise entry
        return entry.deep_copy()


def llguidance_version() -> str:
    return str(getattr(llguidance, "__version__", "") or llguidance.get_version())  # type: ignore[attr-defined]
