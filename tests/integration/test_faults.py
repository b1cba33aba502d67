"""Process faults, each by SIGKILL on a real ``ferry serve`` cluster (tiny model):

- a worker dies mid-generation: ferry serve restarts it, the scheduler recomputes
  every accepted request from prompt plus generated tokens, each completes with the
  text it would have had anyway, and the restart counter moves;
- a gateway dies: the scheduler misses its heartbeats, aborts its requests, and
  their KV blocks are free within seconds;
- the scheduler dies: the gateway answers 503 and ``/ready`` fails; once a new
  scheduler (and its workers) are up, the same gateway process serves again.

The tests share one cluster and run in file order.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import (
    GatewayProcess,
    ServeProcess,
    http_status,
    openai_client,
    read_metrics,
    wait_for,
)

pytestmark = pytest.mark.slow

FAST_FAULTS = ["--worker-heartbeat-timeout-s", "3", "--gateway-timeout-s", "3"]
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(tiny_model_dir, tmp_path_factory.mktemp("faults"), FAST_FAULTS).start()
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.kill()


def _idle(base_url: str) -> bool:
    m = read_metrics(base_url)
    return (m["ferry:kv_cache_usage_perc"] == 0.0 and m["ferry:num_requests_running"] == 0
            and m["ferry:num_requests_waiting"] == 0)


def _stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, first_token: threading.Event) -> tuple[str, str | None, int]:
    text, finish, usage = "", None, 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            first_token.set()
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


def test_worker_killed_mid_generation_is_restarted_and_requests_complete(cluster: ServeProcess) -> None:
    client = openai_client(cluster.base_url)
    prompts = [f"Fault tolerance story {i}:" for i in range(4)]
    max_tokens = 300
    solo = [client.completions.create(model=cluster.model, prompt=p, max_tokens=max_tokens, **GREEDY).choices[0].text
            for p in prompts]
    restarts_before = read_metrics(cluster.base_url).get("ferry:worker_restarts_total", 0.0)
    old_pid = cluster.pid("worker")
    started = threading.Event()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(_stream, client, cluster.model, p, max_tokens, started) for p in prompts]
        assert started.wait(60), "no token arrived"
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=240) for f in futures]
    for (text, finish, num_tokens), expected in zip(results, solo, strict=True):
        assert finish == "length" and num_tokens == max_tokens
        assert text == expected, "recompute after the restart changed a greedy output"
    new_pid = cluster.pid("worker")
    assert new_pid != old_pid
    wait_for(lambda: read_metrics(cluster.base_url).get("ferry:worker_restarts_total", 0.0) >= restarts_before + 1,
             10, what="the restart counter")
    assert read_metrics(cluster.base_url)["ferry:worker_restarts_total"] == restarts_before + 1
    assert time.monotonic() - killed_at < 240
    wait_for(lambda: _idle(cluster.base_url), 15, what="an idle engine")


def test_gateway_killed_has_its_requests_aborted(cluster: ServeProcess, tmp_path: Path) -> None:
    doomed = GatewayProcess(cluster.model, cluster.gateway_endpoint, tmp_path).wait_ready()
    body = {"model": cluster.model, "prompt": "A long tale", "max_tokens": 1000, "stream": True,
            "temperature": 0.0, "ignore_eos": True}

    def hold_stream() -> None:
        try:
            with httpx.stream("POST", f"{doomed.base_url}/v1/completions", json=body, timeout=120,
                              trust_env=False) as resp:
                for _ in resp.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the gateway was killed under it

    threads = [threading.Thread(target=hold_stream, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: read_metrics(cluster.base_url)["ferry:num_requests_running"] >= 3, 60,
             what="the doomed gateway's requests to run")
    doomed.kill()
    killed_at = time.monotonic()
    wait_for(lambda: _idle(cluster.base_url), 20, what="the dead gateway's blocks to be freed")
    assert time.monotonic() - killed_at < 20
    for t in threads:
        t.join(timeout=10)


def test_scheduler_killed_gateway_refuses_then_resumes(cluster: ServeProcess) -> None:
    client = openai_client(cluster.base_url)
    gateway_pid = cluster.pid("gateway")
    scheduler_pid = cluster.pid("scheduler")
    os.kill(scheduler_pid, signal.SIGKILL)
    wait_for(lambda: http_status(f"{cluster.base_url}/ready") not in (200, None), 15, interval_s=0.05,
             what="/ready to fail")
    resp = httpx.post(f"{cluster.base_url}/v1/completions", json={"model": cluster.model, "prompt": "x"},
                      timeout=30, trust_env=False)
    # The replica restarts as a unit (scheduler, then workers that load the model), so
    # the gateway is still refusing a moment after /ready went red.
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"]
    wait_for(lambda: http_status(f"{cluster.base_url}/ready") == 200, 180, what="the new scheduler")
    out = client.completions.create(model=cluster.model, prompt="Back again", max_tokens=5, **GREEDY)
    assert out.usage.completion_tokens == 5
    assert cluster.pid("gateway") == gateway_pid, "the gateway must survive a scheduler restart"
    assert cluster.pid("scheduler") != scheduler_pid
