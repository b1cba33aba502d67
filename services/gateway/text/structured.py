"""Structured outputs and token constraints at the gateway: request fields -> checked SamplingParams fields.

One grammar per request, from exactly one of: ``response_format`` (OpenAI:
``json_object``, ``json_schema``), ``structured_outputs`` (vLLM: ``json``,
``regex``, ``choice``, ``grammar``, ``json_object``), the older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, or a tool choice that
forces a call (tools.py). The grammar is compiled here against the model's
tokenizer (``GrammarChecker``) so that a bad schema, an unsupported feature or a
grammar that can never finish is a 400 carrying llguidance's message, before the
request reaches the engine; the worker compiles the same text again (its own
cache) and enforces it at sampling.

Token constraints: ``logit_bias`` (OpenAI: token id -> bias in [-100, 100]),
``allowed_token_ids`` and ``bad_words`` (vLLM: each word is tokenized with and
without a leading space, and its last token is masked after the others).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.gateway.errors import APIError, bad_request
from services.gateway.protocol import ChatCompletionRequest, SamplingFields
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.grammar import (
    GrammarError,
    check_grammar,
    choice_grammar,
    ebnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    load_tokenizer,
    regex_grammar,
)
from shared.heap import release_and_log

log = logging.getLogger("ferry.gateway.structured")

MAX_LOGIT_BIAS = 100.0


class GrammarChecker:
    """Compiles grammars against one model's tokenizer; remembers the ones that passed (bounded).

    The tokenizer view loads (~1 s) on the first grammar request, which validates off the
    event loop (api/serving.py): gateways that never see a grammar never pay for it.
    """

    def __init__(self, folder: Path, vocab_size: int, eos_token_ids: Sequence[int], max_entries: int = 1024) -> None:
        self._args = (folder, vocab_size, list(eos_token_ids))
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._ok: OrderedDict[str, None] = OrderedDict()
        self.max_entries = max_entries

    def _tok(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(*self._args)
                release_and_log("grammar tokenizer loaded", log)  # what parsing it freed (shared/heap.py)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        if grammar in self._ok:
            return
        check_grammar(self._tok(), grammar)
        with self._lock:
            self._ok[grammar] = None
            while len(self._ok) > self.max_entries:
                self._ok.popitem(last=False)


def checker_of(tok: GatewayTokenizer) -> GrammarChecker:
    """The tokenizer's checker, made on first use (one per tokenizer, i.e. per gateway)."""
    checker = getattr(tok, "grammar_checker", None)
    if checker is None:
        checker = GrammarChecker(tok.folder, tok.vocab_size, tok.eos_token_ids)
        tok.grammar_checker = checker  # type: ignore[attr-defined]
    return checker


def wants_grammar(req: SamplingFields) -> bool:
    """Whether the request carries a structured-output field or tools (validation then compiles)."""
    rf = req.response_format
    return bool((rf is not None and rf.type != "text") or req.structured_outputs is not None
                or req.guided_json is not None or req.guided_regex is not None
                or req.guided_choice is not None or req.guided_grammar is not None
                or (isinstance(req, ChatCompletionRequest) and req.tools))


def _schema_of(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param, code="invalid_schema") from e
    return value


def request_grammar(req: SamplingFields) -> tuple[str, str]:
    """(the grammar text or "", the parameter it came from); 400 when several are given."""
    found: list[tuple[str, str]] = []
    rf = req.response_format
    try:
        if rf is not None and rf.type == "json_object":
            found.append((json_object_grammar(), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            found.append((json_schema_grammar(rf.json_schema.schema_), "response_format"))
        so = req.structured_outputs
        if so is not None:
            kinds = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
            kinds += ["json_object"] if so.json_object else []
            if len(kinds) != 1:
                raise bad_request("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                  "json_object", "structured_outputs")
            p = "structured_outputs"
            if so.json_ is not None:
                found.append((json_schema_grammar(_schema_of(so.json_, p)), p))
            elif so.regex is not None:
                found.append((regex_grammar(so.regex), p))
            elif so.choice is not None:
                found.append((choice_grammar(so.choice), p))
            elif so.grammar is not None:
                found.append((ebnf_grammar(so.grammar), p))
            else:
                found.append((json_object_grammar(), p))
        if req.guided_json is not None:
            found.append((json_schema_grammar(_schema_of(req.guided_json, "guided_json")), "guided_json"))
        if req.guided_regex is not None:
            found.append((regex_grammar(req.guided_regex), "guided_regex"))
        if req.guided_choice is not None:
            found.append((choice_grammar(req.guided_choice), "guided_choice"))
        if req.guided_grammar is not None:
            found.append((ebnf_grammar(req.guided_grammar), "guided_grammar"))
    except GrammarError as e:
        raise bad_request(str(e), _last_param(req), code="invalid_grammar") from e
    if len(found) > 1:
        names = ", ".join(sorted({p for _, p in found}))
        raise bad_request(f"send one structured-output constraint, not several ({names})", found[1][1])
    return found[0] if found else ("", "")


def _last_param(req: SamplingFields) -> str:
    for name in ("guided_grammar", "guided_choice", "guided_regex", "guided_json", "structured_outputs"):
        if getattr(req, name) is not None:
            return name
    return "response_format"


def check(tok: GatewayTokenizer, grammar: str, param: str) -> None:
    """Compile ``grammar`` against the model's vocabulary: a 400 with llguidance's message if it fails."""
    try:
        checker_of(tok).check(grammar)
    except GrammarError as e:
        raise APIError(400, f"{param}: the grammar cannot be used: {e}", param, code="invalid_grammar") from e


def token_constraints(req: SamplingFields, tok: GatewayTokenizer) -> dict[str, Any]:
    """``logit_bias``, ``allowed_token_ids`` and ``bad_words`` as SamplingParams fields."""
    out: dict[str, Any] = {}
    if req.logit_bias:
        bias: dict[int, float] = {}
        for key, value in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys are token ids; {key!r} is not", "logit_bias") from None
            if not 0 <= token < tok.vocab_size:
                raise bad_request(f"logit_bias: {token} is outside the vocabulary (0..{tok.vocab_size - 1})",
                                  "logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise bad_request(f"logit_bias: {value} for token {token} is outside [-100, 100]", "logit_bias")
            bias[token] = float(value)
        out["logit_bias"] = bias
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise bad_request("allowed_token_ids is empty: nothing could be generated", "allowed_token_ids")
        bad = next((t for t in req.allowed_token_ids if t >= tok.vocab_size), None)
        if bad is not None:
            raise bad_request(f"allowed_token_ids: {bad} is outside the vocabulary (0..{tok.vocab_size - 1})",
                              "allowed_token_ids")
        out["allowed_token_ids"] = sorted(set(req.allowed_token_ids))
    if req.bad_words:
        words: list[list[int]] = []
        for word in req.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tok.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        out["bad_words_token_ids"] = words
    return out
