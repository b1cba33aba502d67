"""The structural body check (services/gateway/api/body_check.py), at the exact edge of every bound."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.api.body_check import MAX_JSON_DEPTH, RequestLimits, check_body
from services.gateway.errors import APIError

LIMITS = RequestLimits(max_stop_strings=3, max_logit_bias=4, max_messages=5, max_tools=2, max_prompts=3,
                       max_list_items=10, max_token_ids=8)


def refused(raw: bytes | dict[str, Any], limits: RequestLimits = LIMITS) -> APIError:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(APIError) as info:
        check_body(data, limits)
    assert info.value.status == 400 and info.value.body()["error"]["message"]
    return info.value


def accepted(body: dict[str, Any], limits: RequestLimits = LIMITS) -> None:
    assert check_body(json.dumps(body).encode(), limits) == body


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a\\ud800b"}', b'{"prompt": "\\udc00"}', b'{"messages": [{"content": "\\udfff"}]}',
    b'{"x": {"\\ud800": 1}}', b'{"stop": ["ok", "\\ud83d"]}',
])
def test_unpaired_surrogates_anywhere_are_refused(raw: bytes) -> None:
    assert refused(raw).code == "invalid_unicode"


def test_a_paired_surrogate_is_an_ordinary_character() -> None:
    assert check_body(b'{"prompt": "\\ud83d\\ude00 and \\u0000"}', LIMITS) == {"prompt": "\U0001f600 and \x00"}


@pytest.mark.parametrize("raw", [b'{"prompt": "a\xc0\xafb"}', b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xff"}',
                                 b'{"prompt": "\xe2\x82"}'])
def test_invalid_and_overlong_utf8_bytes_are_refused(raw: bytes) -> None:
    assert "UTF-8" in refused(raw).message


def test_duplicate_keys_are_refused_at_any_depth() -> None:
    assert refused(b'{"max_tokens": 1, "max_tokens": 2}').param == "max_tokens"
    refused(b'{"messages": [{"role": "user", "role": "system"}]}')


def test_depth_edge() -> None:
    def nested(depth: int) -> bytes:  # ``depth`` containers, the outermost object included
        return b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    check_body(nested(MAX_JSON_DEPTH), LIMITS)
    refused(nested(MAX_JSON_DEPTH + 1))
    refused(nested(100_000))  # past the parser's own recursion limit: still a 400


def test_list_items_edge() -> None:
    accepted({"allowed_token_ids": list(range(10))})
    assert refused({"allowed_token_ids": list(range(11))}).code == "too_many_items"
    accepted({"x": [[1]] * 10})
    refused({"x": [[1]] * 11})


@pytest.mark.parametrize(("field", "ok", "too_many"), [
    ("stop", ["a", "b", "c"], ["a", "b", "c", "d"]),
    ("logit_bias", {str(i): 1 for i in range(4)}, {str(i): 1 for i in range(5)}),
    ("messages", [{"role": "user", "content": "x"}] * 5, [{"role": "user", "content": "x"}] * 6),
    ("tools", [{}] * 2, [{}] * 3),
    ("prompt", ["a"] * 3, ["a"] * 4),
    ("prompt", [[1]] * 3, [[1]] * 4),
])
def test_per_field_limits_edge(field: str, ok: Any, too_many: Any) -> None:
    accepted({field: ok})
    err = refused({field: too_many})
    assert err.param == field and err.code == "too_many_items"


def test_token_id_lists() -> None:
    accepted({"prompt": [0, 7, 3]})
    assert refused({"prompt": [1, -1]}).param == "prompt[1]"
    assert refused({"prompt": [1, True]}).param == "prompt[1]"
    assert refused({"prompt": [[1], [2, "x"]]}).param == "prompt[1][1]"
    assert refused({"stop_token_ids": [3, 1.5]}).param == "stop_token_ids[1]"
    assert refused({"tokens": [-5]}).param == "tokens[0]"
    # a prompt of max_model_len tokens leaves no room to generate; one fewer does
    accepted({"prompt": [1] * 7})
    assert refused({"prompt": [1] * 8}).code == "context_length_exceeded"
    assert refused({"prompt": [[1] * 8]}).code == "context_length_exceeded"
    accepted({"tokens": [1] * 8})  # detokenize has no context length


def test_numbers_and_non_objects() -> None:
    assert "too many digits" in refused(b'{"max_tokens": 1' + b"0" * 5000 + b"}").message
    assert check_body(b"[1, 2]", LIMITS) == [1, 2]  # the schema refuses a non-object, with its own message
    refused(b'{"a": 1')
    refused(b"")
