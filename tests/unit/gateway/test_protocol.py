"""Request validation: every kind of bad input gets the right status and an OpenAI-shaped body.

The app runs without its lifespan (no scheduler connection): a request that passes
every check reaches the engine client and gets 503, which proves it was accepted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.gateway.api.app import build_app
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.config import GatewayConfig
from tests.unit.gateway.test_gateway_support import MAX_MODEL_LEN, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def client(tok_dir: Path) -> Iterator[TestClient]:
    cfg = GatewayConfig(model=str(tok_dir), served_model_name="tiny", max_body_bytes=20_000, max_n=4,
                        scheduler_endpoint="ipc:///nonexistent/never.sock")
    yield TestClient(build_app(cfg, GatewayTokenizer(tok_dir)), raise_server_exceptions=False)


def error_of(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


COMPLETION = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None]] = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 100_000}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 5}, "n"),  # over max_n=4
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -9}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens=8
    ({"priority": 2**40}, "priority"),
    ({"queue_timeout_s": 0}, "queue_timeout_s"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [5, 100_000]}, "prompt"),
    ({"prompt": [-1, 5]}, None),
    ({"prompt": [1.5]}, None),
    ({"stop": [""]}, None),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [100_000]}, "stop_token_ids"),
    ({"echo": True}, "echo"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [100_000]}, "allowed_token_ids"),
    ({"bad_words": [""]}, None),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS)
def test_bad_completion_parameters_are_400(client: TestClient, patch: dict[str, Any], param: str | None) -> None:
    err = error_of(client.post("/v1/completions", json={**COMPLETION, **patch}), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_are_400(client: TestClient, literal: str) -> None:
    body = json.dumps(COMPLETION)[:-1] + f', "temperature": {literal}}}'
    err = error_of(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == "temperature"


BAD_CHATS: list[tuple[dict[str, Any], str | None]] = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    # SmolLM2's template does not show tools to the model: "auto" cannot work
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"n": 9}, "n"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHATS)
def test_bad_chat_parameters_are_400(client: TestClient, patch: dict[str, Any], param: str | None) -> None:
    err = error_of(client.post("/v1/chat/completions", json={**CHAT, **patch}), 400)
    if param is not None:
        assert err["param"] == param


def test_over_long_prompt_says_the_limit_and_the_request(client: TestClient) -> None:
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN - 4))
    err = error_of(client.post("/v1/completions", json={**COMPLETION, "prompt": long_prompt, "max_tokens": 10}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN - 4) in err["message"]
    assert str(MAX_MODEL_LEN + 6) in err["message"]
    too_long = list(range(10, 10 + MAX_MODEL_LEN))
    err = error_of(client.post("/v1/completions", json={**COMPLETION, "prompt": too_long}), 400)
    assert err["param"] == "prompt" and str(MAX_MODEL_LEN) in err["message"]
    err = error_of(client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": MAX_MODEL_LEN}), 400)
    assert err["param"] == "max_completion_tokens"


def test_unknown_model_is_404(client: TestClient) -> None:
    err = error_of(client.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    error_of(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)


def test_missing_fields_and_broken_json_are_400(client: TestClient) -> None:
    assert error_of(client.post("/v1/completions", json={"prompt": "x"}), 400)["param"] == "model"
    err = error_of(client.post("/v1/completions", content=b"{not json",
                               headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    err = error_of(client.post("/v1/completions", content=json.dumps(COMPLETION),
                               headers={"content-type": "text/plain"}), 400)
    assert err["code"] == "invalid_content_type"


def test_body_too_large_is_413(client: TestClient) -> None:
    err = error_of(client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 30_000}), 413)
    assert "20000" in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield json.dumps({**COMPLETION, "prompt": "y" * 30_000}).encode()

    error_of(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_valid_requests_reach_the_engine_and_get_503_without_a_scheduler(client: TestClient) -> None:
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                       ("/v1/completions", {**COMPLETION, "prompt": [[5, 6], [7]], "n": 2, "seed": 1}),
                       ("/v1/completions", {**COMPLETION, "stream": True})):
        resp = client.post(path, json=body)
        err = error_of(resp, 503)
        assert err["code"] == "scheduler_unavailable" and resp.headers["retry-after"] == "1"


def test_unknown_route_and_method_are_openai_shaped(client: TestClient) -> None:
    assert error_of(client.get("/v1/nothing"), 404)["code"] == "not_found"
    error_of(client.get("/v1/completions"), 405)


def test_small_endpoints(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tok = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and "".join(tok["token_strs"]) == "Hello world"
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["tokens"][0] == 1  # <|im_start|>
    error_of(client.post("/detokenize", json={"tokens": [10**6]}), 400)
    error_of(client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]}), 400)
    error_of(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["ready"] is False
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert client.get("/version").json()["version"]
    cfg = client.get("/v1/config").json()
    assert cfg["gateway"]["max_n"] == 4 and cfg["model"] == "tiny"


def test_api_key_is_required_and_never_shown(tok_dir: Path) -> None:
    cfg = GatewayConfig(model=str(tok_dir), served_model_name="tiny", api_key="sekrit",
                        scheduler_endpoint="ipc:///nonexistent/never.sock")
    client = TestClient(build_app(cfg, GatewayTokenizer(tok_dir)), raise_server_exceptions=False)
    error_of(client.post("/v1/completions", json=COMPLETION), 401)
    error_of(client.post("/v1/completions", json=COMPLETION, headers={"authorization": "Bearer nope"}), 401)
    ok = client.post("/v1/completions", json=COMPLETION, headers={"authorization": "Bearer sekrit"})
    assert ok.status_code == 503  # past admission, no scheduler
    assert "sekrit" not in client.get("/v1/config").text


def test_building_the_app_does_not_import_torch(tok_dir: Path) -> None:
    code = (
        "import sys\n"
        "from services.gateway.api.app import build_app\n"
        "from services.gateway.__main__ import build_parser\n"
        "from shared.config import GatewayConfig\n"
        f"build_app(GatewayConfig(model={str(tok_dir)!r}))\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
