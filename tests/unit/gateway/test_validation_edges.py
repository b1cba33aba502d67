"""Every request bound tested at its exact edge, on both sides, over HTTP against the real app.

A bound tested only far away (an id of 10^6 against a vocabulary of 420) lets a
mutation of ``>=`` into ``>`` survive; here the last accepted and the first refused
value sit next to each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from services.gateway.protocol import MAX_LOGPROBS, MAX_SEED, MAX_STOP_LENGTH, MAX_STOP_STRINGS
from tests.unit.gateway.test_gateway_support import MAX_MODEL_LEN, FakeScheduler, running_env
from tests.unit.gateway.test_gateway_support import GatewayEnv as Env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from running_env(tmp_path_factory.mktemp("edges"))


@pytest.fixture(scope="module")
def fake(env: Env) -> Iterator[FakeScheduler]:
    yield env.start_fake()
    env.stop_fake()


def status(env: Env, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, str | None]:
    resp = env.http.post(path, json={"model": "tiny", "max_tokens": 1, **body})
    if resp.status_code != 200:
        assert resp.json()["error"]["message"], resp.text
        return resp.status_code, resp.json()["error"]["param"]
    return 200, None


def edge(env: Env, ok: dict[str, Any], bad: dict[str, Any], param: str, path: str = "/v1/completions") -> None:
    assert status(env, ok, path) == (200, None), ok
    code, got = status(env, bad, path)
    assert code == 400 and got is not None and got.startswith(param), (bad, code, got)


def test_prompt_token_id_against_the_vocabulary(env: Env, fake: FakeScheduler) -> None:
    vocab = env.tok.vocab_size
    edge(env, {"prompt": [vocab - 1]}, {"prompt": [vocab]}, "prompt")
    edge(env, {"prompt": [[5], [vocab - 1]]}, {"prompt": [[5], [vocab]]}, "prompt")
    edge(env, {"prompt": [0]}, {"prompt": [-1]}, "prompt")


def test_stop_token_ids_against_the_vocabulary(env: Env, fake: FakeScheduler) -> None:
    vocab = env.tok.vocab_size
    edge(env, {"prompt": "hi", "stop_token_ids": [vocab - 1]}, {"prompt": "hi", "stop_token_ids": [vocab]},
         "stop_token_ids")


def test_detokenize_ids_against_the_vocabulary(env: Env, fake: FakeScheduler) -> None:
    vocab = env.tok.vocab_size
    assert env.http.post("/detokenize", json={"tokens": [vocab - 1]}).status_code == 200
    assert env.http.post("/detokenize", json={"tokens": [vocab]}).status_code == 400


def test_top_k_against_the_vocabulary(env: Env, fake: FakeScheduler) -> None:
    vocab = env.tok.vocab_size
    edge(env, {"prompt": "hi", "top_k": vocab}, {"prompt": "hi", "top_k": vocab + 1}, "top_k")
    edge(env, {"prompt": "hi", "top_k": -1}, {"prompt": "hi", "top_k": -2}, "top_k")


def test_context_length(env: Env, fake: FakeScheduler) -> None:
    # prompt + max_tokens == max_model_len fits; one more does not
    edge(env, {"prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN - 10},
         {"prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN - 9}, "max_tokens")
    edge(env, {"prompt": [5] * (MAX_MODEL_LEN - 1)}, {"prompt": [5] * MAX_MODEL_LEN}, "prompt")


def test_n_and_seed(env: Env, fake: FakeScheduler) -> None:
    max_n = env.app.state.gateway.config.max_n
    edge(env, {"prompt": "hi", "n": max_n}, {"prompt": "hi", "n": max_n + 1}, "n")
    edge(env, {"prompt": "hi", "n": 1}, {"prompt": "hi", "n": 0}, "n")
    edge(env, {"prompt": "hi", "n": 2, "seed": MAX_SEED - 1}, {"prompt": "hi", "n": 2, "seed": MAX_SEED}, "seed")
    edge(env, {"prompt": "hi", "seed": MAX_SEED}, {"prompt": "hi", "seed": MAX_SEED + 1}, "seed")


def test_min_tokens_and_max_tokens(env: Env, fake: FakeScheduler) -> None:
    edge(env, {"prompt": "hi", "max_tokens": 3, "min_tokens": 3}, {"prompt": "hi", "max_tokens": 3, "min_tokens": 4},
         "min_tokens")
    edge(env, {"prompt": "hi", "max_tokens": 1}, {"prompt": "hi", "max_tokens": 0}, "max_tokens")


def test_logprobs(env: Env, fake: FakeScheduler) -> None:
    edge(env, {"prompt": "hi", "logprobs": MAX_LOGPROBS}, {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs")
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    edge(env, {**chat, "top_logprobs": MAX_LOGPROBS}, {**chat, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs",
         "/v1/chat/completions")


def test_sampling_ranges(env: Env, fake: FakeScheduler) -> None:
    edge(env, {"prompt": "hi", "temperature": 2.0}, {"prompt": "hi", "temperature": 2.000001}, "temperature")
    edge(env, {"prompt": "hi", "temperature": 0.0}, {"prompt": "hi", "temperature": -0.000001}, "temperature")
    edge(env, {"prompt": "hi", "top_p": 1.0}, {"prompt": "hi", "top_p": 1.000001}, "top_p")
    edge(env, {"prompt": "hi", "top_p": 0.000001}, {"prompt": "hi", "top_p": 0.0}, "top_p")
    edge(env, {"prompt": "hi", "presence_penalty": -2.0}, {"prompt": "hi", "presence_penalty": -2.000001},
         "presence_penalty")


def test_stop_strings(env: Env, fake: FakeScheduler) -> None:
    edge(env, {"prompt": "hi", "stop": ["x"] * MAX_STOP_STRINGS}, {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)},
         "stop")
    edge(env, {"prompt": "hi", "stop": ["x" * MAX_STOP_LENGTH]}, {"prompt": "hi", "stop": ["x" * (MAX_STOP_LENGTH + 1)]},
         "stop")


def test_body_size(env: Env, fake: FakeScheduler) -> None:
    limit = env.app.state.gateway.config.max_body_bytes
    base = b'{"model": "tiny", "max_tokens": 1, "prompt": "hi", "pad": "'
    fill = limit - len(base) - 2
    ok = env.http.post("/v1/completions", content=base + b"x" * fill + b'"}', headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text
    big = env.http.post("/v1/completions", content=base + b"x" * (fill + 1) + b'"}',
                        headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_refusals_before_the_schema_are_counted(env: Env, fake: FakeScheduler) -> None:
    resp = env.http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\\ud800"}',
                         headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_unicode"
    metrics = env.http.get("/metrics").text
    assert any(line.startswith("ferry:request_rejected_total{") and 'reason="invalid_unicode"' in line
               and 'status="400"' in line and not line.endswith(" 0.0") for line in metrics.splitlines())
