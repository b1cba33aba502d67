"""A scheduler crash is a pause, not an error: SIGKILL on a real ``ferry serve`` (tiny model).

The gateway holds every in-flight stream while ``ferry serve`` restarts the scheduler
and its workers, then re-submits each request as a continuation (prompt + the tokens
already streamed). Each test runs the same batch of streaming requests twice, once
undisturbed and once with processes killed under it, and requires every choice to end
with ``stop``/``length`` and the *same text* (greedy and seeded sampling alike):

- the scheduler SIGKILLed mid-stream under 16 requests (greedy, seeded random, stop
  strings, n=2, logprobs);
- the scheduler SIGKILLed twice in a row (again once the first continuation streams);
- the restarted scheduler SIGKILLed again during its start-up, before it was ready;
- the scheduler and a worker SIGKILLed together.

The tests share one cluster and run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import ServeProcess, http_status, read_metrics, wait_for

pytestmark = pytest.mark.slow

FLAGS = ["--worker-heartbeat-timeout-s", "3", "--gateway-timeout-s", "3", "--max-restarts", "30",
         "--max-resumes", "3"]
MAX_TOKENS = 48
Outcome = dict[int, tuple[str, str | None, int]]  # choice index -> (text, finish_reason, logprob entries)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(tiny_model_dir, tmp_path_factory.mktemp("resume"), FLAGS).start()
    try:
        serve.wait_ready()
        # one request first: the gateway learns from Redis that keys are off, so a Redis
        # timeout under the load of 16 streams later falls back open instead of a 503
        resp = httpx.post(f"{serve.base_url}/v1/completions", json={"model": serve.model, "prompt": "warm",
                          "max_tokens": 2}, timeout=60, trust_env=False)
        assert resp.status_code == 200, resp.text
        yield serve
    finally:
        serve.kill()


def sixteen_requests(model: str) -> list[dict[str, Any]]:
    """16 streaming requests of every kind the resume path must carry exactly."""
    base: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    reqs: list[dict[str, Any]] = []
    for i in range(5):
        reqs.append({**base, "prompt": f"Greedy story number {i}:", "temperature": 0.0})
    for i in range(4):
        reqs.append({**base, "prompt": f"Seeded tale {i}:", "temperature": 0.9, "top_p": 0.95, "seed": 100 + i,
                     "frequency_penalty": 0.3})
    for i, stop in enumerate([["e"], [" th", "an"], ["zzzz-never"]]):
        reqs.append({**base, "prompt": f"Stop here {i}:", "temperature": 0.0, "stop": stop})
    for i in range(2):
        reqs.append({**base, "prompt": f"Two of them {i}:", "temperature": 1.0, "seed": 7 + i, "n": 2})
    for i in range(2):
        reqs.append({**base, "prompt": f"Logprobs {i}:", "temperature": 0.0, "logprobs": 2})
    return reqs


def stream_one(base_url: str, body: dict[str, Any], started: threading.Event) -> tuple[Outcome, dict[str, Any]]:
    out: dict[int, list[Any]] = {}
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300, trust_env=False) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]
            for ch in event.get("choices", []):
                text, finish, lps = out.setdefault(ch["index"], ["", None, 0])
                lp = ch.get("logprobs") or {}
                out[ch["index"]] = [text + ch["text"], ch["finish_reason"] or finish,
                                    lps + len(lp.get("tokens") or [])]
                started.set()
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}, usage


def run_batch(serve: ServeProcess, reqs: list[dict[str, Any]],
              disturb: Callable[[], None] | None = None) -> list[tuple[Outcome, dict[str, Any]]]:
    events = [threading.Event() for _ in reqs]
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        futures = [pool.submit(stream_one, serve.base_url, r, e) for r, e in zip(reqs, events, strict=True)]
        if disturb is not None:
            for e in events:
                assert e.wait(120), "a stream got no token before the fault"
            disturb()
        return [f.result(timeout=600) for f in futures]


def check_same(reqs: list[dict[str, Any]], calm: list[tuple[Outcome, dict[str, Any]]],
               hit: list[tuple[Outcome, dict[str, Any]]]) -> None:
    for body, (a, usage_a), (b, usage_b) in zip(reqs, calm, hit, strict=True):
        assert sorted(b) == list(range(body.get("n", 1)))
        for idx, (text, finish, lps) in b.items():
            assert finish in ("stop", "length"), (body, b)
            assert (text, finish, lps) == a[idx], f"{body['prompt']!r} choice {idx} changed after the fault"
        assert usage_b == usage_a, body["prompt"]


def kill_scheduler(serve: ServeProcess) -> int:
    pid = serve.pid("scheduler")
    os.kill(pid, signal.SIGKILL)
    return pid


def new_scheduler(serve: ServeProcess, old_pid: int) -> int:
    found: list[int] = []

    def started() -> bool:
        procs = [p.pid for p in serve.children("scheduler") if p.pid != old_pid]
        found[:] = procs
        return bool(procs)

    wait_for(started, 60, interval_s=0.02, what="a new scheduler process")
    return found[0]


def resumed_total(serve: ServeProcess) -> float:
    return read_metrics(serve.base_url).get("ferry:requests_resumed_total", 0.0)


def test_scheduler_sigkill_mid_stream_loses_none_of_16(cluster: ServeProcess) -> None:
    reqs = sixteen_requests(cluster.model)
    calm = run_batch(cluster, reqs)
    before = resumed_total(cluster)
    hit = run_batch(cluster, reqs, lambda: kill_scheduler(cluster))
    check_same(reqs, calm, hit)
    assert resumed_total(cluster) > before, "no request was resumed: the kill came too late to test anything"
    assert "resumed" in json.dumps(httpx.get(f"{cluster.base_url}/dashboard/data", timeout=10,
                                             trust_env=False).json()["events"])


def test_scheduler_sigkill_twice_in_a_row(cluster: ServeProcess) -> None:
    reqs = sixteen_requests(cluster.model)[:6]
    reqs = [{**r, "max_tokens": 96} for r in reqs]
    calm = run_batch(cluster, reqs)

    def twice() -> None:
        first = kill_scheduler(cluster)
        second = new_scheduler(cluster, first)
        wait_for(lambda: http_status(f"{cluster.base_url}/ready") == 200, 120, what="the new scheduler ready")
        os.kill(second, signal.SIGKILL)

    check_same(reqs, calm, run_batch(cluster, reqs, twice))


def test_scheduler_sigkill_during_its_start_up(cluster: ServeProcess) -> None:
    reqs = sixteen_requests(cluster.model)[3:9]
    calm = run_batch(cluster, reqs)

    def during_start_up() -> None:
        first = kill_scheduler(cluster)
        second = new_scheduler(cluster, first)
        os.kill(second, signal.SIGKILL)  # before its workers announced themselves

    check_same(reqs, calm, run_batch(cluster, reqs, during_start_up))
    wait_for(lambda: http_status(f"{cluster.base_url}/ready") == 200, 120, what="ready again")


def test_scheduler_and_worker_killed_together(cluster: ServeProcess) -> None:
    reqs = sixteen_requests(cluster.model)[::2]
    calm = run_batch(cluster, reqs)

    def both() -> None:
        worker = cluster.pid("worker")
        kill_scheduler(cluster)
        os.kill(worker, signal.SIGKILL)

    check_same(reqs, calm, run_batch(cluster, reqs, both))
    wait_for(lambda: http_status(f"{cluster.base_url}/ready") == 200, 120, what="ready again")
    resp = httpx.post(f"{cluster.base_url}/v1/completions", json={"model": cluster.model, "prompt": "after",
                      "max_tokens": 3}, timeout=60, trust_env=False)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
