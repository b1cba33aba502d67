"""The whole stack over real processes and sockets, driven by the official ``openai``
client: ``ferry serve`` on a tiny random-weight model (one cluster for the module).

Greedy outputs are the reference everywhere: a request's text must not depend on
what else runs beside it, on streaming, or on how it was cut by stop strings.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import GatewayProcess, ServeProcess, openai_client, read_metrics, wait_for

pytestmark = pytest.mark.slow

GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(serve_cluster: ServeProcess) -> openai.OpenAI:
    return openai_client(serve_cluster.base_url)


def complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12, **kw: Any) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **{**GREEDY, **kw})
    return out.choices[0].text


def stream_text(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12, **kw: Any) -> tuple[str, Any]:
    text, finish = "", None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           **{**GREEDY, **kw}):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def error_body(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["message"], body
    return body["error"]


def test_metadata_endpoints(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [serve_cluster.model]
    base = serve_cluster.base_url
    assert httpx.get(f"{base}/health", trust_env=False).status_code == 200
    assert httpx.get(f"{base}/ready", trust_env=False).status_code == 200
    assert httpx.get(f"{base}/version", trust_env=False).status_code == 200

    def knobs_shown() -> bool:
        flat = json.dumps(httpx.get(f"{base}/v1/config", trust_env=False).json())
        return "max_num_seqs" in flat and "max_waiting_requests" in flat and "queue_timeout_s" in flat

    wait_for(knobs_shown, 5, what="the scheduler's knobs in /v1/config")


def test_completion_usage_and_streaming_agree(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    model, prompt = serve_cluster.model, "The quick brown fox"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=10, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    num_prompt = len(httpx.post(f"{serve_cluster.base_url}/tokenize", json={"model": model, "prompt": prompt},
                                trust_env=False).json()["tokens"])
    assert out.usage.prompt_tokens == num_prompt
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == num_prompt + 10
    text, finish = stream_text(client, model, prompt, max_tokens=10)
    assert (text, finish) == (choice.text, "length")
    # include_usage: a final chunk with no choices carries the same usage.
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_chat_streaming_and_not(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something about boats."}]
    out = client.chat.completions.create(model=serve_cluster.model, messages=messages, max_tokens=8, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 5
    assert out.usage.prompt_tokens_details is not None
    text = ""
    for chunk in client.chat.completions.create(model=serve_cluster.model, messages=messages, max_tokens=8,
                                                stream=True, **GREEDY):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == out.choices[0].message.content


def test_n_and_seeded_sampling(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=serve_cluster.model, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                              extra_body={"ignore_eos": True})
    first = client.completions.create(n=3, seed=1234, **kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 3 * 12
    again = client.completions.create(n=3, seed=1234, **kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    single = [complete(client, seed=7, **{**kw, "temperature": 1.0}) for _ in range(2)]
    assert single[0] == single[1]
    others = {complete(client, seed=seed, **{**kw, "temperature": 1.0}) for seed in (1, 2, 3, 4)}
    assert len(others) > 1, "different seeds all sampled the same text"


def test_stop_strings_cut_the_output(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    model, prompt = serve_cluster.model, "A list of colors:"
    full = complete(client, model, prompt, max_tokens=24)
    # A stop string from the middle of the greedy output; the text before its first
    # occurrence is what must come back, without the stop string itself.
    start = len(full) // 2
    stop = full[start:start + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    expected = full[: full.find(stop)]
    out = client.completions.create(model=model, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    text, finish = stream_text(client, model, prompt, max_tokens=24, stop=[stop])
    assert (text, finish) == (expected, "stop")


def test_logprobs_shape(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    out = client.completions.create(model=serve_cluster.model, prompt="Hello", max_tokens=5, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(v <= 0.0 and math.isfinite(v) for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val >= max(top.values()) - 1e-4, (tok, val, top)
    chat = client.chat.completions.create(model=serve_cluster.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0.0 for item in content)


def test_32_concurrent_streams_match_solo_runs(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    model = serve_cluster.model
    prompts = [f"Request number {i} says" + " hello" * (i % 5) for i in range(32)]
    solo = [complete(client, model, p, max_tokens=16) for p in prompts]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(lambda p: stream_text(client, model, p, max_tokens=16), prompts))
    assert [t for t, _ in together] == solo
    assert all(f == "length" for _, f in together)
    assert len(set(solo)) > 16, "outputs should depend on the prompt"


def test_cancelled_stream_frees_its_blocks(serve_cluster: ServeProcess) -> None:
    body = {"model": serve_cluster.model, "prompt": "Tell me a very long story", "max_tokens": 900,
            "stream": True, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", f"{serve_cluster.base_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [line for _, line in zip(range(6), lines, strict=False)]
            assert any(line.startswith("data: ") for line in got)
            # Engine stats reach the gateway every stats_interval_s: wait for one that shows it.
            wait_for(lambda: _busy(read_metrics(serve_cluster.base_url)), 10, interval_s=0.05,
                     what="the stream to show in the engine stats")
        # Leaving the block closes the connection mid-stream.
    wait_for(lambda: _idle(read_metrics(serve_cluster.base_url)), 15, what="KV usage back to zero")


def _busy(metrics: dict[str, float]) -> bool:
    return metrics["ferry:num_requests_running"] >= 1 and metrics["ferry:kv_cache_usage_perc"] > 0.0


def _idle(metrics: dict[str, float]) -> bool:
    return (metrics["ferry:kv_cache_usage_perc"] == 0.0 and metrics["ferry:num_requests_running"] == 0
            and metrics["ferry:num_requests_waiting"] == 0)


def test_invalid_requests_get_clear_errors(serve_cluster: ServeProcess, client: openai.OpenAI) -> None:
    url = f"{serve_cluster.base_url}/v1/completions"
    model = serve_cluster.model
    cases: list[tuple[Any, int]] = [
        ({"model": "no-such-model", "prompt": "x"}, 404),
        ({"model": model, "prompt": "x", "max_tokens": -1}, 400),
        ({"model": model, "prompt": "x", "n": 0}, 400),
        ({"model": model, "prompt": "x", "n": 100000}, 400),
        ({"model": model, "prompt": "x", "temperature": -0.5}, 400),
        ({"model": model, "prompt": "x", "top_p": 7}, 400),
        ({"model": model, "prompt": [10 ** 9]}, 400),  # token id outside the vocabulary
        ({"model": model, "prompt": [1] * 5000, "max_tokens": 4}, 400),  # longer than max_model_len 1024
        ({"model": model}, 400),  # no prompt
        ('{"model": "x", "prompt": "x", "temperature": NaN}', 400),
        ("{not json", 400),
    ]
    with httpx.Client(trust_env=False, timeout=30) as http:
        for body, status in cases:
            if isinstance(body, str):
                resp = http.post(url, content=body, headers={"content-type": "application/json"})
            else:
                resp = http.post(url, json=body)
            assert resp.status_code == status, (body if not isinstance(body, list) else "...", resp.text)
            err = error_body(resp)
            if body == cases[7][0]:
                assert "1024" in err["message"] and "5000" in err["message"], err
        chat = http.post(f"{serve_cluster.base_url}/v1/chat/completions", json={"model": model, "messages": []})
        assert chat.status_code == 400
        error_body(chat)
    # ... and the server keeps serving.
    assert complete(client, model, "Still alive?", max_tokens=3)


def test_two_gateways_serve_one_engine(serve_cluster: ServeProcess, client: openai.OpenAI,
                                       tmp_path: Any) -> None:
    second = GatewayProcess(serve_cluster.model, serve_cluster.gateway_endpoint, tmp_path, "--api-key", "sekrit")
    try:
        second.wait_ready()
        other = openai_client(second.base_url, api_key="sekrit")
        prompts = [f"Gateway test {i}" for i in range(6)]
        solo = [complete(client, serve_cluster.model, p, max_tokens=8) for p in prompts]
        with ThreadPoolExecutor(max_workers=6) as pool:
            mixed = list(pool.map(lambda ip: complete(client if ip[0] % 2 else other, serve_cluster.model, ip[1],
                                                      max_tokens=8), enumerate(prompts)))
        assert mixed == solo
        denied = httpx.post(f"{second.base_url}/v1/completions", trust_env=False, timeout=30,
                            json={"model": serve_cluster.model, "prompt": "x"},
                            headers={"authorization": "Bearer wrong"})
        assert denied.status_code == 401
        error_body(denied)
    finally:
        second.kill()
