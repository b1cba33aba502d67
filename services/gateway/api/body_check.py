"""Structural checks on a JSON request body, before pydantic sees it.

The schema (``protocol.py``) checks types and ranges field by field; this pass bounds
what that validation may *cost*, for every field at once, including ones added
later:

- the body is UTF-8 (no overlong or invalid byte sequences) and JSON;
- no string (value or key) holds an unpaired UTF-16 surrogate (``"\\ud800"`` is
  valid JSON but not Unicode: tokenizers and encoders fail on it);
- no object repeats a key (two layers reading "the" value of ``max_tokens``
  differently is how limits get bypassed);
- nesting at most ``MAX_JSON_DEPTH`` deep, no list longer than ``max_list_items``;
- fields that cost work per item have their own, configurable limits
  (``RequestLimits``): stop strings, logit_bias entries, messages, tools, prompts;
- token-id lists (``prompt``, ``stop_token_ids``, ``allowed_token_ids``,
  ``tokens``) hold non-negative integers, checked here in one pass: otherwise a
  list of 10^5 bad ids makes the schema build one error object per item and per
  union member (seconds of CPU, gigabytes of memory, for one 400).

A failure is a 400 in OpenAI's error shape naming the field (``param``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import APIError, bad_request

MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
TOKEN_ID_FIELDS = ("prompt", "stop_token_ids", "allowed_token_ids", "tokens")


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits on fields that cost work per item (GatewayConfig knobs)."""

    max_stop_strings: int = 16
    max_logit_bias: int = 1024
    max_messages: int = 4096
    max_tools: int = 128
    max_prompts: int = 256
    max_list_items: int = 1 << 18
    max_token_ids: int = 0  # a prompt longer than this cannot run (max_model_len; 0: unknown)


class _DuplicateKey(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (bad bytes at offset {e.start})",
                          code="invalid_json") from None
    try:
        return json.loads(text, object_pairs_hook=_pairs)
    except _DuplicateKey as e:
        raise bad_request(f"the key {str(e)!r} appears twice in one object; send each key once",
                          _printable(str(e)), code="duplicate_key") from None
    except RecursionError:
        raise bad_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          code="invalid_json") from None
    except ValueError as e:
        if "digits" in str(e):  # Python's int-from-string guard (sys.int_info.default_max_str_digits)
            raise bad_request("a number in the request body has too many digits", code="invalid_json") from None
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def check_body(raw: bytes, limits: RequestLimits) -> Any:
    """Parse and check a JSON body; returns it, or raises an APIError (400)."""
    body = parse_json(raw)
    _walk(body, "", 0, limits.max_list_items)
    if isinstance(body, dict):
        _check_fields(body, limits)
    return body


def _printable(s: str) -> str:
    return _SURROGATE.sub("\ufffd", s)[:64]


def _walk(value: Any, path: str, depth: int, max_items: int) -> None:
    """Depth, list lengths and Unicode of every value, iteratively (no recursion to exhaust)."""
    stack: list[tuple[Any, str, int]] = [(value, path, depth)]
    while stack:
        v, p, d = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise bad_request(f"{p or 'body'}: the string holds an unpaired UTF-16 surrogate "
                                  f"(not valid Unicode)", p or None, code="invalid_unicode")
            continue
        if not isinstance(v, (dict, list)):
            continue
        if d >= MAX_JSON_DEPTH:
            raise bad_request(f"{p or 'body'}: nested too deeply (at most {MAX_JSON_DEPTH} levels)", p or None)
        if isinstance(v, list):
            if len(v) > max_items:
                raise bad_request(f"{p}: {len(v)} items, more than this server accepts in one list "
                                  f"({max_items}, max_list_items)", p or None, code="too_many_items")
            if v and all(type(x) is int for x in v):
                continue  # the common token-id list: nothing inside to walk
            stack.extend((x, f"{p}[{i}]", d + 1) for i, x in enumerate(v))
        else:
            for k, x in v.items():
                if _SURROGATE.search(k):
                    raise bad_request(f"{p or 'body'}: a key holds an unpaired UTF-16 surrogate (not valid Unicode)",
                                      p or None, code="invalid_unicode")
                stack.append((x, f"{p}.{k}" if p else k, d + 1))


def _too_many(param: str, what: str, num: int, limit: int, knob: str) -> APIError:
    return bad_request(f"{param}: {num} {what}, more than this server allows ({limit}, {knob})", param,
                       code="too_many_items")


def _check_fields(body: dict[str, Any], limits: RequestLimits) -> None:
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > limits.max_stop_strings:
        raise _too_many("stop", "stop strings", len(stop), limits.max_stop_strings, "max_stop_strings")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise _too_many("logit_bias", "entries", len(bias), limits.max_logit_bias, "max_logit_bias")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise _too_many("messages", "messages", len(messages), limits.max_messages, "max_messages")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise _too_many("tools", "tools", len(tools), limits.max_tools, "max_tools")
    for name in TOKEN_ID_FIELDS:
        _check_token_ids(body.get(name), name, limits)


def _check_token_ids(value: Any, param: str, limits: RequestLimits) -> None:
    """Token-id lists (and the prompt's list of them) in one cheap pass."""
    if not isinstance(value, list) or not value:
        return
    if param == "prompt":
        if all(isinstance(x, list) for x in value):
            if len(value) > limits.max_prompts:
                raise _too_many("prompt", "prompts", len(value), limits.max_prompts, "max_prompts")
            for i, ids in enumerate(value):
                _check_ids(ids, f"prompt[{i}]", limits.max_token_ids)
            return
        if all(isinstance(x, str) for x in value):
            if len(value) > limits.max_prompts:
                raise _too_many("prompt", "prompts", len(value), limits.max_prompts, "max_prompts")
            return
        _check_ids(value, param, limits.max_token_ids)
        return
    _check_ids(value, param, 0)


def _check_ids(ids: list[Any], param: str, max_len: int) -> None:
    for i, t in enumerate(ids):
        if type(t) is not int or t < 0:
            raise bad_request(f"{param}[{i}]: a token id must be a non-negative integer, got {_short(t)}",
                              f"{param}[{i}]")
    if max_len and len(ids) >= max_len:
        raise bad_request(
            f"the prompt has {len(ids)} tokens, but this model's context length (max_model_len) is {max_len} "
            f"tokens, leaving no room to generate; shorten the prompt", param, code="context_length_exceeded")


def _short(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."
